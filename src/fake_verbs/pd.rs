//! Protection domains, thread domains and parent domains.
//!
//! A parent domain (`ibv_alloc_parent_domain`) is interchangeable with the PD it was made
//! from: objects created on it belong to that PD (same [`ProtectionDomain`], so keys and
//! address handles of either work with QPs of either). It adds an optional thread domain and
//! the application's allocator (kept at the C boundary), and counts the QPs and CQs created
//! through it, so it cannot be deallocated under them.

use super::VerbsError;
use super::context::DeviceContext;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

pub struct ProtectionDomain {
    pub context: Arc<DeviceContext>,
    /// Unique in the process: names the PD in what same-host peers see (the direct path).
    pub id: u32,
    children: AtomicUsize,
}

static NEXT_ID: AtomicU32 = AtomicU32::new(1);

impl ProtectionDomain {
    pub fn new(context: Arc<DeviceContext>) -> Arc<ProtectionDomain> {
        context.adopt_child();
        Arc::new(ProtectionDomain {
            context,
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            children: AtomicUsize::new(0),
        })
    }

    pub fn adopt_child(&self) {
        self.children.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_child(&self) {
        self.children.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_dealloc_pd` fails with EBUSY while MRs, QPs, SRQs, AHs or parent domains still
    /// use the PD.
    pub fn check_deallocatable(&self) -> Result<(), VerbsError> {
        if self.children.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy(
                "protection domain still has MRs, QPs, SRQs, AHs or parent domains",
            ));
        }
        Ok(())
    }
}

impl Drop for ProtectionDomain {
    fn drop(&mut self) {
        self.context.release_child();
    }
}

/// A thread domain (`ibv_alloc_td`): a promise by the application that objects created
/// through it are used by one thread at a time. ugdr's objects lock internally either way,
/// so the promise changes nothing but lifetime rules.
pub struct ThreadDomain {
    pub context: Arc<DeviceContext>,
    /// Parent domains using it (`ibv_dealloc_td` fails with EBUSY while any remain).
    users: AtomicUsize,
}

impl ThreadDomain {
    pub fn new(context: &Arc<DeviceContext>) -> Arc<ThreadDomain> {
        context.adopt_child();
        Arc::new(ThreadDomain {
            context: Arc::clone(context),
            users: AtomicUsize::new(0),
        })
    }

    pub fn check_deallocatable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy(
                "thread domain still used by parent domains",
            ));
        }
        Ok(())
    }
}

impl Drop for ThreadDomain {
    fn drop(&mut self) {
        self.context.release_child();
    }
}

/// A parent domain: a PD plus an optional thread domain.
pub struct ParentDomain {
    pub pd: Arc<ProtectionDomain>,
    pub td: Option<Arc<ThreadDomain>>,
    /// QPs and CQs created through it.
    users: AtomicUsize,
}

impl ParentDomain {
    /// Counts itself in `pd` (and `td`), which then cannot be deallocated before it.
    pub fn new(
        pd: &Arc<ProtectionDomain>,
        td: Option<Arc<ThreadDomain>>,
    ) -> Result<Arc<ParentDomain>, VerbsError> {
        if let Some(td) = &td {
            if !Arc::ptr_eq(&td.context, &pd.context) {
                return Err(VerbsError::Invalid(
                    "thread domain of another device context",
                ));
            }
            td.users.fetch_add(1, Ordering::AcqRel);
        }
        pd.adopt_child();
        Ok(Arc::new(ParentDomain {
            pd: Arc::clone(pd),
            td,
            users: AtomicUsize::new(0),
        }))
    }

    /// Counts one object created through the parent domain until the guard is dropped.
    pub fn adopt(self: &Arc<Self>) -> ParentUse {
        self.users.fetch_add(1, Ordering::AcqRel);
        ParentUse(Arc::clone(self))
    }

    /// `ibv_dealloc_pd` on a parent domain fails with EBUSY while QPs or CQs use it.
    pub fn check_deallocatable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("parent domain still has QPs or CQs"));
        }
        Ok(())
    }
}

impl Drop for ParentDomain {
    fn drop(&mut self) {
        if let Some(td) = &self.td {
            td.users.fetch_sub(1, Ordering::AcqRel);
        }
        self.pd.release_child();
    }
}

/// An object's membership in a parent domain (see [`ParentDomain::adopt`]).
pub struct ParentUse(Arc<ParentDomain>);

impl ParentUse {
    pub fn domain(&self) -> &Arc<ParentDomain> {
        &self.0
    }
}

impl Drop for ParentUse {
    fn drop(&mut self) {
        self.0.users.fetch_sub(1, Ordering::AcqRel);
    }
}
