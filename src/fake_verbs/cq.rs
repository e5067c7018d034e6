//! Completion queues and completion channels.

use super::VerbsError;
use super::clock;
use super::context::{DeviceContext, EVENT_CQ_ERR};
use super::event_queue::EventQueue;
use super::work::{WcStatus, WorkCompletion};
use crate::engine::direct::OwnReceiveRing;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};

/// A completion channel (`ibv_comp_channel`): delivers "CQ has a completion" events, one per
/// arming, through a pollable fd. Events carry the C handle of the CQ.
pub struct CompletionChannel {
    pub context: Arc<DeviceContext>,
    pub events: EventQueue<usize>,
    users: AtomicUsize,
    /// CQs armed while they held completions not yet polled
    /// ([`CompletionQueue::arm`]): each owes an event if it still holds some when the
    /// application asks for one ([`CompletionChannel::take_arming_event`]).
    armed_with_completions: Mutex<Vec<std::sync::Weak<CompletionQueue>>>,
}

impl CompletionChannel {
    pub fn new(context: Arc<DeviceContext>) -> Result<Arc<CompletionChannel>, VerbsError> {
        let events = EventQueue::new()?;
        context.adopt_child();
        Ok(Arc::new(CompletionChannel {
            context,
            events,
            users: AtomicUsize::new(0),
            armed_with_completions: Mutex::new(Vec::new()),
        }))
    }

    /// The event owed by a CQ of this channel that was armed while it held completions and
    /// still holds some: its handle (the arming is used up, as by any event). A CQ whose
    /// completions were all polled since owes none and stays armed for the next one.
    pub fn take_arming_event(&self) -> Option<usize> {
        let mut armed = self
            .armed_with_completions
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let mut found = None;
        armed.retain(|weak| {
            let Some(cq) = weak.upgrade() else {
                return false;
            };
            if found.is_some() {
                return true;
            }
            let mut ring = cq.ring();
            if ring.arming_event && !ring.entries.is_empty() {
                ring.arming = Arming::Off;
                ring.armed_over_completions = false;
                found = Some(cq.handle());
            }
            ring.arming_event = false;
            false
        });
        found
    }

    /// `ibv_destroy_comp_channel` fails with EBUSY while CQs use the channel.
    pub fn check_destroyable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("completion channel still has CQs"));
        }
        Ok(())
    }
}

impl Drop for CompletionChannel {
    fn drop(&mut self) {
        self.context.release_child();
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Arming {
    Off,
    Any,
    SolicitedOnly,
}

struct Ring {
    entries: VecDeque<WorkCompletion>,
    capacity: usize,
    arming: Arming,
    overrun: bool,
    /// Armed while it held completions: owes an event if it still holds some when the
    /// application asks its channel for one.
    arming_event: bool,
    /// The arming in force was made while the CQ held completions (so the hardware would
    /// have raised its event at once, and no other for it).
    armed_over_completions: bool,
    /// The last event fired on such an arming: it stands for that arming's event, and is as
    /// deferrable ([`CompletionQueue::take_stale_event`]).
    fired_for_arming: bool,
}

/// Which clocks a CQ stamps its completions with (`ibv_create_cq_ex` wc_flags).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timestamps {
    /// The device clock (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`).
    pub raw: bool,
    /// The wall clock (`IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK`).
    pub wallclock: bool,
}

/// A completion queue: a bounded ring of completions, notification arming, and the
/// bookkeeping of `ibv_get_cq_event`/`ibv_ack_cq_events`.
pub struct CompletionQueue {
    pub context: Arc<DeviceContext>,
    pub channel: Option<Arc<CompletionChannel>>,
    /// Clocks read when a completion is added (as a HCA stamps the CQE it writes).
    timestamps: Timestamps,
    /// The C handle (`struct ibv_cq *`) of this CQ, for events.
    handle: AtomicUsize,
    ring: Mutex<Ring>,
    /// How many completions the ring holds, as of its last change (written under the ring's
    /// lock): a poll that finds it 0 returns without taking the lock, as polling an empty
    /// hardware CQ reads one CQE's owner bit.
    queued: AtomicUsize,
    users: AtomicUsize,
    events: Mutex<(u64, u64)>, // (delivered, acknowledged)
    events_acked: Condvar,
    /// The receive rings of the QPs whose completions (receives or sends) come here and that
    /// same-host peers place SENDs in (`qp/placed.rs`): a poll completes what they placed
    /// first (the receives, and the sends the ACKs placed with them acknowledge).
    placed_sources: Mutex<Vec<PlacedSource>>,
    /// How many there are (read without the lock on every poll).
    placed_count: AtomicUsize,
}

/// A receive queue whose WRs a same-host peer places SENDs in: the QP completes them.
pub trait PlacedArrivals: Send + Sync {
    /// Completes the receive WRs whose messages were placed, in order (`cq` was polled).
    /// With `poller` (an application polling `cq`): when they complete on `cq` and nothing of
    /// theirs waits in its queue, their completions go straight to it (as many as it has room
    /// for; the rest stay placed for the next poll), without passing through the queue and
    /// its lock.
    fn complete_placed_for(self: Arc<Self>, cq: &CompletionQueue, poller: Option<&mut Poller<'_>>);
}

/// An application's poll being served: where its completions go, and how many more it takes.
pub struct Poller<'s> {
    sink: &'s mut dyn FnMut(&WorkCompletion),
    room: usize,
}

impl Poller<'_> {
    pub fn room(&self) -> usize {
        self.room
    }

    /// Hands the poller one completion (it has room: the caller checked).
    pub fn hand(&mut self, wc: &WorkCompletion) {
        debug_assert!(self.room > 0);
        (self.sink)(wc);
        self.room -= 1;
    }
}

type PlacedSource = (Arc<OwnReceiveRing>, Weak<dyn PlacedArrivals>);

impl CompletionQueue {
    pub fn new(
        context: Arc<DeviceContext>,
        capacity: usize,
        channel: Option<Arc<CompletionChannel>>,
    ) -> Arc<CompletionQueue> {
        Self::with_timestamps(context, capacity, channel, Timestamps::default())
    }

    /// A CQ whose completions carry the clocks `timestamps` asks for.
    pub fn with_timestamps(
        context: Arc<DeviceContext>,
        capacity: usize,
        channel: Option<Arc<CompletionChannel>>,
        timestamps: Timestamps,
    ) -> Arc<CompletionQueue> {
        context.adopt_child();
        if let Some(ch) = &channel {
            ch.users.fetch_add(1, Ordering::AcqRel);
        }
        Arc::new(CompletionQueue {
            context,
            channel,
            timestamps,
            handle: AtomicUsize::new(0),
            ring: Mutex::new(Ring {
                entries: VecDeque::with_capacity(capacity.min(4096)),
                capacity,
                arming: Arming::Off,
                overrun: false,
                arming_event: false,
                armed_over_completions: false,
                fired_for_arming: false,
            }),
            queued: AtomicUsize::new(0),
            users: AtomicUsize::new(0),
            events: Mutex::new((0, 0)),
            events_acked: Condvar::new(),
            placed_sources: Mutex::new(Vec::new()),
            placed_count: AtomicUsize::new(0),
        })
    }

    pub fn set_handle(&self, handle: usize) {
        self.handle.store(handle, Ordering::Release);
    }

    pub fn handle(&self) -> usize {
        self.handle.load(Ordering::Acquire)
    }

    fn ring(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn capacity(&self) -> usize {
        self.ring().capacity
    }

    /// Adds a completion, stamped with the clocks the CQ asked for. A full CQ is an overrun:
    /// the completion is lost and IBV_EVENT_CQ_ERR is raised, as on hardware.
    pub fn push(&self, wc: WorkCompletion, solicited: bool) {
        let notify = self.push_locked(&mut self.ring(), wc, solicited);
        self.notify_if(notify);
    }

    /// A run of pushes under one hold of the ring's lock, taken at the first (an ACK releases
    /// many send completions at once); the channel is told when the run ends.
    pub fn batch(&self) -> PushBatch<'_> {
        PushBatch {
            cq: self,
            ring: None,
            notify: false,
        }
    }

    /// Queues `wc` in `ring`; whether the completion channel is to be told.
    fn push_locked(&self, ring: &mut Ring, mut wc: WorkCompletion, solicited: bool) -> bool {
        // Stamped under the ring's lock: stamps never decrease along the queue.
        if self.timestamps.raw {
            wc.completion_ts = clock::raw_clock();
        }
        if self.timestamps.wallclock {
            wc.completion_wallclock_ns = clock::wallclock_ns();
        }
        if ring.entries.len() >= ring.capacity {
            if !ring.overrun {
                ring.overrun = true;
                tracing::warn!(
                    "cq {:#x}: overrun (capacity {}), completion of wr_id {} lost",
                    self.handle(),
                    ring.capacity,
                    wc.wr_id
                );
                self.context.raise(EVENT_CQ_ERR, self.handle());
            }
            return false;
        }
        ring.entries.push_back(wc);
        self.queued.store(ring.entries.len(), Ordering::Release);
        let fire = match ring.arming {
            Arming::Off => false,
            Arming::Any => true,
            Arming::SolicitedOnly => solicited || wc.status != WcStatus::Success,
        };
        if fire {
            ring.fired_for_arming = std::mem::take(&mut ring.armed_over_completions);
            ring.arming = Arming::Off;
            ring.arming_event = false;
        }
        fire
    }

    /// Whether an event of this CQ that a blocking `ibv_get_cq_event` just took is stale and
    /// not to be handed out: it fired on an arming made while the CQ held completions (one
    /// more came, or the ones there were polled and then one came) and the CQ holds nothing
    /// now. Such an event stands for the arming's own event, which is told only while the CQ
    /// holds completions (the hardware raises that one at the arming, and no other for it).
    /// The CQ is then armed again, as after an arming event not owed: the next completion
    /// fires. An event fired on an arming made while the CQ was empty is always handed out.
    /// (`ibv_rc_pingpong -t -e` re-arms, polls the completion that woke it, posts its SEND and
    /// polls once more: when the SEND completed in between, its completion was polled there
    /// and the event it fired found an empty CQ, which that program takes for an error —
    /// between one run in twenty and one in six beside two busy loops.)
    pub fn take_stale_event(&self) -> bool {
        let mut ring = self.ring();
        if !std::mem::take(&mut ring.fired_for_arming) || !ring.entries.is_empty() {
            return false;
        }
        if ring.arming == Arming::Off {
            ring.arming = Arming::Any;
        }
        true
    }

    fn notify_if(&self, notify: bool) {
        if notify && let Some(ch) = &self.channel {
            let deferred = DEFERRED_EVENTS.with(|d| match &mut *d.borrow_mut() {
                Some(events) => {
                    events.push((Arc::clone(ch), self.handle()));
                    true
                }
                None => false,
            });
            if !deferred {
                ch.events.push(self.handle());
            }
        }
    }

    /// Takes up to `max` completions, oldest first (after completing the receives same-host
    /// peers placed SENDs in).
    pub fn poll(&self, max: usize, mut sink: impl FnMut(&WorkCompletion)) -> usize {
        if self.placed_count.load(Ordering::Relaxed) > 0 {
            if max == 0 || self.timestamps.raw || self.timestamps.wallclock {
                self.complete_placed(None);
            } else {
                let mut poller = Poller {
                    sink: &mut sink,
                    room: max,
                };
                self.complete_placed(Some(&mut poller));
                let handed = max - poller.room;
                if handed > 0 {
                    return handed + self.poll_queued(max - handed, sink);
                }
            }
        }
        self.poll_queued(max, sink)
    }

    /// Whether completions wait in the queue (a placed receive is then queued behind them,
    /// not handed to the poller: one of them may be its QP's earlier receive).
    pub fn holds_completions(&self) -> bool {
        self.queued.load(Ordering::Acquire) > 0
    }

    /// [`CompletionQueue::poll`] without looking at the rings of placed SENDs.
    fn poll_queued(&self, max: usize, sink: impl FnMut(&WorkCompletion)) -> usize {
        if self.queued.load(Ordering::Acquire) == 0 {
            return 0; // as if polled a moment before a completion being added now
        }
        self.take(&mut self.ring(), max, sink)
    }

    fn take(&self, ring: &mut Ring, max: usize, mut sink: impl FnMut(&WorkCompletion)) -> usize {
        let n = max.min(ring.entries.len());
        for wc in ring.entries.drain(..n) {
            sink(&wc);
        }
        if ring.entries.is_empty() {
            ring.arming_event = false;
        }
        self.queued.store(ring.entries.len(), Ordering::Release);
        n
    }

    /// `ibv_poll_cq`: [`CompletionQueue::poll`], and on an empty CQ `progress` (the engine
    /// delivering, from the polling thread, what waits at this process) and a second poll.
    pub fn poll_progressing(
        &self,
        max: usize,
        mut sink: impl FnMut(&WorkCompletion),
        progress: impl FnOnce(),
    ) -> usize {
        let n = self.poll(max, &mut sink);
        if n > 0 || max == 0 {
            return n;
        }
        progress();
        // What progress delivered; the rings were looked at a moment ago, and a SEND placed
        // since then is found by the next poll (looking twice made each empty poll of a spinning
        // application lock the list of rings twice: ~40% of its time in `ib_send_lat`).
        self.poll_queued(max, sink)
    }

    /// `source`'s receives complete on this CQ, and a peer places SENDs in them.
    pub fn add_placed_source(&self, ring: Arc<OwnReceiveRing>, source: Weak<dyn PlacedArrivals>) {
        let mut sources = self
            .placed_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        sources.push((ring, source));
        self.placed_count.store(sources.len(), Ordering::Relaxed);
    }

    /// The QP of `ring` is gone.
    pub fn remove_placed_source(&self, ring: &Arc<OwnReceiveRing>) {
        let mut sources = self
            .placed_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        sources.retain(|(r, _)| !Arc::ptr_eq(r, ring));
        self.placed_count.store(sources.len(), Ordering::Relaxed);
    }

    /// Has the QPs whose rings hold placed SENDs complete them (without this CQ's locks: a
    /// QP's lock comes before its CQs'); receives that complete here go straight to `poller`
    /// where they may (see [`PlacedArrivals::complete_placed_for`]).
    fn complete_placed(&self, mut poller: Option<&mut Poller<'_>>) {
        // An empty poll spins through here: it only reads each ring's cursor, and builds
        // nothing.
        let sources = self
            .placed_sources
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if let [(ring, qp)] = sources.as_slice() {
            // Most CQs: one ring.
            let qp = if ring.arrived() { qp.upgrade() } else { None };
            drop(sources);
            if let Some(qp) = qp {
                qp.complete_placed_for(self, poller);
            }
            return;
        }
        let found: Vec<Arc<dyn PlacedArrivals>> = sources
            .iter()
            .filter(|(ring, _)| ring.arrived())
            .filter_map(|(_, qp)| qp.upgrade())
            .collect();
        drop(sources);
        for qp in found {
            qp.complete_placed_for(self, poller.as_deref_mut());
        }
    }

    /// Removes the completions of QP `qp_num` not yet polled (the QP was reset), as mlx4,
    /// mlx5, hns and bnxt_re clean their CQs on a move to RESET: completions of the QP's
    /// previous life, flushes included, never reach the application afterwards.
    pub fn discard_qp(&self, qp_num: u32) {
        let mut ring = self.ring();
        ring.entries.retain(|wc| wc.qp_num != qp_num);
        self.queued.store(ring.entries.len(), Ordering::Release);
    }

    pub fn is_empty(&self) -> bool {
        self.ring().entries.is_empty()
    }

    /// `ibv_req_notify_cq`: the next completion (or the next solicited one) fires an event.
    ///
    /// Armed for any completion while it still holds completions not yet polled, the CQ also
    /// owes an event right away, as mlx4 and mlx5 raise one when armed with CQEs beyond the
    /// consumer index: an application that takes a bounded batch per event (perftest polls
    /// 16) and was handed more between two armings then gets to the rest instead of waiting
    /// for an event no new completion will raise (`ib_send_bw -e -Q 1` hung at its end about
    /// one run in three). Unlike the hardware's, that event is told only when the
    /// application blocks for one (`ibv_get_cq_event` on a blocking channel) while the CQ
    /// still holds completions: one whose completions it polled first would find nothing
    /// (`ibv_rc_pingpong -t -e`, which re-arms before it polls, takes an empty CQ after an
    /// event for an error), and an application waiting on the channel's fd never sees it.
    pub fn arm(self: &Arc<Self>, solicited_only: bool) -> Result<(), VerbsError> {
        let Some(channel) = &self.channel else {
            // rdma-core providers accept arming a CQ without a channel; nothing will fire.
            return Ok(());
        };
        let mut ring = self.ring();
        let arming = match (ring.arming, solicited_only) {
            (Arming::Any, _) | (_, false) => Arming::Any,
            _ => Arming::SolicitedOnly,
        };
        ring.arming = arming;
        ring.armed_over_completions = arming == Arming::Any && !ring.entries.is_empty();
        if ring.armed_over_completions {
            ring.arming_event = true;
            drop(ring);
            let mut armed = channel
                .armed_with_completions
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            // Once per CQ; destroyed CQs go (a channel whose application never blocks for an
            // event never takes from the list).
            armed.retain(|cq| cq.strong_count() > 0);
            if !armed
                .iter()
                .any(|cq| std::ptr::eq(cq.as_ptr(), Arc::as_ptr(self)))
            {
                armed.push(Arc::downgrade(self));
            }
        }
        Ok(())
    }

    /// `ibv_resize_cq`: at least `cqe` entries and never fewer than are queued.
    pub fn resize(&self, cqe: usize) -> Result<usize, VerbsError> {
        let mut ring = self.ring();
        if cqe < ring.entries.len() {
            return Err(VerbsError::Invalid(
                "cq smaller than the completions it holds",
            ));
        }
        ring.capacity = cqe;
        ring.overrun = false;
        Ok(cqe)
    }

    pub fn adopt_user(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_user(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_destroy_cq` fails with EBUSY while QPs use the CQ.
    pub fn check_destroyable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("cq still used by queue pairs"));
        }
        Ok(())
    }

    /// Counts one event handed to the application by `ibv_get_cq_event`.
    pub fn event_delivered(&self) {
        self.events.lock().unwrap_or_else(|p| p.into_inner()).0 += 1;
    }

    /// `ibv_ack_cq_events`.
    pub fn ack_events(&self, n: u64) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        ev.1 += n;
        self.events_acked.notify_all();
    }

    /// Blocks until every delivered event is acknowledged (`ibv_destroy_cq` does, in rdma-core).
    pub fn wait_events_acked(&self) {
        let mut ev = self.events.lock().unwrap_or_else(|p| p.into_inner());
        while ev.1 < ev.0 {
            ev = self
                .events_acked
                .wait(ev)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Detaches from the context and channel when the CQ is destroyed.
    pub fn destroy(&self) {
        self.ring().arming_event = false;
        if let Some(ch) = &self.channel {
            let me = self.handle();
            ch.events.discard(|h| *h == me);
            ch.users.fetch_sub(1, Ordering::AcqRel);
        }
        self.context.release_child();
    }
}

/// Events to tell: each channel with the CQ handle its event carries.
type ChannelEvents = Vec<(Arc<CompletionChannel>, usize)>;

thread_local! {
    /// The completion events of a [`with_events_deferred`] scope of this thread, in order.
    static DEFERRED_EVENTS: std::cell::RefCell<Option<ChannelEvents>> =
        const { std::cell::RefCell::new(None) };
}

/// Runs `f` (the handling of one arriving message), telling the completion channels of the
/// events its completions fire only when it is done: a message that both acknowledges a
/// SEND and brings the next one completes both before its event wakes the application, as a
/// HCA raises its event after writing the CQE. Told as they fired, the application woke on
/// the first, re-armed and polled while the second was being added, which then fired a
/// second event for a completion its poll took: an event with nothing behind it
/// (`ibv_rc_pingpong -t -e` failed on it). A nested scope leaves the telling to the outer.
pub fn with_events_deferred<R>(f: impl FnOnce() -> R) -> R {
    struct Scope;
    impl Drop for Scope {
        fn drop(&mut self) {
            let events = DEFERRED_EVENTS
                .with(|d| d.borrow_mut().take())
                .unwrap_or_default();
            for (channel, handle) in events {
                channel.events.push(handle);
            }
        }
    }
    let outer = DEFERRED_EVENTS.with(|d| {
        let mut d = d.borrow_mut();
        let outer = d.is_none();
        if outer {
            *d = Some(Vec::new());
        }
        outer
    });
    // Not `outer.then_some(Scope)`: that builds (and drops, telling early) a Scope for a
    // nested call too.
    let _scope = if outer { Some(Scope) } else { None };
    f()
}

/// Pushes to one CQ under one hold of its lock ([`CompletionQueue::batch`]).
pub struct PushBatch<'a> {
    cq: &'a CompletionQueue,
    ring: Option<std::sync::MutexGuard<'a, Ring>>,
    notify: bool,
}

impl PushBatch<'_> {
    /// As [`CompletionQueue::push`].
    pub fn push(&mut self, wc: WorkCompletion, solicited: bool) {
        let ring = self.ring.get_or_insert_with(|| self.cq.ring());
        self.notify |= self.cq.push_locked(ring, wc, solicited);
    }
}

impl Drop for PushBatch<'_> {
    fn drop(&mut self) {
        self.ring = None; // the lock first: the channel's own lock is never taken under it
        self.cq.notify_if(self.notify);
    }
}

#[cfg(test)]
mod tests {
    use super::super::work::WcOpcode;
    use super::*;

    fn wc(wr_id: u64) -> WorkCompletion {
        WorkCompletion::new(wr_id, WcStatus::Success, WcOpcode::Send, 7)
    }

    #[test]
    fn a_batch_queues_in_order_overruns_as_pushes_do_and_tells_an_armed_channel_once_at_its_end() {
        let context = Arc::new(DeviceContext::new().expect("context"));
        let channel = CompletionChannel::new(Arc::clone(&context)).expect("channel");
        let cq = CompletionQueue::new(context, 3, Some(Arc::clone(&channel)));
        cq.arm(false).unwrap();
        {
            let mut batch = cq.batch();
            for wr_id in 1..=4 {
                batch.push(wc(wr_id), true); // the fourth finds the CQ full: lost
            }
            assert_eq!(
                channel.events.try_wait().unwrap(),
                None,
                "not before the end"
            );
        }
        assert_eq!(channel.events.try_wait().unwrap(), Some(cq.handle()));
        assert_eq!(channel.events.try_wait().unwrap(), None, "told once");
        let mut polled = Vec::new();
        assert_eq!(cq.poll(8, |w| polled.push(w.wr_id)), 3);
        assert_eq!(polled, [1, 2, 3]);
        // Not armed since: a batch tells nobody; armed, an empty one tells nobody either.
        cq.batch().push(wc(5), true);
        cq.arm(false).unwrap();
        drop(cq.batch());
        assert_eq!(channel.events.try_wait().unwrap(), None);
        assert_eq!(cq.poll(8, |w| polled.push(w.wr_id)), 1);
        assert_eq!(polled, [1, 2, 3, 5]);
    }

    fn armed_cq() -> (Arc<CompletionChannel>, Arc<CompletionQueue>) {
        let context = Arc::new(DeviceContext::new().expect("context"));
        let channel = CompletionChannel::new(Arc::clone(&context)).expect("channel");
        let cq = CompletionQueue::new(context, 8, Some(Arc::clone(&channel)));
        cq.set_handle(0xa);
        cq.arm(false).unwrap();
        (channel, cq)
    }

    #[test]
    fn events_of_a_deferred_scope_are_told_at_its_end_in_order_and_nested_scopes_join_it() {
        let (channel, a) = armed_cq();
        let b = CompletionQueue::new(Arc::clone(&a.context), 8, Some(Arc::clone(&channel)));
        b.set_handle(0xb);
        b.arm(false).unwrap();
        with_events_deferred(|| {
            b.push(wc(1), true);
            with_events_deferred(|| a.push(wc(2), true));
            a.push(wc(3), true);
            assert_eq!(channel.events.try_wait().unwrap(), None, "not yet");
        });
        assert_eq!(channel.events.try_wait().unwrap(), Some(b.handle()));
        assert_eq!(channel.events.try_wait().unwrap(), Some(a.handle()));
        assert_eq!(channel.events.try_wait().unwrap(), None);
        // Outside a scope, told at once.
        a.arm(false).unwrap();
        a.push(wc(4), true);
        assert_eq!(channel.events.try_wait().unwrap(), Some(a.handle()));
    }

    #[test]
    fn arming_a_cq_that_holds_completions_owes_an_event_while_it_still_holds_them() {
        let (channel, cq) = armed_cq();
        cq.push(wc(1), true);
        assert_eq!(channel.events.try_wait().unwrap(), Some(cq.handle()));
        cq.push(wc(2), true);
        cq.push(wc(3), true);
        // Re-armed with three completions queued, repeatedly: one event owed, listed once.
        for _ in 0..3 {
            cq.arm(false).unwrap();
        }
        assert_eq!(channel.armed_with_completions.lock().unwrap().len(), 1);
        assert_eq!(
            channel.events.try_wait().unwrap(),
            None,
            "not through the fd"
        );
        let mut polled = Vec::new();
        cq.poll(1, |w| polled.push(w.wr_id));
        assert_eq!(channel.take_arming_event(), Some(cq.handle()), "two left");
        assert_eq!(channel.take_arming_event(), None, "once");
        // That event used the arming up: a new completion fires nothing.
        cq.push(wc(4), true);
        assert_eq!(channel.events.try_wait().unwrap(), None);
        // Armed again, then everything polled before the application asks: none owed, and
        // the CQ stays armed for the next completion.
        cq.arm(false).unwrap();
        cq.poll(8, |w| polled.push(w.wr_id));
        assert_eq!(polled, [1, 2, 3, 4]);
        assert_eq!(channel.take_arming_event(), None);
        cq.push(wc(5), true);
        assert_eq!(channel.events.try_wait().unwrap(), Some(cq.handle()));
        assert_eq!(channel.take_arming_event(), None);
    }

    #[test]
    fn a_new_completion_fires_in_place_of_the_arming_event_and_solicited_arming_owes_none() {
        let (channel, cq) = armed_cq();
        cq.push(wc(1), true);
        assert_eq!(channel.events.try_wait().unwrap(), Some(cq.handle()));
        cq.arm(false).unwrap();
        cq.push(wc(2), true);
        assert_eq!(channel.events.try_wait().unwrap(), Some(cq.handle()));
        assert_eq!(
            channel.take_arming_event(),
            None,
            "the completion's event stands for it"
        );
        cq.arm(true).unwrap();
        assert_eq!(channel.take_arming_event(), None, "solicited-only: none");
        assert_eq!(cq.poll(8, |_| ()), 2);
    }

    /// Adds completion `wr_id`, which must fire an event.
    fn push_firing(channel: &CompletionChannel, cq: &CompletionQueue, wr_id: u64) {
        cq.push(wc(wr_id), true);
        assert_eq!(
            channel.events.try_wait().unwrap(),
            Some(cq.handle()),
            "{wr_id}"
        );
    }

    #[test]
    fn an_event_standing_for_an_arming_event_is_stale_once_the_cq_is_empty() {
        let (channel, cq) = armed_cq();
        push_firing(&channel, &cq, 1);
        // Woken, the application re-arms before it polls (`ibv_rc_pingpong -e`), polls the
        // completion, and a second one fires an event before it polls again and takes it.
        cq.arm(false).unwrap();
        assert_eq!(cq.poll(1, |_| ()), 1);
        push_firing(&channel, &cq, 2);
        assert_eq!(cq.poll(1, |_| ()), 1);
        assert!(cq.take_stale_event(), "nothing left for it to stand for");
        assert!(!cq.take_stale_event(), "once");
        // Armed again: the next completion fires, and its event is not stale.
        push_firing(&channel, &cq, 3);
        assert!(!cq.take_stale_event());
        // The same event with a completion still queued is handed out.
        cq.arm(false).unwrap();
        push_firing(&channel, &cq, 4);
        assert!(!cq.take_stale_event(), "3 and 4 are there");
        assert_eq!(cq.poll(8, |_| ()), 2);
    }

    #[test]
    fn an_event_fired_on_an_arming_of_an_empty_cq_is_handed_out_even_once_polled() {
        let (channel, cq) = armed_cq();
        for wr_id in 1..3 {
            push_firing(&channel, &cq, wr_id);
            assert_eq!(cq.poll(1, |_| ()), 1);
            assert!(
                !cq.take_stale_event(),
                "armed while empty: an ordinary event"
            );
            cq.arm(false).unwrap();
        }
    }

    #[test]
    fn a_destroyed_cq_leaves_its_channels_list_when_another_joins_it() {
        let (channel, cq) = armed_cq();
        cq.push(wc(1), true);
        cq.arm(false).unwrap();
        assert_eq!(channel.armed_with_completions.lock().unwrap().len(), 1);
        {
            let gone = CompletionQueue::new(Arc::clone(&cq.context), 8, Some(Arc::clone(&channel)));
            gone.push(wc(9), true);
            gone.arm(false).unwrap();
            assert_eq!(channel.armed_with_completions.lock().unwrap().len(), 2);
        }
        let other = CompletionQueue::new(Arc::clone(&cq.context), 8, Some(Arc::clone(&channel)));
        other.push(wc(9), true);
        other.arm(false).unwrap();
        assert_eq!(
            channel.armed_with_completions.lock().unwrap().len(),
            2,
            "the gone one left"
        );
    }
}
