//! The requester (rxe's `rxe_req.c`): checks a send WR against the QP (`ibv_post_send`'s
//! errors), queues it with its PSN (numbered from `sq_psn`), builds the message header
//! (piggybacking an owed ACK) and starts the UCX send once the queue lock is released. UC and
//! UD sends complete here, when UCX is done with the buffer; RC sends wait for the completer,
//! and keep what it takes to send them again ([`super::timer`]).

use super::super::mr::{KeyCache, local_spans_cached};
use super::super::qp_state::{QpState, QpType};
use super::super::work::{SendOpcode, SendRequest, WcStatus, WorkCompletion};
use super::super::{VerbsError, device};
use super::queues::{DataMessage, HeldMessage, Queues, SendEntry};
use super::{QueuePair, unreliable};
use crate::engine::direct::{self, AtomicOp, DirectAccess};
use crate::engine::wire::{self, Header, Op};
use crate::ucp::{
    AppSpan, Endpoint, LockedWorker, OwnedBytes, SendPayload, SendState, SpanList, Spliced,
};
use smallvec::SmallVec;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

/// This process's bundles (`send_batch`): how many, and the bytes copied into them (frames
/// included) and sent by reference. `UGDR_LOG=debug` shows them at each power of two of the
/// first. Counted as the responder counts its deliveries ([`super::add_to_statistic`]).
static BUNDLES: AtomicU64 = AtomicU64::new(0);
static BUNDLE_BYTES_COPIED: AtomicU64 = AtomicU64::new(0);
static BUNDLE_BYTES_BY_REFERENCE: AtomicU64 = AtomicU64::new(0);

/// The data messages (by PSN) one UCX send carries.
type Seqs = SmallVec<[u32; 8]>;

impl QueuePair {
    /// Posts one send WR. Errors are the ones `ibv_post_send` returns (the WR is not queued);
    /// failures found while executing it become error completions instead.
    pub fn post_send(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        req: SendRequest,
    ) -> Result<(), VerbsError> {
        self.post_send_list(locked, [Ok(req)])
            .map(|_| ())
            .map_err(|(_, e)| e)
    }

    /// Posts a WR list in order, under one hold of the queue lock, looking lkeys up once per
    /// list; the messages go to UCX once the lock is released. Stops at the first WR that
    /// cannot be posted (an `Err` item, or a check of `ibv_post_send`), returning its index
    /// and error: the WRs before it stay posted. `Ok(true)`: a message went out (an answer is
    /// expected); `Ok(false)`: every WR completed at post time (the same-host direct path,
    /// memory-window work, a flush).
    pub fn post_send_list(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        requests: impl IntoIterator<Item = Result<SendRequest, VerbsError>>,
    ) -> Result<bool, (usize, VerbsError)> {
        if self.qp_type == QpType::Ud {
            // Each datagram's endpoint comes from the engine's cache (a UCX call), before the
            // queue lock is taken.
            for (i, req) in requests.into_iter().enumerate() {
                req.and_then(|r| self.post_datagram(locked, r))
                    .map_err(|e| (i, e))?;
            }
            return Ok(true);
        }
        // Most lists hold one WR: its message stays inline (no vector). Messages are built
        // in place and sent from there, by reference: moving each (~180 bytes) from list to
        // batch cost three copies per WR.
        let mut messages: SmallVec<[DataMessage; 1]> = SmallVec::new();
        let posted = self.locked_then_send(locked, |q| {
            for (i, req) in requests.into_iter().enumerate() {
                // Borrowed, not moved out of the Result: a `SendRequest` is 232 bytes.
                let mut req = req;
                let req = req.as_mut().map_err(|e| (i, e.clone()))?;
                match self.post_send_locked(q, req, None) {
                    Ok(Some(m)) => {
                        if messages.len() == 1 {
                            // A list of several: room for SPDK's (~10) at once, not 2, 4, 8, 16.
                            messages.reserve(15);
                        }
                        messages.push(m)
                    }
                    Ok(None) => {}
                    Err(e) => return Err((i, e)),
                }
            }
            Ok(())
        });
        // The messages themselves are sent straight from here (the hot path), the queue lock
        // released; anything else the posts queued went through the outbox.
        let sent = !messages.is_empty();
        match messages.as_mut_slice() {
            // One message (most lists): nothing to bundle.
            one @ [_] => {
                self.send_batch(locked, one);
            }
            all => self.send_data_messages(locked, all),
        }
        posted.map(|()| sent)
    }

    /// Sends a WR list's messages in order (`wire::bundle_plan`): consecutive small ones to the
    /// same peer process on another host as one bundle (`wire::bundle_header`), one UCX send —
    /// over TCP one syscall and one segment instead of one per WR — the rest one by one. Stops
    /// once the QP failed. Payloads are taken from `messages` as they go.
    fn send_data_messages(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        messages: &mut [DataMessage],
    ) {
        let plan = wire::bundle_plan(
            messages
                .iter()
                .map(|m| (m.payload.len(), m.bundle, Arc::as_ptr(&m.endpoint))),
        );
        let sends: SmallVec<[std::ops::Range<usize>; 8]> = plan.collect();
        for send in sends {
            if !self.send_batch(locked, &mut messages[send]) {
                return; // the QP failed: what follows was flushed
            }
        }
    }

    /// Sends `batch` (one message alone, several as a bundle), taking its payloads; false when
    /// the QP failed.
    fn send_batch(self: &Arc<Self>, locked: &LockedWorker<'_>, batch: &mut [DataMessage]) -> bool {
        match batch {
            [] => true,
            [m] => {
                let payload = std::mem::take(&mut m.payload);
                self.start_send(locked, &m.endpoint, &m.header, payload, Some(m.seq))
            }
            _ => {
                // Frames and small payloads are copied into the bundle; large spans of
                // application memory go to UCX by reference (one `sendmsg` gathers them).
                let copied = batch
                    .iter()
                    .map(|m| match m.payload.len() {
                        n if n < wire::BUNDLE_SPLICE_MIN => wire::BUNDLE_FRAME + n,
                        _ => wire::BUNDLE_FRAME,
                    })
                    .sum();
                let mut body = Box::new(Spliced::with_capacity(copied));
                for m in batch.iter() {
                    body.extend_from_slice(&wire::bundle_frame(&m.header, m.payload.len()));
                    body.push_payload(&m.payload, wire::BUNDLE_SPLICE_MIN);
                }
                note_bundle(&body);
                let seqs: Seqs = batch.iter().map(|m| m.seq).collect();
                self.start_send_many(
                    locked,
                    &batch[0].endpoint,
                    true,
                    &wire::bundle_header(),
                    SendPayload::Spliced(body),
                    seqs,
                )
            }
        }
    }

    /// Posts one UD send WR.
    fn post_datagram(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        mut req: SendRequest,
    ) -> Result<(), VerbsError> {
        let Some(ud) = &req.ud else {
            return Err(VerbsError::Invalid("UD send without an address handle"));
        };
        if !Arc::ptr_eq(&ud.ah.pd, &self.pd) {
            return Err(VerbsError::Invalid(
                "address handle of another protection domain",
            ));
        }
        let datagram_to = Some(ud.ah.endpoint(locked));
        let group = ud.ah.group().copied();
        let message =
            self.locked_then_send(locked, |q| self.post_send_locked(q, &mut req, datagram_to))?;
        match (message, group) {
            // A datagram to a multicast group: the engine replicates it.
            (Some(m), Some(mgid)) => self.send_to_group(locked, &mgid, m),
            (Some(m), None) => {
                self.start_send(locked, &m.endpoint, &m.header, m.payload, Some(m.seq));
            }
            (None, _) => {}
        }
        Ok(())
    }

    /// `ibv_post_send`'s checks of a WR against the QP (its state aside): the message kind it
    /// makes and its length, or None for memory-window work (BIND_MW, LOCAL_INV).
    fn check_send(&self, q: &Queues, req: &SendRequest) -> Result<Option<(Op, u64)>, VerbsError> {
        if q.sq.len() >= self.caps.max_send_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if req.sges.len() > self.caps.max_send_sge as usize {
            return Err(VerbsError::Invalid("num_sge above max_send_sge"));
        }
        if let Some(d) = &req.inline_data
            && d.len() > self.caps.max_inline_data as usize
        {
            return Err(VerbsError::Invalid("inline data above max_inline_data"));
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
            (QpType::Uc | QpType::XrcSend, SendOpcode::AtomicWrite) => {
                return Err(VerbsError::Invalid("ATOMIC WRITE is carried over RC only"));
            }
            (
                QpType::XrcSend,
                SendOpcode::SendWithInv | SendOpcode::BindMw | SendOpcode::LocalInv,
            ) => {
                return Err(VerbsError::Invalid(
                    "ugdr carries no memory-window operations over XRC",
                ));
            }
            (QpType::XrcRecv, _) => {
                return Err(VerbsError::Invalid("an XRC target QP has no send queue"));
            }
            _ => {}
        }
        let op = match req.opcode {
            SendOpcode::Send | SendOpcode::SendWithImm | SendOpcode::SendWithInv => Op::Send,
            SendOpcode::BindMw | SendOpcode::LocalInv => return Ok(None),
            SendOpcode::RdmaWrite | SendOpcode::RdmaWriteWithImm => Op::Write,
            SendOpcode::RdmaRead => Op::ReadRequest,
            SendOpcode::AtomicFetchAndAdd | SendOpcode::AtomicCmpAndSwp => {
                // As rxe's validate_send_wr: one 8-byte SGE and an 8-byte aligned address.
                if req.sges.len() != 1
                    || req.sges[0].length != 8
                    || !req.remote_addr.is_multiple_of(8)
                {
                    return Err(VerbsError::Invalid(
                        "atomic needs one 8-byte SGE and an aligned remote address",
                    ));
                }
                Op::Atomic
            }
            SendOpcode::AtomicWrite => {
                if !req.remote_addr.is_multiple_of(8) {
                    return Err(VerbsError::Invalid(
                        "atomic write needs an 8-byte aligned remote address",
                    ));
                }
                Op::Write
            }
        };
        if req.inline_data.is_some() && !matches!(op, Op::Send | Op::Write) {
            return Err(VerbsError::Invalid(
                "inline is for SEND and RDMA WRITE only",
            ));
        }
        Ok(Some((op, length)))
    }

    /// Posts one WR of an RC QP in RTS if it completes at post time (the same-host direct
    /// path): under the queue lock alone, without the worker's. `Ok(false)`: not posted, for
    /// [`QueuePair::post_send_list`] to post; an error is `ibv_post_send`'s.
    /// Borrowed, not moved: a `SendRequest` is 232 bytes, copied twice per WR otherwise.
    pub fn post_send_at_once(&self, req: &SendRequest) -> Result<bool, VerbsError> {
        if self.qp_type != QpType::Rc {
            return Ok(false);
        }
        let mut q = self.queues();
        let same_host = q.peer.as_ref().is_some_and(|p| p.memory.is_some());
        if q.state != QpState::Rts || !same_host || !q.outbox.is_empty() {
            return Ok(false);
        }
        let Some((op, length)) = self.check_send(&q, req)? else {
            return Ok(false);
        };
        let done = self.try_direct(&mut q, req, op, length);
        debug_assert!(q.outbox.is_empty(), "a direct WR queued UCX work");
        Ok(done.is_some())
    }

    /// `datagram_to`: for a UD send, the endpoint to the address handle's process (None:
    /// nobody answers to that address, the datagram is lost).
    pub(super) fn post_send_locked(
        &self,
        q: &mut Queues,
        req: &mut SendRequest,
        datagram_to: Option<Option<Arc<Endpoint>>>,
    ) -> Result<Option<DataMessage>, VerbsError> {
        match q.state {
            QpState::Rts | QpState::Sqd => {}
            QpState::Err | QpState::Sqe => {
                if q.state == QpState::Sqe || q.sq.is_empty() {
                    let mut wc = WorkCompletion::new(
                        req.wr_id,
                        WcStatus::WrFlushErr,
                        req.opcode.completion_opcode(),
                        self.qp_num,
                    );
                    wc.byte_len = 0;
                    self.send_cq.push(wc, true);
                } else {
                    // Behind a READ still landing (see `flush`), in post order.
                    q.sq.push_back(SendEntry {
                        wr_id: req.wr_id,
                        opcode: req.opcode.completion_opcode(),
                        signaled: true,
                        seq: wire::psn_prev(q.next_send_seq),
                        byte_len: 0,
                        outcome: Some(WcStatus::WrFlushErr),
                        response_into: None,
                        pulling: false,
                        resend: None,
                        in_ucx: 0,
                    });
                }
                return Ok(None);
            }
            _ => return Err(VerbsError::Invalid("post_send on a QP that is not in RTS")),
        }
        let Some((op, length)) = self.check_send(q, req)? else {
            // Memory-window work of this process: done now, in post order (`local.rs`).
            return self.post_local_operation(q, req);
        };
        // In SQD the send queue begins no new WR: not even one the direct path would complete
        // at once.
        if q.state == QpState::Rts
            && let Some(done) = self.try_direct(q, req, op, length)
        {
            return Ok(done);
        }
        // The send queue stalls, as a HCA's does, at a fenced WR (IBV_SEND_FENCE) until the
        // READs and atomics posted before it completed, at a READ or atomic while
        // `max_rd_atomic` of them are in flight (the initiator depth), and at every WR posted
        // in SQD until the QP is back in RTS; a WR posted behind a waiting one waits too (the
        // QP's messages go in post order). Its ACK to carry stays owed meanwhile.
        let read_or_atomic = matches!(op, Op::ReadRequest | Op::Atomic);
        let held = self.qp_type.reliable()
            && (!q.held.is_empty()
                || q.state == QpState::Sqd
                || (req.fence && q.reads_outstanding_before(None))
                || (read_or_atomic && q.read_credits_taken_before(None)));
        let seq = q.next_send_seq;
        q.next_send_seq = wire::psn_add(seq, 1);
        q.sq.push_back(SendEntry {
            wr_id: req.wr_id,
            opcode: req.opcode.completion_opcode(),
            signaled: req.signaled || self.sq_sig_all,
            seq,
            byte_len: length as u32,
            outcome: None,
            response_into: None,
            pulling: false,
            resend: None,
            in_ucx: 0,
        });
        let payload = match req.inline_data.take() {
            Some(bytes) => SendPayload::Owned(bytes),
            // Its operand, as the application's 8 bytes.
            None if req.opcode == SendOpcode::AtomicWrite => {
                SendPayload::Owned(req.compare_add.to_ne_bytes().as_slice().into())
            }
            None => {
                // READ and atomics land in local memory: it must be writable.
                let lands_here = !matches!(op, Op::Send | Op::Write);
                let Some(spans) =
                    local_spans_cached(&self.pd, &req.sges, lands_here, &mut q.send_keys)
                else {
                    tracing::debug!(
                        "qp {:#x}: wr_id {} has a bad lkey or range",
                        self.qp_num,
                        req.wr_id
                    );
                    self.fail_entry(q, seq, WcStatus::LocProtErr);
                    return Ok(None);
                };
                if !lands_here {
                    SendPayload::Spans(spans)
                } else {
                    if let Some(e) = q.sq.back_mut() {
                        e.response_into = Some(spans);
                    }
                    if op == Op::Atomic {
                        let mut operands = OwnedBytes::new();
                        operands.extend_from_slice(&req.compare_add.to_le_bytes());
                        operands.extend_from_slice(&req.swap.to_le_bytes());
                        SendPayload::Owned(operands)
                    } else {
                        SendPayload::None
                    }
                }
            }
        };
        let (endpoint, mut header, bundle) = match (&req.ud, datagram_to) {
            (Some(ud), Some(endpoint)) => {
                let endpoint = match endpoint {
                    Some(ep) if length <= u64::from(device::ACTIVE_MTU_BYTES) && !ep.failed() => ep,
                    _ => {
                        // C10-93.1.1: a UD message above the port's MTU emits no packet and
                        // is no error (rxe completes it successfully); neither is a datagram
                        // to an address nobody answers to (or whose process is gone).
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
                (endpoint, header, false)
            }
            _ => {
                let Some(peer) = &q.peer else {
                    self.fail_entry(q, seq, WcStatus::RetryExcErr);
                    return Ok(None);
                };
                let mut header = Header::new(op, peer.qpn, self.qp_num, self.local_lid, seq);
                if self.qp_type == QpType::Uc {
                    header.flags |= wire::FLAG_UNRELIABLE;
                }
                (Arc::clone(&peer.endpoint), header, peer.remote_host)
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
        if req.opcode == SendOpcode::SendWithInv {
            header.flags |= wire::FLAG_INV;
            header.rkey = req.rkey;
        }
        header.length = length as u32;
        // A datagram is copied now and completes once it is handed to UCX, as a HCA completes
        // a UD send when the packet leaves: a send UCX keeps pending forever (to a peer that
        // exited with its shared-memory queue full) must not hold back the QP's later
        // completions, which come in post order.
        let payload = match payload {
            SendPayload::Spans(spans) if self.qp_type == QpType::Ud => {
                SendPayload::Owned(OwnedBytes::from_vec(crate::ucp::gather(&spans)))
            }
            p => p,
        };
        match req.opcode {
            SendOpcode::AtomicFetchAndAdd => header.status = wire::ATOMIC_FETCH_ADD,
            SendOpcode::AtomicCmpAndSwp => header.status = wire::ATOMIC_CMP_SWAP,
            SendOpcode::AtomicWrite => header.status = wire::ATOMIC_WRITE,
            _ => {}
        }
        if req.solicited {
            header.flags |= wire::FLAG_SOLICITED;
        }
        if self.qp_type == QpType::XrcSend {
            // The XRC SRQ at the target (XRCETH), for every operation: a SEND takes its
            // receive WR from it, and RDMA and atomics are checked against its PD. An
            // XRC_SEND QP owes no ACK to piggyback (it executes no request).
            header.set_xrc_srqn(req.xrc_srqn);
        }
        // Toward a same-host peer that takes placed SENDs, a message's ACK is wanted now: the
        // direct path behind it goes on once the peer's ring shows it delivered, without the
        // ACK, but its send-queue slot is freed only by an ACK or a later direct WR.
        let reopens_direct = q.peer.as_ref().is_some_and(|p| {
            p.memory
                .as_ref()
                .is_some_and(|m| m.takes_placed_sends(p.qpn))
        });
        if self.qp_type.reliable()
            && !(req.signaled || self.sq_sig_all)
            && matches!(op, Op::Send | Op::Write)
            && !reopens_direct
        {
            // No completion here waits for its ACK (a later signaled WR's, or a READ's
            // answer, covers it).
            header.hints |= wire::HINT_ACK_MAY_WAIT;
        }
        if self.qp_type.reliable() {
            // Kept until answered, to be sent again if the responder dropped it.
            if let Some(e) = q.sq.back_mut() {
                e.resend = Some((header, payload.clone()));
            }
            self.run_timer(q);
        }
        if self.qp_type != QpType::XrcSend
            && !held
            && let Some(ack) = super::responder::take_owed_ack(q)
        {
            header.flags |= wire::FLAG_ACK;
            header.ack_seq = ack;
        }
        let message = DataMessage {
            endpoint,
            header,
            payload,
            seq,
            bundle,
        };
        if held {
            tracing::debug!(
                "qp {:#x}: wr_id {} held in the send queue ({} held)",
                self.qp_num,
                req.wr_id,
                q.held.len() + 1
            );
            q.held.push_back(HeldMessage {
                fence: req.fence,
                read_or_atomic,
                message,
            });
            return Ok(None);
        }
        Ok(Some(message))
    }

    /// Hands a message to UCX; false when an RC data message could not be sent (the QP
    /// failed).
    pub(super) fn start_send(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        endpoint: &Endpoint,
        header: &Header,
        payload: SendPayload,
        data_seq: Option<u32>,
    ) -> bool {
        let mut seqs = Seqs::new();
        if let Some(seq) = data_seq {
            seqs.push(seq);
        }
        self.start_send_many(locked, endpoint, false, &header.encode(), payload, seqs)
    }

    /// Hands UCX one active message that carries the data messages `seqs` of this QP (none:
    /// an ACK or an answer), alone or as a `bundle` (sent eager); false when an RC data message could not
    /// be sent (the QP failed).
    fn start_send_many(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        endpoint: &Endpoint,
        bundle: bool,
        header: &[u8],
        payload: SendPayload,
        seqs: Seqs,
    ) -> bool {
        // UC sends complete once UCX is done with the buffer: nothing acknowledges them. UD
        // sends carry a copy (`post_send_locked`) and complete once handed to UCX.
        let unreliable = !self.qp_type.reliable();
        let copied = self.qp_type == QpType::Ud;
        // UCX reads application memory until the send completes: counted, so that
        // `destroy` can wait for it (`QueuePair::ucx_io`).
        let reads_app = payload.reads_app();
        let result = if seqs.is_empty() {
            // An ACK, or an answer (a READ's bytes from registered memory).
            let make_done = || {
                let me = reads_app.then(|| Arc::clone(self));
                move |_: &LockedWorker<'_>, _: Result<(), crate::ucp::Error>| {
                    if let Some(me) = me {
                        me.ucx_io_done();
                    }
                }
            };
            endpoint.am_send_then(locked, wire::AM_ID, header, payload, make_done, false)
        } else {
            // Made only if UCX keeps the send pending (not for one its short protocol
            // finished inside the call).
            let make_done = || {
                let me = Arc::clone(self);
                let done_seqs = Seqs::from_slice(&seqs);
                move |locked: &LockedWorker<'_>, result: Result<(), crate::ucp::Error>| {
                    if reads_app {
                        me.ucx_io_done();
                    }
                    if copied {
                        return; // completed when handed over
                    }
                    for &seq in &done_seqs {
                        match &result {
                            Ok(()) if unreliable => me.sent(locked, seq, true),
                            Ok(()) => me.note_in_ucx(locked, seq, -1),
                            Err(e) => {
                                tracing::debug!("qp {:#x}: send seq {seq} failed: {e}", me.qp_num);
                                if unreliable {
                                    me.sent(locked, seq, true);
                                } else {
                                    // UCX is done with it either way; the first failure
                                    // fails the QP and flushes the rest.
                                    me.note_in_ucx(locked, seq, -1);
                                    me.fail_send(locked, seq, WcStatus::RetryExcErr);
                                    return;
                                }
                            }
                        }
                    }
                }
            };
            endpoint.am_send_then(locked, wire::AM_ID, header, payload, make_done, bundle)
        };
        if reads_app && result == Ok(SendState::Pending) {
            // Its callback cannot run before this: it needs the worker lock.
            self.ucx_io_started();
        }
        match result {
            Ok(_) if copied => seqs.iter().for_each(|&s| self.sent(locked, s, false)),
            Ok(SendState::Done) if unreliable => {
                seqs.iter().for_each(|&s| self.sent(locked, s, false))
            }
            // UCX still holds its buffers: not a candidate for retransmission (RC), nor
            // flushed (RC, UC), until it is done.
            Ok(SendState::Pending) => seqs.iter().for_each(|&s| self.note_in_ucx(locked, s, 1)),
            Ok(SendState::Done) => {}
            Err(e) => {
                let Some(&seq) = seqs.first() else {
                    return true;
                };
                tracing::debug!("qp {:#x}: cannot send seq {seq}: {e}", self.qp_num);
                if unreliable {
                    // Lost on the way, as an unreliable transport may lose it.
                    seqs.iter().for_each(|&s| self.sent(locked, s, false));
                } else {
                    self.fail_send(locked, seq, WcStatus::RetryExcErr);
                    return false;
                }
            }
        }
        true
    }

    /// A UC/UD send left: it completes (in post order) without an acknowledgement. `from_ucx`:
    /// UCX kept it pending and is done with its buffers now (see `note_in_ucx`).
    pub(super) fn sent(self: &Arc<Self>, locked: &LockedWorker<'_>, seq: u32, from_ucx: bool) {
        self.locked_then_send(locked, |q| {
            if let Some(e) = q.sq.iter_mut().find(|e| e.seq == seq) {
                if from_ucx {
                    e.in_ucx -= 1;
                }
                e.outcome.get_or_insert(WcStatus::Success);
            }
            self.release_send_completions(q);
        });
    }

    /// The same-host direct path (docs/design.md): an RC WRITE (without immediate) or READ to
    /// a peer whose memory is mapped here is copied now, and completes now. Taken only when
    /// nothing posted earlier is still on its way (`nothing_on_its_way`), so nothing overtakes
    /// what the responder must see first; None leaves the WR to the message path (which then
    /// gives the authoritative outcome of anything the direct checks refused).
    fn try_direct(
        &self,
        q: &mut Queues,
        req: &SendRequest,
        op: Op,
        length: u64,
    ) -> Option<Option<DataMessage>> {
        if op == Op::Send || req.opcode == SendOpcode::RdmaWriteWithImm {
            return self.try_direct_send(q, req, length);
        }
        let kind = match (op, req.opcode) {
            (Op::Write, SendOpcode::RdmaWrite) => DirectAccess::Write,
            (Op::ReadRequest, _) => DirectAccess::Read,
            (Op::Atomic, SendOpcode::AtomicFetchAndAdd) => {
                DirectAccess::Atomic(AtomicOp::FetchAdd(req.compare_add))
            }
            (Op::Atomic, SendOpcode::AtomicCmpAndSwp) => {
                DirectAccess::Atomic(AtomicOp::CompareSwap {
                    compare: req.compare_add,
                    swap: req.swap,
                })
            }
            _ => return None,
        };
        if self.qp_type != QpType::Rc || length == 0 {
            return None;
        }
        // A peer on another host has no shared memory: known before scanning the queue.
        q.peer.as_ref()?.memory.as_ref()?;
        let lands_here = kind != DirectAccess::Write;
        let spans = self.direct_spans(q, req, lands_here)?;
        let peer = q.peer.as_ref()?;
        peer.memory
            .as_ref()?
            .access(
                kind,
                &spans,
                self.local_lid,
                self.qp_num,
                peer.qpn,
                req.rkey,
                req.remote_addr,
            )
            .ok()?;
        // Sorts with the last message sent: ACKs and NAKs never name it.
        let seq = wire::psn_prev(q.next_send_seq);
        self.completed_at_post(q, req, seq, length);
        Some(None)
    }

    /// The local spans of a WR the direct path may carry out now (its inline bytes, or its
    /// SGEs checked, for local writing when `lands_here`), or None: something posted earlier
    /// is still on its way as a message, and RC order keeps this WR behind it.
    fn direct_spans(
        &self,
        q: &mut Queues,
        req: &SendRequest,
        lands_here: bool,
    ) -> Option<SpanList> {
        if !self.nothing_on_its_way(q) {
            return None;
        }
        self.local_spans(req, lands_here, &mut q.send_keys)
    }

    /// Whether every request posted so far took effect at the responder: none is waiting for
    /// its ACK, or (only SENDs and WRITEs wait, no READ or atomic, whose answer is still to
    /// come) the peer's receive ring says its responder delivered them all, which then
    /// acknowledges them. So a window of WRITEs behind a SEND that went as a message goes
    /// direct again once the responder took that SEND, not only once its ACK came back.
    fn nothing_on_its_way(&self, q: &mut Queues) -> bool {
        if q.sq.iter().all(|e| e.outcome.is_some()) {
            return true;
        }
        if q.reads_outstanding_before(None) {
            return false;
        }
        let Some(peer) = q.peer.as_ref() else {
            return false;
        };
        let Some(memory) = peer.memory.as_ref() else {
            return false;
        };
        let me = (self.local_lid, self.qp_num);
        if !memory.delivered_before(&mut q.peer_ring, peer.qpn, me, q.next_send_seq) {
            return false;
        }
        self.apply_ack(q, wire::psn_prev(q.next_send_seq));
        true
    }

    /// A WR's local spans: its inline bytes, or its SGEs checked (for local writing when
    /// `lands_here`); None when an lkey or range is bad.
    fn local_spans(
        &self,
        req: &SendRequest,
        lands_here: bool,
        keys: &mut KeyCache,
    ) -> Option<SpanList> {
        match &req.inline_data {
            Some(bytes) => Some(SmallVec::from_elem(AppSpan::of_owned(bytes), 1)),
            None => local_spans_cached(&self.pd, &req.sges, lands_here, keys),
        }
    }

    /// A WR the direct path carried out while it was posted: it completes now (in post order
    /// with those before it), numbered `seq`.
    #[inline]
    fn completed_at_post(&self, q: &mut Queues, req: &SendRequest, seq: u32, length: u64) {
        if q.sq.is_empty() && q.state == QpState::Rts {
            // Nothing ahead of it to complete first, and no drain to report: its completion
            // (if signaled) goes straight to the CQ, without passing through the queue.
            if req.signaled || self.sq_sig_all {
                let opcode = req.opcode.completion_opcode();
                let mut wc = WorkCompletion::new(req.wr_id, WcStatus::Success, opcode, self.qp_num);
                wc.byte_len = length as u32;
                self.send_cq.push(wc, true);
            }
            return;
        }
        q.sq.push_back(SendEntry {
            wr_id: req.wr_id,
            opcode: req.opcode.completion_opcode(),
            signaled: req.signaled || self.sq_sig_all,
            seq,
            byte_len: length as u32,
            outcome: Some(WcStatus::Success),
            response_into: None,
            pulling: false,
            resend: None,
            in_ucx: 0,
        });
        self.release_send_completions(q);
    }

    /// The same-host SEND path (docs/design.md): an RC SEND (or SEND_WITH_IMM, or RDMA
    /// WRITE_WITH_IMM) to a peer whose receive ring is mapped here is placed in its next
    /// receive WR now (up to [`direct::SEND_MAX`] bytes in the ring, larger ones written in
    /// place; a WRITE's bytes at the address it names), and completes now. The ring takes it only as the PSN after the
    /// last request the responder delivered, so nothing posted earlier is still on its way
    /// (the responder executed all of it, and no request failed there): a placed SEND
    /// acknowledges every request before it, as an ACK of its PSN would. (Waiting for those
    /// ACKs instead kept a windowed sender on messages for good once one SEND went as a
    /// message: one of its window was always unacknowledged.) None leaves it to the message
    /// path (no receive WR posted, or one that takes messages only, or requests before it not
    /// yet delivered: the responder's RNR waiting and its checks then apply).
    fn try_direct_send(
        &self,
        q: &mut Queues,
        req: &SendRequest,
        length: u64,
    ) -> Option<Option<DataMessage>> {
        let (imm, rdma_write) = match req.opcode {
            SendOpcode::Send => (None, None),
            SendOpcode::SendWithImm => (Some(req.imm_data), None),
            // Its bytes to the remote address, its completion to the next receive WR (a
            // zero-length one names no memory: the responder's checks decide it).
            SendOpcode::RdmaWriteWithImm if length > 0 => {
                (Some(req.imm_data), Some((req.rkey, req.remote_addr)))
            }
            _ => return None,
        };
        if self.qp_type != QpType::Rc || length > u64::from(u32::MAX) {
            return None;
        }
        // A fenced one waits for the READs and atomics before it (the message path holds it):
        // the peer may have executed such a READ, which the ring's PSN check lets pass, while
        // its data is still on its way here.
        if req.fence && q.reads_outstanding_before(None) {
            return None;
        }
        let peer = q.peer.as_ref()?;
        // A peer QP without a ring (an SRQ's, one whose CQ has a channel) never takes one.
        let memory = peer
            .memory
            .as_ref()
            .filter(|m| m.takes_placed_sends(peer.qpn))?;
        let spans = self.local_spans(req, false, &mut q.send_keys)?;
        let psn = q.next_send_seq;
        let send = direct::SendToRing {
            spans: &spans,
            imm_data: imm,
            psn,
            // The ACK this QP owes the peer rides along, as on a message.
            ack: q.ack_owed,
            from: (self.local_lid, self.qp_num),
            dst_qpn: peer.qpn,
            rdma_write,
        };
        memory.send(&mut q.peer_ring, &send).ok()?;
        if send.ack.is_some() {
            super::responder::take_owed_ack(q);
        }
        // Delivered, after everything before it: numbered, and all of it acknowledged.
        q.next_send_seq = wire::psn_add(psn, 1);
        self.apply_ack(q, psn);
        self.completed_at_post(q, req, psn, length);
        Some(None)
    }
}

/// Counts a bundle (see [`BUNDLES`]).
fn note_bundle(body: &Spliced) {
    let add = super::add_to_statistic;
    let copied = add(
        &BUNDLE_BYTES_COPIED,
        (body.len() - body.by_reference()) as u64,
    );
    let by_reference = add(&BUNDLE_BYTES_BY_REFERENCE, body.by_reference() as u64);
    let bundles = add(&BUNDLES, 1);
    if bundles.is_power_of_two() {
        tracing::debug!(
            "rc bundles: {bundles} sent, {copied} bytes copied into them, {by_reference} sent by reference"
        );
    }
}
