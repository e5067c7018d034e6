//! The receive side of the same-host SEND path (docs/design.md, "Same-host SEND path"): an
//! RC QP whose connected peer lives on this host publishes its receive queue as a ring
//! (`engine::direct::OwnReceiveRing`); the peer's requester places a SEND in the next receive
//! WR (a small one in its ring entry, a larger one written in place into its buffer; a
//! WRITE_WITH_IMM's bytes at its target, the WR taking its completion), and this QP completes
//! those WRs, in order, when its receive CQ is polled — no message, no progress call, no
//! ACK. A message that arrives
//! through UCX takes its receive WR through the same cursor, after the placed ones before it
//! completed.

use super::super::cq::{CompletionQueue, PlacedArrivals, Poller};
use super::super::mr::{
    in_place_target, land_in_one_pinned_sge, local_spans_cached, receive_sges_pinned,
};
use super::super::qp_state::{QpState, QpType};
use super::super::work::{RecvRequest, WcStatus};
use super::QueuePair;
use super::queues::Queues;
use crate::engine::Engine;
use crate::engine::direct::{self, OwnReceiveRing, PlacedBody, SEND_MAX};
use crate::engine::wire::{self, Header, Op};
use std::sync::{Arc, Mutex, Weak};

/// The queue pairs of this process that have a receive ring (for [`fence_placed_receives`]).
static WITH_RINGS: Mutex<Vec<Weak<QueuePair>>> = Mutex::new(Vec::new());

/// An MR is about to be deregistered or re-registered: receive WRs naming `lkey` take no
/// placed SEND from now on (a SEND for one goes through UCX, whose responder finds the key
/// gone: LOC_PROT_ERR here, REM_OP_ERR at the sender, as a HCA), and those a peer already
/// placed a SEND in complete now, while their memory is still registered (a HCA wrote them
/// before the deregistration). Called before the key goes.
pub fn fence_placed_receives(lkey: u32) {
    let qps: Vec<Arc<QueuePair>> = WITH_RINGS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter_map(Weak::upgrade)
        .collect();
    for qp in qps {
        qp.fence_receives_naming(lkey);
    }
}

impl QueuePair {
    /// Whether this QP may offer its receive queue to a same-host peer: an RC QP with its own
    /// receive queue whose CQs have no completion channel (a placed SEND raises no event:
    /// the CQs' owner must be one that polls). Both CQs: a placed SEND also carries the ACK
    /// of this QP's own sends, which an application waiting for a send completion must get
    /// by polling its send CQ, as a HCA's ACK needs no poll of the receive CQ.
    fn may_offer_receive_ring(&self) -> bool {
        self.qp_type == QpType::Rc
            && self.srq.is_none()
            && self.xrc_target.is_none()
            && self.recv_cq.channel.is_none()
            && self.send_cq.channel.is_none()
            && direct::enabled()
    }

    /// The receive ring to publish with this QP (made the first time its peer is on this host:
    /// the WRs already posted go in first), or None.
    pub(super) fn receive_ring_to_publish(
        self: &Arc<Self>,
        q: &mut Queues,
    ) -> Option<&Arc<OwnReceiveRing>> {
        if let Some(ring) = self.receive_ring.get() {
            return Some(ring);
        }
        // Another process on this host (this process's own QPs send each other messages).
        let same_host = q
            .peer
            .as_ref()
            .and_then(|p| p.memory.as_ref())
            .is_some_and(|m| !m.is_this_process());
        if !same_host || !self.may_offer_receive_ring() {
            return None;
        }
        let ring = match OwnReceiveRing::create(self.caps.max_recv_wr) {
            Ok(r) => Arc::new(r),
            Err(e) => {
                tracing::debug!("qp {:#x}: no receive ring: {e}", self.qp_num);
                return None;
            }
        };
        let ring = self.receive_ring.get_or_init(|| ring);
        ring.set_expected_psn(wire::psn_add(q.last_delivered, 1));
        let posted: Vec<RecvRequest> = q.rq.iter().cloned().collect();
        for wr in &posted {
            self.offer_receive(ring, q, wr);
        }
        let me: Arc<dyn PlacedArrivals> = Arc::clone(self) as Arc<dyn PlacedArrivals>;
        // Polling either CQ completes what was placed (and applies the ACKs it carries).
        self.recv_cq
            .add_placed_source(Arc::clone(ring), Arc::downgrade(&me));
        if !Arc::ptr_eq(&self.send_cq, &self.recv_cq) {
            self.send_cq
                .add_placed_source(Arc::clone(ring), Arc::downgrade(&me));
        }
        let mut all = WITH_RINGS.lock().unwrap_or_else(|p| p.into_inner());
        all.retain(|w| w.strong_count() > 0);
        all.push(Arc::downgrade(self));
        Some(ring)
    }

    /// Queues a receive WR (checked by the caller): on the receive queue, and in the ring if
    /// the QP has one.
    pub(super) fn queue_receive(&self, q: &mut Queues, req: RecvRequest) {
        if let Some(ring) = self.receive_ring.get() {
            self.offer_receive(ring, q, &req);
        }
        q.rq.push_back(req);
    }

    /// Posts `wr` into the ring: a placed SEND may land in it only if its buffers are valid
    /// pinned memory now (else the SEND goes through UCX, and the responder's checks give the
    /// outcome); one larger than a ring entry only if its one SGE lies in a region published
    /// for the direct path, where the peer writes it in place.
    fn offer_receive(&self, ring: &OwnReceiveRing, q: &mut Queues, wr: &RecvRequest) {
        let direct = receive_sges_pinned(&self.pd, &wr.sges, &mut q.recv_keys);
        let in_place = if direct && wr.room() > SEND_MAX as u64 {
            in_place_target(&self.pd, &wr.sges, &mut q.recv_keys)
        } else {
            None
        };
        ring.post(wr.room(), direct, in_place);
    }

    /// Completes, in order, the receive WRs a peer placed SENDs in. True when one failed
    /// (its buffers went away since it was posted): the QP is then in ERR, to be flushed.
    pub(super) fn complete_placed(&self, q: &mut Queues) -> bool {
        self.complete_placed_to(q, None)
    }

    /// [`QueuePair::complete_placed`], the completions handed to `poller` (an application
    /// polling this QP's receive CQ) while it has room, if nothing waits before them: no
    /// completion in the CQ's queue (one of this QP's receives may be there: all of them are
    /// queued under this QP's lock, held now) and no message of this QP still landing.
    fn complete_placed_to(&self, q: &mut Queues, mut poller: Option<&mut Poller<'_>>) -> bool {
        let Some(ring) = self.receive_ring.get() else {
            return false;
        };
        if poller.is_some() && (self.recv_cq.holds_completions() || !q.landing.is_empty()) {
            poller = None;
        }
        // Every message to this QP and every flush comes through here: look before anything.
        if q.placed_failed || !ring.arrived() {
            return false;
        }
        while poller.as_ref().is_none_or(|p| p.room() > 0)
            && let Some(placed) = ring.take_placed(&mut q.placed_bytes[..])
        {
            let Some(wr) = q.rq.pop_front() else {
                break; // the ring runs ahead of the queue only if the peer broke the protocol
            };
            self.established(q);
            if let Some(ack) = placed.ack
                && matches!(q.state, QpState::Rts | QpState::Sqd | QpState::Sqe)
            {
                // The peer's piggybacked ACK of this QP's own requests, as on a message.
                self.peer_acknowledged(q, ack);
            }
            q.expected_seq = wire::psn_add(placed.psn, 1);
            q.last_delivered = placed.psn;
            let (src_qpn, src_lid) = q.peer.as_ref().map_or((0, 0), |p| (p.qpn, p.lid));
            // A WRITE with immediate data completes as one (RECV_RDMA_WITH_IMM).
            let op = if placed.body == PlacedBody::RdmaWrite {
                Op::Write
            } else {
                Op::Send
            };
            let mut h = Header::new(op, self.qp_num, src_qpn, src_lid, 0);
            if let Some(imm) = placed.imm_data {
                h.flags |= wire::FLAG_IMM;
                h.imm_data = imm;
            }
            let len = placed.byte_len as usize;
            let landed = match placed.body {
                // An RDMA WRITE with immediate data: its bytes went where it named (checked
                // by the peer as a direct WRITE); the WR takes only the completion.
                PlacedBody::RdmaWrite => Ok(()),
                // The peer checked the room it read in the ring; one that wrote more than the
                // WR holds (or more than an entry, or in place into a WR that offered no
                // place) broke the protocol: nothing lands.
                _ if len as u64 > wr.room() => Err(WcStatus::LocLenErr),
                PlacedBody::Entry if len > SEND_MAX => Err(WcStatus::LocLenErr),
                PlacedBody::InPlace if wr.sges.len() != 1 => Err(WcStatus::LocLenErr),
                // Written into the WR's one SGE by the peer, through the region's published
                // slot: while it was registered (deregistration completes placed WRs first).
                PlacedBody::InPlace => Ok(()),
                // Most receives: one SGE of pinned memory.
                PlacedBody::Entry
                    if land_in_one_pinned_sge(
                        &self.pd,
                        &wr.sges,
                        &q.placed_bytes[..len],
                        &mut q.recv_keys,
                    ) =>
                {
                    Ok(())
                }
                PlacedBody::Entry => local_spans_cached(&self.pd, &wr.sges, true, &mut q.recv_keys)
                    .map(|spans| {
                        crate::ucp::scatter(&spans, &q.placed_bytes[..len]);
                    })
                    .ok_or(WcStatus::LocProtErr),
            };
            match landed {
                Ok(()) => {
                    let wc = self.recv_completion(&wr, &h, len);
                    match poller.as_deref_mut() {
                        Some(p) => p.hand(&wc),
                        None => self.flushed_receive_in_order(q, wc),
                    }
                }
                Err(status) => {
                    // Deregistered since it was posted (not by ibv_dereg_mr, which fences):
                    // a local protection error, as the message path's check gives (the
                    // peer's SEND already completed).
                    tracing::debug!(
                        "qp {:#x}: placed receive wr_id {} failed: {status:?}",
                        self.qp_num,
                        wr.wr_id
                    );
                    let wc = self.failed_receive(&wr, &h, status);
                    self.flushed_receive_in_order(q, wc);
                    q.placed_failed = true;
                    q.state = QpState::Err;
                    return true;
                }
            }
        }
        false
    }

    /// The next receive WR for a message that arrived through UCX (own receive queue): the
    /// WRs peers placed SENDs in before it complete first.
    pub(super) fn take_own_receive(&self, q: &mut Queues) -> Option<RecvRequest> {
        if let Some(ring) = self.receive_ring.get() {
            if self.complete_placed(q) {
                self.flush(q);
                return None;
            }
            if q.rq.is_empty() || !ring.take_for_message() {
                return None;
            }
        }
        q.rq.pop_front()
    }

    /// A receive WR leaves the queue unused (flushed): the ring skips it too.
    pub(super) fn skip_offered_receive(&self) {
        if let Some(ring) = self.receive_ring.get() {
            ring.skip();
        }
    }

    /// The QP is reset: once no peer reaches it any more, its ring starts over.
    pub(super) fn reset_receive_ring(&self, q: &mut Queues) {
        if let Some(ring) = self.receive_ring.get() {
            if let Some(memory) = Engine::local_memory() {
                memory.withdraw_qp(self.qp_num);
            }
            ring.reset();
        }
        q.placed_failed = false;
    }

    /// The QP entered RTR: placed SENDs are numbered from its `rq_psn`.
    pub(super) fn number_placed_from(&self, psn: u32) {
        if let Some(ring) = self.receive_ring.get() {
            ring.set_expected_psn(psn);
        }
    }

    /// Every request up to `delivered` took effect (the responder is about to acknowledge
    /// it): a SEND the peer places next must follow it. Called before the completions of those
    /// requests are visible, so that an application that saw the last one (and, say, stops)
    /// finds the peer free to place the next SEND. The peer's placed SEND completes here only
    /// under this QP's lock, after them. Not the next PSN the responder expects: that one
    /// moves on past a message waiting for a receive WR, or failing, and a SEND placed then
    /// would take that message's receive WR, or acknowledge a request that failed.
    pub(super) fn placed_follow(&self, delivered: u32) {
        if let Some(ring) = self.receive_ring.get() {
            ring.set_expected_psn(wire::psn_add(delivered, 1));
        }
    }

    /// Stops taking placed SENDs (`ibv_destroy_qp`).
    pub(super) fn retire_receive_ring(&self) {
        if let Some(ring) = self.receive_ring.get() {
            self.recv_cq.remove_placed_source(ring);
            self.send_cq.remove_placed_source(ring);
            WITH_RINGS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .retain(|w| w.strong_count() > 0 && !std::ptr::eq(w.as_ptr(), self));
        }
    }

    /// [`fence_placed_receives`] for this QP: its peer is fenced off (the QP's slot withdrawn,
    /// so no placement is under way), what it placed completes, the posted WRs naming `lkey`
    /// are refused to it, and the QP is published again.
    fn fence_receives_naming(self: &Arc<Self>, lkey: u32) {
        let Some(ring) = self.receive_ring.get() else {
            return;
        };
        let failed = {
            let mut q = self.queues();
            if let Some(memory) = Engine::local_memory() {
                memory.withdraw_qp(self.qp_num);
            }
            let failed = self.complete_placed(&mut q);
            let first = ring.collected();
            for (k, wr) in q.rq.iter().enumerate() {
                if wr.sges.iter().any(|s| s.lkey == lkey && s.length > 0) {
                    ring.refuse(first + k as u64);
                }
            }
            if !failed {
                self.publish_for_direct(&mut q);
            }
            failed
        };
        if failed {
            self.flush_after_placed_failure();
        }
    }

    /// A placed receive failed (the QP is in ERR): flushes the rest, with the worker (the
    /// flush releases kept messages to UCX).
    fn flush_after_placed_failure(self: &Arc<Self>) {
        if let Some(engine) = Engine::running() {
            let locked = engine.worker.lock();
            self.locked_then_send(&locked, |q| self.flush(q));
        }
    }
}

impl PlacedArrivals for QueuePair {
    fn complete_placed_for(
        self: Arc<Self>,
        cq: &CompletionQueue,
        mut poller: Option<&mut Poller<'_>>,
    ) {
        if !std::ptr::eq(Arc::as_ptr(&self.recv_cq), cq) {
            // Polled through its send CQ: the receives complete on the other one.
            poller = None;
        }
        let failed = {
            let mut q = self.queues();
            self.complete_placed_to(&mut q, poller)
        };
        if failed {
            self.flush_after_placed_failure();
        }
    }
}
