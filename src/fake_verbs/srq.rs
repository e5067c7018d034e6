//! Shared receive queues: receive WRs that any QP attached to the SRQ consumes.

use super::context::{DeviceContext, EVENT_SRQ_LIMIT_REACHED};
use super::pd::ProtectionDomain;
use super::qp::QueuePair;
use super::work::RecvRequest;
use super::xrc::{self, XrcSrq};
use super::{VerbsError, device};
use crate::ucp::LockedWorker;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};

struct Queue {
    wrs: VecDeque<RecvRequest>,
    max_wr: u32,
    /// Armed limit (0: disarmed): when fewer WRs remain, SRQ_LIMIT_REACHED fires once.
    limit: u32,
}

pub struct SharedReceiveQueue {
    pub pd: Arc<ProtectionDomain>,
    pub context: Arc<DeviceContext>,
    pub max_sge: u32,
    handle: AtomicUsize,
    queue: Mutex<Queue>,
    users: AtomicUsize,
    /// QPs holding messages until a WR is posted here.
    starving: Mutex<Vec<Weak<QueuePair>>>,
    /// Set once for an XRC SRQ (`IBV_SRQT_XRC`): its number, domain and CQ.
    xrc: OnceLock<XrcSrq>,
}

impl SharedReceiveQueue {
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        max_wr: u32,
        max_sge: u32,
        limit: u32,
    ) -> Result<Arc<SharedReceiveQueue>, VerbsError> {
        if max_wr == 0
            || max_wr > device::MAX_QP_WR as u32
            || max_sge == 0
            || max_sge > device::MAX_SGE as u32
        {
            return Err(VerbsError::Invalid("srq max_wr/max_sge out of range"));
        }
        if limit > max_wr {
            return Err(VerbsError::Invalid("srq_limit above max_wr"));
        }
        pd.adopt_child();
        Ok(Arc::new(SharedReceiveQueue {
            pd: Arc::clone(pd),
            context: Arc::clone(&pd.context),
            max_sge,
            handle: AtomicUsize::new(0),
            queue: Mutex::new(Queue {
                wrs: VecDeque::new(),
                max_wr,
                limit,
            }),
            users: AtomicUsize::new(0),
            starving: Mutex::new(Vec::new()),
            xrc: OnceLock::new(),
        }))
    }

    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes this SRQ an XRC SRQ (see [`xrc::attach_srq`]).
    pub(super) fn make_xrc(&self, x: XrcSrq) {
        let _ = self.xrc.set(x);
    }

    /// Its XRC number, domain and CQ, for an XRC SRQ.
    pub fn xrc(&self) -> Option<&XrcSrq> {
        self.xrc.get()
    }

    pub fn set_handle(&self, h: usize) {
        self.handle.store(h, Ordering::Release);
    }

    /// `ibv_post_srq_recv` for one WR.
    pub fn post(&self, req: RecvRequest) -> Result<(), VerbsError> {
        let mut q = self.queue();
        if q.wrs.len() >= q.max_wr as usize {
            return Err(VerbsError::QueueFull);
        }
        if req.sges.len() > self.max_sge as usize {
            return Err(VerbsError::Invalid("num_sge above the SRQ's max_sge"));
        }
        q.wrs.push_back(req);
        Ok(())
    }

    /// Records that `qp` waits for a WR.
    pub fn note_starving(&self, qp: &Arc<QueuePair>) {
        let mut s = self.starving.lock().unwrap_or_else(|p| p.into_inner());
        let me = Arc::downgrade(qp);
        if !s.iter().any(|w| w.ptr_eq(&me)) {
            s.push(me);
        }
    }

    /// Whether some QP waits for a WR posted here.
    pub fn has_starving(&self) -> bool {
        !self
            .starving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_empty()
    }

    /// Lets the QPs that waited for WRs take them now (in the order they started waiting).
    pub fn deliver_to_starving(&self, locked: &LockedWorker<'_>) {
        let waiting = std::mem::take(&mut *self.starving.lock().unwrap_or_else(|p| p.into_inner()));
        for qp in waiting.iter().filter_map(Weak::upgrade) {
            qp.deliver_pending(locked);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.queue().wrs.is_empty()
    }

    /// Takes the oldest WR for a QP; raises SRQ_LIMIT_REACHED when the armed limit is crossed.
    pub fn take(&self) -> Option<RecvRequest> {
        let mut q = self.queue();
        let wr = q.wrs.pop_front()?;
        if q.limit != 0 && (q.wrs.len() as u32) < q.limit {
            q.limit = 0;
            drop(q);
            self.context
                .raise(EVENT_SRQ_LIMIT_REACHED, self.handle.load(Ordering::Acquire));
        }
        Some(wr)
    }

    /// `ibv_modify_srq`: a new max_wr (never below what is queued) and/or an armed limit.
    pub fn modify(&self, max_wr: Option<u32>, limit: Option<u32>) -> Result<(), VerbsError> {
        let mut q = self.queue();
        let new_max = max_wr.unwrap_or(q.max_wr);
        if new_max == 0 || new_max > device::MAX_QP_WR as u32 || (new_max as usize) < q.wrs.len() {
            return Err(VerbsError::Invalid("srq max_wr"));
        }
        if let Some(l) = limit
            && l > new_max
        {
            return Err(VerbsError::Invalid("srq_limit above max_wr"));
        }
        q.max_wr = new_max;
        if let Some(l) = limit {
            q.limit = l;
        }
        Ok(())
    }

    /// (max_wr, max_sge, srq_limit) for `ibv_query_srq`.
    pub fn attributes(&self) -> (u32, u32, u32) {
        let q = self.queue();
        (q.max_wr, self.max_sge, q.limit)
    }

    pub fn adopt_user(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_user(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_destroy_srq` fails with EBUSY while QPs use the SRQ.
    pub fn destroy(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("srq still used by queue pairs"));
        }
        if let Some(x) = self.xrc.get() {
            xrc::detach_srq(x);
        }
        self.pd.release_child();
        Ok(())
    }
}
