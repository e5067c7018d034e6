//! Memory-window work of a queue pair (rxe's `rxe_do_local_ops` and the responder's
//! `invalidate_rkey`): BIND_MW and LOCAL_INV touch only this process's windows, so the
//! requester executes them when they are posted (after every WR posted before them was sent)
//! and they complete in post order behind those WRs; a failed one completes with
//! `IBV_WC_MW_BIND_ERR` / `IBV_WC_LOC_QP_OP_ERR` and the QP goes to ERR. A SEND_WITH_INV
//! invalidates the responder's window before its receive completes (`IBV_WC_WITH_INV`,
//! `invalidated_rkey`); one naming no bound type 2 window completes the receive with
//! `IBV_WC_REM_INV_REQ_ERR`, NAKs the sender (`IBV_WC_REM_INV_REQ_ERR` there too) and moves
//! the responder to ERR (class J).

use super::super::VerbsError;
use super::super::mw;
use super::super::work::{RecvRequest, SendOpcode, SendRequest, WcStatus};
use super::QueuePair;
use super::queues::{DataMessage, Queues, SendEntry};
use crate::engine::wire::{self, Header, Nak};

impl QueuePair {
    /// Posts a BIND_MW or LOCAL_INV (the QP is in RTS or SQD, the queue has room). Post-time
    /// errors as rxe's: scatter/gather elements or inline data on them, a bind without its
    /// window (EINVAL).
    pub(super) fn post_local_operation(
        &self,
        q: &mut Queues,
        req: &SendRequest,
    ) -> Result<Option<DataMessage>, VerbsError> {
        if !req.sges.is_empty() || req.inline_data.is_some() {
            return Err(VerbsError::Invalid(
                "BIND_MW and LOCAL_INV carry no scatter/gather elements",
            ));
        }
        let outcome = match (req.opcode, &req.bind) {
            (SendOpcode::BindMw, Some(bind)) => bind
                .window
                .bind(&self.pd, self.qp_num, bind)
                .map_err(|e| (WcStatus::MwBindErr, e)),
            (SendOpcode::LocalInv, None) => {
                mw::invalidate(&self.pd, None, req.rkey).map_err(|e| (WcStatus::LocQpOpErr, e))
            }
            _ => return Err(VerbsError::Invalid("BIND_MW without a memory window")),
        };
        let status = match outcome {
            Ok(()) => WcStatus::Success,
            Err((status, e)) => {
                tracing::debug!(
                    "qp {:#x}: wr_id {} ({:?}) failed: {e}",
                    self.qp_num,
                    req.wr_id,
                    req.opcode
                );
                status
            }
        };
        q.sq.push_back(SendEntry {
            wr_id: req.wr_id,
            opcode: req.opcode.completion_opcode(),
            signaled: req.signaled || self.sq_sig_all,
            // Sorts with the last message sent: ACKs and NAKs never name it.
            seq: wire::psn_prev(q.next_send_seq),
            byte_len: 0,
            outcome: Some(status),
            response_into: None,
            pulling: false,
            resend: None,
            in_ucx: 0,
        });
        if status == WcStatus::Success {
            self.release_send_completions(q);
        } else {
            q.state = super::QpState::Err;
            self.flush(q);
        }
        Ok(None)
    }

    /// A SEND that asks to invalidate `h.rkey` reached its receive WR `wr`: invalidates the
    /// window (true; also for a SEND without [`wire::FLAG_INV`]). False when it cannot: `wr`
    /// completed with `IBV_WC_REM_INV_REQ_ERR`, the sender NAKed, the QP in ERR.
    pub(super) fn invalidate_for_send(&self, q: &mut Queues, wr: &RecvRequest, h: &Header) -> bool {
        if h.flags & wire::FLAG_INV == 0 {
            return true;
        }
        let Err(e) = mw::invalidate(&self.pd, Some(self.qp_num), h.rkey) else {
            return true;
        };
        tracing::debug!(
            "qp {:#x}: SEND_WITH_INV of rkey {:#x} from qp {:#x}: {e}",
            self.qp_num,
            h.rkey,
            h.src_qpn
        );
        let mut wc = self.recv_completion(wr, h, 0);
        wc.status = WcStatus::RemInvReqErr;
        wc.wc_flags = 0;
        wc.imm_data = 0;
        self.release_landed(q);
        self.recv_cq.push(wc, true);
        self.send_ack(q, h.seq, Some(Nak::InvalidRequest));
        q.state = super::QpState::Err;
        self.flush(q);
        false
    }
}
