//! The state the requester, responder and completer share, behind the queue pair's one lock:
//! the send queue with each WR's outcome (and what it takes to send it again), the transport
//! timer, the receive queue, the responder's sequence state (early and waiting messages,
//! requests whose data is still landing), the ACK owed, and the outbox of UCX work started
//! only once that lock is released.

use super::super::device;
use super::super::mr::KeyCache;
use super::super::qp_state::QpState;
use super::super::work::{RecvRequest, WcOpcode, WcStatus, WorkCompletion};
use super::{AppSpan, QpAttributes, QueuePair};
use crate::engine::Peer;
use crate::engine::direct::{PeerRing, SEND_MAX};
use crate::engine::wire::{self, Header, Op};
use crate::ucp::{AmData, AmPayload, Endpoint, LockedWorker, SendPayload, SpanList};
use smallvec::SmallVec;
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

pub(super) struct SendEntry {
    pub(super) wr_id: u64,
    pub(super) opcode: WcOpcode,
    pub(super) signaled: bool,
    pub(super) seq: u32,
    pub(super) byte_len: u32,
    /// Set when the entry is finished (acknowledged, or failed with this status).
    pub(super) outcome: Option<WcStatus>,
    /// READ and atomics: where the response lands; they finish with their response, never
    /// with an ACK.
    pub(super) response_into: Option<SpanList>,
    /// A READ whose rendezvous response UCX is writing into `response_into` right now.
    pub(super) pulling: bool,
    /// RC messages: the header (without a piggybacked ACK) and payload to retransmit it with
    /// (application memory stays valid until the WR completes, by the verbs contract).
    pub(super) resend: Option<(Header, SendPayload)>,
    /// Sends of this message UCX has not finished with yet: it reads the WR's buffers, so the
    /// WR is not flushed (RC, UC) until it is done, and a message still leaving this process
    /// cannot have been dropped by the responder, so it is not sent again (RC).
    pub(super) in_ucx: i16,
}

impl SendEntry {
    /// Waiting for the responder: sent (or to be sent again), not answered, not landing.
    pub(super) fn unanswered(&self) -> bool {
        self.outcome.is_none() && !self.pulling && self.resend.is_some()
    }
}

/// A message body: the running handler's, or one kept until it can be delivered.
pub(super) enum Body<'a> {
    Current(AmPayload<'a>),
    Owned(Vec<u8>),
    Held(AmData),
}

impl Body<'_> {
    pub(super) fn len(&self) -> usize {
        match self {
            Body::Current(AmPayload::Transient(b)) => b.len(),
            Body::Current(AmPayload::Persistent(d) | AmPayload::Rendezvous(d)) | Body::Held(d) => {
                d.len()
            }
            Body::Owned(b) => b.len(),
        }
    }

    /// The bytes, when they are already here (not a rendezvous).
    pub(super) fn bytes_if_eager(&self) -> Option<&[u8]> {
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
pub(super) fn needs_receive(h: &Header) -> bool {
    h.op == Op::Send || (h.op == Op::Write && h.flags & wire::FLAG_IMM != 0)
}

pub(super) struct Pending {
    pub(super) header: Header,
    pub(super) body: Body<'static>,
}

/// A request whose effects complete in order at the responder: a receive or a write whose
/// data is landing, or a READ/atomic waiting behind them (so it sees earlier writes).
pub(super) struct Landing {
    pub(super) seq: u32,
    /// The receive completion it produces (SEND, WRITE_WITH_IMM), if any.
    pub(super) wc: Option<WorkCompletion>,
    pub(super) solicited: bool,
    pub(super) landed: bool,
    pub(super) then: Option<Response>,
}

/// What a READ or atomic answers, once every earlier request of the QP took effect.
pub(super) enum Response {
    Read {
        span: Option<AppSpan>,
    },
    Atomic {
        span: AppSpan,
        kind: u8,
        compare_add: u64,
        swap: u64,
    },
    /// An ATOMIC WRITE, stored once every earlier request took effect; answered by the ACK.
    AtomicWrite {
        span: AppSpan,
        value: u64,
    },
}

/// UCX work to start once the queue lock is released. UCX may run callbacks inline inside any
/// call (its `self` transport delivers a send to a QP of this process, and completes a
/// rendezvous receive, before the call returns), and those callbacks take queue locks, so no
/// UCX operation is ever started while a queue lock is held.
pub(super) enum Deferred {
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
        spans: SpanList,
        seq: u32,
        landed: Landed,
    },
    /// Give a kept message body back to UCX (for a rendezvous one, this answers its sender).
    Release(AmData),
}

/// A data message `post_send` sends once the queue lock is released.
pub(super) struct DataMessage {
    pub(super) endpoint: Arc<Endpoint>,
    pub(super) header: Header,
    pub(super) payload: SendPayload,
    pub(super) seq: u32,
    /// It may travel in a bundle with the list's other messages (`Peer::remote_host`).
    pub(super) bundle: bool,
}

/// A data message the send queue holds back ([`Queues::held`]).
pub(super) struct HeldMessage {
    /// Its WR asked for `IBV_SEND_FENCE`: it waits for the READs and atomics posted before it.
    pub(super) fence: bool,
    /// Its WR is a READ or an atomic: it waits for one of the QP's [`Queues::read_credits`].
    pub(super) read_or_atomic: bool,
    pub(super) message: DataMessage,
}

/// What runs when a rendezvous body landed: `QueuePair::on_landed` (responder) or
/// `QueuePair::on_response_landed` (a READ at the requester).
pub(super) type Landed =
    fn(&Arc<QueuePair>, &LockedWorker<'_>, u32, Result<usize, crate::ucp::Error>);

pub(super) struct Queues {
    pub(super) outbox: SmallVec<[Deferred; 2]>,
    pub(super) state: QpState,
    pub(super) attrs: QpAttributes,
    pub(super) peer: Option<Peer>,
    pub(super) sq: VecDeque<SendEntry>,
    /// Requester: the messages of WRs the send queue holds back, in post order, from the
    /// first that may not go yet: a fenced one (`IBV_SEND_FENCE`) while a READ or atomic
    /// posted before it has not completed, or a READ or atomic while `max_rd_atomic` of them
    /// are in flight. The send queue stalls there, as a HCA's does, and they go out once the
    /// one at the front may.
    pub(super) held: VecDeque<HeldMessage>,
    /// The PSN of the next message (from `sq_psn` at RTS).
    pub(super) next_send_seq: u32,
    /// Requester: the newest PSN the responder acknowledged (`sq_psn - 1` before any); an
    /// answer naming a PSN outside [`acked_psn`, last sent] is not the peer's and is ignored.
    pub(super) acked_psn: u32,
    /// The transport timer ([`super::timer`]).
    pub(super) timer: super::timer::Timer,
    pub(super) rq: VecDeque<RecvRequest>,
    /// Responder: the PSN the next request must carry (from `rq_psn` at RTR).
    pub(super) expected_seq: u32,
    /// Responder: the newest PSN delivered and acknowledged (`rq_psn - 1` before any); a
    /// duplicate is answered with it.
    pub(super) last_delivered: u32,
    /// Messages that arrived ahead of `expected_seq`.
    pub(super) early: BTreeMap<u32, Pending>,
    /// In-order messages waiting for a receive WR (RNR), at most [`MAX_KEPT_MESSAGES`] and
    /// [`MAX_KEPT_BYTES`] with `early`; beyond, a message is dropped and RNR-NAKed.
    pub(super) waiting: VecDeque<Pending>,
    /// Bytes of the eager bodies in `early` and `waiting`.
    pub(super) kept_bytes: usize,
    /// Requests dropped (not from the peer, not in RTR, out of sequence, over the bounds).
    pub(super) dropped: u64,
    /// Receives whose data is still landing (rendezvous), completed in order.
    pub(super) landing: VecDeque<Landing>,
    /// The newest delivered sequence number the peer has not been told about; it rides on the
    /// next message this QP sends, or goes alone when the engine flushes owed ACKs.
    pub(super) ack_owed: Option<u32>,
    /// When `ack_owed` last became owed after none was (µs, `engine::owe_ack`'s clock).
    pub(super) ack_owed_since: u64,
    /// The application's poll (`Engine::app_polls`) in which `ack_owed` became owed.
    pub(super) ack_owed_poll: u64,
    /// This QP is on the engine's list of full batches (`engine::ack_batch_full`).
    pub(super) full_batch_listed: bool,
    pub(super) acks_unsent: u32,
    /// The oldest and newest sequence numbers not yet acknowledged whose requester waits for
    /// their ACK (they came without `wire::HINT_ACK_MAY_WAIT`): an ACK that covers the oldest
    /// goes as soon as the process runs out of work.
    pub(super) prompt_ack: Option<(u32, u32)>,
    /// IBV_EVENT_COMM_EST was raised (the first message reached the QP in RTR).
    pub(super) comm_established: bool,
    /// In SQD with `en_sqd_async_notify`: IBV_EVENT_SQ_DRAINED is owed once the SQ is empty.
    pub(super) sqd_notify: bool,
    /// UC/UD: numbers receives in arrival order (their completions are released in it).
    pub(super) next_receive: u32,
    /// IBV_EVENT_QP_LAST_WQE_REACHED was raised since the last RESET (once per entry into
    /// ERR: a later modify to ERR, e.g. `rdma_disconnect` after the peer's, raises nothing).
    pub(super) last_wqe_raised: bool,
    /// The MRs the send WRs' and the receive WRs' lkeys named last.
    pub(super) send_keys: KeyCache,
    pub(super) recv_keys: KeyCache,
    /// Requester: the same-host peer's receive ring, mapped here (the SEND path's cache).
    pub(super) peer_ring: PeerRing,
    /// Responder: a receive WR a peer placed a SEND in failed; no later one completes.
    pub(super) placed_failed: bool,
    /// Responder: where a placed SEND's bytes are read out of the ring before they land
    /// (kept, not a fresh zeroed array on the stack at every poll).
    pub(super) placed_bytes: Box<[u8; SEND_MAX]>,
}

/// Most messages an RC QP in RTR keeps for later (ahead of sequence, or waiting for a receive
/// WR); a QP not in RTR keeps none. What exceeds it is dropped and retransmitted by the
/// requester.
pub(super) const MAX_KEPT_MESSAGES: usize = 256;
/// Most bytes of eager message bodies an RC QP keeps (rendezvous bodies stay at the sender
/// until they are delivered).
pub(super) const MAX_KEPT_BYTES: usize = 4 << 20;

/// Turns a handler's payload into something that outlives the handler.
pub(super) fn keep(payload: AmPayload<'_>) -> (Body<'static>, bool) {
    match payload {
        AmPayload::Transient(b) => (Body::Owned(b.to_vec()), false),
        AmPayload::Persistent(d) | AmPayload::Rendezvous(d) => (Body::Held(d), true),
    }
}

pub(super) fn release_kept(q: &mut Queues) {
    q.kept_bytes = 0;
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

impl Queues {
    /// The PSN of the first message the send queue holds back ([`Queues::held`]), if any.
    pub(super) fn first_held(&self) -> Option<u32> {
        self.held.front().map(|h| h.message.seq)
    }

    /// The send queue's entries that it began: those before the first it holds.
    pub(super) fn begun(&self) -> impl Iterator<Item = &SendEntry> {
        let held_from = self.first_held();
        self.sq.iter().take_while(move |e| Some(e.seq) != held_from)
    }

    /// The READs and atomics posted before the send WR `seq` (before every WR: None) that have
    /// not completed yet: their answer has not come, or is still landing.
    fn reads_before(&self, seq: Option<u32>) -> impl Iterator<Item = &SendEntry> {
        self.sq
            .iter()
            .take_while(move |e| Some(e.seq) != seq)
            .filter(|e| e.outcome.is_none() && (e.response_into.is_some() || e.pulling))
    }

    /// Whether a READ or atomic posted before the send WR `seq` (before every WR: None) has
    /// not completed yet.
    pub(super) fn reads_outstanding_before(&self, seq: Option<u32>) -> bool {
        self.reads_before(seq).next().is_some()
    }

    /// Whether no read credit is left for the send WR `seq` (None: one posted now):
    /// [`Queues::read_credits`] READs and atomics before it have not completed. Looks no
    /// further than that many.
    pub(super) fn read_credits_taken_before(&self, seq: Option<u32>) -> bool {
        self.reads_before(seq)
            .nth(self.read_credits() - 1)
            .is_some()
    }

    /// How many READs and atomics the requester may have in flight: `max_rd_atomic` (the
    /// initiator depth), and one where it is 0, as mlx4 and mlx5 program their HCAs (the
    /// log2 of the depth, 0 for both 0 and 1).
    fn read_credits(&self) -> usize {
        usize::from(self.attrs.max_rd_atomic.max(1))
    }

    /// The queues of a new QP (RESET).
    pub(super) fn new() -> Queues {
        Queues {
            outbox: SmallVec::new(),
            state: QpState::Reset,
            attrs: QpAttributes {
                port_num: device::PORT_NUM,
                ..Default::default()
            },
            peer: None,
            sq: VecDeque::new(),
            held: VecDeque::new(),
            next_send_seq: 0,
            acked_psn: wire::PSN_MASK,
            timer: super::timer::Timer::default(),
            rq: VecDeque::new(),
            expected_seq: 0,
            last_delivered: wire::PSN_MASK,
            early: BTreeMap::new(),
            waiting: VecDeque::new(),
            kept_bytes: 0,
            dropped: 0,
            landing: VecDeque::new(),
            ack_owed: None,
            ack_owed_since: 0,
            ack_owed_poll: 0,
            full_batch_listed: false,
            acks_unsent: 0,
            prompt_ack: None,
            comm_established: false,
            sqd_notify: false,
            next_receive: 0,
            last_wqe_raised: false,
            send_keys: KeyCache::default(),
            recv_keys: KeyCache::default(),
            peer_ring: PeerRing::default(),
            placed_failed: false,
            placed_bytes: Box::new([0; SEND_MAX]),
        }
    }
}
