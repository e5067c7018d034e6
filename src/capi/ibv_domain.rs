//! Thread domains and parent domains (`ibv_alloc_td`, `ibv_dealloc_td`,
//! `ibv_alloc_parent_domain`; a parent domain is deallocated with `ibv_dealloc_pd`). All are
//! inline in verbs.h and reach ugdr through the `verbs_context` table.
//!
//! A parent domain is handed out as an `ibv_pd` whose Rust object is the PD it was made from,
//! so every verb that takes a PD accepts it unchanged. QPs (`ibv_create_qp`/`_ex` on it) and
//! CQs (`ibv_create_cq_ex` with `IBV_CQ_INIT_ATTR_MASK_PD`) created through it count in it,
//! and when it has an allocator their objects live in memory from that allocator
//! (`layout::ShellMemory`): what a hardware provider allocates per QP and CQ is its queue
//! buffers; ugdr's queues are inside the object, so the object is what it allocates.

use super::boundary::{Fallback, ffi_boundary, status};
use super::ibv_pd_mr::our_pd;
use super::layout::{ContextShell, ParentLink, PdShell, TdShell, owned_context};
use crate::fake_verbs::pd::{ParentDomain, ThreadDomain};
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::c_int;
use std::sync::Arc;

/// `enum ibv_parent_domain_init_attr_mask`.
const PD_ATTR_ALLOCATORS: u32 = 1;
const PD_ATTR_PD_CONTEXT: u32 = 1 << 1;

/// `verbs_context.alloc_td`: `comp_mask` must be 0 (EINVAL).
pub(crate) unsafe extern "C" fn alloc_td_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_td_init_attr,
) -> *mut ibv_td {
    ffi_boundary!("ibv_alloc_td", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return <*mut ibv_td>::fail(libc::EINVAL);
        };
        // SAFETY: `attr` is NULL or the caller's struct.
        if attr.is_null() || unsafe { (*attr).comp_mask } != 0 {
            return <*mut ibv_td>::fail(libc::EINVAL);
        }
        TdShell::into_raw(Box::new(TdShell {
            ibv: UnsafeCell::new(ibv_td { context: ctx }),
            inner: ThreadDomain::new(&shell.inner),
        }))
    })
}

/// # Safety
/// `td` is NULL or a valid `ibv_td`.
unsafe fn our_td<'a>(td: *mut ibv_td) -> Option<&'a TdShell> {
    if td.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_td has a readable `context` field.
    unsafe { owned_context((*td).context)? };
    // SAFETY: its context is ours, so it is a TdShell.
    unsafe { TdShell::from_raw(td) }
}

/// `verbs_context.dealloc_td`: EBUSY while a parent domain uses it.
pub(crate) unsafe extern "C" fn dealloc_td_op(td: *mut ibv_td) -> c_int {
    ffi_boundary!("ibv_dealloc_td", {
        // SAFETY: the caller's TD (or NULL), ownership checked.
        let Some(shell) = (unsafe { our_td(td) }) else {
            return c_int::fail(libc::EINVAL);
        };
        if let Err(e) = shell.inner.check_deallocatable() {
            return status(Err(e));
        }
        // SAFETY: ours; the application gives it up here.
        unsafe { TdShell::destroy(td) };
        0
    })
}

/// `verbs_context.alloc_parent_domain`: a PD of this context (not itself a parent domain),
/// an optional TD of this context, `comp_mask` within ALLOCATORS | PD_CONTEXT (both
/// callbacks given with ALLOCATORS); otherwise NULL with EINVAL.
pub(crate) unsafe extern "C" fn alloc_parent_domain_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_parent_domain_init_attr,
) -> *mut ibv_pd {
    ffi_boundary!("ibv_alloc_parent_domain", {
        if !ContextShell::is_ours(ctx) || attr.is_null() {
            return <*mut ibv_pd>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &*attr };
        if a.comp_mask & !(PD_ATTR_ALLOCATORS | PD_ATTR_PD_CONTEXT) != 0 {
            return <*mut ibv_pd>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's PD (or NULL), ownership checked.
        let Some(base) = (unsafe { our_pd(a.pd) }) else {
            return <*mut ibv_pd>::fail(libc::EINVAL);
        };
        // SAFETY: our own PD's context field.
        if base.parent.is_some() || unsafe { (*a.pd).context } != ctx {
            return <*mut ibv_pd>::fail(libc::EINVAL);
        }
        let td = if a.td.is_null() {
            None
        } else {
            // SAFETY: the caller's TD, ownership checked.
            match unsafe { our_td(a.td) } {
                Some(t) => Some(Arc::clone(&t.inner)),
                None => return <*mut ibv_pd>::fail(libc::EINVAL),
            }
        };
        let allocator = if a.comp_mask & PD_ATTR_ALLOCATORS != 0 {
            match (a.alloc, a.free) {
                (Some(alloc), Some(free)) => Some((alloc, free)),
                _ => return <*mut ibv_pd>::fail(libc::EINVAL),
            }
        } else {
            None
        };
        let domain = match ParentDomain::new(&base.inner, td) {
            Ok(d) => d,
            Err(e) => return <*mut ibv_pd>::fail(e.errno()),
        };
        let pd_context = if a.comp_mask & PD_ATTR_PD_CONTEXT != 0 {
            a.pd_context
        } else {
            std::ptr::null_mut()
        };
        PdShell::into_raw(Box::new(PdShell {
            // rdma-core's ibv_initialize_parent_domain: the PD's context and handle.
            // SAFETY: our own PD's fields.
            ibv: UnsafeCell::new(unsafe { *base.as_raw() }),
            inner: Arc::clone(&base.inner),
            parent: Some(ParentLink {
                domain,
                allocator,
                pd_context,
            }),
        }))
    })
}
