//! The RC responder (rxe's `rxe_resp.c`): takes what arrives for the QP from its connected
//! peer only, checks the sequence (early messages wait in a reorder map, duplicates are
//! dropped), holds in-order messages that find no receive WR (RNR), checks rkeys and access
//! before a WRITE, READ or atomic touches memory (else NAK, QP to ERR), executes READs and
//! atomics after every earlier request took effect, and acknowledges what took effect
//! (coalesced: on the next outgoing message, every [`ACK_BATCH`] deliveries, or when the
//! engine flushes owed ACKs). Where the data lands is [`super::receive`].

use super::super::context::EVENT_QP_ACCESS_ERR;
use super::super::mr;
use super::super::qp_state::{QpState, QpType};
use super::super::work::RecvRequest;
use super::QueuePair;
use super::queues::{
    Body, Deferred, Landing, MAX_KEPT_MESSAGES, Pending, Queues, Response, keep, needs_receive,
};
use crate::engine::wire::{self, Header, Nak, Op};
use crate::ucp::{AmPayload, AppSpan, LockedWorker, SendPayload};
use smallvec::SmallVec;
use std::sync::Arc;

/// At most this many delivered messages go unacknowledged before an ACK is sent at once.
const ACK_BATCH: u32 = 16;

impl QueuePair {
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

    pub(super) fn on_request_locked(
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
                srq.note_starving(self);
            }
            let (body, kept) = keep(payload);
            q.waiting.push_back(Pending { header: h, body });
            kept
        };
        self.drain_early(q);
        kept
    }

    /// Moves messages that arrived early and are now next in sequence to the delivery path.
    pub(super) fn drain_early(self: &Arc<Self>, q: &mut Queues) {
        while let Some(p) = q.early.remove(&q.expected_seq) {
            q.expected_seq = q.expected_seq.wrapping_add(1);
            q.waiting.push_back(p);
        }
        self.deliver_waiting(q);
    }

    /// Executes waiting requests in order; a SEND (or WRITE_WITH_IMM) without a posted receive
    /// stops the queue, as an RNR stops a HCA's responder.
    pub(super) fn deliver_waiting(self: &Arc<Self>, q: &mut Queues) {
        while let Some(front) = q.waiting.front() {
            if q.state == QpState::Err {
                break;
            }
            let receive = if needs_receive(&front.header) {
                match self.take_receive(q) {
                    Some(wr) => Some(wr),
                    None => {
                        if let Some(srq) = &self.srq {
                            srq.note_starving(self);
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

    /// Executes one in-order request.
    pub(super) fn execute(
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
    pub(super) fn check_remote(
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
    pub(super) fn refuse(&self, q: &mut Queues, h: &Header, body: Body<'_>) {
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
    pub(super) fn respond_in_order(&self, q: &mut Queues, h: &Header, response: Response) {
        q.landing.push_back(Landing {
            seq: h.seq,
            wc: None,
            solicited: false,
            landed: true,
            then: Some(response),
        });
        self.release_landed(q);
    }

    /// Sends the answer of a READ (the bytes, read by UCX from registered memory) or atomic.
    pub(super) fn answer(&self, q: &mut Queues, seq: u32, response: Response) {
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
                    SendPayload::Owned(old.to_le_bytes().as_slice().into()),
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
    pub(super) fn acknowledge(&self, q: &mut Queues, seq: u32) {
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
            crate::engine::owe_ack(self.qp_num);
        }
    }

    pub(super) fn send_ack(&self, q: &mut Queues, seq: u32, nak: Option<Nak>) {
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
