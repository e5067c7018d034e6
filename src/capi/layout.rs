//! The objects handed to C: each a `#[repr(C)]` shell whose first field is the rdma-core
//! struct (so the application's pointer is the shell's pointer), followed by the Rust object.
//! One `from_raw` per type (rxe's `to_rqp()`); every `ibv_*` field sits in an `UnsafeCell`
//! because the application reads (and, for `ibv_qp_ex.wr_id`, writes) fields ugdr updates.

use crate::fake_verbs::VerbsError;
use crate::fake_verbs::ah::AddressHandle;
use crate::fake_verbs::context::DeviceContext;
use crate::fake_verbs::cq::{CompletionChannel, CompletionQueue};
use crate::fake_verbs::dm::DeviceMemory;
use crate::fake_verbs::mr::MemoryRegion;
use crate::fake_verbs::mw::MemoryWindow;
use crate::fake_verbs::pd::{ParentDomain, ParentUse, ProtectionDomain, ThreadDomain};
use crate::fake_verbs::qp::QueuePair;
use crate::fake_verbs::srq::SharedReceiveQueue;
use crate::fake_verbs::work::{SendRequest, WorkCompletion};
use crate::fake_verbs::xrc::XrcdHandle;
use crate::sys::*;
use dashmap::{DashMap, DashSet};
use rustc_hash::FxBuildHasher;
use std::cell::UnsafeCell;
use std::mem::{MaybeUninit, offset_of};
use std::os::raw::c_void;
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
    /// Its command fd (`cmd_fd`): closed with the context (`capi::ibv_import`).
    pub cmd_file: std::os::fd::OwnedFd,
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
            #[allow(dead_code)]
            pub fn into_raw(shell: Box<$name>) -> *mut $c {
                // The C struct is the first field of a #[repr(C)] struct: same address.
                Box::into_raw(shell).cast()
            }

            /// # Safety
            /// `raw` is NULL or was returned by `into_raw` and not yet destroyed.
            #[allow(dead_code)]
            pub unsafe fn from_raw<'a>(raw: *const $c) -> Option<&'a $name> {
                // SAFETY: same address as the shell (first field of a #[repr(C)] struct).
                unsafe { (raw as *const $name).as_ref() }
            }

            /// # Safety
            /// `raw` was returned by `into_raw` (or placed by a [`ShellMemory`]) and is not
            /// used again.
            pub unsafe fn destroy(raw: *mut $c) {
                // SAFETY: forwarded contract.
                unsafe { release_shell(raw as *mut $name) };
            }

            #[allow(dead_code)]
            pub fn as_raw(&self) -> *mut $c {
                self.ibv.get()
            }
        }
    };
}

shell!(
    /// `ibv_pd`, or a parent domain (`ibv_alloc_parent_domain`): the same PD object as the
    /// one it was made from, plus `parent`.
    PdShell, ibv_pd, ProtectionDomain, parent: Option<ParentLink>
);
shell!(
    /// `ibv_td`.
    TdShell, ibv_td, ThreadDomain
);
shell!(
    /// `ibv_dm` (its `memcpy_to_dm`/`memcpy_from_dm` pointers are what the inline
    /// `ibv_memcpy_to/from_dm` call).
    DmShell, ibv_dm, DeviceMemory
);
shell!(
    /// `ibv_mr`.
    MrShell, ibv_mr, MemoryRegion
);
shell!(
    /// `ibv_mw`.
    MwShell, ibv_mw, MemoryWindow
);
shell!(
    /// `ibv_srq`.
    SrqShell, ibv_srq, SharedReceiveQueue
);
shell!(
    /// `ibv_xrcd`.
    XrcdShell, ibv_xrcd, XrcdHandle
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

/// The completion channels ugdr created, by the address of their shell, with the channel
/// each stands for: a lookup hands out its own reference, so a thread that found a channel
/// keeps using it while another destroys the shell (and only one destroy can remove it).
pub(crate) static CHANNELS: LazyLock<DashMap<usize, Arc<CompletionChannel>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);

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

// ------------------------------------------------------------------ parent domains

/// `void *(*alloc)(pd, pd_context, size, alignment, resource_type)` of a parent domain.
pub(crate) type AllocFn =
    unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void;
/// `void (*free)(pd, pd_context, ptr, resource_type)` of a parent domain.
pub(crate) type FreeFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64);

/// What `ibv_alloc_parent_domain`'s caller gave a parent domain beyond its PD.
pub(crate) struct ParentLink {
    pub domain: Arc<ParentDomain>,
    /// The application's allocator (`IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS`).
    pub allocator: Option<(AllocFn, FreeFn)>,
    /// `IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT`, handed back to the allocator.
    pub pd_context: *mut c_void,
}

/// `resource_type` of the allocations ugdr asks a parent domain's allocator for: no
/// `rdma_driver_id` names ugdr, so the upper 32 bits are `RDMA_DRIVER_UNKNOWN` (0) and the
/// lower ones say what the memory holds: the queue pair or completion queue object itself
/// (the structure the application's pointer points to, which the inline verbs read).
pub(crate) const RESOURCE_QP: u64 = 1;
pub(crate) const RESOURCE_CQ: u64 = 2;

/// Memory from a parent domain's allocator, and how to give it back.
struct CustomHome {
    free: FreeFn,
    parent: *mut ibv_pd,
    pd_context: *mut c_void,
    resource_type: u64,
}

/// An object created through a parent domain: its count in the domain, and its memory when
/// the domain's allocator provided it.
struct Membership {
    _use: ParentUse,
    home: Option<CustomHome>,
}

// SAFETY: the pointers are the application's opaque values (its parent domain and context),
// only handed back to its own `free` callback, from whichever thread destroys the object, as
// rdma-core's providers do.
unsafe impl Send for Membership {}
// SAFETY: as above; never dereferenced by ugdr.
unsafe impl Sync for Membership {}

/// Shells placed through parent domains, by address.
static MEMBERS: LazyLock<DashMap<usize, Membership, FxBuildHasher>> =
    LazyLock::new(DashMap::default);

/// Frees a shell: with the parent domain's `free` when its allocator provided the memory,
/// else as the Box it is; then leaves the parent domain.
///
/// # Safety
/// `raw` is a live shell (from `into_raw` or [`ShellMemory::place`]) that is not used again.
unsafe fn release_shell<T>(raw: *mut T) {
    match MEMBERS.remove(&(raw as usize)).map(|(_, m)| m) {
        Some(Membership {
            _use,
            home: Some(home),
        }) => {
            // SAFETY: placed (written) by ShellMemory::place in the application's memory;
            // dropped once, then that memory goes back to the callback that gave it.
            unsafe {
                std::ptr::drop_in_place(raw);
                (home.free)(home.parent, home.pd_context, raw.cast(), home.resource_type);
            }
        }
        // SAFETY: the heap allocation made by into_raw or ShellMemory::reserve (a
        // Box<MaybeUninit<T>>, the same layout), initialized since.
        _ => drop(unsafe { Box::from_raw(raw) }),
    }
}

/// Memory reserved for a shell before the object behind it is made (so that an allocator's
/// failure leaves nothing to undo): the heap, or, for an object created through a parent
/// domain with an allocator, that allocator's memory. Given back if never placed.
pub(crate) struct ShellMemory<T> {
    ptr: *mut MaybeUninit<T>,
    membership: Option<Membership>,
}

impl<T> ShellMemory<T> {
    /// Reserves memory for an object created on `pd` (a PD or parent domain of ugdr's).
    pub fn reserve(pd: Option<&PdShell>, resource_type: u64) -> Result<Self, VerbsError> {
        let Some(link) = pd.and_then(|p| p.parent.as_ref().map(|l| (p, l))) else {
            return Ok(Self::on_heap(None));
        };
        let (shell, link) = link;
        let membership = |home| Membership {
            _use: link.domain.adopt(),
            home,
        };
        let Some((alloc, free)) = link.allocator else {
            return Ok(Self::on_heap(Some(membership(None))));
        };
        let parent = shell.as_raw();
        let (size, align) = (size_of::<T>(), align_of::<T>());
        // SAFETY: the application's allocator, called as rdma-core's providers call it.
        let p = unsafe { alloc(parent, link.pd_context, size, align, resource_type) };
        if p == usize::MAX as *mut c_void {
            // IBV_ALLOCATOR_USE_DEFAULT: the object still counts in the parent domain.
            return Ok(Self::on_heap(Some(membership(None))));
        }
        if p.is_null() {
            return Err(VerbsError::NoResources(
                "the parent domain's allocator returned NULL",
            ));
        }
        if !(p as usize).is_multiple_of(align) {
            // SAFETY: giving back what the callback just returned.
            unsafe { free(parent, link.pd_context, p, resource_type) };
            return Err(VerbsError::Invalid(
                "the parent domain's allocator ignored the alignment",
            ));
        }
        Ok(ShellMemory {
            ptr: p.cast(),
            membership: Some(membership(Some(CustomHome {
                free,
                parent,
                pd_context: link.pd_context,
                resource_type,
            }))),
        })
    }

    fn on_heap(membership: Option<Membership>) -> Self {
        ShellMemory {
            ptr: Box::into_raw(Box::new(MaybeUninit::<T>::uninit())),
            membership,
        }
    }

    /// Moves `shell` into the memory; the pointer is the application's (release it with the
    /// type's `destroy`).
    pub fn place(mut self, shell: T) -> *mut T {
        let ptr = self.ptr;
        // SAFETY: `ptr` is reserved, aligned memory for one T, not yet initialized.
        unsafe { (*ptr).write(shell) };
        if let Some(m) = self.membership.take() {
            MEMBERS.insert(ptr as usize, m);
        }
        self.ptr = std::ptr::null_mut();
        ptr.cast()
    }
}

impl<T> Drop for ShellMemory<T> {
    fn drop(&mut self) {
        if self.ptr.is_null() {
            return;
        }
        match self.membership.take().and_then(|m| m.home) {
            // SAFETY: the callback's memory, never initialized, given back once.
            Some(h) => unsafe {
                (h.free)(h.parent, h.pd_context, self.ptr.cast(), h.resource_type)
            },
            // SAFETY: the Box<MaybeUninit<T>> leaked by on_heap, never initialized.
            None => drop(unsafe { Box::from_raw(self.ptr) }),
        }
    }
}
