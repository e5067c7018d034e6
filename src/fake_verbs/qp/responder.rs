//! The RC responder (rxe's `rxe_resp.c`): takes requests only in RTR (or later) and only from
//! the connected peer (the LID and QP its RTR attributes name), checks the PSN against the
//! sequence that starts at `rq_psn` (early messages wait in a bounded reorder map; a duplicate
//! is dropped and answered: re-ACKed, or RNR-NAKed while it waits for a receive), holds a
//! bounded number of in-order messages that find no receive WR (beyond: dropped and
//! RNR-NAKed, the requester sends it again), checks rkeys and access before a WRITE, READ or
//! atomic touches memory (else NAK, QP to ERR), executes READs and atomics after every
//! earlier request took effect, and acknowledges what took effect (coalesced: on the next
//! outgoing message, after [`ACK_BATCH`] deliveries once the application had its chance to
//! answer them, or when the engine flushes owed ACKs; those no completion at the requester
//! waits for, after [`LAZY_ACK_BATCH`] deliveries so, or when the engine flushes ACKs that
//! are overdue).
//! Everything else is dropped and counted (`UGDR_LOG=debug` shows the count). Where the data
//! lands is [`super::receive`].

use super::super::context::{EVENT_QP_ACCESS_ERR, EVENT_QP_REQ_ERR};
use super::super::qp_state::{QpState, QpType};
use super::super::work::{RecvRequest, WcStatus};
use super::super::{mr, mw};
use super::QueuePair;
use super::completer::from_peer;
use super::queues::{
    Body, Deferred, Landing, MAX_KEPT_BYTES, MAX_KEPT_MESSAGES, Pending, Queues, Response, keep,
    needs_receive,
};
use crate::engine::wire::{self, Header, Nak, Op};
use crate::ucp::{AmPayload, AppSpan, LockedWorker, SendPayload};
use smallvec::SmallVec;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A full batch: this many delivered messages unacknowledged, while the requester waits for
/// one of them (see [`note_prompt_ack`]) ...
const ACK_BATCH: u32 = 16;
/// ... and while it waits for none: it only holds their copies for sending again, and its
/// send queue's slots as its application sees them free at a later signaled WR's completion.
/// A full batch's ACK goes alone once the application has polled `engine::ACK_BATCH_POLLS`
/// times without answering (`engine::ack_batch_full`), ...
const LAZY_ACK_BATCH: u32 = 64;
/// ... or at once when this many full batches are owed (a stream the progress thread delivers
/// while the application does not poll).
const FULL_BATCHES_HELD: u32 = 4;

/// This process's reliable responders: requests delivered, and ACKs that went as messages of
/// their own (not riding on a message back). `UGDR_LOG=debug` shows both at each power of two
/// of the first. Counted by a plain load and store, not a locked add per message: deliveries
/// run under the worker lock, and a count lost to a race only blurs a log line.
static DELIVERED: AtomicU64 = AtomicU64::new(0);
static ACKS_ALONE: AtomicU64 = AtomicU64::new(0);

impl QueuePair {
    /// A request for this QP (SEND, WRITE, READ, atomic). Returns true when the payload's
    /// data was kept (UCX must keep it).
    pub fn on_request(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        self.locked_then_send(locked, |q| {
            // SENDs a same-host peer placed before this message complete first: they came
            // first, and the sequence it is checked against follows them.
            if self.complete_placed(q) {
                self.flush(q);
            }
            self.on_request_locked(q, h, payload)
        })
    }

    pub(super) fn on_request_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        if !self.qp_type.reliable() {
            self.on_unreliable_locked(q, h, payload);
            return false;
        }
        if self.qp_type == QpType::XrcSend {
            // Only requests: no responder (so it never owes an ACK, whose slot its requests
            // use for the XRC SRQ number, see `wire`).
            self.drop_request(q, &h, "an XRC_SEND QP executes no request");
            return false;
        }
        if !matches!(
            q.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            // As a HCA drops packets to a QP that is not ready: the requester sends it again.
            self.drop_request(q, &h, "the QP is not in RTR");
            return false;
        }
        if !from_peer(q, &h) {
            self.drop_request(q, &h, "not from the connected peer");
            return false;
        }
        if h.flags & wire::FLAG_ACK != 0
            && matches!(q.state, QpState::Rts | QpState::Sqd | QpState::Sqe)
        {
            self.peer_acknowledged(q, h.ack_seq);
        }
        self.established(q);
        if h.seq != q.expected_seq {
            if wire::psn_before(h.seq, q.expected_seq) || q.early.contains_key(&h.seq) {
                self.on_duplicate(q, &h);
                return false;
            }
            note_prompt_ack(q, &h);
            if !self.may_keep(q, &payload) {
                self.drop_request(q, &h, "ahead of sequence, and the QP keeps enough");
                return false;
            }
            return self.keep_pending(q, h, payload, true);
        }
        if self.xrc_target.is_some() && !self.xrc_request_valid(q, &h) {
            return false;
        }
        note_prompt_ack(q, &h);
        let receive = if q.waiting.is_empty() && needs_receive(&h) {
            self.take_receive_for(q, &h)
        } else {
            None
        };
        let kept = if q.waiting.is_empty() && (!needs_receive(&h) || receive.is_some()) {
            q.expected_seq = wire::psn_add(q.expected_seq, 1);
            self.execute(q, h, Body::Current(payload), receive);
            false
        } else {
            if needs_receive(&h) {
                self.wait_for_receive(&h);
            }
            if !self.may_keep(q, &payload) {
                // Receiver not ready, and it keeps enough: RNR-NAKed now (also when others
                // wait), so the requester sends it again after this QP's RNR timer, not after
                // its ACK timeout, which grows with the bytes it has in flight (seconds for a
                // window of 1 MiB SENDs). Those already waiting are RNR-NAKed when their
                // duplicates come.
                self.drop_request(q, &h, "no receive WR, and the QP keeps enough");
                self.send_ack(q, h.seq, Some(Nak::ReceiverNotReady));
                return false;
            }
            q.expected_seq = wire::psn_add(q.expected_seq, 1);
            self.keep_pending(q, h, payload, false)
        };
        self.drain_early(q);
        kept
    }

    /// Whether the QP may keep one more message with this payload.
    fn may_keep(&self, q: &Queues, payload: &AmPayload<'_>) -> bool {
        q.early.len() + q.waiting.len() < MAX_KEPT_MESSAGES
            && q.kept_bytes + eager_len(payload) <= MAX_KEPT_BYTES
    }

    /// Keeps a message for later: in the reorder map (`early`) or at the end of the in-order
    /// messages waiting for a receive WR. Returns whether UCX must keep the payload.
    fn keep_pending(&self, q: &mut Queues, h: Header, payload: AmPayload<'_>, early: bool) -> bool {
        q.kept_bytes += eager_len(&payload);
        let (body, kept) = keep(payload);
        let p = Pending { header: h, body };
        if early {
            q.early.insert(h.seq, p);
        } else {
            q.waiting.push_back(p);
        }
        kept
    }

    /// A request this QP already has (the requester's timer sent it again): dropped, and
    /// answered so the requester knows where the responder stands: an RNR NAK while it waits
    /// for a receive WR, else the newest acknowledgement (coalesced with the ACKs owed).
    fn on_duplicate(&self, q: &mut Queues, h: &Header) {
        if let Some(front) = q.waiting.front().map(|p| p.header.seq)
            && !wire::psn_before(h.seq, front)
        {
            if h.seq == front {
                self.send_ack(q, front, Some(Nak::ReceiverNotReady));
            }
            return;
        }
        tracing::trace!("qp {:#x}: duplicate psn {:#x}", self.qp_num, h.seq);
        if q.ack_owed.is_none() {
            q.ack_owed = Some(q.last_delivered);
            crate::engine::owe_ack(self.qp_num);
        }
        // The requester timed out waiting: it wants the answer now.
        crate::engine::ack_wanted_soon();
    }

    /// Counts a request the responder does not take (`UGDR_LOG=debug` shows the count at
    /// each power of two, `trace` every one).
    pub(super) fn drop_request(&self, q: &mut Queues, h: &Header, why: &str) {
        q.dropped += 1;
        let debug = q.dropped.is_power_of_two() && tracing::enabled!(tracing::Level::DEBUG);
        if debug || tracing::enabled!(tracing::Level::TRACE) {
            let what = format!(
                "qp {:#x} in {:?}: dropped {:?} psn {:#x} from lid {:#06x} qp {:#x}: {why}",
                self.qp_num, q.state, h.op, h.seq, h.src_lid, h.src_qpn
            );
            if debug {
                tracing::debug!("{what} ({} dropped so far)", q.dropped);
            } else {
                tracing::trace!("{what}");
            }
        }
    }

    /// Moves messages that arrived early and are now next in sequence to the delivery path.
    pub(super) fn drain_early(self: &Arc<Self>, q: &mut Queues) {
        while !q.early.is_empty()
            && let Some(p) = q.early.remove(&q.expected_seq)
        {
            q.expected_seq = wire::psn_add(q.expected_seq, 1);
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
            let header = front.header;
            // Early arrivals reach this queue unchecked (see on_request_locked).
            if self.xrc_target.is_some() && !self.xrc_request_valid(q, &header) {
                break;
            }
            let receive = if needs_receive(&header) {
                match self.take_receive_for(q, &header) {
                    Some(wr) => Some(wr),
                    None => {
                        self.wait_for_receive(&header);
                        break;
                    }
                }
            } else {
                None
            };
            let p = q.waiting.pop_front().expect("checked");
            q.kept_bytes = q
                .kept_bytes
                .saturating_sub(p.body.bytes_if_eager().map_or(0, <[u8]>::len));
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
            Op::Write if h.status == wire::ATOMIC_WRITE => {
                let operand = body
                    .bytes_if_eager()
                    .and_then(|b| <[u8; 8]>::try_from(b).ok());
                let Some(span) = self.check_remote(q, &h, 8, mr::ACCESS_REMOTE_WRITE) else {
                    self.refuse(q, &h, body, receive);
                    return;
                };
                let (Some(span), Some(bytes)) = (span.filter(aligned_word), operand) else {
                    self.refuse_invalid(q, &h, body);
                    return;
                };
                let value = u64::from_ne_bytes(bytes);
                self.respond_in_order(q, &h, Response::AtomicWrite { span, value });
            }
            Op::Write => {
                let len = body.len();
                let Some(target) = self.check_remote(q, &h, len as u64, mr::ACCESS_REMOTE_WRITE)
                else {
                    self.refuse(q, &h, body, receive);
                    return;
                };
                self.deliver_receive(q, receive, h, body, target);
            }
            Op::ReadRequest => {
                let Some(span) =
                    self.check_remote(q, &h, u64::from(h.length), mr::ACCESS_REMOTE_READ)
                else {
                    self.refuse(q, &h, body, None);
                    return;
                };
                self.respond_in_order(q, &h, Response::Read { span });
            }
            Op::Atomic => {
                let operands = body.bytes_if_eager();
                let Some(span) = self.check_remote(q, &h, 8, mr::ACCESS_REMOTE_ATOMIC) else {
                    self.refuse(q, &h, body, None);
                    return;
                };
                // The key allows it, but the address is not an aligned word or the operands
                // are malformed: an invalid request (rxe's misaligned-atomic error), not a hang.
                let (Some(span), Some(ops)) = (
                    span.filter(aligned_word),
                    operands.filter(|o| o.len() == 16),
                ) else {
                    self.refuse_invalid(q, &h, body);
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
    /// must grant it over the range (the rkey of the QP's PD; at an XRC target, of the named
    /// XRC SRQ's PD). `Some(None)` for a zero-length access (no key is checked);
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
        // An XRC target checks the rkey against the PD of the XRC SRQ the request names.
        let xrc_pd = self.xrc_srq_pd(h);
        let pd = xrc_pd.as_ref().unwrap_or(&self.pd);
        match mw::remote_span(pd, self.qp_num, h.rkey, h.remote_addr, len, access) {
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
    /// class C: a local access violation work-queue error). The receive WR a WRITE_WITH_IMM
    /// took completes with IBV_WC_REM_ACCESS_ERR, as rxe completes it (`do_class_ac_error`).
    pub(super) fn refuse(
        &self,
        q: &mut Queues,
        h: &Header,
        body: Body<'_>,
        receive: Option<RecvRequest>,
    ) {
        if let Body::Held(d) = body {
            q.outbox.push(Deferred::Release(d));
        }
        // Earlier requests that already took effect are acknowledged before the NAK.
        self.release_landed(q);
        if let Some(wr) = receive {
            self.push_receive(self.failed_receive(&wr, h, WcStatus::RemAccessErr), true);
        }
        self.send_ack(q, h.seq, Some(Nak::RemoteAccess));
        self.raise(EVENT_QP_ACCESS_ERR);
        q.state = QpState::Err;
        self.flush(q);
    }

    /// Refuses a malformed request (an atomic at an address that is not an aligned word):
    /// NAK invalid request (the requester's WR completes with REM_INV_REQ_ERR), the QP to ERR
    /// with an invalid-request work-queue error, as rxe's responder does.
    fn refuse_invalid(&self, q: &mut Queues, h: &Header, body: Body<'_>) {
        if let Body::Held(d) = body {
            q.outbox.push(Deferred::Release(d));
        }
        self.release_landed(q);
        self.send_ack(q, h.seq, Some(Nak::InvalidRequest));
        self.raise(EVENT_QP_REQ_ERR);
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
        if let Response::AtomicWrite { span, value } = response {
            // Acknowledged with what landed before it; nothing to send back.
            span.atomic_store(value);
            return;
        }
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
            Response::AtomicWrite { .. } => unreachable!("stored above"),
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

    /// Sends the ACK this QP owes, if any, whatever its age (before the QP goes: a HCA
    /// acknowledges what it delivered).
    pub fn flush_ack(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        self.send_owed_ack_by(locked, None);
    }

    /// Sends the ACK this QP owes, if any; with `owed_by` only if it has been owed since then
    /// or earlier (a flush of overdue ACKs), else it stays owed and listed with its own age.
    /// (The engine's list still holds a QP whose ACK rode on a message since it was listed;
    /// its age is that of the list's entry, not of the ACK owed now, which may be a
    /// microsecond old: sent alone, it would go just before the answer it could ride on.)
    pub(super) fn send_owed_ack_by(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        owed_by: Option<u64>,
    ) {
        self.locked_then_send(locked, |q| match owed_ack_at_flush(q, owed_by) {
            OwedAck::None => {}
            OwedAck::Later => {
                crate::engine::still_owe_ack(self.qp_num, q.ack_owed_since, q.prompt_ack.is_some())
            }
            OwedAck::Now => {
                if let Some(seq) = take_owed_ack(q) {
                    self.send_ack(q, seq, None);
                }
            }
        });
    }

    /// Sends the ACK of this QP's full batch if it has been owed since the application's poll
    /// numbered `poll` or earlier; while the batch is full and not yet due it stays listed
    /// (`engine::ack_batch_full`).
    pub(super) fn send_full_batch_ack_by(self: &Arc<Self>, locked: &LockedWorker<'_>, poll: u64) {
        self.locked_then_send(locked, |q| {
            q.full_batch_listed = false;
            match full_batch_at_flush(q, poll) {
                OwedAck::None => {}
                OwedAck::Later => self.list_full_batch(q),
                OwedAck::Now => {
                    if let Some(seq) = take_owed_ack(q) {
                        self.send_ack(q, seq, None);
                    }
                }
            }
        });
    }

    /// Puts this QP, once, on the engine's list of full batches (`engine::ack_batch_full`).
    fn list_full_batch(&self, q: &mut Queues) {
        if !q.full_batch_listed {
            q.full_batch_listed = true;
            crate::engine::ack_batch_full(self.qp_num);
        }
    }

    /// `seq` was delivered: acknowledge it with the next message, or now when many are owed.
    pub(super) fn acknowledge(&self, q: &mut Queues, seq: u32) {
        if !self.qp_type.reliable() {
            return;
        }
        let delivered = count(&DELIVERED);
        if delivered.is_power_of_two() {
            tracing::debug!(
                "rc responders: {delivered} requests delivered, {} ACKs sent alone",
                ACKS_ALONE.load(Ordering::Relaxed)
            );
        }
        let first = q.ack_owed.is_none();
        q.last_delivered = seq;
        q.ack_owed = Some(seq);
        q.acks_unsent += 1;
        let prompt = prompt_ack_after(q.prompt_ack, seq).0;
        if first {
            q.ack_owed_since = crate::engine::owe_ack(self.qp_num);
            q.ack_owed_poll = app_polls();
        }
        let batch = ack_batch(prompt);
        if q.acks_unsent >= batch {
            let cutoff = crate::engine::full_batch_cutoff(app_polls());
            if q.acks_unsent >= FULL_BATCHES_HELD * batch
                || full_batch_at_flush(q, cutoff) == OwedAck::Now
            {
                take_owed_ack(q);
                self.send_ack(q, seq, None);
                return;
            }
            self.list_full_batch(q);
        }
        if prompt {
            crate::engine::ack_wanted_soon();
        }
    }

    pub(super) fn send_ack(&self, q: &mut Queues, seq: u32, nak: Option<Nak>) {
        if !self.qp_type.reliable() {
            return; // UC and UD are never acknowledged
        }
        let Some(peer) = &q.peer else { return };
        count(&ACKS_ALONE);
        let mut header = Header::new(Op::Ack, peer.qpn, self.qp_num, self.local_lid, seq);
        header.status = nak.map_or(0, |n| n as u8);
        if nak == Some(Nak::ReceiverNotReady) {
            // The RNR NAK timer the requester waits before trying again (IBA 9.7.5.2.8).
            header.length = u32::from(q.attrs.min_rnr_timer);
        }
        let endpoint = Arc::clone(&peer.endpoint);
        q.outbox.push(Deferred::Send {
            endpoint,
            header,
            payload: SendPayload::None,
            data_seq: None,
        });
    }
}

/// One more in a statistics counter (see [`DELIVERED`]); returns the new count.
fn count(counter: &AtomicU64) -> u64 {
    super::add_to_statistic(counter, 1)
}

/// Notes a request whose requester waits for its ACK (it came without
/// `wire::HINT_ACK_MAY_WAIT`) among those not yet acknowledged.
fn note_prompt_ack(q: &mut Queues, h: &Header) {
    if h.hints & wire::HINT_ACK_MAY_WAIT != 0 {
        return;
    }
    q.prompt_ack = Some(match q.prompt_ack {
        None => (h.seq, h.seq),
        Some((oldest, newest)) if wire::psn_before(newest, h.seq) => (oldest, h.seq),
        Some(kept) => kept,
    });
}

/// The acknowledgement this QP owes, to be sent now (alone or on a message): no longer owed.
pub(super) fn take_owed_ack(q: &mut Queues) -> Option<u32> {
    let seq = q.ack_owed.take()?;
    q.acks_unsent = 0;
    q.prompt_ack = prompt_ack_after(q.prompt_ack, seq).1;
    Some(seq)
}

/// The application's polls so far (0 before the engine runs).
fn app_polls() -> u64 {
    crate::engine::Engine::running().map_or(0, |e| e.app_polls())
}

/// The deliveries a full batch holds: [`ACK_BATCH`] while the requester waits for one
/// (`prompt`), else [`LAZY_ACK_BATCH`].
fn ack_batch(prompt: bool) -> u32 {
    if prompt { ACK_BATCH } else { LAZY_ACK_BATCH }
}

/// Whether the ACK this QP owes is for a full batch.
fn batch_full(q: &Queues) -> bool {
    q.ack_owed.is_some()
        && q.acks_unsent >= ack_batch(prompt_ack_after(q.prompt_ack, q.last_delivered).0)
}

/// At a flush of full batches that takes those owed since the application's poll `poll` or
/// earlier: none (no full batch is owed: a message carried its ACK), later, or now.
fn full_batch_at_flush(q: &Queues, poll: u64) -> OwedAck {
    if !batch_full(q) {
        OwedAck::None
    } else if q.ack_owed_poll <= poll {
        OwedAck::Now
    } else {
        OwedAck::Later
    }
}

/// What a flush of owed ACKs does with this QP's.
#[derive(Debug, PartialEq, Eq)]
enum OwedAck {
    /// It owes none (one rode on a message since it was listed).
    None,
    /// It owes one younger than the flush asks for: it stays owed and is listed again.
    Later,
    /// It sends it alone now.
    Now,
}

/// At a flush of owed ACKs: all of them (`owed_by` None), or those owed since `owed_by` or
/// earlier.
fn owed_ack_at_flush(q: &Queues, owed_by: Option<u64>) -> OwedAck {
    match (q.ack_owed, owed_by) {
        (None, _) => OwedAck::None,
        (Some(_), Some(cutoff)) if q.ack_owed_since > cutoff => OwedAck::Later,
        (Some(_), _) => OwedAck::Now,
    }
}

/// For an acknowledgement of everything up to `seq`, given the prompt ACKs wanted
/// (`Queues::prompt_ack`): whether it covers one, and what is still wanted after it.
fn prompt_ack_after(wanted: Option<(u32, u32)>, seq: u32) -> (bool, Option<(u32, u32)>) {
    match wanted {
        Some((oldest, _)) if wire::psn_before(seq, oldest) => (false, wanted),
        Some((_, newest)) if wire::psn_before(seq, newest) => (true, Some((newest, newest))),
        Some(_) => (true, None),
        None => (false, None),
    }
}

/// The bytes a kept payload holds in memory (a rendezvous body stays at its sender).
fn eager_len(payload: &AmPayload<'_>) -> usize {
    match payload {
        AmPayload::Transient(b) => b.len(),
        AmPayload::Persistent(d) => d.len(),
        AmPayload::Rendezvous(_) => 0,
    }
}

/// An atomic's target: one 8-byte word at an 8-byte aligned address.
fn aligned_word(span: &AppSpan) -> bool {
    span.len() == 8 && span.addr().is_multiple_of(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(seq: u32, may_wait: bool) -> Header {
        let mut h = Header::new(Op::Send, 1, 2, 3, seq);
        if may_wait {
            h.hints |= wire::HINT_ACK_MAY_WAIT;
        }
        h
    }

    #[test]
    fn only_requests_without_the_hint_want_a_prompt_ack() {
        let mut q = Queues::new();
        note_prompt_ack(&mut q, &request(5, true));
        assert_eq!(q.prompt_ack, None);
        note_prompt_ack(&mut q, &request(6, false));
        note_prompt_ack(&mut q, &request(7, true));
        note_prompt_ack(&mut q, &request(9, false));
        assert_eq!(
            q.prompt_ack,
            Some((6, 9)),
            "the oldest and the newest wanted"
        );
    }

    #[test]
    fn an_ack_answers_the_wanted_ones_it_covers() {
        let wanted = Some((6, 9));
        assert_eq!(prompt_ack_after(wanted, 5), (false, wanted));
        assert_eq!(prompt_ack_after(wanted, 6), (true, Some((9, 9))));
        assert_eq!(prompt_ack_after(wanted, 8), (true, Some((9, 9))));
        assert_eq!(prompt_ack_after(wanted, 9), (true, None));
        assert_eq!(prompt_ack_after(wanted, 12), (true, None));
        assert_eq!(prompt_ack_after(None, 12), (false, None));
        // Sequence numbers wrap at 24 bits.
        let across = Some((wire::PSN_MASK, 1));
        assert_eq!(
            prompt_ack_after(across, wire::PSN_MASK - 1),
            (false, across)
        );
        assert_eq!(prompt_ack_after(across, 0), (true, Some((1, 1))));
        assert_eq!(prompt_ack_after(across, 1), (true, None));
    }

    #[test]
    fn sending_the_owed_ack_clears_what_it_answers() {
        let mut q = Queues::new();
        assert_eq!(take_owed_ack(&mut q), None);
        note_prompt_ack(&mut q, &request(3, false));
        note_prompt_ack(&mut q, &request(4, false));
        q.ack_owed = Some(3);
        q.acks_unsent = 2;
        assert_eq!(take_owed_ack(&mut q), Some(3));
        assert_eq!((q.ack_owed, q.acks_unsent), (None, 0));
        assert_eq!(q.prompt_ack, Some((4, 4)), "4 still waits for its ACK");
    }

    /// The engine's list of QPs owing an ACK keeps a QP whose ACK rode on a message since it
    /// was listed, with the list's age: a flush of overdue ACKs goes by the age of the ACK the
    /// QP owes now, else it sent ACKs a microsecond old alone, just before the answer they
    /// would have ridden on (SPDK's target across hosts: one `sendmsg` in ten).
    #[test]
    fn a_flush_of_overdue_acks_sends_only_an_ack_owed_that_long() {
        let mut q = Queues::new();
        assert_eq!(owed_ack_at_flush(&q, None), OwedAck::None);
        assert_eq!(owed_ack_at_flush(&q, Some(1_000)), OwedAck::None);
        q.ack_owed = Some(7);
        q.ack_owed_since = 1_000;
        assert_eq!(owed_ack_at_flush(&q, Some(999)), OwedAck::Later, "younger");
        assert_eq!(owed_ack_at_flush(&q, Some(1_000)), OwedAck::Now);
        assert_eq!(owed_ack_at_flush(&q, Some(5_000)), OwedAck::Now);
        assert_eq!(owed_ack_at_flush(&q, None), OwedAck::Now, "a flush of all");
    }

    /// A batch that fills while one bundle is delivered is answered by the application's
    /// next messages: its ACK goes alone only when a flush of full batches finds it full
    /// and owed since the cutoff's poll or earlier.
    #[test]
    fn a_flush_of_full_batches_sends_only_a_full_batch_owed_since_the_cutoff() {
        let mut q = Queues::new();
        assert_eq!(
            full_batch_at_flush(&q, u64::MAX),
            OwedAck::None,
            "none owed"
        );
        q.ack_owed = Some(20);
        q.last_delivered = 20;
        q.ack_owed_poll = 5;
        q.acks_unsent = LAZY_ACK_BATCH - 1;
        assert!(!batch_full(&q), "no requester waits: a lazy batch");
        assert_eq!(full_batch_at_flush(&q, u64::MAX), OwedAck::None);
        q.acks_unsent = LAZY_ACK_BATCH;
        assert!(batch_full(&q));
        assert_eq!(full_batch_at_flush(&q, 4), OwedAck::Later, "too new");
        assert_eq!(full_batch_at_flush(&q, 5), OwedAck::Now);
        // A requester waiting for one of them makes 16 deliveries a full batch.
        note_prompt_ack(&mut q, &request(18, false));
        q.acks_unsent = ACK_BATCH;
        assert!(batch_full(&q));
        assert_eq!(full_batch_at_flush(&q, u64::MAX), OwedAck::Now);
        q.acks_unsent = ACK_BATCH - 1;
        assert_eq!(full_batch_at_flush(&q, u64::MAX), OwedAck::None);
        q.acks_unsent = ACK_BATCH;
        // An answer carried the ACK: no batch is owed any more.
        take_owed_ack(&mut q);
        assert!(!batch_full(&q));
        assert_eq!(full_batch_at_flush(&q, u64::MAX), OwedAck::None);
    }
}
