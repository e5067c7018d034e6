//! The completer (rxe's `rxe_comp.c`): turns ACKs, NAKs and READ/atomic responses into send
//! completions, released strictly in post order; a NAK or a failed send fails the QP; an RNR
//! NAK counts against `rnr_retry`; entering ERR flushes every outstanding WR (sends first,
//! then receives) with IBV_WC_WR_FLUSH_ERR. Only answers from the connected peer (its LID and
//! QP) naming a PSN this QP sent and the responder has not acknowledged yet count.

use super::super::qp_state::QpState;
use super::super::work::{WcOpcode, WcStatus, WorkCompletion};
use super::QueuePair;
use super::queues::{Deferred, HeldMessage, Queues, release_kept};
use super::receive::flushed_receive;
use crate::engine::Engine;
use crate::engine::wire::{self, Header, Nak};
use crate::ucp::{AmPayload, LockedWorker};
use std::sync::Arc;

impl QueuePair {
    /// The send WR `seq` failed: it completes with `status` and the QP goes to ERR.
    pub(super) fn fail_send(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        seq: u32,
        status: WcStatus,
    ) {
        self.locked_then_send(locked, |q| {
            if matches!(q.state, QpState::Err | QpState::Reset) {
                return;
            }
            self.fail_entry(q, seq, status)
        });
    }

    /// Completes every outstanding WR with IBV_WC_WR_FLUSH_ERR, in order (sends after any
    /// already-finished ones, then receives). A send acknowledged behind one still unfinished
    /// (a READ waiting for its data) never got its completion: it is flushed too, as hardware
    /// flushes every WQE after the first incomplete one, so an unsignaled WR never reports
    /// success; one that failed keeps its error.
    ///
    /// A WR whose data UCX is still writing into the application's buffers (a READ's
    /// rendezvous response, a rendezvous SEND landing in a receive) completes only once it
    /// landed, and the WRs after it wait behind it: hardware never reports a WR, flushed or
    /// not, while it still writes its buffers, and applications reuse them at once (SPDK
    /// reposts the receive and hands the buffer to the next request).
    pub(super) fn flush(&self, q: &mut Queues) {
        // Same-host peers stop reaching this QP's memory before anything is flushed.
        if let Some(memory) = Engine::local_memory() {
            memory.withdraw_qp(self.qp_num);
        }
        // What they placed before is received, as a HCA's arrivals before the error are.
        self.complete_placed(q);
        // WRs the send queue held back were never sent: flushed below with the rest.
        q.held.clear();
        for e in q.sq.iter_mut().filter(|e| !e.pulling) {
            e.outcome = Some(match e.outcome {
                Some(failed) if failed != WcStatus::Success => failed,
                _ => WcStatus::WrFlushErr,
            });
        }
        self.release_send_completions(q);
        for l in q.landing.iter_mut() {
            if let Some(wc) = l.wc.as_mut() {
                *wc = flushed_receive(wc);
            }
            l.then = None;
        }
        self.release_landed(q);
        while let Some(r) = q.rq.pop_front() {
            self.skip_offered_receive();
            let wc =
                WorkCompletion::new(r.wr_id, WcStatus::WrFlushErr, WcOpcode::Recv, self.qp_num);
            self.flushed_receive_in_order(q, wc);
        }
        release_kept(q);
    }

    pub(super) fn fail_entry(&self, q: &mut Queues, seq: u32, status: WcStatus) {
        if let Some(e) = q.sq.iter_mut().find(|e| e.seq == seq) {
            e.outcome = Some(status);
        }
        // In ERR before its completion is released: nothing held behind a fence may go.
        q.state = QpState::Err;
        self.release_send_completions(q);
        self.flush(q);
    }

    /// Releases finished send WRs from the head of the queue, in post order. One that did not
    /// succeed (flushed, failed) while UCX still reads its buffers for a live peer waits for
    /// UCX (`note_in_ucx`), and the WRs after it wait behind it: hardware stops reading a WR's
    /// buffers before it reports it, and the application reuses them at once (an SPDK
    /// initiator hands a flushed command's buffer to the next qpair). One that succeeded was
    /// delivered whole, so what UCX still carries is a duplicate the responder drops.
    pub(super) fn release_send_completions(&self, q: &mut Queues) {
        // One hold of the CQ's lock for all the completions an ACK releases.
        let mut done = self.send_cq.batch();
        while let Some(head) = q.sq.front() {
            let Some(status) = head.outcome else { break };
            if status != WcStatus::Success
                && head.in_ucx > 0
                && q.peer.as_ref().is_some_and(|p| !p.endpoint.failed())
            {
                break;
            }
            let e = q.sq.pop_front().expect("head exists");
            if e.signaled || status != WcStatus::Success {
                let mut wc = WorkCompletion::new(e.wr_id, status, e.opcode, self.qp_num);
                wc.byte_len = if status == WcStatus::Success {
                    e.byte_len
                } else {
                    0
                };
                done.push(wc, true);
            }
        }
        drop(done);
        self.check_drained(q);
        self.release_held(q);
    }

    /// Sends the messages the send queue held back ([`Queues::held`]) that may go now: in
    /// post order, up to a fenced one that still waits for a READ or atomic posted before it,
    /// or a READ or atomic for which no read credit is free. None goes in SQD (the send queue
    /// begins nothing new until RTS, which sends them), nor from a QP that failed (`fail_entry`
    /// and `fail` enter ERR before they release the failed WR's completion): the flush drops
    /// them.
    pub(super) fn release_held(&self, q: &mut Queues) {
        if q.held.is_empty() || q.state != QpState::Rts {
            return;
        }
        while let Some(next) = q.held.front() {
            let seq = Some(next.message.seq);
            if (next.fence && q.reads_outstanding_before(seq))
                || (next.read_or_atomic && q.read_credits_taken_before(seq))
            {
                break;
            }
            let HeldMessage { message, .. } = q.held.pop_front().expect("front exists");
            q.outbox.push(Deferred::Send {
                endpoint: message.endpoint,
                header: message.header,
                payload: message.payload,
                data_seq: Some(message.seq),
            });
        }
    }

    /// An ACK (or NAK) from the responder.
    pub fn on_ack(self: &Arc<Self>, locked: &LockedWorker<'_>, h: &Header) {
        let failed = self.locked_then_send(locked, |q| {
            self.on_ack_locked(q, h);
            std::mem::take(&mut q.timer.failed)
        });
        if failed {
            self.transport_failed();
        }
    }

    pub(super) fn on_ack_locked(&self, q: &mut Queues, h: &Header) {
        if !matches!(q.state, QpState::Rts | QpState::Sqd | QpState::Sqe) {
            return;
        }
        if !from_peer(q, h) || !answers_sent(q, h.seq) {
            tracing::debug!(
                "qp {:#x}: ignoring an ACK for psn {:#x} from lid {:#06x} qp {:#x}",
                self.qp_num,
                h.seq,
                h.src_lid,
                h.src_qpn
            );
            return;
        }
        let nak = Nak::from_raw(h.status);
        if nak.is_some() && h.seq == q.acked_psn {
            return; // a NAK names a request still unanswered
        }
        match nak {
            None => {
                q.timer.answered();
                self.apply_ack(q, h.seq);
            }
            Some(Nak::ReceiverNotReady) => {
                // It waits for a receive WR, or the responder could not keep it: once the
                // responder's RNR timer (in `length`) ran out, it and everything after it go
                // again. Nothing is acknowledged by it.
                if q.timer.rnr_retry_allowed(q.attrs.rnr_retry) {
                    q.timer
                        .resend_after_rnr(h.seq, super::timer::rnr_delay(h.length));
                    self.run_timer(q);
                } else {
                    tracing::debug!(
                        "qp {:#x}: psn {:#x}: RNR retry counter exceeded",
                        self.qp_num,
                        h.seq
                    );
                    q.timer.failed = true;
                    self.fail_entry(q, h.seq, WcStatus::RnrRetryExcErr);
                }
            }
            Some(nak) => {
                q.timer.answered();
                for e in q.sq.iter_mut() {
                    if !wire::psn_before(e.seq, h.seq) {
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
                    Nak::ReceiverNotReady => unreachable!("handled above"),
                };
                self.fail_entry(q, h.seq, status);
            }
        }
    }

    /// A cumulative acknowledgement from the peer (alone, or piggybacked on its request):
    /// every send up to and including `seq` was delivered. Ignored unless `seq` lies between
    /// what was acknowledged already and the last PSN sent.
    pub(super) fn peer_acknowledged(&self, q: &mut Queues, seq: u32) {
        if answers_sent(q, seq) {
            q.timer.answered();
            self.apply_ack(q, seq);
        }
    }

    /// Every send up to and including `seq` was delivered: complete them (in post order).
    pub(super) fn apply_ack(&self, q: &mut Queues, seq: u32) {
        if wire::psn_before(q.acked_psn, seq) {
            q.acked_psn = seq;
            q.timer.progressed();
        }
        if q.sq.is_empty() {
            // Nothing to release (a SEND that completed at post time): no CQ batch to open.
            self.check_drained(q);
            return;
        }
        for e in q.sq.iter_mut() {
            if wire::psn_before(seq, e.seq) {
                break;
            }
            if e.response_into.is_none() {
                e.outcome.get_or_insert(WcStatus::Success);
            }
        }
        self.release_send_completions(q);
    }

    /// The answer to one of this QP's READs or atomics. One of another length than the request
    /// (or of the other kind) is a bad response (IBV_WC_BAD_RESP_ERR, the QP goes to ERR) and
    /// nothing of it lands: UCX aborts the process when a rendezvous message is received into a
    /// buffer smaller than the sender claims, and a short one would leave part of the buffer
    /// unwritten under a successful completion.
    pub fn on_response(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        h: Header,
        payload: AmPayload<'_>,
    ) -> bool {
        self.locked_then_send(locked, |q| {
            if !from_peer(q, &h) {
                return false;
            }
            let Some(e) =
                q.sq.iter_mut()
                    .find(|e| e.seq == h.seq && e.outcome.is_none())
            else {
                return false;
            };
            q.timer.answered();
            let Some(spans) = e.response_into.clone() else {
                return false;
            };
            let room = crate::ucp::total_len(&spans);
            let len = match &payload {
                AmPayload::Transient(bytes) => bytes.len(),
                AmPayload::Persistent(data) | AmPayload::Rendezvous(data) => data.len(),
            };
            let kind = if e.opcode == WcOpcode::RdmaRead {
                wire::Op::ReadResponse
            } else {
                wire::Op::AtomicResponse
            };
            if len != room || h.op != kind {
                tracing::debug!(
                    "qp {:#x}: bad response {:?} of {len} bytes to psn {:#x} ({room} asked)",
                    self.qp_num,
                    h.op,
                    h.seq
                );
                // Nothing is kept: UCX releases the payload (a rendezvous one unfetched).
                self.fail_entry(q, h.seq, WcStatus::BadRespErr);
                return false;
            }
            match payload {
                AmPayload::Transient(bytes) => crate::ucp::scatter(&spans, bytes),
                AmPayload::Persistent(data) => crate::ucp::scatter(&spans, data.bytes()),
                AmPayload::Rendezvous(data) => {
                    e.pulling = true;
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

    pub(super) fn on_response_landed(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        seq: u32,
        result: Result<usize, crate::ucp::Error>,
    ) {
        self.locked_then_send(locked, |q| {
            let err = q.state == QpState::Err;
            if let Some(e) =
                q.sq.iter_mut()
                    .find(|e| e.seq == seq && e.outcome.is_none() && e.pulling)
            {
                e.pulling = false;
                // Landed after the QP went to ERR: the flush completion it was holding back.
                e.outcome = Some(match result {
                    _ if err => WcStatus::WrFlushErr,
                    Ok(_) => WcStatus::Success,
                    Err(_) => WcStatus::LocQpOpErr,
                });
            }
            self.release_send_completions(q);
        })
    }
}

/// `h` comes from the QP this one is connected to: its LID and QP number.
pub(super) fn from_peer(q: &Queues, h: &Header) -> bool {
    q.peer
        .as_ref()
        .is_some_and(|p| p.qpn == h.src_qpn && p.lid == h.src_lid)
}

/// `seq` names what this QP sent and was not acknowledged before it (or the newest PSN
/// acknowledged, which a re-ACK repeats): [`acked_psn`, last sent].
fn answers_sent(q: &Queues, seq: u32) -> bool {
    let last_sent = wire::psn_prev(q.next_send_seq);
    !wire::psn_before(seq, q.acked_psn) && !wire::psn_before(last_sent, seq)
}
