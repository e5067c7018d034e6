//! Address handles: `ibv_create_ah`, `ibv_destroy_ah`, and the two helpers that build one
//! from a received UD completion (`ibv_init_ah_from_wc`, `ibv_create_ah_from_wc`). Objects
//! of another library go to the real functions.

use super::boundary::{Fallback, ffi_boundary};
use super::ibv_pd_mr::our_pd;
use super::ibv_qp::av_from;
use super::layout::{AhShell, owned_context};
use super::passthrough::real_functions;
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::ah::AddressHandle;
use crate::fake_verbs::device;
use crate::fake_verbs::work::WC_GRH;
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::c_int;
use std::sync::Arc;

mod real {
    use super::*;

    real_functions! {
    ibv_create_ah @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_ah_attr) -> *mut ibv_ah;
    ibv_destroy_ah @ "IBVERBS_1.1": fn(*mut ibv_ah) -> c_int;
    ibv_init_ah_from_wc @ "IBVERBS_1.1": fn(*mut ibv_context, u8, *mut ibv_wc, *mut ibv_grh, *mut ibv_ah_attr) -> c_int;
    ibv_create_ah_from_wc @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_wc, *mut ibv_grh, u8) -> *mut ibv_ah;
    }
}

/// ugdr's address handle behind `ah`, if it is one.
///
/// # Safety
/// `ah` is NULL or a valid `ibv_ah`.
pub(crate) unsafe fn our_ah<'a>(ah: *mut ibv_ah) -> Option<&'a AhShell> {
    if ah.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_ah has a readable `context` field.
    unsafe { owned_context((*ah).context)? };
    // SAFETY: its context is ours, so it is an AhShell.
    unsafe { AhShell::from_raw(ah) }
}

fn create_ah(pd: *mut ibv_pd, attr: &ibv_ah_attr) -> Result<*mut ibv_ah, VerbsError> {
    // SAFETY: callers checked that `pd` is ours.
    let pd_shell = unsafe { our_pd(pd) }.ok_or(VerbsError::Invalid("pd"))?;
    let engine = Engine::get()?;
    let ah = AddressHandle::new(engine, Arc::clone(&pd_shell.inner), av_from(attr))?;
    // SAFETY: reading the context field of our own PD.
    let context = unsafe { (*pd).context };
    let shell = Box::new(AhShell {
        ibv: UnsafeCell::new(ibv_ah {
            context,
            pd,
            handle: 0,
        }),
        inner: ah,
    });
    Ok(AhShell::into_raw(shell))
}

/// Creates an address handle: NULL with errno EINVAL for a bad PD or address vector.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah {
    ffi_boundary!("ibv_create_ah", {
        // SAFETY: caller passes a PD (or NULL).
        if unsafe { our_pd(pd) }.is_none() {
            return match real::ibv_create_ah() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, attr) },
                _ => <*mut ibv_ah>::fail(libc::EINVAL),
            };
        }
        if attr.is_null() {
            return <*mut ibv_ah>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        match create_ah(pd, unsafe { &*attr }) {
            Ok(ah) => ah,
            Err(e) => {
                tracing::debug!("ibv_create_ah: {e}");
                <*mut ibv_ah>::fail(e.errno())
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int {
    ffi_boundary!("ibv_destroy_ah", {
        // SAFETY: caller passes an AH (or NULL).
        let Some(shell) = (unsafe { our_ah(ah) }) else {
            return match real::ibv_destroy_ah() {
                // SAFETY: not ours, so the real library's AH.
                Some(real) if !ah.is_null() => unsafe { real(ah) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        shell.inner.destroy();
        // SAFETY: ours; the application gives it up here (sends already posted hold their
        // own reference to the handle).
        unsafe { AhShell::destroy(ah) };
        0
    })
}

/// The address vector that answers a received UD message (IBA 11.2.3.3 / rdma-core's
/// `ibv_init_ah_from_wc`): back to its source LID and SL, and with a GRH, to its source GID
/// from the GID of this port it was sent to.
fn reply_av(port_num: u8, wc: &ibv_wc, grh: Option<&ibv_grh>) -> Result<ibv_ah_attr, VerbsError> {
    if port_num != device::PORT_NUM {
        return Err(VerbsError::Invalid("port_num"));
    }
    let mut attr = ibv_ah_attr {
        dlid: wc.slid,
        sl: wc.sl,
        src_path_bits: wc.dlid_path_bits,
        port_num,
        ..Default::default()
    };
    if wc.wc_flags & WC_GRH != 0 {
        let grh = grh.ok_or(VerbsError::Invalid(
            "grh is NULL but the completion has one",
        ))?;
        let engine = Engine::get()?;
        // SAFETY: every bit pattern of the union is a valid byte array.
        let (sgid, dgid) = unsafe { (grh.sgid.raw, grh.dgid.raw) };
        if dgid != engine.gid {
            return Err(VerbsError::Invalid(
                "the GRH's destination GID is not this port's",
            ));
        }
        let vtf = u32::from_be(grh.version_tclass_flow);
        attr.is_global = 1;
        attr.grh = ibv_global_route {
            dgid: ibv_gid { raw: sgid },
            flow_label: vtf & 0xf_ffff,
            sgid_index: 0,
            hop_limit: 0xff,
            traffic_class: ((vtf >> 20) & 0xff) as u8,
        };
    }
    Ok(attr)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_init_ah_from_wc(
    ctx: *mut ibv_context,
    port_num: u8,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    ah_attr: *mut ibv_ah_attr,
) -> c_int {
    ffi_boundary!("ibv_init_ah_from_wc", {
        // SAFETY: only compares the pointer against ugdr's registry.
        if unsafe { owned_context(ctx) }.is_none() {
            return match real::ibv_init_ah_from_wc() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx, port_num, wc, grh, ah_attr) },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        if wc.is_null() || ah_attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's completion and (optional) GRH, read only.
        match reply_av(port_num, unsafe { &*wc }, unsafe { grh.as_ref() }) {
            Ok(attr) => {
                // SAFETY: the caller's out-parameter, checked non-NULL.
                unsafe { *ah_attr = attr };
                0
            }
            Err(e) => {
                tracing::debug!("ibv_init_ah_from_wc: {e}");
                c_int::fail(e.errno())
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_ah_from_wc(
    pd: *mut ibv_pd,
    wc: *mut ibv_wc,
    grh: *mut ibv_grh,
    port_num: u8,
) -> *mut ibv_ah {
    ffi_boundary!("ibv_create_ah_from_wc", {
        // SAFETY: caller passes a PD (or NULL).
        if unsafe { our_pd(pd) }.is_none() {
            return match real::ibv_create_ah_from_wc() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, wc, grh, port_num) },
                _ => <*mut ibv_ah>::fail(libc::EINVAL),
            };
        }
        if wc.is_null() {
            return <*mut ibv_ah>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's completion and (optional) GRH, read only.
        let result = reply_av(port_num, unsafe { &*wc }, unsafe { grh.as_ref() })
            .and_then(|attr| create_ah(pd, &attr));
        match result {
            Ok(ah) => ah,
            Err(e) => {
                tracing::debug!("ibv_create_ah_from_wc: {e}");
                <*mut ibv_ah>::fail(e.errno())
            }
        }
    })
}
