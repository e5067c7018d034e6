//! Queue pairs: RC semantics on top of the engine's messages (docs/design.md), split by role
//! as rdma-core's rxe splits them:
//!
//! | file | role |
//! |---|---|
//! | [`attributes`] | caps, address vectors, modify attributes and their value checks |
//! | [`queues`] | the state the roles share under the QP's lock, and the outbox of UCX work |
//! | [`transition`] | what entering each state does (`ibv_modify_qp`), state-change events |
//! | [`requester`] | `ibv_post_send`: checks, sequence numbers, headers, sending |
//! | [`responder`] | RC arrivals: peer and sequence checks, RNR waiting, key checks, READ/atomic execution, ACKs |
//! | [`receive`] | `ibv_post_recv`, receive checks, data placement, in-order receive completions |
//! | [`placed`] | receives a same-host peer placed small SENDs in (the receive ring) |
//! | [`completer`] | ACK/NAK and READ/atomic responses → send completions in post order; flush |
//! | [`timer`] | the transport timer: retransmission, RETRY_EXC_ERR |
//! | [`local`] | memory-window work: BIND_MW and LOCAL_INV in post order, remote invalidation |
//! | [`unreliable`] | the UC and UD receive side (nothing acknowledged, nothing waits) |
//! | [`xrc`] | XRC target QPs: receives from the SRQ each SEND names, completions on its CQ |
//!
//! This file holds the queue pair itself, its creation and destruction, the lock-then-send
//! discipline every role uses, and the [`MessageReceiver`] the engine dispatches to.

mod attributes;
mod completer;
mod local;
mod multicast;
mod placed;
mod queues;
mod receive;
mod requester;
mod resolve;
mod responder;
mod timer;
mod transition;
mod unreliable;
mod xrc;

pub use crate::engine::Peer;
pub use attributes::{AddressVector, GlobalRoute, ModifyRequest, QpAttributes, QpCaps};
pub use placed::fence_placed_receives;
pub use xrc::XrcTarget;

use super::VerbsError;
use super::cq::CompletionQueue;
use super::pd::ProtectionDomain;
use super::qp_state::{QpState, QpType};
use super::srq::SharedReceiveQueue;
use super::work::WcStatus;
use crate::engine::MessageReceiver;
use crate::engine::direct::OwnReceiveRing;
use crate::engine::wire::Header;
use crate::ucp::{AmPayload, AppSpan, Endpoint, LockedWorker};
use queues::{Deferred, Queues, release_kept};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// How long `ibv_destroy_qp` waits for UCX to be done with the QP's application memory when
/// the peer is alive but does not take (or drop) what is in flight: a peer stopped in a
/// debugger, or one that does not progress. Past it the destroy goes on (see `destroy`).
const UCX_IO_FENCE_MAX: Duration = Duration::from_secs(2);
/// How often that wait looks whether a peer on this host died.
const PEER_CHECK_EVERY: Duration = Duration::from_millis(20);

pub struct QueuePair {
    pub qp_num: u32,
    pub qp_type: QpType,
    pub pd: Arc<ProtectionDomain>,
    pub send_cq: Arc<CompletionQueue>,
    pub recv_cq: Arc<CompletionQueue>,
    /// Where receives come from instead of the QP's own queue.
    pub srq: Option<Arc<SharedReceiveQueue>>,
    pub sq_sig_all: bool,
    pub caps: QpCaps,
    /// This port's LID (completions at the peer carry it as `slid`).
    pub local_lid: u16,
    handle: AtomicUsize,
    queues: Mutex<Queues>,
    /// UCX operations in flight over this QP's application memory: sends that read it (data
    /// messages, READ responses) and rendezvous receives that write it. Counted up and down
    /// under the worker lock; `destroy` waits for it to reach 0.
    ucx_io: AtomicU32,
    /// Told when the transport timer (or the RNR retry count) fails the QP.
    on_transport_error: Mutex<Option<TransportErrorHook>>,
    /// An XRC target QP's domain and handles ([`xrc`]).
    xrc_target: Option<XrcTarget>,
    /// Its receive queue as a same-host peer sees it ([`placed`]), made once a peer on this
    /// host is connected.
    receive_ring: OnceLock<Arc<OwnReceiveRing>>,
}

/// What the owner of a QP (the connection manager) does when the QP's peer stopped answering.
pub type TransportErrorHook = Arc<dyn Fn() + Send + Sync>;

impl QueuePair {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        qp_num: u32,
        qp_type: QpType,
        pd: Arc<ProtectionDomain>,
        send_cq: Arc<CompletionQueue>,
        recv_cq: Arc<CompletionQueue>,
        srq: Option<Arc<SharedReceiveQueue>>,
        sq_sig_all: bool,
        caps: QpCaps,
        local_lid: u16,
    ) -> Result<Arc<QueuePair>, VerbsError> {
        if qp_type == QpType::XrcRecv {
            return Err(VerbsError::Invalid(
                "an XRC target QP is made on an xrcd (QueuePair::new_xrc_target)",
            ));
        }
        pd.adopt_child();
        send_cq.adopt_user();
        recv_cq.adopt_user();
        if let Some(s) = &srq {
            s.adopt_user();
        }
        Ok(Arc::new(QueuePair {
            qp_num,
            qp_type,
            pd,
            send_cq,
            recv_cq,
            srq,
            sq_sig_all,
            caps,
            local_lid,
            handle: AtomicUsize::new(0),
            queues: Mutex::new(Queues::new()),
            ucx_io: AtomicU32::new(0),
            on_transport_error: Mutex::new(None),
            xrc_target: None,
            receive_ring: OnceLock::new(),
        }))
    }

    pub fn set_handle(&self, h: usize) {
        self.handle.store(h, Ordering::Release);
    }

    pub fn handle(&self) -> usize {
        self.handle.load(Ordering::Acquire)
    }

    fn queues(&self) -> MutexGuard<'_, Queues> {
        self.queues.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` under the queue lock, then sends what it queued, with the lock released.
    fn locked_then_send<R>(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        f: impl FnOnce(&mut Queues) -> R,
    ) -> R {
        let (result, outbox) = {
            let mut q = self.queues();
            let r = f(&mut q);
            if q.outbox.is_empty() {
                return r;
            }
            (r, std::mem::take(&mut q.outbox))
        };
        for work in outbox {
            match work {
                Deferred::Send {
                    endpoint,
                    header,
                    payload,
                    data_seq,
                } => {
                    self.start_send(locked, &endpoint, &header, payload, data_seq);
                }
                Deferred::Release(data) => locked.release(data),
                Deferred::Receive {
                    data,
                    spans,
                    seq,
                    landed,
                } => {
                    let me = Arc::clone(self);
                    let done = Box::new(
                        move |locked: &LockedWorker<'_>,
                              result: Result<usize, crate::ucp::Error>| {
                            me.ucx_io_done();
                            landed(&me, locked, seq, result)
                        },
                    );
                    match locked.receive_rendezvous(data, &spans, done) {
                        // Its callback cannot run before this: it needs the worker lock.
                        Ok(false) => self.ucx_io_started(),
                        Ok(true) => landed(self, locked, seq, Ok(0)),
                        Err(e) => landed(self, locked, seq, Err(e)),
                    }
                }
            }
        }
        result
    }

    /// Raises an asynchronous event about this QP (called with its queues locked; nothing
    /// once `destroy` cleared the handle, so no event can follow `ibv_destroy_qp`).
    fn raise(&self, event_type: u32) {
        let handle = self.handle();
        if handle != 0 {
            self.pd.context.raise(event_type, handle);
        }
    }

    /// Runs `hook` (without the QP's lock) when the transport timer or the RNR retry count
    /// fails this QP: its peer stopped answering.
    pub fn on_transport_error(&self, hook: Option<TransportErrorHook>) {
        *self
            .on_transport_error
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = hook;
    }

    /// The QP's peer stopped answering: tells the owner's hook (no lock of the QP held).
    fn transport_failed(&self) {
        let hook = self
            .on_transport_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    pub fn state(&self) -> QpState {
        self.queues().state
    }

    pub fn attributes(&self) -> (QpState, QpAttributes) {
        let q = self.queues();
        (q.state, q.attrs)
    }

    pub fn peer_endpoint(&self) -> Option<Arc<Endpoint>> {
        self.queues().peer.as_ref().map(|p| Arc::clone(&p.endpoint))
    }

    /// `ibv_destroy_qp`: releases kept messages and detaches from PD and CQs (no
    /// completions). Once it returns, nothing reads or writes the application's buffers on
    /// its behalf any more, as a HCA stops DMA for a QP before `ibv_destroy_qp` returns:
    /// UCX operations still moving bytes of this QP's WRs or READ responses (the peer pulling
    /// a rendezvous message) are progressed to their end first. Those to a peer found dead end
    /// at once; a live peer that takes none of it for [`UCX_IO_FENCE_MAX`] (stopped) is given
    /// up on, and may read what it was sent later.
    pub fn destroy(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        let peer = self.locked_then_send(locked, |q| {
            release_kept(q);
            q.sq.clear();
            q.held.clear();
            q.rq.clear();
            q.state = QpState::Reset;
            self.handle.store(0, Ordering::Release);
            if q.dropped > 0 {
                tracing::debug!("qp {:#x}: {} requests dropped", self.qp_num, q.dropped);
            }
            q.peer.as_ref().map(|p| Arc::clone(&p.endpoint))
        });
        self.wait_for_ucx_io(locked, peer.as_deref());
        self.retire_receive_ring();
        self.on_transport_error(None);
        self.pd.release_child();
        self.send_cq.release_user();
        self.recv_cq.release_user();
        if let Some(s) = &self.srq {
            s.release_user();
        }
        if let Some(d) = self.xrc_domain() {
            d.remove_target(self.qp_num);
        }
    }
}

impl QueuePair {
    /// A UCX operation over this QP's application memory started (it stays pending).
    pub(super) fn ucx_io_started(&self) {
        self.ucx_io.fetch_add(1, Ordering::AcqRel);
    }

    /// One such operation ended (its callback ran).
    pub(super) fn ucx_io_done(&self) {
        self.ucx_io.fetch_sub(1, Ordering::AcqRel);
    }

    /// Progresses the worker until UCX is done with this QP's application memory, the peer
    /// is found dead, or [`UCX_IO_FENCE_MAX`] passed. A peer on this host that died leaves
    /// its transfers pending in UCX for good; the progress thread, which would notice, waits
    /// for the worker this holds, so this looks itself now and then.
    fn wait_for_ucx_io(&self, locked: &LockedWorker<'_>, peer: Option<&Endpoint>) {
        let deadline = Instant::now() + UCX_IO_FENCE_MAX;
        let mut next_peer_check = Instant::now();
        while self.ucx_io.load(Ordering::Acquire) > 0 {
            let now = Instant::now();
            if now >= next_peer_check {
                next_peer_check = now + PEER_CHECK_EVERY;
                if let Some(engine) = crate::engine::Engine::running() {
                    engine.check_local_peers(locked);
                }
            }
            if peer.is_some_and(Endpoint::failed) {
                return;
            }
            if now >= deadline {
                tracing::warn!(
                    "qp {:#x}: destroyed while its peer still had {} transfer(s) of its memory \
                     in flight",
                    self.qp_num,
                    self.ucx_io.load(Ordering::Acquire)
                );
                return;
            }
            if locked.progress() == 0 {
                std::thread::yield_now();
            }
        }
    }
}

/// How the engine reaches a queue pair: each role handles what concerns it.
impl MessageReceiver for QueuePair {
    fn request_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        super::cq::with_events_deferred(|| self.on_request(locked, header, payload))
    }

    fn response_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        super::cq::with_events_deferred(|| self.on_response(locked, header, payload))
    }

    fn group_datagram(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        mgid: &[u8; 16],
        payload: AmPayload<'_>,
    ) -> bool {
        self.on_group_datagram(locked, header, mgid, payload)
    }

    fn ack_arrived(self: Arc<Self>, locked: &LockedWorker<'_>, header: &Header) {
        super::cq::with_events_deferred(|| self.on_ack(locked, header));
    }

    fn send_owed_ack(self: Arc<Self>, locked: &LockedWorker<'_>, owed_by: Option<u64>) {
        self.send_owed_ack_by(locked, owed_by);
    }

    fn send_full_batch_ack(self: Arc<Self>, locked: &LockedWorker<'_>, poll: u64) {
        self.send_full_batch_ack_by(locked, poll);
    }

    fn peer_failed(self: Arc<Self>, locked: &LockedWorker<'_>) {
        if !self.peer_endpoint().is_some_and(|ep| ep.failed()) {
            return;
        }
        // UC and UD senders are not told: an unacknowledged transport cannot know.
        if self.qp_type.reliable() {
            self.fail(locked, WcStatus::RetryExcErr);
        }
        // Sends flushed before, held while UCX carried their buffers to that peer, complete.
        self.locked_then_send(locked, |q| self.release_send_completions(q));
    }

    fn tick(self: Arc<Self>, locked: &LockedWorker<'_>, now: std::time::Instant) -> bool {
        QueuePair::tick(&self, locked, now)
    }
}

/// Adds `n` to a statistics counter and returns the new total: a plain load and store, not a
/// locked add, since the counters are updated under the worker lock and a count lost to a race
/// only blurs a log line.
fn add_to_statistic(counter: &std::sync::atomic::AtomicU64, n: u64) -> u64 {
    use std::sync::atomic::Ordering;
    let total = counter.load(Ordering::Relaxed) + n;
    counter.store(total, Ordering::Relaxed);
    total
}
