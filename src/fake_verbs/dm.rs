//! Device memory (`ibv_alloc_dm`): on a NIC, a small memory on the device that the host
//! reaches with `ibv_memcpy_to/from_dm` and RDMA reaches through `ibv_reg_dm_mr`. ugdr's
//! device is software, so its "device memory" is host memory ugdr owns (an anonymous
//! mapping), with the same bounds and the same limit on the total (`max_dm_size`).

use super::VerbsError;
use super::context::DeviceContext;
use super::device::MAX_DM_SIZE;
use crate::ucp::{AppRegion, AppSpan, HostBuffer};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Bytes of device memory allocated in this process (at most [`MAX_DM_SIZE`]).
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
/// The largest alignment `log_align_req` may ask for: a page (each DM is its own mapping).
pub const MAX_LOG_ALIGN: u32 = 12;

pub struct DeviceMemory {
    pub context: Arc<DeviceContext>,
    buffer: HostBuffer,
    /// MRs registered on it (`ibv_free_dm` fails with EBUSY while any remain).
    users: AtomicUsize,
}

impl DeviceMemory {
    /// `ibv_alloc_dm`: `length` bytes aligned to `2^log_align` (zeroed).
    pub fn allocate(
        context: &Arc<DeviceContext>,
        length: u64,
        log_align: u32,
    ) -> Result<Arc<DeviceMemory>, VerbsError> {
        if length == 0 || length > MAX_DM_SIZE {
            return Err(VerbsError::Invalid(
                "device memory length is 0 or above max_dm_size",
            ));
        }
        if log_align > MAX_LOG_ALIGN {
            return Err(VerbsError::Invalid("device memory alignment above a page"));
        }
        ALLOCATED
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(length).filter(|n| *n <= MAX_DM_SIZE)
            })
            .map_err(|_| VerbsError::NoResources("device memory exhausted (max_dm_size)"))?;
        let buffer = match HostBuffer::new(length) {
            Ok(b) => b,
            Err(e) => {
                ALLOCATED.fetch_sub(length, Ordering::AcqRel);
                return Err(e.into());
            }
        };
        context.adopt_child();
        Ok(Arc::new(DeviceMemory {
            context: Arc::clone(context),
            buffer,
            users: AtomicUsize::new(0),
        }))
    }

    pub fn len(&self) -> u64 {
        self.buffer.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// `[offset, offset + len)` of the device memory, if inside it (EINVAL otherwise).
    pub fn span(&self, offset: u64, len: u64) -> Result<AppSpan, VerbsError> {
        self.buffer
            .span(offset, len)
            .ok_or(VerbsError::Invalid("range outside the device memory"))
    }

    /// `[offset, offset + len)` as registrable memory (`ibv_reg_dm_mr`), if inside it: a
    /// region of its own, valid while this device memory lives (its MRs keep it).
    pub fn region(&self, offset: u64, len: u64) -> Result<AppRegion, VerbsError> {
        self.buffer
            .region(offset, len)
            .ok_or(VerbsError::Invalid("range outside the device memory"))
    }

    pub fn adopt_user(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_user(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_free_dm` fails with EBUSY while MRs use the memory.
    pub fn check_freeable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("device memory still has MRs"));
        }
        Ok(())
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        ALLOCATED.fetch_sub(self.len(), Ordering::AcqRel);
        self.context.release_child();
    }
}
