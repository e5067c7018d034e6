//! Queue pairs: the send and receive queues, the state machine, and RC semantics on top of
//! the engine's messages (docs/design.md): in-order delivery by sequence number, send
//! completions in post order once the responder acknowledged, and flush-on-error. UC and UD
//! share the send queue and the receive placement; their unacknowledged receive side is in
//! [`unreliable`].

mod unreliable;

use super::context::{
    EVENT_COMM_EST, EVENT_QP_ACCESS_ERR, EVENT_QP_FATAL, EVENT_QP_LAST_WQE_REACHED,
    EVENT_QP_REQ_ERR, EVENT_SQ_DRAINED,
};
use super::cq::CompletionQueue;
use super::mr::{self, local_spans};
use super::pd::ProtectionDomain;
use super::qp_state::{AttrMask, QpState, QpType, TransitionError, check_transition};
use super::srq::SharedReceiveQueue;
use super::work::{
    RecvRequest, SendOpcode, SendRequest, WC_WITH_IMM, WcOpcode, WcStatus, WorkCompletion,
};
use super::{VerbsError, device};
use crate::engine::wire::{self, Header, Nak, Op};
use crate::ucp::{AmData, AmPayload, AppSpan, Endpoint, LockedWorker, SendPayload, SendState};
use smallvec::SmallVec;
use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

/// Queue sizes granted at creation (`ibv_qp_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpCaps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl QpCaps {
    /// What ugdr grants for a request (`ibv_create_qp` may raise, never lower, the caps).
    pub fn grant(requested: QpCaps) -> Result<QpCaps, VerbsError> {
        let max_wr = device::MAX_QP_WR as u32;
        let max_sge = device::MAX_SGE as u32;
        if requested.max_send_wr > max_wr || requested.max_recv_wr > max_wr {
            return Err(VerbsError::Invalid("more work requests than max_qp_wr"));
        }
        if requested.max_send_sge > max_sge || requested.max_recv_sge > max_sge {
            return Err(VerbsError::Invalid("more SGEs than max_sge"));
        }
        if requested.max_inline_data > device::MAX_INLINE_DATA {
            return Err(VerbsError::Invalid(
                "max_inline_data above the device limit",
            ));
        }
        Ok(QpCaps {
            max_send_wr: requested.max_send_wr.max(1),
            max_recv_wr: requested.max_recv_wr.max(1),
            max_send_sge: requested.max_send_sge.max(1),
            max_recv_sge: requested.max_recv_sge.max(1),
            max_inline_data: requested.max_inline_data.max(64),
        })
    }
}

/// Global routing header fields of an address vector (`ibv_global_route`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// An address vector (`ibv_ah_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AddressVector {
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: bool,
    pub port_num: u8,
    pub grh: GlobalRoute,
}

/// The attributes `ibv_modify_qp` sets and `ibv_query_qp` reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct QpAttributes {
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    pub path_mtu: u32,
    pub ah: AddressVector,
    pub alt_ah: AddressVector,
    pub alt_pkey_index: u16,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub path_mig_state: u32,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub min_rnr_timer: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub en_sqd_async_notify: u8,
}

/// One `ibv_modify_qp` call, converted.
#[derive(Debug, Clone, Copy)]
pub struct ModifyRequest {
    pub mask: AttrMask,
    pub state: Option<QpState>,
    pub claimed_cur: Option<QpState>,
    pub attrs: QpAttributes,
}

/// The remote QP an RC/UC QP is connected to, and the endpoint to its process.
#[derive(Clone)]
pub struct Peer {
    pub endpoint: Arc<Endpoint>,
    pub qpn: u32,
}

struct SendEntry {
    wr_id: u64,
    opcode: WcOpcode,
    signaled: bool,
    seq: u32,
    byte_len: u32,
    /// Set when the entry is finished (acknowledged, or failed with this status).
    outcome: Option<WcStatus>,
    /// READ and atomics: where the response lands; they finish with their response, never
    /// with an ACK.
    response_into: Option<SmallVec<[AppSpan; 4]>>,
}

/// A message body: the running handler's, or one kept until it can be delivered.
enum Body<'a> {
    Current(AmPayload<'a>),
    Owned(Vec<u8>),
    Held(AmData),
}

impl Body<'_> {
    fn len(&self) -> usize {
        match self {
            Body::Current(AmPayload::Transient(b)) => b.len(),
            Body::Current(AmPayload::Persistent(d) | AmPayload::Rendezvous(d)) | Body::Held(d) => {
                d.len()
            }
            Body::Owned(b) => b.len(),
        }
    }

    /// The bytes, when they are already here (not a rendezvous).
    fn bytes_if_eager(&self) -> Option<&[u8]> {
        match self {
            Body::Current(AmPayload::Transient(b)) => Some(b),
            Body::Current(AmPayload::Persistent(d)) => Some(d.bytes()),
            Body::Held(d) if !d.is_rendezvous() => Some(d.bytes()),
            Body::Owned(b) => Some(b),
            _ => None,
        }
    }
}

/// Requests that consume a posted receive.
fn needs_receive(h: &Header) -> bool {
    h.op == Op::Send || (h.op == Op::Write && h.flags & wire::FLAG_IMM != 0)
}

struct Pending {
    header: Header,
    body: Body<'static>,
}

/// A request whose effects complete in order at the responder: a receive or a write whose
/// data is landing, or a READ/atomic waiting behind them (so it sees earlier writes).
struct Landing {
    seq: u32,
    /// The receive completion it produces (SEND, WRITE_WITH_IMM), if any.
    wc: Option<WorkCompletion>,
    solicited: bool,
    landed: bool,
    then: Option<Response>,
}

/// What a READ or atomic answers, once every earlier request of the QP took effect.
enum Response {
    Read {
        span: Option<AppSpan>,
    },
    Atomic {
        span: AppSpan,
        kind: u8,
        compare_add: u64,
        swap: u64,
    },
}

/// UCX work to start once the queue lock is released. UCX may run callbacks inline inside any
/// call (its `self` transport delivers a send to a QP of this process, and completes a
/// rendezvous receive, before the call returns), and those callbacks take queue locks, so no
/// UCX operation is ever started while a queue lock is held.
enum Deferred {
    Send {
        endpoint: Arc<Endpoint>,
        header: Header,
        payload: SendPayload,
        /// For data messages: the send-queue entry that fails if UCX cannot send it.
        data_seq: Option<u32>,
    },
    /// Pull a rendezvous body into `spans` (a receive WR's buffers, a WRITE's target, or a
    /// READ's SGEs at the requester); `landed` runs when it is in place.
    Receive {
        data: AmData,
        spans: SmallVec<[AppSpan; 4]>,
        seq: u32,
        landed: Landed,
    },
    /// Give a kept message body back to UCX (for a rendezvous one, this answers its sender).
    Release(AmData),
}

/// A data message `post_send` sends once the queue lock is released.
struct DataMessage {
    endpoint: Arc<Endpoint>,
    header: Header,
    payload: SendPayload,
    seq: u32,
}

/// What runs when a rendezvous body landed: `QueuePair::on_landed` (responder) or
/// `QueuePair::on_response_landed` (a READ at the requester).
type Landed = fn(&Arc<QueuePair>, &LockedWorker<'_>, u32, Result<usize, crate::ucp::Error>);

struct Queues {
    outbox: SmallVec<[Deferred; 2]>,
    state: QpState,
    attrs: QpAttributes,
    peer: Option<Peer>,
    sq: VecDeque<SendEntry>,
    next_send_seq: u32,
    rq: VecDeque<RecvRequest>,
    expected_seq: u32,
    /// Messages that arrived ahead of `expected_seq`.
    early: BTreeMap<u32, Pending>,
    /// In-order messages waiting for a receive WR (RNR: kept, as with infinite rnr_retry).
    waiting: VecDeque<Pending>,
    /// Receives whose data is still landing (rendezvous), completed in order.
    landing: VecDeque<Landing>,
    /// The newest delivered sequence number the peer has not been told about; it rides on the
    /// next message this QP sends, or goes alone when the engine flushes owed ACKs.
    ack_owed: Option<u32>,
    acks_unsent: u32,
    /// IBV_EVENT_COMM_EST was raised (the first message reached the QP in RTR).
    comm_established: bool,
    /// In SQD with `en_sqd_async_notify`: IBV_EVENT_SQ_DRAINED is owed once the SQ is empty.
    sqd_notify: bool,
    /// UC/UD: numbers receives in arrival order (their completions are released in it).
    next_receive: u32,
}

/// At most this many delivered messages go unacknowledged before an ACK is sent at once.
const ACK_BATCH: u32 = 16;

/// QPs that owe their peer an ACK (by QP number), flushed by the engine when the application
/// or the progress thread runs out of work ([`take_owed_acks`]).
static OWED_ACKS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static OWED_COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The QPs that owe an ACK, emptying the list (cheap when it is empty).
pub fn take_owed_acks() -> Vec<u32> {
    if OWED_COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let mut owed = OWED_ACKS.lock().unwrap_or_else(|p| p.into_inner());
    OWED_COUNT.store(0, Ordering::Release);
    std::mem::take(&mut *owed)
}

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
}

/// Most messages a QP keeps for a receiver that is not yet ready (RTR) or has no WR posted.
const MAX_KEPT_MESSAGES: usize = 1 << 16;

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
        if !matches!(qp_type, QpType::Rc | QpType::Uc | QpType::Ud) {
            return Err(VerbsError::Unsupported(
                "queue pair type (ugdr carries RC, UC and UD queue pairs)",
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
            queues: Mutex::new(Queues {
                outbox: SmallVec::new(),
                state: QpState::Reset,
                attrs: QpAttributes {
                    port_num: device::PORT_NUM,
                    ..Default::default()
                },
                peer: None,
                sq: VecDeque::new(),
                next_send_seq: 0,
                rq: VecDeque::new(),
                expected_seq: 0,
                early: BTreeMap::new(),
                waiting: VecDeque::new(),
                landing: VecDeque::new(),
                ack_owed: None,
                acks_unsent: 0,
                comm_established: false,
                sqd_notify: false,
                next_receive: 0,
            }),
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
                } => self.start_send(locked, &endpoint, &header, payload, data_seq),
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
                            landed(&me, locked, seq, result)
                        },
                    );
                    match locked.receive_rendezvous(data, &spans, done) {
                        Ok(false) => {}
                        Ok(true) => landed(self, locked, seq, Ok(0)),
                        Err(e) => landed(self, locked, seq, Err(e)),
                    }
                }
            }
        }
        result
    }

    fn start_send(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        endpoint: &Endpoint,
        header: &Header,
        payload: SendPayload,
        data_seq: Option<u32>,
    ) {
        // UC and UD sends complete once UCX is done with the buffer: nothing acknowledges them.
        let unreliable = self.qp_type != QpType::Rc;
        let result = match data_seq {
            Some(seq) => {
                let me = Arc::clone(self);
                endpoint.am_send(
                    locked,
                    wire::AM_ID,
                    &header.encode(),
                    payload,
                    move |locked, result| match result {
                        Ok(()) if unreliable => me.sent(locked, seq),
                        Ok(()) => {}
                        Err(e) => {
                            tracing::debug!("qp {:#x}: send seq {seq} failed: {e}", me.qp_num);
                            if unreliable {
                                me.sent(locked, seq);
                            } else {
                                me.fail_send(locked, seq, WcStatus::RetryExcErr);
                            }
                        }
                    },
                )
            }
            None => endpoint.am_send(locked, wire::AM_ID, &header.encode(), payload, |_, _| {}),
        };
        match (result, data_seq) {
            (Ok(SendState::Done), Some(seq)) if unreliable => self.sent(locked, seq),
            (Ok(_), _) | (Err(_), None) => {}
            (Err(e), Some(seq)) => {
                tracing::debug!(
                    "qp {:#x}: cannot send {:?} seq {seq}: {e}",
                    self.qp_num,
                    header.op,
                );
                if unreliable {
                    // Lost on the way, as an unreliable transport may lose it.
                    self.sent(locked, seq);
                } else {
                    self.fail_send(locked, seq, WcStatus::RetryExcErr);
                }
            }
        }
    }

    /// A UC/UD send left: it completes (in post order) without an acknowledgement.
    fn sent(self: &Arc<Self>, locked: &LockedWorker<'_>, seq: u32) {
        self.locked_then_send(locked, |q| {
            if let Some(e) =
                q.sq.iter_mut()
                    .find(|e| e.seq == seq && e.outcome.is_none())
            {
                e.outcome = Some(WcStatus::Success);
            }
            self.release_send_completions(q);
        });
    }

    /// Raises an asynchronous event about this QP.
    fn raise(&self, event_type: u32) {
        self.pd.context.raise(event_type, self.handle());
    }

    /// The send WR `seq` failed: it completes with `status` and the QP goes to ERR.
    fn fail_send(self: &Arc<Self>, locked: &LockedWorker<'_>, seq: u32, status: WcStatus) {
        self.locked_then_send(locked, |q| {
            if matches!(q.state, QpState::Err | QpState::Reset) {
                return;
            }
            self.fail_entry(q, seq, status)
        });
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

    /// `ibv_destroy_qp`: releases kept messages and detaches from PD and CQs. No completions.
    pub fn destroy(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        self.locked_then_send(locked, |q| {
            release_kept(q);
            q.sq.clear();
            q.rq.clear();
            q.state = QpState::Reset;
        });
        self.pd.release_child();
        self.send_cq.release_user();
        self.recv_cq.release_user();
        if let Some(s) = &self.srq {
            s.release_user();
        }
    }

    /// Checks a modify against the state machine and the attribute values; applies it only
    /// if all of it is valid ("none of the attributes will be modified" otherwise).
    /// `peer` is the resolved destination when the request moves an RC QP to RTR.
    pub fn modify(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        req: &ModifyRequest,
        peer: Option<Peer>,
    ) -> Result<QpState, VerbsError> {
        self.locked_then_send(locked, |q| self.modify_locked(q, req, peer))
    }

    fn modify_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        req: &ModifyRequest,
        peer: Option<Peer>,
    ) -> Result<QpState, VerbsError> {
        let cur = q.state;
        let next = req.state.unwrap_or(cur);
        check_transition(self.qp_type, cur, next, req.mask, req.claimed_cur).map_err(|e| {
            tracing::debug!("modify qp {:#x}: {e:?}", self.qp_num);
            match e {
                TransitionError::Invalid { .. } => {
                    VerbsError::Invalid("invalid qp state transition")
                }
                TransitionError::Missing { .. } => {
                    VerbsError::Invalid("required qp attributes missing")
                }
                TransitionError::Unexpected { .. } => {
                    VerbsError::Invalid("qp attribute not allowed in this transition")
                }
                TransitionError::CurStateMismatch { .. } => {
                    VerbsError::Invalid("cur_qp_state does not match")
                }
            }
        })?;
        check_values(req)?;
        if next == QpState::Rtr
            && cur != QpState::Rtr
            && matches!(self.qp_type, QpType::Rc | QpType::Uc)
            && peer.is_none()
        {
            return Err(VerbsError::Invalid(
                "destination address cannot be resolved",
            ));
        }
        apply_attrs(&mut q.attrs, req);
        if next != cur || next == QpState::Reset || next == QpState::Err {
            self.enter(q, next, peer);
        }
        Ok(q.state)
    }

    fn enter(self: &Arc<Self>, q: &mut Queues, next: QpState, peer: Option<Peer>) {
        tracing::debug!("qp {:#x}: {:?} -> {:?}", self.qp_num, q.state, next);
        match next {
            QpState::Reset => {
                release_kept(q);
                q.sq.clear();
                q.rq.clear();
                q.peer = None;
                q.next_send_seq = 0;
                q.expected_seq = 0;
                q.ack_owed = None;
                q.acks_unsent = 0;
                q.comm_established = false;
                q.sqd_notify = false;
                q.next_receive = 0;
                q.attrs = QpAttributes {
                    port_num: device::PORT_NUM,
                    ..Default::default()
                };
                q.state = QpState::Reset;
            }
            QpState::Err => {
                q.state = QpState::Err;
                self.flush(q);
            }
            QpState::Rtr => {
                q.state = QpState::Rtr;
                q.peer = peer;
                q.expected_seq = 0;
                if !q.early.is_empty() {
                    self.established(q);
                }
                // Messages that arrived before RTR (the peer may be faster) are delivered now.
                self.drain_early(q);
            }
            QpState::Rts => {
                if q.state == QpState::Rtr {
                    q.next_send_seq = 0;
                }
                q.state = QpState::Rts;
                q.sqd_notify = false;
            }
            QpState::Sqd => {
                q.state = QpState::Sqd;
                q.sqd_notify = q.attrs.en_sqd_async_notify != 0;
                self.check_drained(q);
            }
            other => q.state = other,
        }
    }

    /// The first message reached the QP while in RTR (IBA 11.6.3: IBV_EVENT_COMM_EST, so a
    /// passive side knows the connection works before it moves to RTS).
    fn established(&self, q: &mut Queues) {
        if q.state == QpState::Rtr && !q.comm_established {
            q.comm_established = true;
            self.raise(EVENT_COMM_EST);
        }
    }

    /// In SQD with notification asked for: IBV_EVENT_SQ_DRAINED once no send is outstanding.
    fn check_drained(&self, q: &mut Queues) {
        if q.sqd_notify && q.state == QpState::Sqd && q.sq.is_empty() {
            q.sqd_notify = false;
            self.raise(EVENT_SQ_DRAINED);
        }
    }

    /// Moves the QP to ERR because of a failure the engine saw (peer gone, transport error):
    /// an error not caused by one work request, so IBV_EVENT_QP_FATAL as well.
    pub fn fail(self: &Arc<Self>, locked: &LockedWorker<'_>, status: WcStatus) {
        self.locked_then_send(locked, |q| {
            if q.state == QpState::Err || q.state == QpState::Reset {
                return;
            }
            self.raise(EVENT_QP_FATAL);
            if let Some(e) = q.sq.iter_mut().find(|e| e.outcome.is_none()) {
                e.outcome = Some(status);
            }
            self.release_send_completions(q);
            q.state = QpState::Err;
            self.flush(q);
        })
    }

    /// Completes every outstanding WR with IBV_WC_WR_FLUSH_ERR, in order (sends after any
    /// already-finished ones, then receives).
    fn flush(&self, q: &mut Queues) {
        self.release_send_completions(q);
        while let Some(e) = q.sq.pop_front() {
            let status = e.outcome.unwrap_or(WcStatus::WrFlushErr);
            let mut wc = WorkCompletion::new(e.wr_id, status, e.opcode, self.qp_num);
            wc.byte_len = 0;
            self.send_cq.push(wc, true);
        }
        for l in q.landing.drain(..) {
            if let Some(mut wc) = l.wc {
                wc.status = WcStatus::WrFlushErr;
                wc.byte_len = 0;
                wc.wc_flags = 0;
                self.recv_cq.push(wc, true);
            }
        }
        if self.srq.is_some() {
            // IBA 11.6.3: a QP on an SRQ that went to ERR will take no more of its WRs.
            self.raise(EVENT_QP_LAST_WQE_REACHED);
        }
        for r in q.rq.drain(..) {
            self.recv_cq.push(
                WorkCompletion::new(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qp_num),
                true,
            );
        }
        release_kept(q);
    }

    // ---------------------------------------------------------------- send side

    /// Posts one send WR. Errors are the ones `ibv_post_send` returns (the WR is not queued);
    /// failures found while executing it become error completions instead.
    pub fn post_send(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        req: SendRequest,
    ) -> Result<(), VerbsError> {
        // A UD send's endpoint comes from the engine's cache, before the queue lock is taken.
        let datagram_to = match (self.qp_type, &req.ud) {
            (QpType::Ud, Some(ud)) => {
                if !Arc::ptr_eq(&ud.ah.pd, &self.pd) {
                    return Err(VerbsError::Invalid(
                        "address handle of another protection domain",
                    ));
                }
                Some(ud.ah.endpoint(locked))
            }
            (QpType::Ud, None) => {
                return Err(VerbsError::Invalid("UD send without an address handle"));
            }
            _ => None,
        };
        // The message itself is sent straight from here (the hot path), the queue lock
        // released; anything else the post queued goes through the outbox.
        let message =
            self.locked_then_send(locked, |q| self.post_send_locked(q, req, datagram_to))?;
        if let Some(DataMessage {
            endpoint,
            header,
            payload,
            seq,
        }) = message
        {
            self.start_send(locked, &endpoint, &header, payload, Some(seq));
        }
        Ok(())
    }

    /// `datagram_to`: for a UD send, the endpoint to the address handle's process (None:
    /// nobody answers to that address, the datagram is lost).
    fn post_send_locked(
        &self,
        q: &mut Queues,
        req: SendRequest,
        datagram_to: Option<Option<Arc<Endpoint>>>,
    ) -> Result<Option<DataMessage>, VerbsError> {
        match q.state {
            QpState::Rts | QpState::Sqd => {}
            QpState::Err | QpState::Sqe => {
                let mut wc = WorkCompletion::new(
                    req.wr_id,
                    WcStatus::WrFlushErr,
                    req.opcode.completion_opcode(),
                    self.qp_num,
                );
                wc.byte_len = 0;
                self.send_cq.push(wc, true);
                return Ok(None);
            }
            _ => return Err(VerbsError::Invalid("post_send on a QP that is not in RTS")),
        }
        if q.sq.len() >= self.caps.max_send_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if req.sges.len() > self.caps.max_send_sge as usize {
            return Err(VerbsError::Invalid("num_sge above max_send_sge"));
        }
        if let Some(d) = &req.inline_data {
            if d.len() > self.caps.max_inline_data as usize {
                return Err(VerbsError::Invalid("inline data above max_inline_data"));
            }
        }
        let length = req.length();
        if length > u64::from(device::MAX_MSG_SIZE) {
            return Err(VerbsError::Invalid(
                "message longer than the port's max_msg_sz",
            ));
        }
        match (self.qp_type, req.opcode) {
            (QpType::Ud, SendOpcode::Send | SendOpcode::SendWithImm) => {}
            (QpType::Ud, _) => {
                return Err(VerbsError::Invalid(
                    "UD carries SEND and SEND_WITH_IMM only",
                ));
            }
            (
                QpType::Uc,
                SendOpcode::RdmaRead | SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd,
            ) => {
                return Err(VerbsError::Invalid("UC carries no RDMA READ or atomics"));
            }
            _ => {}
        }
        let op = match req.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm => Op::Send,
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => Op::Write,
            SendOpcode::RdmaRead => Op::ReadRequest,
            SendOpcode::AtomicFetchAndAdd | SendOpcode::AtomicCmpAndSwp => {
                // As rxe's validate_send_wr: one 8-byte SGE and an 8-byte aligned address.
                if req.sges.len() != 1 || req.sges[0].length != 8 || req.remote_addr % 8 != 0 {
                    return Err(VerbsError::Invalid(
                        "atomic needs one 8-byte SGE and an aligned remote address",
                    ));
                }
                Op::Atomic
            }
        };
        if req.inline_data.is_some() && !matches!(op, Op::Send | Op::Write) {
            return Err(VerbsError::Invalid(
                "inline is for SEND and RDMA WRITE only",
            ));
        }
        let seq = q.next_send_seq;
        q.next_send_seq = seq.wrapping_add(1);
        q.sq.push_back(SendEntry {
            wr_id: req.wr_id,
            opcode: req.opcode.completion_opcode(),
            signaled: req.signaled || self.sq_sig_all,
            seq,
            byte_len: length as u32,
            outcome: None,
            response_into: None,
        });
        let payload = match (op, req.inline_data) {
            (_, Some(bytes)) => SendPayload::Owned(bytes),
            (Op::Send | Op::Write, None) => match local_spans(&self.pd, &req.sges, false) {
                Some(spans) => SendPayload::Spans(spans),
                None => {
                    tracing::debug!(
                        "qp {:#x}: wr_id {} has a bad lkey or range",
                        self.qp_num,
                        req.wr_id
                    );
                    self.fail_entry(q, seq, WcStatus::LocProtErr);
                    return Ok(None);
                }
            },
            (_, None) => {
                // READ and atomics land in local memory: it must be writable.
                let Some(spans) = local_spans(&self.pd, &req.sges, true) else {
                    tracing::debug!(
                        "qp {:#x}: wr_id {} has a bad lkey or range",
                        self.qp_num,
                        req.wr_id
                    );
                    self.fail_entry(q, seq, WcStatus::LocProtErr);
                    return Ok(None);
                };
                if let Some(e) = q.sq.back_mut() {
                    e.response_into = Some(spans);
                }
                if op == Op::Atomic {
                    let mut operands = Vec::with_capacity(16);
                    operands.extend_from_slice(&req.compare_add.to_le_bytes());
                    operands.extend_from_slice(&req.swap.to_le_bytes());
                    SendPayload::Owned(operands)
                } else {
                    SendPayload::None
                }
            }
        };
        let (endpoint, mut header) = match (&req.ud, datagram_to) {
            (Some(ud), Some(endpoint)) => {
                let endpoint = match endpoint {
                    Some(ep) if length <= u64::from(device::ACTIVE_MTU_BYTES) => ep,
                    _ => {
                        // C10-93.1.1: a UD message above the port's MTU emits no packet and
                        // is no error (rxe completes it successfully); neither is a datagram
                        // to an address nobody answers to.
                        tracing::debug!(
                            "qp {:#x}: datagram of {length} bytes to lid {:#06x} not sent",
                            self.qp_num,
                            ud.ah.av.dlid
                        );
                        if let Some(e) = q.sq.back_mut() {
                            e.outcome = Some(WcStatus::Success);
                        }
                        self.release_send_completions(q);
                        return Ok(None);
                    }
                };
                let header =
                    unreliable::datagram_header(ud, q.attrs.qkey, self.qp_num, self.local_lid, seq);
                (endpoint, header)
            }
            _ => {
                let Some(peer) = q.peer.clone() else {
                    self.fail_entry(q, seq, WcStatus::RetryExcErr);
                    return Ok(None);
                };
                let mut header = Header::new(op, peer.qpn, self.qp_num, self.local_lid, seq);
                if self.qp_type == QpType::Uc {
                    header.flags |= wire::FLAG_UNRELIABLE;
                }
                (peer.endpoint, header)
            }
        };
        if matches!(
            req.opcode,
            SendOpcode::SendWithImm | SendOpcode::RdmaWriteWithImm
        ) {
            header.flags |= wire::FLAG_IMM;
            header.imm_data = req.imm_data;
        }
        if op != Op::Send {
            header.remote_addr = req.remote_addr;
            header.rkey = req.rkey;
        }
        header.length = length as u32;
        match req.opcode {
            SendOpcode::AtomicFetchAndAdd => header.status = wire::ATOMIC_FETCH_ADD,
            SendOpcode::AtomicCmpAndSwp => header.status = wire::ATOMIC_CMP_SWAP,
            _ => {}
        }
        if req.solicited {
            header.flags |= wire::FLAG_SOLICITED;
        }
        if let Some(ack) = q.ack_owed.take() {
            header.flags |= wire::FLAG_ACK;
            header.ack_seq = ack;
            q.acks_unsent = 0;
        }
        Ok(Some(DataMessage {
            endpoint,
            header,
            payload,
            seq,
        }))
    }

    fn fail_entry(&self, q: &mut Queues, seq: u32, status: WcStatus) {
        if let Some(e) = q.sq.iter_mut().find(|e| e.seq == seq) {
            e.outcome = Some(status);
        }
        self.release_send_completions(q);
        q.state = QpState::Err;
        self.flush(q);
    }

    /// Releases finished send WRs from the head of the queue, in post order.
    fn release_send_completions(&self, q: &mut Queues) {
        while let Some(head) = q.sq.front() {
            let Some(status) = head.outcome else { break };
            let e = q.sq.pop_front().expect("head exists");
            if e.signaled || status != WcStatus::Success {
                let mut wc = WorkCompletion::new(e.wr_id, status, e.opcode, self.qp_num);
                wc.byte_len = if status == WcStatus::Success {
                    e.byte_len
                } else {
                    0
                };
                self.send_cq.push(wc, true);
            }
        }
        self.check_drained(q);
    }

    /// An ACK (or NAK) from the responder.
    pub fn on_ack(self: &Arc<Self>, locked: &LockedWorker<'_>, h: &Header) {
        self.locked_then_send(locked, |q| self.on_ack_locked(q, h))
    }

    fn on_ack_locked(&self, q: &mut Queues, h: &Header) {
        if !matches!(q.state, QpState::Rts | QpState::Sqd | QpState::Sqe) {
            return;
        }
        if q.peer.as_ref().map(|p| p.qpn) != Some(h.src_qpn) {
            return;
        }
        match Nak::from_raw(h.status) {
            None => self.apply_ack(q, h.seq),
            Some(nak) => {
                for e in q.sq.iter_mut() {
                    if !wire::seq_before(e.seq, h.seq) {
                        break;
                    }
                    if e.response_into.is_none() {
                        e.outcome.get_or_insert(WcStatus::Success);
                    }
                }
                let status = match nak {
                    Nak::InvalidRequest => WcStatus::RemInvReqErr,
                    Nak::RemoteOperational => WcStatus::RemOpErr,
                    Nak::RemoteAccess => WcStatus::RemAccessErr,
                };
                self.fail_entry(q, h.seq, status);
            }
        }
    }

    /// Every send up to and including `seq` was delivered: complete them (in post order).
    fn apply_ack(&self, q: &mut Queues, seq: u32) {
        for e in q.sq.iter_mut() {
            if wire::seq_before(seq, e.seq) {
                break;
            }
            if e.response_into.is_none() {
                e.outcome.get_or_insert(WcStatus::Success);
            }
        }
        self.release_send_completions(q);
    }

    /// Sends the ACK this QP owes, if any (the engine calls this when it flushes owed ACKs).
    pub fn flush_ack(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        self.locked_then_send(locked, |q| {
            if let Some(seq) = q.ack_owed.take() {
                q.acks_unsent = 0;
                self.send_ack(q, seq, None);
            }
        });
    }

    /// `seq` was delivered: acknowledge it with the next message, or now when many are owed.
    fn acknowledge(&self, q: &mut Queues, seq: u32) {
        if self.qp_type != QpType::Rc {
            return;
        }
        let first = q.ack_owed.is_none();
        q.ack_owed = Some(seq);
        q.acks_unsent += 1;
        if q.acks_unsent >= ACK_BATCH {
            q.ack_owed = None;
            q.acks_unsent = 0;
            self.send_ack(q, seq, None);
        } else if first {
            OWED_ACKS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(self.qp_num);
            OWED_COUNT.fetch_add(1, Ordering::AcqRel);
        }
    }

    // ---------------------------------------------------------------- receive side

    /// Posts one receive WR (errors as `ibv_post_recv` returns them).
    pub fn post_recv(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        req: RecvRequest,
    ) -> Result<(), VerbsError> {
        self.locked_then_send(locked, |q| self.post_recv_locked(q, req))
    }

    fn post_recv_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        req: RecvRequest,
    ) -> Result<(), VerbsError> {
        match q.state {
            QpState::Reset => return Err(VerbsError::Invalid("post_recv on a QP in RESET")),
            QpState::Err => {
                self.recv_cq.push(
                    WorkCompletion::new(
                        req.wr_id,
                        WcStatus::WrFlushErr,
                        WcOpcode::Recv,
                        self.qp_num,
                    ),
                    true,
                );
                return Ok(());
            }
            _ => {}
        }
        if self.srq.is_some() {
            return Err(VerbsError::Invalid("post_recv on a QP that uses an SRQ"));
        }
        if q.rq.len() >= self.caps.max_recv_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if req.sges.len() > self.caps.max_recv_sge as usize {
            return Err(VerbsError::Invalid("num_sge above max_recv_sge"));
        }
        q.rq.push_back(req);
        self.deliver_waiting(q);
        Ok(())
    }

    /// A request for this QP (SEND, WRITE, READ, atomic). Returns true when the payload's
    /// data was kept (UCX must keep it).
    pub fn on_request(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        self.locked_then_send(locked, |q| self.on_request_locked(q, h, payload))
    }

    fn on_request_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        if self.qp_type != QpType::Rc {
            self.on_unreliable_locked(q, h, payload);
            return false;
        }
        let connected = q.peer.as_ref().map(|p| p.qpn);
        if h.flags & wire::FLAG_ACK != 0
            && connected == Some(h.src_qpn)
            && matches!(q.state, QpState::Rts | QpState::Sqd | QpState::Sqe)
        {
            self.apply_ack(q, h.ack_seq);
        }
        match q.state {
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe => {
                if connected != Some(h.src_qpn) {
                    tracing::debug!(
                        "qp {:#x}: dropping message from qp {:#x} (not the connected peer)",
                        self.qp_num,
                        h.src_qpn
                    );
                    return false;
                }
                self.established(q);
            }
            QpState::Init => {
                // The peer is already in RTS while this side is not yet in RTR: a HCA would
                // drop the packet and the sender retransmit; keep it instead, until RTR.
                if q.early.len() >= MAX_KEPT_MESSAGES {
                    return false;
                }
                let (body, kept) = keep(payload);
                q.early.insert(h.seq, Pending { header: h, body });
                return kept;
            }
            _ => return false,
        }
        if h.seq != q.expected_seq {
            if wire::seq_before(h.seq, q.expected_seq) || q.early.len() >= MAX_KEPT_MESSAGES {
                return false; // a duplicate, or too far ahead
            }
            let (body, kept) = keep(payload);
            q.early.insert(h.seq, Pending { header: h, body });
            return kept;
        }
        q.expected_seq = q.expected_seq.wrapping_add(1);
        let receive = if q.waiting.is_empty() && needs_receive(&h) {
            self.take_receive(q)
        } else {
            None
        };
        let kept = if q.waiting.is_empty() && (!needs_receive(&h) || receive.is_some()) {
            self.execute(q, h, Body::Current(payload), receive);
            false
        } else {
            if let Some(srq) = self.srq.as_ref().filter(|_| needs_receive(&h)) {
                srq.note_starving(self.qp_num);
            }
            let (body, kept) = keep(payload);
            q.waiting.push_back(Pending { header: h, body });
            kept
        };
        self.drain_early(q);
        kept
    }

    /// Moves messages that arrived early and are now next in sequence to the delivery path.
    fn drain_early(self: &Arc<Self>, q: &mut Queues) {
        while let Some(p) = q.early.remove(&q.expected_seq) {
            q.expected_seq = q.expected_seq.wrapping_add(1);
            q.waiting.push_back(p);
        }
        self.deliver_waiting(q);
    }

    /// Executes waiting requests in order; a SEND (or WRITE_WITH_IMM) without a posted receive
    /// stops the queue, as an RNR stops a HCA's responder.
    fn deliver_waiting(self: &Arc<Self>, q: &mut Queues) {
        while let Some(front) = q.waiting.front() {
            if q.state == QpState::Err {
                break;
            }
            let receive = if needs_receive(&front.header) {
                match self.take_receive(q) {
                    Some(wr) => Some(wr),
                    None => {
                        if let Some(srq) = &self.srq {
                            srq.note_starving(self.qp_num);
                        }
                        break;
                    }
                }
            } else {
                None
            };
            let p = q.waiting.pop_front().expect("checked");
            let body = match p.body {
                Body::Owned(b) => Body::Owned(b),
                Body::Held(d) => Body::Held(d),
                Body::Current(_) => unreachable!("only kept bodies wait"),
            };
            self.execute(q, p.header, body, receive);
        }
    }

    /// The next receive WR: from the SRQ if the QP has one, else from its own queue.
    fn take_receive(&self, q: &mut Queues) -> Option<RecvRequest> {
        match &self.srq {
            Some(srq) => srq.take(),
            None => q.rq.pop_front(),
        }
    }

    /// Delivers messages that waited for receive WRs (after WRs were posted to the SRQ).
    pub fn deliver_pending(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        self.locked_then_send(locked, |q| self.deliver_waiting(q));
    }

    /// Executes one in-order request.
    fn execute(
        self: &Arc<Self>,
        q: &mut Queues,
        h: Header,
        body: Body<'_>,
        receive: Option<RecvRequest>,
    ) {
        match h.op {
            Op::Send => {
                self.deliver_receive(q, receive, h, body, None);
            }
            Op::Write => {
                let len = body.len();
                let Some(target) = self.check_remote(q, &h, len as u64, mr::ACCESS_REMOTE_WRITE)
                else {
                    self.refuse(q, &h, body);
                    return;
                };
                self.deliver_receive(q, receive, h, body, target);
            }
            Op::ReadRequest => {
                let Some(span) =
                    self.check_remote(q, &h, u64::from(h.length), mr::ACCESS_REMOTE_READ)
                else {
                    self.refuse(q, &h, body);
                    return;
                };
                self.respond_in_order(q, &h, Response::Read { span });
            }
            Op::Atomic => {
                let operands = body.bytes_if_eager();
                let span = self
                    .check_remote(q, &h, 8, mr::ACCESS_REMOTE_ATOMIC)
                    .flatten();
                let (Some(span), Some(ops)) = (span, operands.filter(|o| o.len() == 16)) else {
                    self.refuse(q, &h, body);
                    return;
                };
                let compare_add = u64::from_le_bytes(ops[..8].try_into().expect("8 bytes"));
                let swap = u64::from_le_bytes(ops[8..].try_into().expect("8 bytes"));
                self.respond_in_order(
                    q,
                    &h,
                    Response::Atomic {
                        span,
                        kind: h.status,
                        compare_add,
                        swap,
                    },
                );
            }
            Op::Ack | Op::ReadResponse | Op::AtomicResponse => {}
        }
    }

    /// The remote-access check of a WRITE/READ/atomic: the QP must allow `access` and the rkey
    /// must grant it over the range. `Some(None)` for a zero-length access (no key is checked);
    /// `None` is a remote access error.
    fn check_remote(
        &self,
        q: &Queues,
        h: &Header,
        len: u64,
        access: u32,
    ) -> Option<Option<AppSpan>> {
        if len == 0 {
            return Some(None);
        }
        if q.attrs.access_flags & access != access {
            tracing::debug!(
                "qp {:#x}: access {access:#x} not enabled on the QP",
                self.qp_num
            );
            return None;
        }
        match mr::remote_span(&self.pd, h.rkey, h.remote_addr, len, access) {
            Some(span) => Some(Some(span)),
            None => {
                tracing::debug!(
                    "qp {:#x}: rkey {:#x} refuses {len} bytes at {:#x} for access {access:#x}",
                    self.qp_num,
                    h.rkey,
                    h.remote_addr
                );
                None
            }
        }
    }

    /// NAKs a request with a remote access error (nothing was written or read). The
    /// responder's QP goes to ERR with IBV_EVENT_QP_ACCESS_ERR (IBA 9.9.3.1.2, responder
    /// class C: a local access violation work-queue error).
    fn refuse(&self, q: &mut Queues, h: &Header, body: Body<'_>) {
        if let Body::Held(d) = body {
            q.outbox.push(Deferred::Release(d));
        }
        // Earlier requests that already took effect are acknowledged before the NAK.
        self.release_landed(q);
        self.send_ack(q, h.seq, Some(Nak::RemoteAccess));
        self.raise(EVENT_QP_ACCESS_ERR);
        q.state = QpState::Err;
        self.flush(q);
    }

    /// Answers a READ or atomic after every earlier request of this QP took effect.
    fn respond_in_order(&self, q: &mut Queues, h: &Header, response: Response) {
        q.landing.push_back(Landing {
            seq: h.seq,
            wc: None,
            solicited: false,
            landed: true,
            then: Some(response),
        });
        self.release_landed(q);
    }

    fn recv_completion(&self, wr: &RecvRequest, h: &Header, len: usize) -> WorkCompletion {
        let opcode = if h.op == Op::Write {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let mut wc = WorkCompletion::new(wr.wr_id, WcStatus::Success, opcode, self.qp_num);
        wc.byte_len = len as u32;
        wc.src_qp = h.src_qpn;
        wc.slid = h.src_lid;
        if h.flags & wire::FLAG_IMM != 0 {
            wc.wc_flags |= WC_WITH_IMM;
            wc.imm_data = h.imm_data;
        }
        wc
    }

    /// Checks the receive WR against a SEND; on failure completes it with an error, NAKs the
    /// sender and moves the QP to ERR.
    /// `reserve`: bytes in front of the message (a UD receive's GRH area).
    fn check_receive(
        &self,
        q: &mut Queues,
        wr: &RecvRequest,
        h: &Header,
        len: usize,
        reserve: usize,
    ) -> Option<SmallVec<[AppSpan; 4]>> {
        let capacity: u64 = wr.sges.iter().map(|s| u64::from(s.length)).sum();
        let (status, nak) = if (len + reserve) as u64 > capacity {
            (WcStatus::LocLenErr, Nak::InvalidRequest)
        } else {
            match local_spans(&self.pd, &wr.sges, true) {
                Some(spans) => return Some(spans),
                None => (WcStatus::LocProtErr, Nak::RemoteOperational),
            }
        };
        tracing::debug!(
            "qp {:#x}: receive wr_id {} failed: {status:?} (message {len} bytes, buffer {capacity})",
            self.qp_num,
            wr.wr_id
        );
        let mut wc = self.recv_completion(wr, h, len);
        wc.status = status;
        wc.byte_len = 0;
        wc.wc_flags = 0;
        self.release_landed(q);
        self.recv_cq.push(wc, true);
        self.send_ack(q, h.seq, Some(nak));
        if nak == Nak::InvalidRequest && self.qp_type == QpType::Rc {
            // Responder class C (IBA 9.9.3.1.2): an invalid request work-queue error.
            self.raise(EVENT_QP_REQ_ERR);
        }
        q.state = QpState::Err;
        self.flush(q);
        None
    }

    /// Places a SEND (into the receive WR's buffers) or a WRITE (into `target`), then
    /// completes the receive WR if there is one.
    fn deliver_receive(
        &self,
        q: &mut Queues,
        wr: Option<RecvRequest>,
        h: Header,
        body: Body<'_>,
        target: Option<AppSpan>,
    ) {
        let len = body.len();
        let spans: SmallVec<[AppSpan; 4]> = if h.op == Op::Send {
            let wr = wr.as_ref().expect("a SEND has a receive WR");
            match self.check_receive(q, wr, &h, len, 0) {
                Some(s) => s,
                None => {
                    if let Body::Held(d) = body {
                        q.outbox.push(Deferred::Release(d));
                    }
                    return; // a current rendezvous descriptor is dropped by UCX
                }
            }
        } else {
            target.into_iter().collect()
        };
        let wc = wr.as_ref().map(|wr| self.recv_completion(wr, &h, len));
        let solicited = h.flags & wire::FLAG_SOLICITED != 0;
        self.place(q, h.seq, spans, body, wc, solicited);
    }

    /// Puts a message body into `spans` (now, or through a rendezvous receive), then
    /// completes `wc` in order with the QP's other receives (`key` orders them).
    fn place(
        &self,
        q: &mut Queues,
        key: u32,
        spans: SmallVec<[AppSpan; 4]>,
        body: Body<'_>,
        wc: Option<WorkCompletion>,
        solicited: bool,
    ) {
        match body {
            Body::Current(AmPayload::Transient(bytes)) => {
                crate::ucp::scatter(&spans, bytes);
                self.complete_landed(q, key, wc, solicited);
            }
            Body::Current(AmPayload::Persistent(data)) => {
                // Consumed inside its own handler: read it and let UCX free it.
                crate::ucp::scatter(&spans, data.bytes());
                self.complete_landed(q, key, wc, solicited);
            }
            Body::Owned(bytes) => {
                crate::ucp::scatter(&spans, &bytes);
                self.complete_landed(q, key, wc, solicited);
            }
            Body::Held(data) if !data.is_rendezvous() => {
                crate::ucp::scatter(&spans, data.bytes());
                q.outbox.push(Deferred::Release(data));
                self.complete_landed(q, key, wc, solicited);
            }
            Body::Current(AmPayload::Rendezvous(data)) | Body::Held(data) => {
                q.landing.push_back(Landing {
                    seq: key,
                    wc,
                    solicited,
                    landed: false,
                    then: None,
                });
                q.outbox.push(Deferred::Receive {
                    landed: QueuePair::on_landed,
                    data,
                    spans,
                    seq: key,
                });
            }
        }
    }

    fn on_landed(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        seq: u32,
        result: Result<usize, crate::ucp::Error>,
    ) {
        self.locked_then_send(locked, |q| {
            if let Some(l) = q.landing.iter_mut().find(|l| l.seq == seq) {
                l.landed = true;
                if let Err(e) = result {
                    tracing::debug!("qp {:#x}: rendezvous of seq {seq} failed: {e}", self.qp_num);
                    if let Some(wc) = l.wc.as_mut() {
                        wc.status = WcStatus::LocQpOpErr;
                    }
                }
            }
            self.release_landed(q);
        })
    }

    /// Completes requests whose effects are in place, in order: receive completions, READ and
    /// atomic answers, and the acknowledgement of the last one.
    fn release_landed(&self, q: &mut Queues) {
        let mut last = None;
        while q.landing.front().is_some_and(|l| l.landed) {
            let l = q.landing.pop_front().expect("checked");
            if let Some(wc) = l.wc {
                self.recv_cq.push(wc, l.solicited);
            }
            if let Some(r) = l.then {
                self.answer(q, l.seq, r);
            }
            last = Some(l.seq);
        }
        if let Some(seq) = last {
            self.acknowledge(q, seq);
        }
    }

    fn complete_landed(
        &self,
        q: &mut Queues,
        seq: u32,
        wc: Option<WorkCompletion>,
        solicited: bool,
    ) {
        q.landing.push_back(Landing {
            seq,
            wc,
            solicited,
            landed: true,
            then: None,
        });
        self.release_landed(q);
    }

    /// Sends the answer of a READ (the bytes, read by UCX from registered memory) or atomic.
    fn answer(&self, q: &mut Queues, seq: u32, response: Response) {
        let Some(peer) = &q.peer else { return };
        let (op, payload) = match response {
            Response::Read { span } => (
                Op::ReadResponse,
                span.map_or(SendPayload::None, |s| {
                    SendPayload::Spans(SmallVec::from_elem(s, 1))
                }),
            ),
            Response::Atomic {
                span,
                kind,
                compare_add,
                swap,
            } => {
                let old = match kind {
                    wire::ATOMIC_FETCH_ADD => span.fetch_add(compare_add),
                    _ => span.compare_swap(compare_add, swap),
                };
                let Some(old) = old else { return };
                (
                    Op::AtomicResponse,
                    SendPayload::Owned(old.to_le_bytes().to_vec()),
                )
            }
        };
        let header = Header::new(op, peer.qpn, self.qp_num, self.local_lid, seq);
        let endpoint = Arc::clone(&peer.endpoint);
        q.outbox.push(Deferred::Send {
            endpoint,
            header,
            payload,
            data_seq: None,
        });
    }

    /// The answer to one of this QP's READs or atomics.
    pub fn on_response(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        self.locked_then_send(locked, |q| {
            if q.peer.as_ref().map(|p| p.qpn) != Some(h.src_qpn) {
                return false;
            }
            let Some(e) =
                q.sq.iter_mut()
                    .find(|e| e.seq == h.seq && e.outcome.is_none())
            else {
                return false;
            };
            let Some(spans) = e.response_into.clone() else {
                return false;
            };
            match payload {
                AmPayload::Transient(bytes) => crate::ucp::scatter(&spans, bytes),
                AmPayload::Persistent(data) => crate::ucp::scatter(&spans, data.bytes()),
                AmPayload::Rendezvous(data) => {
                    q.outbox.push(Deferred::Receive {
                        landed: QueuePair::on_response_landed,
                        data,
                        spans,
                        seq: h.seq,
                    });
                    return false; // the descriptor is consumed by the receive
                }
            };
            e.outcome = Some(WcStatus::Success);
            self.release_send_completions(q);
            false
        })
    }

    fn on_response_landed(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        seq: u32,
        result: Result<usize, crate::ucp::Error>,
    ) {
        self.locked_then_send(locked, |q| {
            if let Some(e) =
                q.sq.iter_mut()
                    .find(|e| e.seq == seq && e.outcome.is_none())
            {
                e.outcome = Some(if result.is_ok() {
                    WcStatus::Success
                } else {
                    WcStatus::LocQpOpErr
                });
            }
            self.release_send_completions(q);
        })
    }

    fn send_ack(&self, q: &mut Queues, seq: u32, nak: Option<Nak>) {
        if self.qp_type != QpType::Rc {
            return; // UC and UD are never acknowledged
        }
        let Some(peer) = &q.peer else { return };
        let mut header = Header::new(Op::Ack, peer.qpn, self.qp_num, self.local_lid, seq);
        header.status = nak.map_or(0, |n| n as u8);
        let endpoint = Arc::clone(&peer.endpoint);
        q.outbox.push(Deferred::Send {
            endpoint,
            header,
            payload: SendPayload::None,
            data_seq: None,
        });
    }
}

/// Turns a handler's payload into something that outlives the handler.
fn keep(payload: AmPayload<'_>) -> (Body<'static>, bool) {
    match payload {
        AmPayload::Transient(b) => (Body::Owned(b.to_vec()), false),
        AmPayload::Persistent(d) | AmPayload::Rendezvous(d) => (Body::Held(d), true),
    }
}

fn release_kept(q: &mut Queues) {
    let early = std::mem::take(&mut q.early);
    let held: Vec<AmData> = early
        .into_values()
        .chain(q.waiting.drain(..))
        .filter_map(|p| match p.body {
            Body::Held(d) => Some(d),
            Body::Owned(_) | Body::Current(_) => None,
        })
        .collect();
    q.outbox.extend(held.into_iter().map(Deferred::Release));
}

fn check_values(req: &ModifyRequest) -> Result<(), VerbsError> {
    let m = req.mask;
    let a = &req.attrs;
    if m.contains(AttrMask::PORT) && a.port_num != device::PORT_NUM {
        return Err(VerbsError::Invalid("port_num"));
    }
    if m.contains(AttrMask::PKEY_INDEX) && a.pkey_index >= device::PKEY_TABLE_LEN {
        return Err(VerbsError::Invalid("pkey_index"));
    }
    if m.contains(AttrMask::PATH_MTU) && !(1..=5).contains(&a.path_mtu) {
        return Err(VerbsError::Invalid("path_mtu"));
    }
    if m.contains(AttrMask::ACCESS_FLAGS)
        && a.access_flags
            & !(super::mr::ACCESS_LOCAL_WRITE
                | super::mr::ACCESS_REMOTE_WRITE
                | super::mr::ACCESS_REMOTE_READ
                | super::mr::ACCESS_REMOTE_ATOMIC)
            != 0
    {
        return Err(VerbsError::Invalid("qp_access_flags"));
    }
    if m.contains(AttrMask::MAX_QP_RD_ATOMIC) && i32::from(a.max_rd_atomic) > device::MAX_RD_ATOMIC
    {
        return Err(VerbsError::Invalid("max_rd_atomic"));
    }
    if m.contains(AttrMask::MAX_DEST_RD_ATOMIC)
        && i32::from(a.max_dest_rd_atomic) > device::MAX_RD_ATOMIC
    {
        return Err(VerbsError::Invalid("max_dest_rd_atomic"));
    }
    if m.contains(AttrMask::TIMEOUT) && a.timeout > 31 {
        return Err(VerbsError::Invalid("timeout"));
    }
    if m.contains(AttrMask::RETRY_CNT) && a.retry_cnt > 7 {
        return Err(VerbsError::Invalid("retry_cnt"));
    }
    if m.contains(AttrMask::RNR_RETRY) && a.rnr_retry > 7 {
        return Err(VerbsError::Invalid("rnr_retry"));
    }
    if m.contains(AttrMask::MIN_RNR_TIMER) && a.min_rnr_timer > 31 {
        return Err(VerbsError::Invalid("min_rnr_timer"));
    }
    if m.contains(AttrMask::DEST_QPN) && a.dest_qp_num >= 1 << 24 {
        return Err(VerbsError::Invalid("dest_qp_num"));
    }
    if m.contains(AttrMask::AV) {
        if a.ah.port_num != 0 && a.ah.port_num != device::PORT_NUM {
            return Err(VerbsError::Invalid("ah_attr.port_num"));
        }
        if a.ah.is_global && i32::from(a.ah.grh.sgid_index) >= device::GID_TABLE_LEN {
            return Err(VerbsError::Invalid("ah_attr.grh.sgid_index"));
        }
        if !a.ah.is_global && a.ah.dlid == 0 {
            return Err(VerbsError::Invalid("ah_attr.dlid is 0 and no GRH"));
        }
    }
    Ok(())
}

fn apply_attrs(a: &mut QpAttributes, req: &ModifyRequest) {
    let m = req.mask;
    let r = &req.attrs;
    macro_rules! set {
        ($bit:ident, $($f:ident),+) => { if m.contains(AttrMask::$bit) { $(a.$f = r.$f;)+ } };
    }
    set!(QKEY, qkey);
    set!(RQ_PSN, rq_psn);
    set!(SQ_PSN, sq_psn);
    set!(DEST_QPN, dest_qp_num);
    set!(ACCESS_FLAGS, access_flags);
    set!(PKEY_INDEX, pkey_index);
    set!(PORT, port_num);
    set!(PATH_MTU, path_mtu);
    set!(AV, ah);
    set!(ALT_PATH, alt_ah, alt_pkey_index, alt_port_num, alt_timeout);
    set!(PATH_MIG_STATE, path_mig_state);
    set!(TIMEOUT, timeout);
    set!(RETRY_CNT, retry_cnt);
    set!(RNR_RETRY, rnr_retry);
    set!(MIN_RNR_TIMER, min_rnr_timer);
    set!(MAX_QP_RD_ATOMIC, max_rd_atomic);
    set!(MAX_DEST_RD_ATOMIC, max_dest_rd_atomic);
    set!(EN_SQD_ASYNC_NOTIFY, en_sqd_async_notify);
}
