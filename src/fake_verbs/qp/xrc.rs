//! XRC target QPs (`IBV_QPT_XRC_RECV`, the kernel's XRC_TGT): an RC responder without
//! queues or a PD of its own. Every request names an XRC SRQ (the requester's `remote_srqn`,
//! IBA's XRCETH; on ugdr's wire see `engine::wire`), which must be one of this QP's domain
//! (see `fake_verbs::xrc`); else the request is invalid: NAKed (the sender's WR completes
//! with IBV_WC_REM_INV_REQ_ERR), this QP goes to ERR with IBV_EVENT_QP_REQ_ERR.
//!
//! - A SEND (or WRITE_WITH_IMM) takes its receive WR from that SRQ; the WR's buffers are
//!   checked against the SRQ's PD, and the completion goes to the SRQ's CQ with `qp_num` this
//!   QP and `src_qp` the sending XRC_SEND QP (as mlx5 reports them).
//! - An RDMA WRITE, READ or atomic is executed as RC's responder executes it (the same
//!   checks: this QP's access flags, then the rkey over the range, else REM_ACCESS_ERR at the
//!   requester and this QP to ERR with IBV_EVENT_QP_ACCESS_ERR), with the rkey looked up in
//!   **the PD of the named XRC SRQ**: the target QP has no PD that memory is registered in,
//!   and the SRQ is what its owner made in a PD. This is what rxe's XRC responder does as
//!   posted to linux-rdma (Bob Pearson's series, "RDMA/rxe: Extend rxe_resp.c to support xrc
//!   qps", 2022: `pd = XRC_TGT ? pkt->srq->pd : qp->pd` in check_rkey and execute); mlx5_ib
//!   likewise gives an XRC_TGT QP only a placeholder PD, and the XRC SRQ its creator's. (The
//!   RDMA Aware Networks manual does not say.) A type 2 memory window never matches here
//!   (none is bound through a target QP), as rxe's series refuses it.
//!
//! Remote invalidation (SEND_WITH_INV) is not carried over XRC (refused at post; a target
//! refuses a request that asks for it). A target QP lives as long as one of its handles (the
//! creator's, `ibv_open_qp`'s) does, as the kernel's shared QPs. XRC requests take the message
//! path, never the same-host direct path (`engine::direct` publishes a QP's one PD; a target's
//! PD is the named SRQ's, per request).

use super::super::context::EVENT_QP_REQ_ERR;
use super::super::pd::ProtectionDomain;
use super::super::qp_state::{QpState, QpType};
use super::super::srq::SharedReceiveQueue;
use super::super::work::{RecvRequest, WorkCompletion};
use super::super::xrc::{XrcDomain, XrcdHandle};
use super::queues::Queues;
use super::{QpCaps, QueuePair};
use crate::engine::wire::{Header, Nak, Op};
use std::sync::atomic::{AtomicU32, AtomicUsize};
use std::sync::{Arc, Mutex};

/// What an XRC target QP has beyond a QP: its domain, and the handles (C objects) that
/// refer to it, each with the xrcd handle it was made or opened through.
pub struct XrcTarget {
    pub domain: Arc<XrcDomain>,
    handles: Mutex<Vec<(usize, Arc<XrcdHandle>)>>,
}

impl QueuePair {
    /// `ibv_create_qp_ex` with `IBV_QPT_XRC_RECV` on `xrcd`.
    pub fn new_xrc_target(qp_num: u32, xrcd: &Arc<XrcdHandle>, local_lid: u16) -> Arc<QueuePair> {
        let d = &xrcd.domain;
        d.target_pd.adopt_child();
        d.target_cq.adopt_user();
        d.target_cq.adopt_user();
        Arc::new(QueuePair {
            qp_num,
            qp_type: QpType::XrcRecv,
            pd: Arc::clone(&d.target_pd),
            send_cq: Arc::clone(&d.target_cq),
            recv_cq: Arc::clone(&d.target_cq),
            srq: None,
            sq_sig_all: false,
            caps: QpCaps::default(),
            local_lid,
            handle: AtomicUsize::new(0),
            queues: Mutex::new(Queues::new()),
            ucx_io: AtomicU32::new(0),
            receive_ring: std::sync::OnceLock::new(),
            on_transport_error: Mutex::new(None),
            xrc_target: Some(XrcTarget {
                domain: Arc::clone(d),
                handles: Mutex::new(Vec::new()),
            }),
        })
    }

    /// An XRC target QP's domain.
    pub fn xrc_domain(&self) -> Option<&Arc<XrcDomain>> {
        self.xrc_target.as_ref().map(|t| &t.domain)
    }

    /// A new C handle of this target QP (its creator's, or `ibv_open_qp`'s through `xrcd`);
    /// the first one receives its asynchronous events.
    pub fn add_xrc_handle(&self, handle: usize, xrcd: &Arc<XrcdHandle>) {
        let Some(t) = &self.xrc_target else { return };
        let mut hs = t.handles.lock().unwrap_or_else(|p| p.into_inner());
        xrcd.adopt_user();
        hs.push((handle, Arc::clone(xrcd)));
        if hs.len() == 1 {
            self.set_handle(handle);
        }
    }

    /// Drops a C handle of this target QP; true when it was the last one (the QP itself is
    /// destroyed then). Events go to a remaining handle.
    pub fn remove_xrc_handle(&self, handle: usize) -> bool {
        let Some(t) = &self.xrc_target else {
            return true;
        };
        let mut hs = t.handles.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = hs.iter().position(|(h, _)| *h == handle) {
            hs.remove(i).1.release_user();
        }
        match hs.first() {
            Some((h, _)) => {
                if self.handle() == handle {
                    self.set_handle(*h);
                }
                false
            }
            None => true,
        }
    }

    /// The XRC SRQ a request names, if it is one of this target QP's domain.
    fn named_srq(&self, h: &Header) -> Option<Arc<SharedReceiveQueue>> {
        self.xrc_domain()?.srq(h.xrc_srqn()?)
    }

    /// At an XRC target, the PD remote accesses are checked in: the named XRC SRQ's (None
    /// elsewhere: the QP's own PD).
    pub(super) fn xrc_srq_pd(&self, h: &Header) -> Option<Arc<ProtectionDomain>> {
        self.xrc_target.as_ref()?;
        // A target's own PD has no memory registered in it: with the SRQ gone, nothing passes.
        Some(
            self.named_srq(h)
                .map_or_else(|| Arc::clone(&self.pd), |srq| Arc::clone(&srq.pd)),
        )
    }

    /// Where a request's receive WR comes from: the SRQ it names (XRC target), else the
    /// QP's SRQ or its own queue.
    pub(super) fn take_receive_for(&self, q: &mut Queues, h: &Header) -> Option<RecvRequest> {
        if self.xrc_target.is_none() {
            return self.take_receive(q);
        }
        self.named_srq(h)?.take()
    }

    /// No receive WR for `h` yet: have the SRQ it would come from deliver it when one is
    /// posted.
    pub(super) fn wait_for_receive(self: &Arc<Self>, h: &Header) {
        match (&self.srq, &self.xrc_target) {
            (Some(srq), _) => srq.note_starving(self),
            (None, Some(_)) => {
                if let Some(srq) = self.named_srq(h) {
                    srq.note_starving(self);
                }
            }
            (None, None) => {}
        }
    }

    /// The PD a receive WR's buffers are checked against: the XRC SRQ's, else the QP's.
    pub(super) fn receive_pd(&self, h: &Header) -> Arc<ProtectionDomain> {
        self.xrc_srq_pd(h).unwrap_or_else(|| Arc::clone(&self.pd))
    }

    /// Puts a receive completion on its CQ: the XRC SRQ's for a target QP (nowhere when the
    /// SRQ is gone), else the QP's receive CQ.
    pub(super) fn push_receive(&self, wc: WorkCompletion, solicited: bool) {
        if self.xrc_target.is_none() {
            self.recv_cq.push(wc, solicited);
            return;
        }
        let srq = self
            .xrc_domain()
            .and_then(|d| d.srq(wc.xrc_srqn))
            .and_then(|s| s.xrc().map(|x| Arc::clone(&x.cq)));
        match srq {
            Some(cq) => cq.push(wc, solicited),
            None => tracing::debug!(
                "qp {:#x}: completion of wr_id {} dropped: XRC SRQ {:#x} is gone",
                self.qp_num,
                wc.wr_id,
                wc.xrc_srqn
            ),
        }
    }

    /// Checks an in-order request to an XRC target QP: a SEND (without invalidation), WRITE,
    /// READ or atomic naming an SRQ of its domain. Anything else is NAKed as an invalid
    /// request and the QP goes to ERR (IBA 9.9.3.1.2, responder class C:
    /// IBV_EVENT_QP_REQ_ERR).
    pub(super) fn xrc_request_valid(&self, q: &mut Queues, h: &Header) -> bool {
        let carried = match h.op {
            Op::Send => h.flags & crate::engine::wire::FLAG_INV == 0,
            Op::Write | Op::ReadRequest | Op::Atomic => true,
            Op::Ack | Op::ReadResponse | Op::AtomicResponse => false,
        };
        if carried && self.named_srq(h).is_some() {
            return true;
        }
        tracing::debug!(
            "xrc qp {:#x}: {:?} (flags {:#x}) names XRC SRQ {:?}, not one of its domain",
            self.qp_num,
            h.op,
            h.flags,
            h.xrc_srqn()
        );
        self.release_landed(q);
        self.send_ack(q, h.seq, Some(Nak::InvalidRequest));
        self.raise(EVENT_QP_REQ_ERR);
        q.state = QpState::Err;
        self.flush(q);
        false
    }
}
