//! Device memory: `ibv_alloc_dm`, `ibv_free_dm`, `ibv_reg_dm_mr` (through the
//! `verbs_context` table) and `ibv_memcpy_to_dm`/`ibv_memcpy_from_dm` (inline in verbs.h:
//! they call the function pointers in the `ibv_dm` itself). The memory is host memory ugdr
//! owns (`fake_verbs::dm`); copies outside it (EFAULT) or not in 4-byte words (EINVAL) touch
//! nothing.

use super::boundary::{Fallback, ffi_boundary, status};
use super::ibv_import;
use super::ibv_pd_mr::{mr_shell, our_pd};
use super::layout::{ContextShell, DmShell, owned_context};
use crate::fake_verbs::dm::DeviceMemory;
use crate::fake_verbs::mr::MemoryRegion;
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::Arc;

/// `verbs_context.alloc_dm`: `length` in (0, max_dm_size], `log_align_req` ≤ 12,
/// `comp_mask` 0 (else EINVAL); ENOMEM once `max_dm_size` is allocated.
pub(crate) unsafe extern "C" fn alloc_dm_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_alloc_dm_attr,
) -> *mut ibv_dm {
    ffi_boundary!("ibv_alloc_dm", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return <*mut ibv_dm>::fail(libc::EINVAL);
        };
        if attr.is_null() {
            return <*mut ibv_dm>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &*attr };
        if a.comp_mask != 0 {
            return <*mut ibv_dm>::fail(libc::EINVAL);
        }
        match DeviceMemory::allocate(&shell.inner, a.length as u64, a.log_align_req) {
            Ok(dm) => {
                let handle = ibv_import::publish_dm(&dm);
                dm_shell(ctx, dm, handle)
            }
            Err(e) => {
                tracing::debug!("ibv_alloc_dm: {e}");
                <*mut ibv_dm>::fail(e.errno())
            }
        }
    })
}

/// Hands out `dm` as an `ibv_dm` of `ctx` under `handle` (a new DM's, or an imported one's).
pub(crate) fn dm_shell(ctx: *mut ibv_context, dm: Arc<DeviceMemory>, handle: u32) -> *mut ibv_dm {
    DmShell::into_raw(Box::new(DmShell {
        ibv: UnsafeCell::new(ibv_dm {
            context: ctx,
            memcpy_to_dm: Some(memcpy_to_dm),
            memcpy_from_dm: Some(memcpy_from_dm),
            comp_mask: 0,
            handle,
        }),
        inner: dm,
    }))
}

/// # Safety
/// `dm` is NULL or a valid `ibv_dm`.
unsafe fn our_dm<'a>(dm: *mut ibv_dm) -> Option<&'a DmShell> {
    if dm.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_dm has a readable `context` field.
    unsafe { owned_context((*dm).context)? };
    // SAFETY: its context is ours, so it is a DmShell.
    unsafe { DmShell::from_raw(dm) }
}

/// `verbs_context.free_dm`: EBUSY while MRs are registered on it.
pub(crate) unsafe extern "C" fn free_dm_op(dm: *mut ibv_dm) -> c_int {
    ffi_boundary!("ibv_free_dm", {
        // SAFETY: the caller's DM (or NULL), ownership checked.
        let Some(shell) = (unsafe { our_dm(dm) }) else {
            return c_int::fail(libc::EINVAL);
        };
        // SAFETY: ours (checked), so a DmShell's ibv_dm.
        let handle = unsafe { (*dm).handle };
        if !ibv_import::is_live(handle) {
            // Freed already through another struct of it (an imported one).
            return c_int::fail(libc::EINVAL);
        }
        if let Err(e) = shell.inner.check_freeable() {
            return status(Err(e));
        }
        ibv_import::retire(handle);
        // SAFETY: ours; the application gives it up here.
        unsafe { DmShell::destroy(dm) };
        0
    })
}

/// `verbs_context.reg_dm_mr`: `[dm_offset, dm_offset + length)` of the DM as a zero-based MR
/// (`IBV_ACCESS_ZERO_BASED` required; its `addr` is NULL, as rdma-core reports it).
pub(crate) unsafe extern "C" fn reg_dm_mr_op(
    pd: *mut ibv_pd,
    dm: *mut ibv_dm,
    dm_offset: u64,
    length: usize,
    access: c_uint,
) -> *mut ibv_mr {
    ffi_boundary!("ibv_reg_dm_mr", {
        // SAFETY: the caller's PD and DM (or NULL), ownership checked.
        let (Some(pd_shell), Some(dm_shell)) = (unsafe { our_pd(pd) }, unsafe { our_dm(dm) })
        else {
            return <*mut ibv_mr>::fail(libc::EINVAL);
        };
        match MemoryRegion::register_device_memory(
            &pd_shell.inner,
            &dm_shell.inner,
            dm_offset,
            length as u64,
            access,
        ) {
            Ok(mr) => {
                let handle = ibv_import::publish_mr(&mr);
                mr_shell(pd, pd_shell, mr, std::ptr::null_mut(), length, handle)
            }
            Err(e) => {
                tracing::debug!("ibv_reg_dm_mr: {e}");
                <*mut ibv_mr>::fail(e.errno())
            }
        }
    })
}

/// The DM behind an `ibv_dm` whose copy pointers are ugdr's (only ugdr's DMs have them).
fn dm_of<'a>(dm: *mut ibv_dm) -> Option<&'a DmShell> {
    // SAFETY: reached through the pointers in one of ugdr's ibv_dm (or a NULL dm).
    unsafe { our_dm(dm) }
}

/// Copies `length` bytes between the DM's `[dm_offset, dm_offset + length)` and the host
/// memory at `host` (`to_dm`: host → DM). 0, or (nothing copied) as mlx5, the provider with
/// device memory, answers: EFAULT for a range outside the DM, EINVAL for an offset or length
/// not a multiple of 4 (device memory is reached in 4-byte words) or a NULL host address.
fn copy_dm(dm: *mut ibv_dm, dm_offset: u64, host: *mut u8, length: usize, to_dm: bool) -> c_int {
    let Some(shell) = dm_of(dm) else {
        return c_int::fail(libc::EINVAL);
    };
    match shell.inner.span(dm_offset, length as u64) {
        Err(_) => c_int::fail(libc::EFAULT),
        Ok(_) if !dm_offset.is_multiple_of(4) || !length.is_multiple_of(4) => {
            c_int::fail(libc::EINVAL)
        }
        Ok(_) if length == 0 => 0,
        Ok(_) if host.is_null() => c_int::fail(libc::EINVAL),
        Ok(span) => {
            let (src, dst) = if to_dm {
                (host.cast_const(), span.as_ptr())
            } else {
                (span.as_ptr().cast_const(), host)
            };
            // SAFETY: the caller's `length` bytes at `host` (readable for `to_dm`, writable
            // otherwise: the verb's contract); the span is inside the DM's memory, alive while
            // the DM is. `copy` tolerates overlap (a host buffer inside the DM).
            unsafe { std::ptr::copy(src, dst, length) };
            0
        }
    }
}

/// `ibv_dm.memcpy_to_dm`.
unsafe extern "C" fn memcpy_to_dm(
    dm: *mut ibv_dm,
    dm_offset: u64,
    host_addr: *const c_void,
    length: usize,
) -> c_int {
    ffi_boundary!("ibv_memcpy_to_dm", {
        copy_dm(dm, dm_offset, host_addr.cast_mut().cast(), length, true)
    })
}

/// `ibv_dm.memcpy_from_dm`.
unsafe extern "C" fn memcpy_from_dm(
    host_addr: *mut c_void,
    dm: *mut ibv_dm,
    dm_offset: u64,
    length: usize,
) -> c_int {
    ffi_boundary!("ibv_memcpy_from_dm", {
        copy_dm(dm, dm_offset, host_addr.cast(), length, false)
    })
}
