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
//!   wake-up; an idle process sleeps after one window.
//! * `busy`: never sleeps (one core per process, always).
//!
//! In every mode the progress thread steps aside while the application busy-polls its CQs
//! (two threads fighting over the worker cost more than either), and hands the owed ACKs to
//! the peers when the application runs out of work.

use super::Engine;
use crate::ucp::{self, Worker};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How the progress thread waits for work (`UGDR_PROGRESS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProgressMode {
    Event,
    Adaptive,
    Busy,
}

impl ProgressMode {
    /// `UGDR_PROGRESS` (`event`, `adaptive`, `busy`); anything else is the default, with a
    /// warning.
    pub fn from_env() -> ProgressMode {
        match std::env::var("UGDR_PROGRESS") {
            Err(_) => ProgressMode::Adaptive,
            Ok(v) => ProgressMode::parse(&v).unwrap_or_else(|| {
                tracing::warn!(
                    "UGDR_PROGRESS={v:?} is not event, adaptive or busy; using adaptive"
                );
                ProgressMode::Adaptive
            }),
        }
    }

    pub fn parse(v: &str) -> Option<ProgressMode> {
        match v.trim().to_ascii_lowercase().as_str() {
            "event" => Some(ProgressMode::Event),
            "adaptive" | "" => Some(ProgressMode::Adaptive),
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

/// `UGDR_PROGRESS_SPIN_US`: the adaptive window in µs (0 behaves as `event`).
fn spin_window() -> Duration {
    std::env::var("UGDR_PROGRESS_SPIN_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(DEFAULT_SPIN, Duration::from_micros)
}

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

/// What the application's threads tell the progress thread.
#[derive(Default)]
pub(super) struct Activity {
    /// `ibv_poll_cq` progress calls (the progress thread steps aside while they come fast).
    app_polls: AtomicU64,
    /// Consecutive application progress calls that found nothing (under the worker lock).
    idle_app_polls: AtomicU32,
    /// Posts by the application: an answer is expected soon.
    app_posts: AtomicU64,
}

impl Activity {
    /// The application posted work.
    pub(super) fn posted(&self) {
        self.app_posts.fetch_add(1, Ordering::Relaxed);
    }

    /// One `ibv_poll_cq` progress call: progresses if the worker is free, and flushes owed
    /// ACKs once the application has found nothing several times in a row.
    pub(super) fn progress_from_app(&self, engine: &Engine) {
        self.app_polls.fetch_add(1, Ordering::Relaxed);
        if let Some(locked) = engine.worker.try_lock() {
            if locked.progress() > 0 {
                self.idle_app_polls.store(0, Ordering::Relaxed);
                return;
            }
            let idle = self.idle_app_polls.load(Ordering::Relaxed) + 1;
            self.idle_app_polls.store(idle, Ordering::Relaxed);
            if idle % IDLE_POLLS_PER_ACK_FLUSH == 0 {
                engine.flush_owed_acks(&locked);
            }
        }
    }
}

/// The progress thread's body: runs until `stopping`.
pub(super) fn run(worker: &Worker, stopping: &AtomicBool, activity: &Activity, mode: ProgressMode) {
    let spin = match mode {
        ProgressMode::Adaptive => spin_window(),
        ProgressMode::Event => Duration::ZERO,
        ProgressMode::Busy => Duration::MAX,
    };
    let efd = worker.event_fd();
    let mut last_peer_check = Instant::now();
    let mut polls_seen = activity.app_polls.load(Ordering::Relaxed);
    let mut posts_seen = activity.app_posts.load(Ordering::Relaxed);
    let mut last_activity: Option<Instant> = None;
    let mut polls_at_pass = polls_seen;
    let mut window_start = Instant::now();
    while !stopping.load(Ordering::Acquire) {
        // The application's polls are counted over windows of BUSY_POLL_WINDOW, across this
        // thread's passes and short sleeps; polls counted in a window much older than that
        // (this thread slept long) say nothing about now.
        let polls = activity.app_polls.load(Ordering::Relaxed);
        if window_start.elapsed() > 2 * BUSY_POLL_WINDOW {
            polls_seen = polls;
            window_start = Instant::now();
        } else if polls.wrapping_sub(polls_seen) >= BUSY_POLL_THRESHOLD {
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
            polls_seen = activity.app_polls.load(Ordering::Relaxed);
            window_start = Instant::now();
            continue;
        }
        if window_start.elapsed() >= BUSY_POLL_WINDOW {
            polls_seen = polls;
            window_start = Instant::now();
        }
        let locked = worker.lock();
        let mut events = 0u32;
        loop {
            let n = locked.progress();
            if n == 0 {
                break;
            }
            events = events.saturating_add(n);
        }
        let posts = activity.app_posts.load(Ordering::Relaxed);
        if events > 0 || posts != posts_seen {
            posts_seen = posts;
            last_activity = Some(Instant::now());
        }
        let spinning =
            mode == ProgressMode::Busy || last_activity.is_some_and(|t| t.elapsed() < spin);
        // The ACKs owed go alone now unless the application is polling and this thread will
        // look again soon: then they ride on the application's answer, or go when its polls
        // find nothing (Activity::progress_from_app). Never left behind before sleeping.
        let app_polling = activity.app_polls.load(Ordering::Relaxed) != polls_at_pass;
        polls_at_pass = activity.app_polls.load(Ordering::Relaxed);
        if let Some(engine) = Engine::running() {
            if !(spinning && app_polling) {
                engine.flush_owed_acks(&locked);
            }
            if last_peer_check.elapsed() >= PEER_CHECK_INTERVAL {
                last_peer_check = Instant::now();
                engine.check_local_peers(&locked);
            }
        }
        if spinning {
            drop(locked);
            if mode == ProgressMode::Busy {
                // A core of its own: only give the worker lock a moment to pass to others.
                for _ in 0..64 {
                    std::hint::spin_loop();
                }
            } else {
                // Keep progressing, but let the application's threads (and the worker lock)
                // go first: on a machine with few cores they need the CPU this thread takes.
                std::thread::yield_now();
            }
            continue;
        }
        last_activity = None;
        if !locked.arm() {
            continue;
        }
        drop(locked);
        ucp::wait_readable(&[efd], 100);
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
    }
}
