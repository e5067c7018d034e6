//! Protection domains and memory regions. Registration checks the memory first (EFAULT for
//! ranges that are not mapped with the access needed, as the kernel's pinning); a region whose
//! memory the application later unmaps or replaces is invalidated (`ucp::memory`, and the
//! interposed libc calls in `libc_memory`).

use super::boundary::{Fallback, ffi_boundary, status};
use super::layout::{ContextShell, MrShell, PdShell, owned_context};
use super::passthrough;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::mr::{self, MemoryRegion};
use crate::fake_verbs::pd::ProtectionDomain;
use crate::sys::*;
use crate::ucp::AppRegion;
use crate::ugdr::host_memory;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_alloc_pd(ctx: *mut ibv_context) -> *mut ibv_pd {
    ffi_boundary!("ibv_alloc_pd", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return match passthrough::ibv_alloc_pd() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx) },
                _ => <*mut ibv_pd>::fail(libc::EINVAL),
            };
        };
        let pd = ProtectionDomain::new(shell.inner.clone());
        let ibv = ibv_pd {
            context: ctx,
            handle: 0,
        };
        PdShell::into_raw(Box::new(PdShell {
            ibv: UnsafeCell::new(ibv),
            inner: pd,
        }))
    })
}

/// # Safety
/// `pd` is NULL or a valid `ibv_pd` (ugdr's or the real library's).
pub(crate) unsafe fn our_pd<'a>(pd: *mut ibv_pd) -> Option<&'a PdShell> {
    if pd.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_pd has a readable `context` field.
    unsafe { owned_context((*pd).context)? };
    // SAFETY: its context is ours, so the PD is a PdShell.
    unsafe { PdShell::from_raw(pd) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int {
    ffi_boundary!("ibv_dealloc_pd", {
        // SAFETY: caller passes a PD (or NULL).
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return match passthrough::ibv_dealloc_pd() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if let Err(e) = shell.inner.check_deallocatable() {
            return status(Err(e));
        }
        // SAFETY: ours; the application gives it up here.
        unsafe { PdShell::destroy(pd) };
        0
    })
}

/// Registers `[addr, addr + len)` of host memory for `pd` (`ibv_reg_mr*` and `ugdr_reg_mr`):
/// the argument checks (EINVAL) first, then the memory must be mapped, and writable when the
/// access flags let anyone write there (EFAULT otherwise, as the kernel's pinning fails), all
/// decided without touching the memory (`ugdr::host_memory`).
pub(crate) fn register_host(
    pd: &Arc<ProtectionDomain>,
    addr: u64,
    len: u64,
    iova: u64,
    access: u32,
) -> Result<Arc<MemoryRegion>, VerbsError> {
    MemoryRegion::validate(addr, len, iova, access)?;
    let writable = mr::needs_writable(access);
    host_memory::check(addr, len, writable)?;
    // SAFETY: mapped host memory (checked above) that the application registers and promises
    // to keep until it deregisters it; unmapping it (or taking away the access it needs)
    // earlier invalidates the region first (`ucp::memory`): AppRegion's contract.
    let region = unsafe { AppRegion::new(addr, len, writable) };
    MemoryRegion::register(pd, region, iova, access)
}

fn register(
    pd: *mut ibv_pd,
    shell: &PdShell,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    if addr.is_null() && length != 0 {
        return <*mut ibv_mr>::fail(libc::EINVAL);
    }
    match register_host(&shell.inner, addr as u64, length as u64, iova, access) {
        Ok(mr) => {
            // SAFETY: reading the PD's context field of our own PD.
            let context = unsafe { (*shell.as_raw()).context };
            let ibv = ibv_mr {
                context,
                pd,
                addr,
                length,
                handle: 0,
                lkey: mr.lkey,
                rkey: mr.rkey,
            };
            MrShell::into_raw(Box::new(MrShell {
                ibv: UnsafeCell::new(ibv),
                inner: mr,
            }))
        }
        Err(e) => {
            tracing::debug!("ibv_reg_mr: {e}");
            <*mut ibv_mr>::fail(e.errno())
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ibv_mr {
    ffi_boundary!("ibv_reg_mr", {
        // SAFETY: caller passes a PD (or NULL).
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return match passthrough::ibv_reg_mr() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, addr, length, access) },
                _ => <*mut ibv_mr>::fail(libc::EINVAL),
            };
        };
        register(pd, shell, addr, length, addr as u64, access as u32)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: c_int,
) -> *mut ibv_mr {
    ffi_boundary!("ibv_reg_mr_iova", {
        // SAFETY: caller passes a PD (or NULL).
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return match passthrough::ibv_reg_mr_iova() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, addr, length, iova, access) },
                _ => <*mut ibv_mr>::fail(libc::EINVAL),
            };
        };
        register(pd, shell, addr, length, iova, access as u32)
    })
}

/// What the `ibv_reg_mr` macro calls when the access flags are not a compile-time constant
/// without optional bits (perftest: IBV_ACCESS_RELAXED_ORDERING).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_reg_mr_iova2(
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    ffi_boundary!("ibv_reg_mr_iova2", {
        // SAFETY: caller passes a PD (or NULL).
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return match passthrough::ibv_reg_mr_iova2() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, addr, length, iova, access) },
                _ => <*mut ibv_mr>::fail(libc::EINVAL),
            };
        };
        register(pd, shell, addr, length, iova, access)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int {
    ffi_boundary!("ibv_dereg_mr", {
        if mr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: a valid ibv_mr has a readable `context` field.
        if unsafe { owned_context((*mr).context) }.is_none() {
            return match passthrough::ibv_dereg_mr() {
                // SAFETY: not ours, so the real library's MR.
                Some(real) => unsafe { real(mr) },
                None => c_int::fail(libc::EINVAL),
            };
        }
        // SAFETY: its context is ours, so it is an MrShell.
        if let Some(shell) = unsafe { MrShell::from_raw(mr) } {
            shell.inner.deregister();
        }
        // SAFETY: ours; the application gives it up here.
        unsafe { MrShell::destroy(mr) };
        0
    })
}
