//! XRC target QPs (`IBV_QPT_XRC_RECV`, the kernel's XRC_TGT): an RC responder without
//! queues of its own. Each SEND names an XRC SRQ (the requester puts `remote_srqn` in the
//! header's `rkey`, unused by a SEND); the receive WR comes from that SRQ, its buffers are
//! checked against the SRQ's PD, and the completion goes to the SRQ's CQ with `qp_num` this
//! QP and `src_qp` the sending XRC_SEND QP (as mlx5 reports them). An SRQ number that is not
//! one of this QP's domain (see `fake_verbs::xrc`) is an invalid request: NAKed (the sender's
//! WR completes with IBV_WC_REM_INV_REQ_ERR), this QP goes to ERR with
//! IBV_EVENT_QP_REQ_ERR. ugdr carries SEND and SEND_WITH_IMM over XRC (RDMA and atomics,
//! which the XRC SRQ's PD would authorise, are refused at post). A target QP lives as long as
//! one of its handles (the creator's, `ibv_open_qp`'s) does, as the kernel's shared QPs.

use super::super::context::EVENT_QP_REQ_ERR;
use super::super::pd::ProtectionDomain;
use super::super::qp_state::{QpState, QpType};
use super::super::srq::SharedReceiveQueue;
use super::super::work::{RecvRequest, WorkCompletion};
use super::super::xrc::{XrcDomain, XrcdHandle};
use super::queues::Queues;
use super::{QpCaps, QueuePair};
use crate::engine::wire::{Header, Nak, Op};
use std::sync::atomic::AtomicUsize;
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
        self.xrc_domain()?.srq(h.rkey)
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
        match self.named_srq(h) {
            Some(srq) if self.xrc_target.is_some() => Arc::clone(&srq.pd),
            _ => Arc::clone(&self.pd),
        }
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

    /// Checks an in-order request to an XRC target QP: a SEND naming an SRQ of its domain.
    /// Anything else is NAKed as an invalid request and the QP goes to ERR (IBA 9.9.3.1.2,
    /// responder class C: IBV_EVENT_QP_REQ_ERR).
    pub(super) fn xrc_request_valid(&self, q: &mut Queues, h: &Header) -> bool {
        // The header's rkey names the SRQ: no remote invalidation through an XRC target.
        if h.op == Op::Send
            && h.flags & crate::engine::wire::FLAG_INV == 0
            && self.named_srq(h).is_some()
        {
            return true;
        }
        tracing::debug!(
            "xrc qp {:#x}: {:?} names XRC SRQ {:#x}, not one of its domain",
            self.qp_num,
            h.op,
            h.rkey
        );
        self.release_landed(q);
        self.send_ack(q, h.seq, Some(Nak::InvalidRequest));
        self.raise(EVENT_QP_REQ_ERR);
        q.state = QpState::Err;
        self.flush(q);
        false
    }
}
