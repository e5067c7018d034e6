//! Who progresses the worker, and when (docs/design.md, "Who progresses").
//!
//! Two kinds of thread call `ucp_worker_progress`: the application's, from `ibv_poll_cq` on an
//! empty CQ (if nobody else holds the worker), and the engine's progress thread, which makes
//! a process that does not poll answer anyway (a target spinning on memory, one blocked in
//! `ibv_get_cq_event`). How the progress thread waits for work is [`ProgressMode`]:
//!
//! * `event`: progress until idle, arm the worker's event fd, sleep in `poll()`. Costs nothing
//!   when idle, and a wake-up (plus a signal by the sender) per message that finds it asleep.
//! * `adaptive` (default): as `event`, but after any activity (a message, a post, the
//!   application polling) keep progressing without sleeping for [`DEFAULT_SPIN`], yielding
//!   the CPU between passes; then arm and sleep. Back-to-back traffic never waits for a
//!   wake-up; an idle process sleeps after one window; an application that waits for
//!   completion events gets a thread that sleeps as in `event` ([`EVENT_WAIT_WINDOW`]), and
//!   so does a CPU that other threads keep busy ([`CONTENDED_YIELD`]).
//! * `busy`: never sleeps (one core per process, always).
//!
//! In every mode the progress thread steps aside while the application busy-polls its CQs
//! (two threads fighting over the worker cost more than either), hands the owed ACKs to the
//! peers when the application runs out of work, and runs the QPs' transport timers every
//! [`super::TIMER_TICK`] while any is armed.

use super::{AckFlush, Engine};
use crate::ucp::{self, Worker};
use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How the progress thread waits for work (`UGDR_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    Event,
    Adaptive,
    Busy,
}

/// How the progress thread runs: the mode and the adaptive window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProgressConfig {
    pub mode: ProgressMode,
    /// How long the adaptive progress thread keeps polling after the last activity.
    pub spin: Duration,
}

impl ProgressConfig {
    /// `UGDR_PROGRESS` (`event`, `adaptive`, `busy`; unset: adaptive) and
    /// `UGDR_PROGRESS_SPIN_US` (a whole number of µs; unset: [`DEFAULT_SPIN`]). Any other
    /// value is refused: the engine does not start (a benchmark run under a mistyped mode
    /// would measure something else than it says).
    pub fn from_env() -> Result<ProgressConfig, String> {
        let mode = match std::env::var("UGDR_PROGRESS") {
            Err(_) => ProgressMode::Adaptive,
            Ok(v) => ProgressMode::parse(&v).ok_or_else(|| {
                format!("UGDR_PROGRESS={v:?} is not one of event, adaptive, busy")
            })?,
        };
        let spin = match std::env::var("UGDR_PROGRESS_SPIN_US") {
            Err(_) => DEFAULT_SPIN,
            Ok(v) => v
                .trim()
                .parse::<u64>()
                .map(Duration::from_micros)
                .map_err(|_| {
                    format!("UGDR_PROGRESS_SPIN_US={v:?} is not a whole number of microseconds")
                })?,
        };
        Ok(ProgressConfig { mode, spin })
    }
}

impl ProgressMode {
    pub fn parse(v: &str) -> Option<ProgressMode> {
        match v.trim().to_ascii_lowercase().as_str() {
            "event" => Some(ProgressMode::Event),
            "adaptive" => Some(ProgressMode::Adaptive),
            "busy" => Some(ProgressMode::Busy),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ProgressMode::Event => "event",
            ProgressMode::Adaptive => "adaptive",
            ProgressMode::Busy => "busy",
        }
    }
}

/// How long the adaptive progress thread keeps progressing after the last activity before it
/// sleeps on the event fd. Longer than a round trip across hosts (tens of µs over TCP), so
/// that ping-pong traffic never finds it asleep; short enough that a process that goes idle
/// stops spending CPU at once (measured in the README's table of modes).
pub const DEFAULT_SPIN: Duration = Duration::from_micros(200);

/// How long the progress thread steps aside while the application busy-polls, and how many
/// empty polls in that time count as busy-polling (a spinning application polls thousands of
/// times in it). A short window, because an application may alternate between polling its CQ
/// and spinning on memory a peer writes (ib_write_lat): the first window without polls hands
/// progress back to this thread. Measured here: a 1 ms window kept ibv_rc_pingpong ~40%
/// faster but made ib_write_lat wait ~1 ms per message; 50 µs costs some ping-pong latency
/// and brings ib_write_lat to ~150 µs (the event fd wake-up on this VM dominates).
const BUSY_POLL_WINDOW: Duration = Duration::from_micros(50);
const BUSY_POLL_THRESHOLD: u64 = 8;

/// An application whose `ibv_poll_cq` found nothing to progress this many times in a row is
/// not about to send: the ACKs it owes go out alone.
const IDLE_POLLS_PER_ACK_FLUSH: u32 = 8;

/// How often the progress thread checks that local peers are alive.
const PEER_CHECK_INTERVAL: Duration = Duration::from_millis(200);
/// How often the shared-memory receive FIFOs are looked at for a slot a dead sender abandoned.
const FIFO_CHECK_INTERVAL: Duration = Duration::from_millis(50);

/// What the application's threads tell the progress thread.
#[derive(Default)]
pub(super) struct Activity {
    /// `ibv_poll_cq` progress calls (the progress thread steps aside while they come fast).
    app_polls: AtomicU64,
    /// Consecutive application progress calls that found nothing (under the worker lock).
    idle_app_polls: AtomicU32,
    /// Posts by the application: an answer is expected soon.
    app_posts: AtomicU64,
    /// When the application last armed a CQ for a completion event (µs, dispatch's clock).
    event_wait_us: AtomicU64,
    /// When a thread of the application last blocked in `ibv_get_cq_event` (same clock).
    event_block_us: AtomicU64,
}

/// How long after the application last armed a CQ for an event the adaptive progress thread
/// does not spin: an application that sleeps until completion events wake it (SPDK's
/// `--interrupt-mode`, `ibv_rc_pingpong -e`) needs the CPU the moment it is woken, and on a
/// host with few cores a spinning progress thread takes it (measured: SPDK's target in
/// interrupt mode served 2.8k IOPS with the thread spinning, 81k with it sleeping).
const EVENT_WAIT_WINDOW: Duration = Duration::from_millis(20);

impl Activity {
    /// The application armed a CQ for a completion event.
    pub(super) fn armed_for_events(&self) {
        self.event_wait_us
            .store(super::dispatch::now_us(), Ordering::Relaxed);
    }

    /// Whether the application waits for completion events these days.
    fn waits_for_events(&self) -> bool {
        recent(&self.event_wait_us)
    }

    /// A thread of the application blocks in `ibv_get_cq_event`.
    pub(super) fn blocked_for_event(&self) {
        self.event_block_us
            .store(super::dispatch::now_us(), Ordering::Relaxed);
    }

    /// Whether the application blocks in `ibv_get_cq_event` these days: it is handed what
    /// arrives through that call and usually answers at once (a ping-pong), where one that
    /// waits in its own event loop on a non-blocking channel (SPDK's `--interrupt-mode`) is
    /// driven by every event, and served about a third fewer IOPS with its ACKs held.
    pub(super) fn blocks_for_events(&self) -> bool {
        recent(&self.event_block_us)
    }

    /// The application posted work.
    pub(super) fn posted(&self) {
        bump(&self.app_posts);
    }

    /// One `ibv_poll_cq` progress call: progresses if the worker is free, and flushes owed
    /// ACKs once the application has found nothing several times in a row. `counted`: it
    /// counts as the application's poll (the progress thread steps aside while they come
    /// fast).
    pub(super) fn progress_from_app(&self, engine: &Engine, counted: bool) {
        if counted {
            bump(&self.app_polls);
        }
        let Some(locked) = engine.worker.try_lock() else {
            // Another thread progresses. When it keeps the worker long (copying a rendezvous
            // message in: ~70 µs per MiB), a caller spinning here only takes the CPU that
            // thread needs where cores are few; short holds are waited out by spinning.
            let failed = BUSY_WORKER_POLLS.get() + 1;
            BUSY_WORKER_POLLS.set(failed);
            if failed >= BUSY_WORKER_POLLS_BEFORE_YIELD {
                BUSY_WORKER_POLLS.set(0);
                std::thread::yield_now();
            }
            return;
        };
        BUSY_WORKER_POLLS.set(0);
        // A full batch's ACK that no answer took since it became owed, polls ago, goes alone.
        if super::dispatch::ack_batches_full() {
            let cutoff = super::dispatch::full_batch_cutoff(self.polls());
            engine.flush_full_batches(&locked, cutoff);
        }
        if locked.progress() > 0 {
            self.idle_app_polls.store(0, Ordering::Relaxed);
            if super::dispatch::owed_acks_overdue() {
                engine.flush_owed_acks(&locked, AckFlush::Overdue);
            }
            return;
        }
        let idle = self.idle_app_polls.load(Ordering::Relaxed) + 1;
        self.idle_app_polls.store(idle, Ordering::Relaxed);
        // An application that blocks for completion events polls after each one until it
        // finds nothing, then answers or blocks again: its ACKs wait for the answer (`run`).
        if idle.is_multiple_of(IDLE_POLLS_PER_ACK_FLUSH)
            && let Some(which) = super::dispatch::owed_acks_wanted()
        {
            if !self.blocks_for_events() {
                engine.flush_owed_acks(&locked, which);
            } else if super::dispatch::owed_acks_overdue() {
                engine.flush_owed_acks(&locked, AckFlush::Overdue);
            }
        }
    }
}

thread_local! {
    /// This application thread's polls in a row that found the worker taken.
    static BUSY_WORKER_POLLS: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Polls in a row that find the worker taken before the polling thread yields its CPU.
const BUSY_WORKER_POLLS_BEFORE_YIELD: u32 = 16;

/// Whether the time in `at` (dispatch's clock; 0: never) lies within EVENT_WAIT_WINDOW.
fn recent(at: &AtomicU64) -> bool {
    let at = at.load(Ordering::Relaxed);
    at != 0 && super::dispatch::now_us().saturating_sub(at) < EVENT_WAIT_WINDOW.as_micros() as u64
}

/// Counts one more of the application's polls or posts: a plain load and store, not a locked
/// read-modify-write on every verb call. The counters only tell the progress thread whether
/// the application is active, so an increment lost to two application threads at once
/// changes nothing.
fn bump(counter: &AtomicU64) {
    counter.store(
        counter.load(Ordering::Relaxed).wrapping_add(1),
        Ordering::Relaxed,
    );
}

/// While polling without sleeping, the progress thread takes the worker only once the
/// application has neither polled nor posted for this long: an application between receiving
/// and answering would otherwise find the worker taken, and if this thread lost its CPU while
/// holding it (cores shared with spinning threads), wait for a whole scheduler tick.
const APP_QUIET: Duration = Duration::from_micros(5);

/// The application's counters as the progress thread last saw them.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Seen {
    polls: u64,
    posts: u64,
}

impl Activity {
    /// The application's `ibv_poll_cq` progress calls so far.
    pub(super) fn polls(&self) -> u64 {
        self.app_polls.load(Ordering::Relaxed)
    }

    fn seen(&self) -> Seen {
        Seen {
            polls: self.app_polls.load(Ordering::Relaxed),
            posts: self.app_posts.load(Ordering::Relaxed),
        }
    }
}

/// Counts the application's polls over windows of BUSY_POLL_WINDOW, across the progress
/// thread's passes and short sleeps.
struct PollWindow {
    start: Instant,
    polls: u64,
}

impl PollWindow {
    /// Whether the application busy-polls now (then the progress thread steps aside); polls
    /// counted in a window much older than BUSY_POLL_WINDOW (this thread slept long) say
    /// nothing about now.
    fn busy_polling(&mut self, polls: u64) -> bool {
        let age = self.start.elapsed();
        if age > 2 * BUSY_POLL_WINDOW {
            self.restart(polls);
            return false;
        }
        if polls.wrapping_sub(self.polls) >= BUSY_POLL_THRESHOLD {
            return true;
        }
        if age >= BUSY_POLL_WINDOW {
            self.restart(polls);
        }
        false
    }

    fn restart(&mut self, polls: u64) {
        self.start = Instant::now();
        self.polls = polls;
    }
}

/// A yield that gave the CPU away for longer than this found it contended: other threads
/// wanted it (a few µs is the cost of the call itself).
const CONTENDED_YIELD: Duration = Duration::from_micros(1000);

/// How long the adaptive progress thread does not spin (it waits as in `event` mode) once a
/// yield found the CPU contended.
const CONTENDED_BACKOFF: Duration = Duration::from_millis(20);

/// Gives the CPU (adaptive) or only the worker lock (busy) a moment before the next pass.
/// Adaptive: when the CPU turned out to be contended (the yield came back late), sets
/// `calm_after`, until when not to spin.
fn pause(mode: ProgressMode, activity: &Activity, calm_after: &mut Option<Instant>) {
    if mode == ProgressMode::Busy {
        for _ in 0..64 {
            std::hint::spin_loop();
        }
    } else {
        // Let the application's threads go first: on a machine with few cores they need the
        // CPU this thread takes.
        let start = Instant::now();
        let polls = activity.seen().polls;
        std::thread::yield_now();
        // Late, and not because the application polled meanwhile (when it busy-polls the
        // thread steps aside anyway, and sleeping on the event fd would make every peer
        // signal it): other threads want this CPU.
        if start.elapsed() > CONTENDED_YIELD && activity.seen().polls == polls {
            *calm_after = Some(Instant::now() + CONTENDED_BACKOFF);
        }
    }
}

/// The CPUs any of the process's threads may run on (the union of their affinities, from
/// `/proc/self/task`); None when they cannot be read.
fn process_cpus() -> Option<CpuSet> {
    let mut union = CpuSet::new();
    let mut found = false;
    for entry in std::fs::read_dir("/proc/self/task").ok()?.flatten() {
        let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
            continue;
        };
        let Ok(cpus) = sched_getaffinity(Pid::from_raw(tid)) else {
            continue; // the thread ended meanwhile
        };
        for cpu in 0..CpuSet::count() {
            if cpus.is_set(cpu).unwrap_or(false) {
                let _ = union.set(cpu);
                found = true;
            }
        }
    }
    found.then_some(union)
}

/// Moves the calling thread onto every CPU the process's threads may use. The progress
/// thread is started by whichever application thread opens the first device and inherits its
/// CPUs: under a DPDK or SPDK application, a reactor pinned to one core, where the progress
/// thread could only take that core from its reactor (and wait for the reactor's time slice
/// to end before each delivery) while the CPUs DPDK keeps for its control threads sat idle.
/// A binding of the whole process (`taskset`, an MPI launcher's) still holds: then every
/// thread has the same CPUs.
fn run_on_process_cpus() {
    let Some(cpus) = process_cpus() else {
        return;
    };
    let me = Pid::from_raw(0);
    if sched_getaffinity(me).is_ok_and(|now| now == cpus) {
        return;
    }
    match sched_setaffinity(me, &cpus) {
        Ok(()) => tracing::debug!("progress thread: on every CPU of the process's threads"),
        Err(e) => tracing::debug!("progress thread: keeps its creator's CPUs: {e}"),
    }
}

/// The progress thread's body: runs until `stopping`.
pub(super) fn run(
    worker: &Worker,
    stopping: &AtomicBool,
    activity: &Activity,
    config: ProgressConfig,
) {
    run_on_process_cpus();
    let mode = config.mode;
    let spin = match mode {
        ProgressMode::Adaptive => config.spin,
        ProgressMode::Event => Duration::ZERO,
        ProgressMode::Busy => Duration::MAX,
    };
    let efd = worker.event_fd();
    let mut last_peer_check = Instant::now();
    let mut seen = activity.seen();
    let mut window = PollWindow {
        start: Instant::now(),
        polls: seen.polls,
    };
    // When something last happened (a message, a post, busy polling); None: idle.
    let mut last_activity: Option<Instant> = None;
    // Since when the application has neither polled nor posted.
    let mut app_quiet_since = Instant::now();
    // Whether this thread polls without sleeping now.
    let mut spinning = false;
    // Until when this thread does not spin: a yield found the CPU contended (other threads,
    // another process's, want it). A thread that keeps yielding on a busy CPU starves under
    // Linux's EEVDF scheduler (every yield pushes its deadline a slice further), and the
    // application waiting for it with it; one that sleeps on the event fd is woken in time.
    let mut calm_after: Option<Instant> = None;
    let mut next_tick = Instant::now();
    let mut pending = PendingSendPoll::new();
    let watch_fifos = worker.watched_fifos() > 0;
    let mut last_fifo_check = Instant::now();
    while !stopping.load(Ordering::Acquire) {
        // A slot of the shared-memory FIFO that a dead sender took and never wrote stops all
        // shared-memory receiving, whoever progresses (the application polling, or this thread).
        if watch_fifos && last_fifo_check.elapsed() >= FIFO_CHECK_INTERVAL {
            last_fifo_check = Instant::now();
            if let (Some(engine), Some(locked)) = (Engine::running(), worker.try_lock()) {
                engine.mend_receive_fifos(&locked);
            }
        }
        // Transport timers run whether the application sleeps, polls or spins, and no ACK
        // waits longer than OWED_ACK_MAX_WAIT for a message to ride on.
        super::tick_if_due(worker, &mut next_tick);
        if super::dispatch::owed_acks_overdue()
            && let (Some(locked), Some(engine)) = (worker.try_lock(), Engine::running())
        {
            engine.flush_owed_acks(&locked, AckFlush::Overdue);
        }
        let now = activity.seen();
        if window.busy_polling(now.polls) {
            // The application is spinning in ibv_poll_cq and progresses the worker itself. A
            // window without such polls (it blocks, or spins on memory a peer writes, as
            // ib_write_lat does) hands progress back to this thread.
            last_activity = Some(Instant::now());
            if mode == ProgressMode::Busy {
                let until = Instant::now() + BUSY_POLL_WINDOW;
                while Instant::now() < until {
                    std::thread::yield_now();
                }
            } else {
                std::thread::sleep(BUSY_POLL_WINDOW);
            }
            window.restart(activity.seen().polls);
            continue;
        }
        if now != seen {
            if now.posts != seen.posts {
                last_activity = Some(Instant::now());
            }
            seen = now;
            app_quiet_since = Instant::now();
        }
        if calm_after.is_some_and(|t| Instant::now() >= t) {
            calm_after = None;
        }
        spinning = spinning
            && calm_after.is_none()
            && (mode == ProgressMode::Busy || last_activity.is_some_and(|t| t.elapsed() < spin));
        let locked = if spinning {
            if app_quiet_since.elapsed() < APP_QUIET {
                pause(mode, activity, &mut calm_after);
                continue;
            }
            match worker.try_lock() {
                Some(l) => l,
                None => {
                    pause(mode, activity, &mut calm_after);
                    continue;
                }
            }
        } else {
            worker.lock()
        };
        // Until idle, or until the application polls: then it progresses the worker itself
        // (its polls count before they try the lock). Under a steady stream (rendezvous
        // messages whose bytes each progress call copies in, one after another) this thread
        // would otherwise never find the worker idle, hold it throughout and do every copy
        // while the application spins on a lock it cannot take: one busy thread more than
        // there are cores on a small host (ib_send_bw -s 1MiB on 2 cores: ~4.5 GB/s so, the
        // receiver's progress thread doing nearly all copies).
        let polls_before = activity.seen().polls;
        let mut events = 0u32;
        loop {
            let n = locked.progress();
            if n == 0 {
                break;
            }
            events = events.saturating_add(n);
            if activity.seen().polls != polls_before {
                break;
            }
        }
        if events > 0 {
            last_activity = Some(Instant::now());
        }
        spinning = mode == ProgressMode::Busy
            || (last_activity.is_some_and(|t| t.elapsed() < spin)
                && !activity.waits_for_events()
                && calm_after.is_none());
        // The ACKs owed go alone now unless the application is polling and this thread will
        // look again soon: then they ride on the application's answer, or go when its polls
        // find nothing (Activity::progress_from_app). Nor while the application blocks in
        // ibv_get_cq_event: it was just handed what arrived and usually answers at once,
        // and the ACK riding on its answer makes one message instead of two, and at the peer
        // one completion event for both the send's completion and the answer's arrival
        // (`ibv_rc_pingpong -t -e` polls twice after each event and fails on an event whose
        // completion it took already, as it did when ACK and answer came apart). Such an
        // ACK waits at most OWED_ACK_MAX_WAIT: this thread wakes to send it, and an
        // application thread sends it before it blocks in ibv_get_cq_event again.
        let app_polling = activity.seen().polls != seen.polls;
        let held_for_answer = !spinning && activity.blocks_for_events();
        if let Some(engine) = Engine::running() {
            let answer_soon = held_for_answer || (spinning && app_polling);
            if !answer_soon && let Some(which) = super::dispatch::owed_acks_wanted() {
                engine.flush_owed_acks(&locked, which);
            }
            if !answer_soon && super::dispatch::ack_batches_full() {
                engine.flush_full_batches(&locked, u64::MAX);
            }
            if last_peer_check.elapsed() >= PEER_CHECK_INTERVAL {
                last_peer_check = Instant::now();
                engine.check_local_peers(&locked);
            }
        }
        if spinning {
            drop(locked);
            pause(mode, activity, &mut calm_after);
            continue;
        }
        last_activity = None;
        if !locked.arm() {
            continue;
        }
        // A send that goes pending from now on wakes this thread (`Worker::note_sleeping`).
        worker.note_sleeping(true);
        let sends_pending = worker.sends_pending();
        drop(locked);
        let mut wait = if super::dispatch::timers_armed() {
            super::TIMER_TICK
        } else {
            Duration::from_millis(100)
        };
        if let Some(due) = super::dispatch::owed_acks_due_in() {
            wait = wait.min(due);
        }
        if let Some(due) = super::dispatch::early_tick_in() {
            wait = wait.min(due);
        }
        if let Some(poll) = pending.next_poll(sends_pending) {
            wait = wait.min(poll);
        }
        ucp::wait_readable_for(&[efd], wait);
        worker.note_sleeping(false);
    }
}

/// How often a sleeping progress thread looks at sends UCX still holds (a peer's shared-memory
/// FIFO was full): nothing wakes it when room comes, and a UC or UD sender that sleeps in
/// `ibv_get_cq_event`, which no ACK wakes either, waited for this thread's 100 ms timeout
/// before each batch (`ib_send_bw -e -c UC -s 64`: ~0.5 MB/s). First after
/// [`PENDING_SEND_POLL_MIN`], twice as long each time no fewer are pending than the last time
/// (a peer that died with its FIFO full keeps a send pending until UCX declares it gone), up
/// to [`PENDING_SEND_POLL_MAX`].
struct PendingSendPoll {
    count: usize,
    every: Duration,
}

const PENDING_SEND_POLL_MIN: Duration = Duration::from_micros(20);
const PENDING_SEND_POLL_MAX: Duration = Duration::from_millis(10);

impl PendingSendPoll {
    fn new() -> PendingSendPoll {
        PendingSendPoll {
            count: 0,
            every: PENDING_SEND_POLL_MIN,
        }
    }

    /// With `pending` sends held now: how long to sleep at most (None: none is pending).
    fn next_poll(&mut self, pending: usize) -> Option<Duration> {
        if pending == 0 {
            *self = PendingSendPoll::new();
            return None;
        }
        if pending < self.count || self.count == 0 {
            self.every = PENDING_SEND_POLL_MIN;
        } else {
            self.every = (self.every * 2).min(PENDING_SEND_POLL_MAX);
        }
        self.count = pending;
        Some(self.every)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_parse_and_name() {
        for m in [
            ProgressMode::Event,
            ProgressMode::Adaptive,
            ProgressMode::Busy,
        ] {
            assert_eq!(ProgressMode::parse(m.name()), Some(m));
        }
        assert_eq!(ProgressMode::parse(" BUSY "), Some(ProgressMode::Busy));
        assert_eq!(ProgressMode::parse("poll"), None);
        assert_eq!(ProgressMode::parse(""), None);
    }

    #[test]
    fn pending_sends_are_looked_at_soon_then_less_often_while_none_goes() {
        let mut poll = PendingSendPoll::new();
        assert_eq!(poll.next_poll(0), None, "none pending: the usual sleep");
        assert_eq!(poll.next_poll(5), Some(PENDING_SEND_POLL_MIN));
        assert_eq!(
            poll.next_poll(5),
            Some(PENDING_SEND_POLL_MIN * 2),
            "none went"
        );
        assert_eq!(
            poll.next_poll(7),
            Some(PENDING_SEND_POLL_MIN * 4),
            "more came"
        );
        assert_eq!(poll.next_poll(3), Some(PENDING_SEND_POLL_MIN), "some went");
        for _ in 0..20 {
            poll.next_poll(3);
        }
        assert_eq!(poll.next_poll(3), Some(PENDING_SEND_POLL_MAX), "capped");
        assert_eq!(poll.next_poll(0), None);
        assert_eq!(poll.next_poll(3), Some(PENDING_SEND_POLL_MIN), "afresh");
    }
}
