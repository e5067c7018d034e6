//! The objects handed to C: each a `#[repr(C)]` shell whose first field is the rdma-core
//! struct (so the application's pointer is the shell's pointer), followed by the Rust object.
//! One `from_raw` per type (rxe's `to_rqp()`); every `ibv_*` field sits in an `UnsafeCell`
//! because the application reads (and, for `ibv_qp_ex.wr_id`, writes) fields ugdr updates.

use crate::fake_verbs::ah::AddressHandle;
use crate::fake_verbs::context::DeviceContext;
use crate::fake_verbs::cq::{CompletionChannel, CompletionQueue};
use crate::fake_verbs::mr::MemoryRegion;
use crate::fake_verbs::pd::ProtectionDomain;
use crate::fake_verbs::qp::QueuePair;
use crate::fake_verbs::srq::SharedReceiveQueue;
use crate::fake_verbs::work::{SendRequest, WorkCompletion};
use crate::sys::*;
use dashmap::DashSet;
use rustc_hash::FxBuildHasher;
use std::cell::UnsafeCell;
use std::mem::offset_of;
use std::sync::{Arc, LazyLock};

/// `ibv_device` plus room for libibverbs' private `verbs_device` tail, zeroed (libraries that
/// peek there, like libmlx5's `mlx5dv_is_supported`, then see "no provider ops").
#[repr(C)]
pub(crate) struct DeviceShell {
    pub ibv: UnsafeCell<ibv_device>,
    _private_tail: [u64; 64],
}

// SAFETY: the device is written once before publication and only read afterwards.
unsafe impl Sync for DeviceShell {}

impl DeviceShell {
    pub fn new(ibv: ibv_device) -> DeviceShell {
        DeviceShell {
            ibv: UnsafeCell::new(ibv),
            _private_tail: [0; 64],
        }
    }

    pub fn as_raw(&self) -> *mut ibv_device {
        self.ibv.get()
    }
}

/// A context: the `verbs_context` (whose last field is the `ibv_context` the app sees).
#[repr(C)]
pub(crate) struct ContextShell {
    pub vctx: UnsafeCell<verbs_context>,
    pub inner: Arc<DeviceContext>,
}

/// The `ibv_context` pointers ugdr handed out (the ownership test for pass-through).
static CONTEXTS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);

impl ContextShell {
    /// Publishes the shell; the application gets `&vctx.context`.
    pub fn into_raw(shell: Box<ContextShell>) -> *mut ibv_context {
        let shell = Box::into_raw(shell);
        // SAFETY: `shell` is a valid, uniquely owned allocation; we take the field's address.
        let ctx = unsafe { std::ptr::addr_of_mut!((*(*shell).vctx.get()).context) };
        CONTEXTS.insert(ctx as usize);
        ctx
    }

    pub fn is_ours(ctx: *const ibv_context) -> bool {
        !ctx.is_null() && CONTEXTS.contains(&(ctx as usize))
    }

    /// rdma-core's `verbs_get_ctx()` for ugdr's contexts; None for NULL or foreign ones.
    ///
    /// # Safety
    /// A non-NULL `ctx` registered in CONTEXTS points into a live ContextShell.
    pub unsafe fn from_raw<'a>(ctx: *const ibv_context) -> Option<&'a ContextShell> {
        if !Self::is_ours(ctx) {
            return None;
        }
        let base = (ctx as *const u8).wrapping_sub(offset_of!(verbs_context, context));
        // SAFETY: registered contexts are `&vctx.context` of a live ContextShell whose first
        // field is the verbs_context, so stepping back by the offset yields the shell.
        Some(unsafe { &*(base as *const ContextShell) })
    }

    /// Unpublishes and frees the shell.
    ///
    /// # Safety
    /// `ctx` came from `into_raw` and is not used again.
    pub unsafe fn destroy(ctx: *mut ibv_context) {
        CONTEXTS.remove(&(ctx as usize));
        let base = (ctx as *mut u8).wrapping_sub(offset_of!(verbs_context, context));
        // SAFETY: as in from_raw; the Box was leaked by into_raw.
        drop(unsafe { Box::from_raw(base as *mut ContextShell) });
    }
}

/// Defines a shell type whose first field is an rdma-core struct.
macro_rules! shell {
    ($(#[$doc:meta])* $name:ident, $c:ty, $inner:ty $(, $field:ident : $fty:ty)*) => {
        $(#[$doc])*
        #[repr(C)]
        pub(crate) struct $name {
            pub ibv: UnsafeCell<$c>,
            pub inner: Arc<$inner>,
            $(pub $field: $fty,)*
        }

        impl $name {
            /// Publishes the shell; the application gets the pointer to its C struct.
            pub fn into_raw(shell: Box<$name>) -> *mut $c {
                // The C struct is the first field of a #[repr(C)] struct: same address.
                Box::into_raw(shell).cast()
            }

            /// # Safety
            /// `raw` is NULL or was returned by `into_raw` and not yet destroyed.
            pub unsafe fn from_raw<'a>(raw: *const $c) -> Option<&'a $name> {
                // SAFETY: same address as the shell (first field of a #[repr(C)] struct).
                unsafe { (raw as *const $name).as_ref() }
            }

            /// # Safety
            /// `raw` was returned by `into_raw` and is not used again.
            pub unsafe fn destroy(raw: *mut $c) {
                // SAFETY: the Box was leaked by into_raw.
                drop(unsafe { Box::from_raw(raw as *mut $name) });
            }

            #[allow(dead_code)]
            pub fn as_raw(&self) -> *mut $c {
                self.ibv.get()
            }
        }
    };
}

shell!(
    /// `ibv_pd`.
    PdShell, ibv_pd, ProtectionDomain
);
shell!(
    /// `ibv_mr`.
    MrShell, ibv_mr, MemoryRegion
);
shell!(
    /// `ibv_srq`.
    SrqShell, ibv_srq, SharedReceiveQueue
);
shell!(
    /// `ibv_ah`.
    AhShell, ibv_ah, AddressHandle
);
shell!(
    /// `ibv_comp_channel`.
    ChannelShell, ibv_comp_channel, CompletionChannel
);
shell!(
    /// Every CQ is an `ibv_cq_ex` (its first 128 bytes are the `ibv_cq`); `current` is the
    /// completion `ibv_start_poll`/`ibv_next_poll` made current.
    CqShell, ibv_cq_ex, CompletionQueue, current: UnsafeCell<Option<WorkCompletion>>
);
shell!(
    /// Every QP is an `ibv_qp_ex`; `batch` holds the requests built between `ibv_wr_start`
    /// and `ibv_wr_complete`.
    QpShell, ibv_qp_ex, QueuePair, batch: UnsafeCell<WrBatch>
);

/// Work requests being built with the `ibv_wr_*` API (one thread per QP between
/// `ibv_wr_start` and `ibv_wr_complete`, as the API requires).
#[derive(Default)]
pub(crate) struct WrBatch {
    pub requests: Vec<SendRequest>,
    /// The first error found while building (reported by `ibv_wr_complete`).
    pub error: Option<std::os::raw::c_int>,
}

/// The channels ugdr created (the ownership test for `ibv_get_cq_event` pass-through).
pub(crate) static CHANNELS: LazyLock<DashSet<usize, FxBuildHasher>> =
    LazyLock::new(DashSet::default);

/// `obj->context` of an rdma-core object, if that context is ugdr's.
///
/// # Safety
/// `context_field` is the `context` field read from a valid rdma-core object (or NULL).
pub(crate) unsafe fn owned_context<'a>(
    context_field: *mut ibv_context,
) -> Option<&'a ContextShell> {
    // SAFETY: forwarded contract.
    unsafe { ContextShell::from_raw(context_field) }
}
