//! What the engine delivers to: the interface a queue pair implements (the verbs layer above
//! registers its queue pairs by number), the connection a QP names its peer by, the list of
//! QPs that owe their peer an ACK, and the list of QPs whose transport timer runs.
//!
//! The engine knows QP numbers, headers and endpoints, never verbs semantics: it routes a
//! message by its destination QP number and lets the receiver decide what it means.

use super::wire::Header;
use crate::ucp::{AmPayload, Endpoint, LockedWorker};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The receiving end of one QP number. Every call runs inside progress (or a verbs call),
/// under the worker lock.
pub trait MessageReceiver: Send + Sync {
    /// A request (SEND, WRITE, READ request, atomic) for this QP. Returns true when the
    /// payload's data was kept (UCX must not free it yet).
    fn request_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool;

    /// The answer to one of this QP's READs or atomics (same return as above).
    fn response_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool;

    /// A UD datagram to multicast group `mgid`, which this QP is attached to (same return).
    fn group_datagram(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        mgid: &[u8; 16],
        payload: AmPayload<'_>,
    ) -> bool;

    /// An ACK or NAK from the peer's responder.
    fn ack_arrived(self: Arc<Self>, locked: &LockedWorker<'_>, header: &Header);

    /// Send the ACK this QP announced with [`owe_ack`], if it still owes one; with
    /// `owed_by` (µs, [`owe_ack`]'s clock) only if it has been owed since then or earlier,
    /// else list it again with [`still_owe_ack`].
    fn send_owed_ack(self: Arc<Self>, locked: &LockedWorker<'_>, owed_by: Option<u64>);

    /// Send the ACK of the full batch this QP announced with [`ack_batch_full`] if it has
    /// been owed since the application's poll numbered `poll` or earlier; list it again while
    /// the batch is full and not yet due.
    fn send_full_batch_ack(self: Arc<Self>, locked: &LockedWorker<'_>, poll: u64);

    /// An endpoint to some peer process failed: a QP whose peer it was fails.
    fn peer_failed(self: Arc<Self>, locked: &LockedWorker<'_>);

    /// The transport timer of a QP that called [`arm_timer`] (every [`TIMER_TICK`] while it
    /// is armed): retransmit or fail what was not answered in time. Returns whether the timer
    /// must keep running (false: the QP is disarmed and arms itself again when it needs to).
    fn tick(self: Arc<Self>, locked: &LockedWorker<'_>, now: Instant) -> bool;
}

/// How often the progress thread runs the transport timers of armed QPs.
pub const TIMER_TICK: Duration = Duration::from_millis(10);

/// The remote QP an RC/UC QP is connected to, and the endpoint to its process.
#[derive(Clone)]
pub struct Peer {
    pub endpoint: Arc<Endpoint>,
    pub qpn: u32,
    /// The LID of the peer's port.
    pub lid: u16,
    /// Its process's published memory, when it is on this host and may be mapped here.
    pub memory: Option<Arc<super::direct::PeerMemory>>,
    /// It runs on another host: a list of small messages to it is worth sending as one
    /// bundle (`wire::bundle_header`). Over the network each UCX send is a syscall and a
    /// segment, which a bundle saves; on this host UCX's shared memory sends without a syscall,
    /// and bundling only copies and holds back the first messages (measured with SPDK's
    /// randrw on one host: 250–280k IOPS sent one by one, 188k bundled).
    pub remote_host: bool,
}

/// A list of QP numbers that many threads add to and the engine empties, with a count that
/// says without the lock whether it holds any.
struct QpList {
    qpns: Mutex<Vec<u32>>,
    count: AtomicUsize,
}

impl QpList {
    const fn new() -> QpList {
        QpList {
            qpns: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
        }
    }

    fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    /// Adds `qpn`; `then` runs under the list's lock, told whether the list was empty.
    fn push(&self, qpn: u32, then: impl FnOnce(bool)) {
        let mut qpns = self.qpns.lock().unwrap_or_else(|p| p.into_inner());
        qpns.push(qpn);
        then(self.count.fetch_add(1, Ordering::AcqRel) == 0);
    }

    /// Empties the list (cheap when it is empty) and gives back each QP once; `then` runs
    /// under the list's lock.
    fn take(&self, then: impl FnOnce()) -> Vec<u32> {
        if self.is_empty() {
            return Vec::new();
        }
        let mut qpns = {
            let mut qpns = self.qpns.lock().unwrap_or_else(|p| p.into_inner());
            self.count.store(0, Ordering::Release);
            then();
            std::mem::take(&mut *qpns)
        };
        // A QP may have been listed more than once (it owed anew after an ACK rode on its
        // message, or its full batch was not yet due at the last flush).
        qpns.sort_unstable();
        qpns.dedup();
        qpns
    }
}

/// QPs that owe their peer an ACK, flushed by the engine when the application or the
/// progress thread runs out of work.
static OWED_ACKS: QpList = QpList::new();
/// When the oldest ACK on the list became owed (µs since [`epoch`]; 0: none owed).
static OWED_SINCE_US: AtomicU64 = AtomicU64::new(0);

fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

pub(super) fn now_us() -> u64 {
    (epoch().elapsed().as_micros() as u64).max(1)
}

/// Some ACK on the list was asked for promptly (see [`ack_wanted_soon`]).
static OWED_PROMPTLY: AtomicBool = AtomicBool::new(false);

/// QP `qpn` holds an ACK back, hoping to piggyback it: the engine sends it (through
/// [`MessageReceiver::send_owed_ack`]) at the latest once it has waited
/// [`OWED_ACK_MAX_WAIT`], and sooner, when nothing else is going on, if [`ack_wanted_soon`].
/// Returns when it became owed, which the QP keeps: the list keeps a QP whose ACK rode on a
/// message meanwhile (it is not taken off), so only the QP knows how old its ACK is.
pub fn owe_ack(qpn: u32) -> u64 {
    let now = now_us();
    list_owed_ack(qpn, now);
    now
}

/// QP `qpn` still owes the ACK it announced at `since`, which a flush of overdue ACKs found
/// younger than [`OWED_ACK_MAX_WAIT`]: listed again with its own age (`prompt`: its
/// requester waits for it, see [`ack_wanted_soon`]).
pub fn still_owe_ack(qpn: u32, since: u64, prompt: bool) {
    list_owed_ack(qpn, since);
    if prompt {
        ack_wanted_soon();
    }
}

fn list_owed_ack(qpn: u32, since: u64) {
    // Under the list's lock: the oldest entry's time, 0 only while the list is empty.
    OWED_ACKS.push(qpn, |was_empty| {
        if was_empty {
            OWED_SINCE_US.store(since, Ordering::Release);
        } else {
            OWED_SINCE_US.fetch_min(since, Ordering::AcqRel);
        }
    });
}

/// A QP owes an ACK that its peer's requester waits for (a signaled WR's completion, or a
/// request sent again): the ACKs owed go as soon as this process runs out of work, not only
/// when they are overdue.
pub fn ack_wanted_soon() {
    OWED_PROMPTLY.store(true, Ordering::Release);
}

/// QPs owing the ACK of a full batch of deliveries that no answer has carried yet (by QP
/// number), a short list apart from [`OWED_ACKS`]: the application's polls look at it while
/// it is not empty, and must not walk every QP that owes an ACK each time. A QP is listed
/// once per full batch ([`ack_batch_full`]) and again while its batch is not yet due.
static FULL_BATCHES: QpList = QpList::new();

/// QP `qpn` owes the ACK of a full batch: it goes alone once the application has polled
/// [`ACK_BATCH_POLLS`] times since the ACK became owed (see [`full_batch_cutoff`]), or when
/// the progress thread runs out of work, unless a message carries it first. Not at once: the
/// batch often fills in the middle of one bundle's delivery, just before the application
/// answers it with a message the ACK rides on.
pub fn ack_batch_full(qpn: u32) {
    FULL_BATCHES.push(qpn, |_| {});
}

/// Whether some QP may owe the ACK of a full batch (cheap: the application's polls ask).
pub(super) fn ack_batches_full() -> bool {
    !FULL_BATCHES.is_empty()
}

/// The QPs listed by [`ack_batch_full`], each once, emptying the list.
pub(super) fn take_full_batches() -> Vec<u32> {
    FULL_BATCHES.take(|| {})
}

/// The application's polls after the one that delivered a full batch before its ACK goes
/// alone. SPDK's target answers a request in the reactor pass after the one that delivered
/// it (its reads complete in the accel poller first) and posts its answers at the end of
/// that pass, after its CQ poll; its initiator polls its CQ until it finds it empty (two or
/// three polls) before it posts the commands that answer what it got. Measured across two
/// namespaces (`scripts/spdk --netns`, randrw q16, first bundles up to 36 KiB, 10 s runs):
/// with the ACK sent at the 16th delivery the target sent ~107k ACKs alone, each just before
/// the answer it could have ridden on (~0.05 extra `sendmsg` per I/O on each side); after
/// two polls, the target 56–90 per 2,097,152 deliveries and the initiator ~30k; after four,
/// 11 and 28.
pub const ACK_BATCH_POLLS: u64 = 4;

/// A full batch's ACK owed since the application's poll numbered this or earlier goes alone
/// now (`app_polls`: the application's polls so far).
pub fn full_batch_cutoff(app_polls: u64) -> u64 {
    app_polls.saturating_sub(ACK_BATCH_POLLS)
}

/// The QPs that owe an ACK, each once, emptying the list (cheap when it is empty).
pub(super) fn take_owed_acks() -> Vec<u32> {
    OWED_ACKS.take(|| {
        OWED_SINCE_US.store(0, Ordering::Release);
        OWED_PROMPTLY.store(false, Ordering::Release);
    })
}

/// Which owed ACKs a flush sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckFlush {
    /// Every one: the process ran out of work, or is about to wait.
    All,
    /// Only those owed for longer than [`OWED_ACK_MAX_WAIT`]; younger ones stay listed.
    Overdue,
}

/// Which ACKs should go once this process runs out of work: all, when one was asked for
/// promptly; the overdue ones, when some may be.
pub(super) fn owed_acks_wanted() -> Option<AckFlush> {
    if OWED_PROMPTLY.load(Ordering::Acquire) && !OWED_ACKS.is_empty() {
        Some(AckFlush::All)
    } else {
        owed_acks_overdue().then_some(AckFlush::Overdue)
    }
}

/// The longest an owed ACK waits for a message to ride on or for the application to run out
/// of work: a peer's requester must never stall (or retransmit) because this process keeps
/// polling, or keeps finding work, without ever sending.
pub const OWED_ACK_MAX_WAIT: Duration = Duration::from_micros(200);

/// Whether some ACK may have been owed for longer than [`OWED_ACK_MAX_WAIT`] (the list's
/// oldest entry is; its QP may have sent that ACK on a message since).
pub(super) fn owed_acks_overdue() -> bool {
    let since = OWED_SINCE_US.load(Ordering::Acquire);
    since != 0 && now_us().saturating_sub(since) > OWED_ACK_MAX_WAIT.as_micros() as u64
}

/// The time (µs, [`owe_ack`]'s clock) an ACK must have been owed since to be overdue now.
pub(super) fn overdue_cutoff() -> u64 {
    now_us().saturating_sub(OWED_ACK_MAX_WAIT.as_micros() as u64)
}

/// How long until the ACKs owed now are overdue; None when none is owed.
pub(super) fn owed_acks_due_in() -> Option<Duration> {
    let since = OWED_SINCE_US.load(Ordering::Acquire);
    (since != 0).then(|| {
        let due = since + OWED_ACK_MAX_WAIT.as_micros() as u64 + 1;
        Duration::from_micros(due.saturating_sub(now_us()))
    })
}

/// QPs whose transport timer runs (by QP number), ticked by the progress thread.
static ARMED: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static ARMED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// QP `qpn` has requests waiting for an answer: the progress thread calls its
/// [`MessageReceiver::tick`] every [`TIMER_TICK`] until it returns false. Call once per
/// arming (the QP remembers that it is armed).
pub fn arm_timer(qpn: u32) {
    let was_idle = {
        let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        armed.push(qpn);
        ARMED_COUNT.fetch_add(1, Ordering::AcqRel) == 0
    };
    if was_idle {
        // The progress thread may sleep for up to 100 ms with no timer armed: wake it.
        if let Some(engine) = super::Engine::running() {
            engine.worker.signal();
        }
    }
}

/// When (µs since [`epoch`]; 0: never) the armed timers must run before their next
/// [`TIMER_TICK`]: the end of an RNR NAK's wait, which is far shorter than a tick (a
/// responder's `min_rnr_timer` 12 is 640 µs), and after which a HCA sends again at once.
static EARLY_TICK_US: AtomicU64 = AtomicU64::new(0);

/// An armed QP's timer must run `after` from now (an RNR NAK's wait ends then), maybe sooner
/// than the next tick: the progress thread runs the timers then (woken if it sleeps longer).
pub fn tick_early(after: Duration) {
    let at = now_us().saturating_add(after.as_micros() as u64);
    let earlier = EARLY_TICK_US
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            (t == 0 || at < t).then_some(at)
        })
        .is_ok();
    if earlier && let Some(engine) = super::Engine::running() {
        engine.worker.signal();
    }
}

/// How long until the timers must run early ([`tick_early`]); None when nothing asked.
pub(super) fn early_tick_in() -> Option<Duration> {
    let at = EARLY_TICK_US.load(Ordering::Acquire);
    (at != 0).then(|| Duration::from_micros(at.saturating_sub(now_us())))
}

/// Whether the timers must run early now; if so, forgets it (a QP whose wait is not over yet
/// asks again when its timer runs).
pub(super) fn take_early_tick() -> bool {
    if EARLY_TICK_US.load(Ordering::Acquire) == 0 {
        return false;
    }
    let now = now_us();
    EARLY_TICK_US
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |t| {
            (t != 0 && t <= now).then_some(0)
        })
        .is_ok()
}

/// Whether any QP's timer runs.
pub(super) fn timers_armed() -> bool {
    ARMED_COUNT.load(Ordering::Acquire) != 0
}

/// The armed QPs, emptying the list (they are armed again with [`rearm`]).
pub(super) fn take_armed() -> Vec<u32> {
    if !timers_armed() {
        return Vec::new();
    }
    let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
    ARMED_COUNT.fetch_sub(armed.len(), Ordering::AcqRel);
    std::mem::take(&mut *armed)
}

/// Puts QPs whose timer keeps running back on the list.
pub(super) fn rearm(qpns: Vec<u32>) {
    if qpns.is_empty() {
        return;
    }
    let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
    ARMED_COUNT.fetch_add(qpns.len(), Ordering::AcqRel);
    armed.extend(qpns);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The timers run early at the earliest time asked for, once: taken when due (also with no
    /// timer armed, see `tick_if_due`), and forgotten then.
    #[test]
    fn an_early_tick_is_the_earliest_asked_for_and_taken_once_due() {
        assert_eq!(early_tick_in(), None);
        tick_early(Duration::from_secs(3600));
        tick_early(Duration::from_millis(50));
        tick_early(Duration::from_secs(7200));
        let left = early_tick_in().expect("asked for");
        assert!(left <= Duration::from_millis(50), "{left:?}");
        assert!(!take_early_tick(), "not due yet");
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(early_tick_in(), Some(Duration::ZERO));
        assert!(take_early_tick());
        assert!(!take_early_tick(), "taken once");
        assert_eq!(early_tick_in(), None);
    }

    /// The list of QPs owing an ACK names each once, however often it was listed, and is as
    /// old as its oldest entry, also one listed again with an older ACK than the others'.
    /// (No other unit test owes ACKs: none runs an engine that delivers.)
    #[test]
    fn the_owed_list_names_each_qp_once_and_is_as_old_as_its_oldest_ack() {
        let since = || OWED_SINCE_US.load(Ordering::Acquire);
        take_owed_acks();
        // The times below (µs on the engine's clock) lie more than OWED_ACK_MAX_WAIT back.
        now_us();
        std::thread::sleep(Duration::from_millis(2));
        still_owe_ack(0xa1, 900, false);
        assert_eq!(since(), 900);
        still_owe_ack(0xa3, 700, false);
        assert_eq!(since(), 700, "an older one");
        still_owe_ack(0xa1, 800, false);
        assert_eq!(since(), 700, "a younger one changes nothing");
        assert_eq!(owed_acks_wanted(), Some(AckFlush::Overdue), "none prompt");
        still_owe_ack(0xa2, 300, true);
        assert_eq!(since(), 300);
        assert_eq!(owed_acks_wanted(), Some(AckFlush::All), "a prompt one");
        assert_eq!(take_owed_acks(), vec![0xa1, 0xa2, 0xa3]);
        assert_eq!((since(), owed_acks_wanted()), (0, None));
        assert!(owed_acks_due_in().is_none());
        // A QP owing anew: listed as old as the time owe_ack gave it.
        let listed = owe_ack(0xa4);
        assert_eq!(since(), listed);
        assert_eq!(take_owed_acks(), vec![0xa4]);
    }

    /// The list of full batches is apart from the list of owed ACKs, and names each QP once.
    #[test]
    fn the_full_batch_list_names_each_qp_once_apart_from_the_owed_list() {
        take_full_batches();
        assert!(!ack_batches_full());
        ack_batch_full(0xb2);
        ack_batch_full(0xb1);
        ack_batch_full(0xb2);
        assert!(ack_batches_full());
        assert_eq!(take_full_batches(), vec![0xb1, 0xb2]);
        assert!(!ack_batches_full());
        assert_eq!(take_full_batches(), Vec::<u32>::new());
        assert_eq!(full_batch_cutoff(10), 10 - ACK_BATCH_POLLS);
        assert_eq!(full_batch_cutoff(1), 0);
    }
}
