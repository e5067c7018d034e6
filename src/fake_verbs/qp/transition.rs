//! The state machine applied to a queue pair (`ibv_modify_qp`; the table itself is
//! [`crate::fake_verbs::qp_state`]): what entering each state does to the queues, and the
//! events a state change raises (COMM_EST, SQ_DRAINED, QP_FATAL, LAST_WQE_REACHED).

use super::super::context::{
    EVENT_COMM_EST, EVENT_QP_FATAL, EVENT_QP_LAST_WQE_REACHED, EVENT_SQ_DRAINED,
};
use super::super::qp_state::{QpState, QpType, TransitionError, check_transition};
use super::super::work::WcStatus;
use super::super::{VerbsError, device};
use super::attributes::{apply_attrs, check_values};
use super::queues::{Queues, release_kept};
use super::{ModifyRequest, Peer, QpAttributes, QueuePair};
use crate::engine::Engine;
use crate::engine::wire;
use crate::ucp::LockedWorker;
use std::sync::Arc;

impl QueuePair {
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

    pub(super) fn modify_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        req: &ModifyRequest,
        peer: Option<Peer>,
    ) -> Result<QpState, VerbsError> {
        let ignored = self.qp_type.ignored_modify_attrs();
        let filtered = ModifyRequest {
            mask: req.mask.difference(ignored),
            ..*req
        };
        let req = &filtered;
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
            && !matches!(self.qp_type, QpType::Ud)
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
        self.publish_for_direct(q);
        Ok(q.state)
    }

    /// Tells same-host peers (the direct path) whether, and by whom, this QP's memory may be
    /// reached now: an RC QP with a peer, in a state whose responder executes requests.
    pub(super) fn publish_for_direct(self: &Arc<Self>, q: &mut Queues) {
        let Some(memory) = Engine::local_memory() else {
            return;
        };
        match (&q.peer, q.state) {
            (Some(peer), QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe)
                if self.qp_type == QpType::Rc =>
            {
                let peer = (peer.lid, peer.qpn);
                let ring = self.receive_ring_to_publish(q).map(Arc::clone);
                memory.publish_qp(
                    self.qp_num,
                    self.pd.id,
                    q.attrs.access_flags,
                    peer,
                    ring.as_deref(),
                );
            }
            _ => memory.withdraw_qp(self.qp_num),
        }
    }

    pub(super) fn enter(self: &Arc<Self>, q: &mut Queues, next: QpState, peer: Option<Peer>) {
        tracing::debug!("qp {:#x}: {:?} -> {:?}", self.qp_num, q.state, next);
        match next {
            QpState::Reset => {
                release_kept(q);
                q.sq.clear();
                q.held.clear();
                q.rq.clear();
                self.reset_receive_ring(q);
                self.send_cq.discard_qp(self.qp_num);
                self.recv_cq.discard_qp(self.qp_num);
                q.peer = None;
                q.next_send_seq = 0;
                q.acked_psn = wire::PSN_MASK;
                q.timer.restart();
                q.expected_seq = 0;
                q.last_delivered = wire::PSN_MASK;
                q.dropped = 0;
                q.ack_owed = None;
                q.prompt_ack = None;
                q.acks_unsent = 0;
                q.comm_established = false;
                q.sqd_notify = false;
                q.next_receive = 0;
                q.last_wqe_raised = false;
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
                // Nothing arrived before (a QP in INIT keeps nothing): the sequence starts at
                // the PSN the requester numbers from.
                q.state = QpState::Rtr;
                q.peer = peer;
                q.expected_seq = q.attrs.rq_psn & wire::PSN_MASK;
                self.number_placed_from(q.expected_seq);
                q.last_delivered = wire::psn_prev(q.expected_seq);
            }
            QpState::Rts => {
                if q.state == QpState::Rtr {
                    q.next_send_seq = q.attrs.sq_psn & wire::PSN_MASK;
                    q.acked_psn = wire::psn_prev(q.next_send_seq);
                    q.timer.restart();
                }
                q.state = QpState::Rts;
                q.sqd_notify = false;
                // What was posted in SQD goes now.
                self.release_held(q);
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
    pub(super) fn established(&self, q: &mut Queues) {
        if q.state == QpState::Rtr && !q.comm_established {
            q.comm_established = true;
            self.raise(EVENT_COMM_EST);
        }
    }

    /// In SQD with notification asked for: IBV_EVENT_SQ_DRAINED once no WR the send queue
    /// began is outstanding (those it holds, posted in SQD or behind a fence, it has not begun).
    pub(super) fn check_drained(&self, q: &mut Queues) {
        // Called on every completion: the send queue is looked through only in SQD.
        if !q.sqd_notify || q.state != QpState::Sqd {
            return;
        }
        if q.begun().all(|e| e.outcome.is_some()) {
            q.sqd_notify = false;
            self.raise(EVENT_SQ_DRAINED);
        }
    }

    /// IBA 11.6.3: a QP on an SRQ that went to ERR will take no more of its WRs. Raised once
    /// its flushed receive completions are on the CQ, once per entry into ERR (rdmavt and rxe
    /// raise it on the transition only; a later modify to ERR raises nothing).
    pub(super) fn last_wqe_reached(&self, q: &mut Queues) {
        if self.srq.is_some()
            && q.state == QpState::Err
            && q.landing.is_empty()
            && !q.last_wqe_raised
        {
            q.last_wqe_raised = true;
            self.raise(EVENT_QP_LAST_WQE_REACHED);
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
            if let Some(e) = q.sq.iter_mut().find(|e| e.outcome.is_none() && !e.pulling) {
                e.outcome = Some(status);
            }
            // In ERR before its completion is released, as `fail_entry`.
            q.state = QpState::Err;
            self.release_send_completions(q);
            self.flush(q);
        })
    }
}
