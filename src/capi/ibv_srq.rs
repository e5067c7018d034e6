//! Shared receive queues.

use super::boundary::{Fallback, ffi_boundary, status};
use super::layout::{PdShell, SrqShell, owned_context};
use super::passthrough::real_functions;
use crate::engine::Engine;
use crate::fake_verbs::srq::SharedReceiveQueue;
use crate::fake_verbs::work::RecvRequest;
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_void};

mod real {
    use super::*;

    real_functions! {
        ibv_create_srq @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_srq_init_attr) -> *mut ibv_srq;
        ibv_modify_srq @ "IBVERBS_1.1": fn(*mut ibv_srq, *mut ibv_srq_attr, c_int) -> c_int;
        ibv_query_srq @ "IBVERBS_1.1": fn(*mut ibv_srq, *mut ibv_srq_attr) -> c_int;
        ibv_destroy_srq @ "IBVERBS_1.1": fn(*mut ibv_srq) -> c_int;
    }
}

/// # Safety
/// `srq` is NULL or a valid `ibv_srq`.
pub(crate) unsafe fn our_srq<'a>(srq: *mut ibv_srq) -> Option<&'a SrqShell> {
    if srq.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_srq has a readable `context` field.
    unsafe { owned_context((*srq).context)? };
    // SAFETY: its context is ours, so it is an SrqShell.
    unsafe { SrqShell::from_raw(srq) }
}

pub(super) fn create(
    pd: *mut ibv_pd,
    srq_context: *mut c_void,
    attr: &mut ibv_srq_attr,
) -> *mut ibv_srq {
    // SAFETY: callers checked that the PD's context is ugdr's.
    let Some(pd_shell) = (unsafe { PdShell::from_raw(pd) }) else {
        return <*mut ibv_srq>::fail(libc::EINVAL);
    };
    match SharedReceiveQueue::new(&pd_shell.inner, attr.max_wr, attr.max_sge, attr.srq_limit) {
        Ok(srq) => {
            // SAFETY: reading the context field of ugdr's own PD.
            let context = unsafe { (*pd_shell.as_raw()).context };
            let ibv = ibv_srq {
                context,
                srq_context,
                pd,
                ..Default::default()
            };
            let raw = SrqShell::into_raw(Box::new(SrqShell {
                ibv: UnsafeCell::new(ibv),
                inner: std::sync::Arc::clone(&srq),
            }));
            srq.set_handle(raw as usize);
            raw
        }
        Err(e) => <*mut ibv_srq>::fail(e.errno()),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_srq(
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> *mut ibv_srq {
    ffi_boundary!("ibv_create_srq", {
        if pd.is_null() || attr.is_null() {
            return <*mut ibv_srq>::fail(libc::EINVAL);
        }
        // SAFETY: a valid ibv_pd has a readable context field.
        if unsafe { owned_context((*pd).context) }.is_none() {
            return match real::ibv_create_srq() {
                // SAFETY: not ugdr's PD, so the real library's.
                Some(f) => unsafe { f(pd, attr) },
                None => <*mut ibv_srq>::fail(libc::EINVAL),
            };
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &mut *attr };
        create(pd, a.srq_context, &mut a.attr)
    })
}

/// `verbs_context.create_srq_ex`: basic and XRC SRQs (tag matching is not carried).
pub(crate) unsafe extern "C" fn create_srq_ex_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_srq_init_attr_ex,
) -> *mut ibv_srq {
    ffi_boundary!("ibv_create_srq_ex", {
        if attr.is_null() {
            return <*mut ibv_srq>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &mut *attr };
        let xrc = a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0 != 0
            && a.srq_type == ibv_srq_type::IBV_SRQT_XRC;
        if xrc {
            return super::ibv_xrc::create_xrc_srq(ctx, a);
        }
        let supported = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0
            | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0;
        if a.comp_mask & !supported != 0
            || (a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0 != 0
                && a.srq_type != ibv_srq_type::IBV_SRQT_BASIC)
        {
            return <*mut ibv_srq>::fail(libc::EOPNOTSUPP);
        }
        // SAFETY: the PD (if any) is the application's.
        if a.pd.is_null() || unsafe { (*a.pd).context } != ctx {
            return <*mut ibv_srq>::fail(libc::EINVAL);
        }
        create(a.pd, a.srq_context, &mut a.attr)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_modify_srq(
    srq: *mut ibv_srq,
    attr: *mut ibv_srq_attr,
    mask: c_int,
) -> c_int {
    ffi_boundary!("ibv_modify_srq", {
        // SAFETY: caller passes an SRQ (or NULL).
        let Some(shell) = (unsafe { our_srq(srq) }) else {
            return match real::ibv_modify_srq() {
                // SAFETY: not ugdr's SRQ, so the real library's.
                Some(f) if !srq.is_null() => unsafe { f(srq, attr, mask) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if attr.is_null()
            || mask as u32
                & !(ibv_srq_attr_mask::IBV_SRQ_MAX_WR.0 | ibv_srq_attr_mask::IBV_SRQ_LIMIT.0)
                != 0
        {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &*attr };
        let max_wr = (mask as u32 & ibv_srq_attr_mask::IBV_SRQ_MAX_WR.0 != 0).then_some(a.max_wr);
        let limit = (mask as u32 & ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 != 0).then_some(a.srq_limit);
        status(shell.inner.modify(max_wr, limit))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int {
    ffi_boundary!("ibv_query_srq", {
        // SAFETY: caller passes an SRQ (or NULL).
        let Some(shell) = (unsafe { our_srq(srq) }) else {
            return match real::ibv_query_srq() {
                // SAFETY: not ugdr's SRQ, so the real library's.
                Some(f) if !srq.is_null() => unsafe { f(srq, attr) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        let (max_wr, max_sge, srq_limit) = shell.inner.attributes();
        // SAFETY: the caller's out-parameter, checked non-NULL.
        unsafe {
            attr.write(ibv_srq_attr {
                max_wr,
                max_sge,
                srq_limit,
            })
        };
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int {
    ffi_boundary!("ibv_destroy_srq", {
        // SAFETY: caller passes an SRQ (or NULL).
        let Some(shell) = (unsafe { our_srq(srq) }) else {
            return match real::ibv_destroy_srq() {
                // SAFETY: not ugdr's SRQ, so the real library's.
                Some(f) if !srq.is_null() => unsafe { f(srq) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if let Err(e) = shell.inner.destroy() {
            return status(Err(e));
        }
        shell.inner.context.forget_object(srq as usize);
        // SAFETY: ugdr's; the application gives it up here.
        unsafe { SrqShell::destroy(srq) };
        0
    })
}

/// `ibv_context_ops.post_srq_recv`: posts the list in order (bad_wr at the first refused WR),
/// then lets the QPs that waited for WRs deliver.
pub(crate) unsafe extern "C" fn post_srq_recv(
    srq: *mut ibv_srq,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    ffi_boundary!("ibv_post_srq_recv", {
        // SAFETY: only reached through ugdr's ops table, so `srq` is an SrqShell.
        let Some(shell) = (unsafe { SrqShell::from_raw(srq) }) else {
            return libc::EINVAL;
        };
        let mut cur = wr;
        let mut result = 0;
        while !cur.is_null() {
            // SAFETY: `cur` walks the application's NULL-terminated WR list.
            let w = unsafe { &*cur };
            // SAFETY: sg_list/num_sge of the same WR.
            let posted =
                unsafe { super::ibv_qp::read_sges(w.sg_list, w.num_sge, shell.inner.max_sge) }
                    .and_then(|sges| {
                        shell.inner.post(RecvRequest {
                            wr_id: w.wr_id,
                            sges,
                        })
                    });
            if let Err(e) = posted {
                if !bad_wr.is_null() {
                    // SAFETY: the caller's out-parameter.
                    unsafe { *bad_wr = cur };
                }
                result = e.errno();
                break;
            }
            cur = w.next;
        }
        if let (true, Some(engine)) = (shell.inner.has_starving(), Engine::running()) {
            shell.inner.deliver_to_starving(&engine.worker.lock());
        }
        result
    })
}
