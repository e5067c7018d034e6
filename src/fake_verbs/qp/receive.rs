//! The receive queue and where arriving data lands: posting receive WRs (`ibv_post_recv`),
//! taking one (from the QP or its SRQ), checking it against a message (length, lkeys: else
//! LOC_LEN_ERR / LOC_PROT_ERR and a NAK), placing the bytes now or through a rendezvous
//! receive, and releasing receive completions (and READ/atomic answers) in sequence order once
//! their data is in place.

use super::super::VerbsError;
use super::super::context::EVENT_QP_REQ_ERR;
use super::super::mr::local_spans_cached;
use super::super::qp_state::{QpState, QpType};
use super::super::work::{
    RecvRequest, WC_WITH_IMM, WC_WITH_INV, WcOpcode, WcStatus, WorkCompletion,
};
use super::QueuePair;
use super::queues::{Body, Deferred, Landing, Queues};
use crate::engine::wire::{self, Header, Nak, Op};
use crate::ucp::{AmPayload, AppSpan, LockedWorker, SpanList};
use std::sync::Arc;

impl QueuePair {
    /// Posts one receive WR (errors as `ibv_post_recv` returns them).
    pub fn post_recv(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        req: RecvRequest,
    ) -> Result<(), VerbsError> {
        self.locked_then_send(locked, |q| self.post_recv_locked(q, req))
    }

    pub(super) fn post_recv_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        req: RecvRequest,
    ) -> Result<(), VerbsError> {
        match q.state {
            QpState::Reset => return Err(VerbsError::Invalid("post_recv on a QP in RESET")),
            QpState::Err => {
                let wc = WorkCompletion::new(
                    req.wr_id,
                    WcStatus::WrFlushErr,
                    WcOpcode::Recv,
                    self.qp_num,
                );
                self.flushed_receive_in_order(q, wc);
                return Ok(());
            }
            _ => {}
        }
        self.check_post_recv(q, &req)?;
        self.queue_receive(q, req);
        self.deliver_waiting(q);
        Ok(())
    }

    /// `ibv_post_recv`'s checks of a receive WR against the QP (its state aside).
    fn check_post_recv(&self, q: &Queues, req: &RecvRequest) -> Result<(), VerbsError> {
        if self.srq.is_some() {
            return Err(VerbsError::Invalid("post_recv on a QP that uses an SRQ"));
        }
        if matches!(self.qp_type, QpType::XrcSend | QpType::XrcRecv) {
            return Err(VerbsError::Invalid("an XRC QP has no receive queue"));
        }
        if q.rq.len() >= self.caps.max_recv_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if req.sges.len() > self.caps.max_recv_sge as usize {
            return Err(VerbsError::Invalid("num_sge above max_recv_sge"));
        }
        Ok(())
    }

    /// Posts a receive WR without the worker when posting only queues it: the QP is in INIT,
    /// RTR, RTS, SQD or SQE and no message waits for a receive (the common case; the worker
    /// lock is then not taken for every receive). `Ok(Some(req))` hands the WR back for
    /// [`QueuePair::post_recv`], which may deliver what waits (and so send) or flush.
    pub fn post_recv_queued_only(
        &self,
        req: RecvRequest,
    ) -> Result<Option<RecvRequest>, VerbsError> {
        let mut q = self.queues();
        if matches!(q.state, QpState::Reset | QpState::Err) || !q.waiting.is_empty() {
            return Ok(Some(req));
        }
        self.check_post_recv(&q, &req)?;
        self.queue_receive(&mut q, req);
        Ok(None)
    }

    /// The next receive WR: from the SRQ if the QP has one, else from its own queue.
    pub(super) fn take_receive(&self, q: &mut Queues) -> Option<RecvRequest> {
        match &self.srq {
            Some(srq) => srq.take(),
            None => self.take_own_receive(q),
        }
    }

    /// Delivers messages that waited for receive WRs (after WRs were posted to the SRQ).
    pub fn deliver_pending(self: &Arc<Self>, locked: &LockedWorker<'_>) {
        self.locked_then_send(locked, |q| self.deliver_waiting(q));
    }

    pub(super) fn recv_completion(
        &self,
        wr: &RecvRequest,
        h: &Header,
        len: usize,
    ) -> WorkCompletion {
        let opcode = if h.op == Op::Write {
            WcOpcode::RecvRdmaWithImm
        } else {
            WcOpcode::Recv
        };
        let mut wc = WorkCompletion::new(wr.wr_id, WcStatus::Success, opcode, self.qp_num);
        wc.byte_len = len as u32;
        wc.src_qp = h.src_qpn;
        wc.slid = h.src_lid;
        if self.xrc_target.is_some() {
            wc.xrc_srqn = h.xrc_srqn().unwrap_or(0);
        }
        if h.flags & wire::FLAG_IMM != 0 {
            wc.wc_flags |= WC_WITH_IMM;
            wc.imm_data = h.imm_data;
        } else if h.flags & wire::FLAG_INV != 0 && matches!(self.qp_type, QpType::Rc | QpType::Uc) {
            // Only RC and UC invalidate (XRC carries no SEND_WITH_INV, see `xrc`).
            wc.wc_flags |= WC_WITH_INV;
            wc.imm_data = h.rkey; // the union's invalidated_rkey
        }
        wc
    }

    /// The completion of a receive WR that `h` took and that failed with `status`.
    pub(super) fn failed_receive(
        &self,
        wr: &RecvRequest,
        h: &Header,
        status: WcStatus,
    ) -> WorkCompletion {
        let mut wc = self.recv_completion(wr, h, 0);
        wc.status = status;
        wc.wc_flags = 0;
        wc
    }

    /// Checks the receive WR against a SEND; on failure completes it with an error, NAKs the
    /// sender and moves the QP to ERR.
    /// `reserve`: bytes in front of the message (a UD receive's GRH area).
    pub(super) fn check_receive(
        &self,
        q: &mut Queues,
        wr: &RecvRequest,
        h: &Header,
        len: usize,
        reserve: usize,
    ) -> Option<SpanList> {
        let capacity = wr.room();
        let (status, nak) = if (len + reserve) as u64 > capacity {
            (WcStatus::LocLenErr, Nak::InvalidRequest)
        } else {
            let spans = if self.xrc_target.is_none() {
                local_spans_cached(&self.pd, &wr.sges, true, &mut q.recv_keys)
            } else {
                local_spans_cached(&self.receive_pd(h), &wr.sges, true, &mut q.recv_keys)
            };
            match spans {
                Some(spans) => return Some(spans),
                None => (WcStatus::LocProtErr, Nak::RemoteOperational),
            }
        };
        tracing::debug!(
            "qp {:#x}: receive wr_id {} failed: {status:?} (message {len} bytes, buffer {capacity})",
            self.qp_num,
            wr.wr_id
        );
        let wc = self.failed_receive(wr, h, status);
        self.release_landed(q);
        self.push_receive(wc, true);
        self.send_ack(q, h.seq, Some(nak));
        if nak == Nak::InvalidRequest && self.qp_type.reliable() {
            // Responder class C (IBA 9.9.3.1.2): an invalid request work-queue error.
            self.raise(EVENT_QP_REQ_ERR);
        }
        q.state = QpState::Err;
        self.flush(q);
        None
    }

    /// Places a SEND (into the receive WR's buffers) or a WRITE (into `target`), then
    /// completes the receive WR if there is one.
    pub(super) fn deliver_receive(
        &self,
        q: &mut Queues,
        wr: Option<RecvRequest>,
        h: Header,
        body: Body<'_>,
        target: Option<AppSpan>,
    ) {
        let len = body.len();
        let spans: SpanList = if h.op == Op::Send {
            let wr = wr.as_ref().expect("a SEND has a receive WR");
            match self
                .check_receive(q, wr, &h, len, 0)
                .filter(|_| self.invalidate_for_send(q, wr, &h))
            {
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
    pub(super) fn place(
        &self,
        q: &mut Queues,
        key: u32,
        spans: SpanList,
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

    pub(super) fn on_landed(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        seq: u32,
        result: Result<usize, crate::ucp::Error>,
    ) {
        self.locked_then_send(locked, |q| {
            let err = q.state == QpState::Err;
            if let Some(l) = q.landing.iter_mut().find(|l| l.seq == seq && !l.landed) {
                l.landed = true;
                if let Err(e) = result {
                    tracing::debug!("qp {:#x}: rendezvous of seq {seq} failed: {e}", self.qp_num);
                    if let Some(wc) = l.wc.as_mut().filter(|_| !err) {
                        wc.status = WcStatus::LocQpOpErr;
                    }
                }
            }
            self.release_landed(q);
        })
    }

    /// Completes requests whose effects are in place, in order: receive completions, READ and
    /// atomic answers, and the acknowledgement of the last one.
    pub(super) fn release_landed(&self, q: &mut Queues) {
        if q.state != QpState::Err
            && let Some(seq) = q
                .landing
                .iter()
                .take_while(|l| l.landed)
                .last()
                .map(|l| l.seq)
        {
            self.placed_follow(seq);
        }
        let mut last = None;
        while q.landing.front().is_some_and(|l| l.landed) {
            let l = q.landing.pop_front().expect("checked");
            if let Some(wc) = l.wc {
                self.push_receive(wc, l.solicited);
            }
            if let Some(r) = l.then {
                self.answer(q, l.seq, r);
            }
            last = Some(l.seq);
        }
        if q.state == QpState::Err {
            // Flushed: nothing is acknowledged any more; the SRQ hears of the last WQE.
            self.last_wqe_reached(q);
        } else if let Some(seq) = last {
            self.acknowledge(q, seq);
        }
    }

    /// Completes a receive WR (flushed, or one a same-host peer placed a SEND in) after those
    /// still landing (see `flush`), in order.
    pub(super) fn flushed_receive_in_order(&self, q: &mut Queues, wc: WorkCompletion) {
        if q.landing.is_empty() {
            self.push_receive(wc, true);
        } else {
            q.landing.push_back(Landing {
                seq: 0,
                wc: Some(wc),
                solicited: true,
                landed: true,
                then: None,
            });
        }
    }

    pub(super) fn complete_landed(
        &self,
        q: &mut Queues,
        seq: u32,
        wc: Option<WorkCompletion>,
        solicited: bool,
    ) {
        if q.landing.is_empty() {
            // Nothing lands before it (the common case): what release_landed would do with it
            // alone in the queue, without queueing it.
            if q.state != QpState::Err {
                self.placed_follow(seq);
            }
            if let Some(wc) = wc {
                self.push_receive(wc, solicited);
            }
            if q.state == QpState::Err {
                self.last_wqe_reached(q);
            } else {
                self.acknowledge(q, seq);
            }
            return;
        }
        q.landing.push_back(Landing {
            seq,
            wc,
            solicited,
            landed: true,
            then: None,
        });
        self.release_landed(q);
    }
}

/// A receive completion turned into its flush (no length, no flags).
pub(super) fn flushed_receive(wc: &WorkCompletion) -> WorkCompletion {
    let mut wc = *wc;
    wc.status = WcStatus::WrFlushErr;
    wc.byte_len = 0;
    wc.wc_flags = 0;
    wc
}
