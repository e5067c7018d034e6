//! Protection domains and memory regions: registration (pinned or on-demand paging, the
//! latter also of the whole address space), re-registration, `ibv_advise_mr`. A pinned
//! registration checks the memory first (EFAULT for ranges that are not mapped with the access
//! needed, as the kernel's pinning); a pinned region whose memory the application later unmaps
//! or replaces is invalidated (`ucp::memory`, and the interposed libc calls in `libc_hooks`).
//! An on-demand region is not pinned: unmapping inside it leaves the MR usable, and accesses
//! to pages that are not mapped fail (checked per access, see `ucp::memory`).

use super::boundary::{Fallback, ffi_boundary, set_errno, status};
use super::ibv_import;
use super::layout::{ContextShell, MrShell, PdShell, owned_context};
use super::passthrough::{self, real_functions};
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::mr::{self, ACCESS_ON_DEMAND, MemoryRegion};
use crate::fake_verbs::pd::ProtectionDomain;
use crate::fake_verbs::work::Sge;
use crate::sys::*;
use crate::ucp::AppRegion;
use crate::ugdr::host_memory;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

/// The real library's functions of the same names.
mod real {
    use super::*;

    real_functions! {
    ibv_rereg_mr @ "IBVERBS_1.1": fn(*mut ibv_mr, c_int, *mut ibv_pd, *mut c_void, usize, c_int) -> c_int;
    }
}

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
            handle: ibv_import::publish_pd(&pd),
        };
        PdShell::into_raw(Box::new(PdShell {
            ibv: UnsafeCell::new(ibv),
            inner: pd,
            parent: None,
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
        // A parent domain carries its PD's handle (as rdma-core's) but is not that PD.
        let handle = match &shell.parent {
            // SAFETY: ours (checked), so a PdShell's ibv_pd.
            None => unsafe { (*pd).handle },
            Some(_) => 0,
        };
        if handle != 0 && !ibv_import::is_live(handle) {
            // Deallocated already through another struct of it (an imported one).
            return c_int::fail(libc::EINVAL);
        }
        // A parent domain goes when nothing was created through it; its PD stays (the
        // parent domain counted itself out of it when dropped). A PD goes when nothing (parent
        // domains included) uses it.
        let busy = match &shell.parent {
            Some(link) => link.domain.check_deallocatable(),
            None => shell.inner.check_deallocatable(),
        };
        if let Err(e) = busy {
            return status(Err(e));
        }
        ibv_import::retire(handle);
        // SAFETY: ours; the application gives it up here.
        unsafe { PdShell::destroy(pd) };
        0
    })
}

/// The memory `[addr, addr + len)` a registration with `access` at `iova` covers, checked.
/// On-demand paging: nothing is promised or checked now (NULL with length `SIZE_MAX` is the
/// whole address space, implicit ODP; other NULL addresses are EINVAL). Pinned: the argument
/// checks (EINVAL) first, then the memory must be mapped, and writable when the access flags
/// let anyone write there (EFAULT otherwise, as the kernel's pinning fails), all decided
/// without touching the memory (`ugdr::host_memory`). Each call makes a region of its own
/// (its own liveness cell): a re-registration never shares the old registration's.
fn host_region(addr: u64, len: u64, iova: u64, access: u32) -> Result<AppRegion, VerbsError> {
    if access & ACCESS_ON_DEMAND != 0 {
        if addr == 0 && !mr::is_whole_address_space(addr, len) {
            return Err(VerbsError::Invalid("NULL address"));
        }
        return Ok(AppRegion::on_demand(addr, len));
    }
    if addr == 0 && len != 0 {
        return Err(VerbsError::Invalid("NULL address"));
    }
    MemoryRegion::validate(addr, len, iova, access)?;
    let writable = mr::needs_writable(access);
    host_memory::check(addr, len, writable)?;
    // SAFETY: mapped host memory (checked above) that the application registers and promises
    // to keep until it deregisters (or re-registers) it; unmapping it (or taking away the
    // access it needs) earlier invalidates the region first (`ucp::memory`): AppRegion's
    // contract.
    Ok(unsafe { AppRegion::new(addr, len, writable) })
}

/// Registers `[addr, addr + len)` of host memory for `pd` (`ibv_reg_mr*` and `ugdr_reg_mr`),
/// checked as [`host_region`] says.
pub(crate) fn register_host(
    pd: &Arc<ProtectionDomain>,
    addr: u64,
    len: u64,
    iova: u64,
    access: u32,
) -> Result<Arc<MemoryRegion>, VerbsError> {
    let region = host_region(addr, len, iova, access)?;
    MemoryRegion::register(pd, region, iova, access)
}

/// Hands out `mr` as an `ibv_mr` of `pd` (its `addr` and `length` as given) under `handle`
/// (a new MR's from `ibv_import::publish_mr`, an imported one's).
pub(crate) fn mr_shell(
    pd: *mut ibv_pd,
    shell: &PdShell,
    mr: Arc<MemoryRegion>,
    addr: *mut c_void,
    length: usize,
    handle: u32,
) -> *mut ibv_mr {
    // SAFETY: reading the PD's context field of our own PD.
    let context = unsafe { (*shell.as_raw()).context };
    let ibv = ibv_mr {
        context,
        pd,
        addr,
        length,
        handle,
        lkey: mr.lkey(),
        rkey: mr.rkey(),
    };
    MrShell::into_raw(Box::new(MrShell {
        ibv: UnsafeCell::new(ibv),
        inner: mr,
    }))
}

fn register(
    pd: *mut ibv_pd,
    shell: &PdShell,
    addr: *mut c_void,
    length: usize,
    iova: u64,
    access: u32,
) -> *mut ibv_mr {
    match register_host(&shell.inner, addr as u64, length as u64, iova, access) {
        Ok(mr) => {
            let handle = ibv_import::publish_mr(&mr);
            mr_shell(pd, shell, mr, addr, length, handle)
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
        let handle = unsafe { (*mr).handle };
        if !ibv_import::is_live(handle) {
            // Deregistered already through another struct of it (an imported one).
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: its context is ours, so it is an MrShell.
        if let Some(shell) = unsafe { MrShell::from_raw(mr) }
            && let Err(e) = shell.inner.deregister()
        {
            tracing::debug!("ibv_dereg_mr: {e}");
            return c_int::fail(e.errno());
        }
        ibv_import::retire(handle);
        // SAFETY: ours; the application gives it up here.
        unsafe { MrShell::destroy(mr) };
        0
    })
}

/// `enum ibv_rereg_mr_flags` and `enum ibv_rereg_mr_err_code`.
const REREG_TRANSLATION: c_int = 1;
const REREG_PD: c_int = 1 << 1;
const REREG_ACCESS: c_int = 1 << 2;
const REREG_SUPPORTED: c_int = REREG_TRANSLATION | REREG_PD | REREG_ACCESS;
const REREG_ERR_INPUT: c_int = -1;
const REREG_ERR_CMD: c_int = -4;

/// `ibv_rereg_mr`: libibverbs' argument checks (IBV_REREG_MR_ERR_INPUT, errno EINVAL: unknown
/// flags, a translation without address or length, access flags without
/// IBV_REREG_MR_CHANGE_ACCESS), then the device's (IBV_REREG_MR_ERR_CMD with errno: no flags,
/// a PD of another context, bad access flags, a device-memory MR: EINVAL; memory windows
/// bound: EBUSY). On success the MR's `pd`, `addr`, `length`, `lkey` and `rkey` are current.
/// On failure the MR is unchanged and still valid.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_rereg_mr(
    mr: *mut ibv_mr,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> c_int {
    ffi_boundary!("ibv_rereg_mr", on_panic = REREG_ERR_CMD, {
        let input_error = |why: &str| {
            tracing::debug!("ibv_rereg_mr: {why}");
            set_errno(libc::EINVAL);
            REREG_ERR_INPUT
        };
        if mr.is_null() {
            return input_error("NULL mr");
        }
        // SAFETY: a valid ibv_mr has a readable `context` field.
        if unsafe { owned_context((*mr).context) }.is_none() {
            return match real::ibv_rereg_mr() {
                // SAFETY: not ours, so the real library's MR.
                Some(real) => unsafe { real(mr, flags, pd, addr, length, access) },
                None => input_error("no real libibverbs"),
            };
        }
        if flags & !REREG_SUPPORTED != 0 {
            return input_error("unknown flags");
        }
        if flags & REREG_TRANSLATION != 0 && (length == 0 || addr.is_null()) {
            return input_error("a translation needs an address and a length");
        }
        if access != 0 && flags & REREG_ACCESS == 0 {
            return input_error("access flags without IBV_REREG_MR_CHANGE_ACCESS");
        }
        // SAFETY: its context is ours, so it is an MrShell.
        let Some(shell) = (unsafe { MrShell::from_raw(mr) }) else {
            return input_error("NULL mr");
        };
        match reregister(mr, shell, flags, pd, addr, length, access as u32) {
            Ok(()) => 0,
            Err(e) => {
                tracing::debug!("ibv_rereg_mr: {e}");
                set_errno(e.errno());
                REREG_ERR_CMD
            }
        }
    })
}

/// The device's part of `ibv_rereg_mr`; updates the application's `ibv_mr` on success.
fn reregister(
    mr: *mut ibv_mr,
    shell: &MrShell,
    flags: c_int,
    pd: *mut ibv_pd,
    addr: *mut c_void,
    length: usize,
    access: u32,
) -> Result<(), VerbsError> {
    if flags == 0 {
        return Err(VerbsError::Invalid("nothing to change"));
    }
    let old = shell.inner.registration();
    if old.dm.is_some() {
        return Err(VerbsError::Invalid(
            "device memory MRs cannot be re-registered",
        ));
    }
    let new_pd = if flags & REREG_PD != 0 {
        // SAFETY: the caller's PD (or NULL); ownership checked before use.
        let p = unsafe { our_pd(pd) }.ok_or(VerbsError::Invalid("pd is not ugdr's"))?;
        Arc::clone(&p.inner)
    } else {
        Arc::clone(&old.pd)
    };
    let new_access = if flags & REREG_ACCESS != 0 {
        access
    } else {
        old.access
    };
    // SAFETY: the application's MR, ours; its fields are only written by ugdr, here.
    let (old_addr, old_length) = unsafe { ((*mr).addr, (*mr).length) };
    let (new_addr, new_length, iova) = if flags & REREG_TRANSLATION != 0 {
        (addr, length, addr as u64)
    } else {
        (old_addr, old_length, old.iova)
    };
    let region = host_region(new_addr as u64, new_length as u64, iova, new_access)?;
    shell.inner.reregister(&new_pd, region, iova, new_access)?;
    // SAFETY: as above; the application reads these fields after the call returns.
    unsafe {
        if flags & REREG_PD != 0 {
            (*mr).pd = pd;
        }
        (*mr).addr = new_addr;
        (*mr).length = new_length;
        (*mr).lkey = shell.inner.lkey();
        (*mr).rkey = shell.inner.rkey();
    }
    Ok(())
}

/// `verbs_context.advise_mr` (the `ibv_advise_mr` inline): see `mr::advise`. Returns 0 or
/// the errno value.
pub(crate) unsafe extern "C" fn advise_mr_op(
    pd: *mut ibv_pd,
    advice: ib_uverbs_advise_mr_advice,
    flags: u32,
    sg_list: *mut ibv_sge,
    num_sge: u32,
) -> c_int {
    ffi_boundary!("ibv_advise_mr", {
        // SAFETY: the caller's PD (or NULL), ownership checked.
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return c_int::fail(libc::EINVAL);
        };
        if sg_list.is_null() && num_sge != 0 {
            return c_int::fail(libc::EINVAL);
        }
        let sges: Vec<Sge> = (0..num_sge as usize)
            .map(|i| {
                // SAFETY: the caller's array of num_sge entries.
                let s = unsafe { *sg_list.add(i) };
                Sge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                }
            })
            .collect();
        status(mr::advise(&shell.inner, advice.0, flags, &sges))
    })
}
