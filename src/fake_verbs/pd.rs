//! Protection domain.

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

    /// `ibv_dealloc_pd` fails with EBUSY while MRs, QPs, SRQs or AHs still use the PD.
    pub fn check_deallocatable(&self) -> Result<(), VerbsError> {
        if self.children.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy(
                "protection domain still has MRs, QPs, SRQs or AHs",
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
