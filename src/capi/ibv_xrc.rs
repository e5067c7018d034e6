//! XRC at the C boundary (`verbs_context` ops behind rdma-core's inlines): `ibv_open_xrcd` /
//! `ibv_close_xrcd`, XRC SRQs (`ibv_create_srq_ex` with `IBV_SRQT_XRC`), `ibv_get_srq_num`,
//! XRC target QPs (`ibv_create_qp_ex` with `IBV_QPT_XRC_RECV` and an xrcd) and `ibv_open_qp`.
//! What a domain is in ugdr: `fake_verbs::xrc`; the target QP: `fake_verbs::qp::xrc`.

use super::boundary::{Fallback, ffi_boundary};
use super::ibv_srq::our_srq;
use super::layout::{ContextShell, QpShell, RESOURCE_QP, ShellMemory, WrBatch, XrcdShell};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::qp::QueuePair;
use crate::fake_verbs::xrc::{self, XrcdHandle};
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::c_int;
use std::sync::Arc;

/// The xrcd shell behind `xrcd` if it is ugdr's and belongs to `ctx`.
///
/// # Safety
/// `xrcd` is NULL or a valid `ibv_xrcd`.
unsafe fn our_xrcd<'a>(xrcd: *mut ibv_xrcd, ctx: *mut ibv_context) -> Option<&'a XrcdShell> {
    // SAFETY: a valid ibv_xrcd has a readable `context` field.
    if xrcd.is_null() || unsafe { (*xrcd).context } != ctx || !ContextShell::is_ours(ctx) {
        return None;
    }
    // SAFETY: its context is ours, so it is an XrcdShell.
    unsafe { XrcdShell::from_raw(xrcd) }
}

/// `verbs_context.open_xrcd`. FD and OFLAGS are required (as `ibv_cmd_open_xrcd`); the
/// file's `st_dev`/`st_ino` name the domain.
pub(crate) unsafe extern "C" fn open_xrcd_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_xrcd_init_attr,
) -> *mut ibv_xrcd {
    ffi_boundary!("ibv_open_xrcd", {
        // SAFETY: ctx is the application's context (checked ours below).
        let Some(context) =
            (unsafe { ContextShell::from_raw(ctx) }).filter(|_| ContextShell::is_ours(ctx))
        else {
            return <*mut ibv_xrcd>::fail(libc::EINVAL);
        };
        if attr.is_null() {
            return <*mut ibv_xrcd>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { *attr };
        let fd_bit = ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0;
        let oflags_bit = ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0;
        if a.comp_mask >= ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_RESERVED.0 {
            return <*mut ibv_xrcd>::fail(libc::EOPNOTSUPP);
        }
        if a.comp_mask & fd_bit == 0 || a.comp_mask & oflags_bit == 0 {
            return <*mut ibv_xrcd>::fail(libc::EINVAL);
        }
        let file = if a.fd == -1 {
            None
        } else {
            // SAFETY: fstat writes into a zeroed stat of our own.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: any fd value is safe to ask about; EBADF when it is none.
            if unsafe { libc::fstat(a.fd, &mut st) } != 0 {
                return <*mut ibv_xrcd>::fail(libc::EBADF);
            }
            Some((st.st_dev, st.st_ino))
        };
        let create = a.oflags & libc::O_CREAT != 0;
        let exclusive = a.oflags & libc::O_EXCL != 0;
        match XrcdHandle::open(&context.inner, file, create, exclusive) {
            Ok(handle) => XrcdShell::into_raw(Box::new(XrcdShell {
                ibv: UnsafeCell::new(ibv_xrcd { context: ctx }),
                inner: handle,
            })),
            Err(e) => <*mut ibv_xrcd>::fail(e.errno()),
        }
    })
}

/// `verbs_context.close_xrcd`: EBUSY while SRQs or QPs made through this handle remain.
pub(crate) unsafe extern "C" fn close_xrcd_op(xrcd: *mut ibv_xrcd) -> c_int {
    ffi_boundary!("ibv_close_xrcd", {
        if xrcd.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: reached through ugdr's ops table, so a ugdr xrcd (its context is ours).
        let Some(shell) = (unsafe { our_xrcd(xrcd, (*xrcd).context) }) else {
            return libc::EINVAL;
        };
        if let Err(e) = shell.inner.check_closable() {
            return e.errno();
        }
        // SAFETY: ours; the application gives it up here.
        unsafe { XrcdShell::destroy(xrcd) };
        0
    })
}

/// `ibv_create_srq_ex` with `IBV_SRQT_XRC`: needs an xrcd, a CQ and a PD of this context.
pub(crate) fn create_xrc_srq(ctx: *mut ibv_context, a: &mut ibv_srq_init_attr_ex) -> *mut ibv_srq {
    let needed = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_XRCD.0
        | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_CQ.0
        | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0;
    if a.comp_mask & needed != needed {
        return <*mut ibv_srq>::fail(libc::EINVAL);
    }
    // SAFETY: the application's xrcd and CQ pointers (or NULL); ownership checked.
    let (xrcd, cq) = unsafe { (our_xrcd(a.xrcd, ctx), super::ibv_qp::our_cq(a.cq)) };
    let (Some(xrcd), Some(cq)) = (xrcd, cq) else {
        return <*mut ibv_srq>::fail(libc::EINVAL);
    };
    // SAFETY: the PD (if any) is the application's.
    if a.pd.is_null() || unsafe { (*a.pd).context } != ctx {
        return <*mut ibv_srq>::fail(libc::EINVAL);
    }
    let raw = super::ibv_srq::create(a.pd, a.srq_context, &mut a.attr);
    // SAFETY: just created by ugdr (or NULL).
    if let Some(srq) = unsafe { our_srq(raw) } {
        xrc::attach_srq(&srq.inner, &xrcd.inner, &cq.inner);
    }
    raw
}

/// `verbs_context.get_srq_num`: the number an XRC_SEND WR names the SRQ by (XRC SRQs only).
pub(crate) unsafe extern "C" fn get_srq_num_op(srq: *mut ibv_srq, srq_num: *mut u32) -> c_int {
    ffi_boundary!("ibv_get_srq_num", {
        // SAFETY: reached through ugdr's ops table with the application's SRQ.
        let Some(shell) = (unsafe { our_srq(srq) }) else {
            return libc::EINVAL;
        };
        match shell.inner.xrc() {
            Some(x) if !srq_num.is_null() => {
                // SAFETY: the caller's out-parameter, checked non-NULL.
                unsafe { *srq_num = x.number };
                0
            }
            _ => libc::EINVAL,
        }
    })
}

/// A C handle for target QP `qp`: a fresh `ibv_qp_ex` with no PD, CQs or SRQ, as rdma-core
/// gives XRC_RECV QPs.
fn target_shell(
    ctx: *mut ibv_context,
    qp: &Arc<QueuePair>,
    qp_context: *mut std::os::raw::c_void,
    xrcd: &Arc<XrcdHandle>,
) -> Result<*mut ibv_qp, VerbsError> {
    let memory = ShellMemory::<QpShell>::reserve(None, RESOURCE_QP)?;
    let base = ibv_qp {
        context: ctx,
        qp_context,
        handle: qp.qp_num,
        qp_num: qp.qp_num,
        state: ibv_qp_state(qp.state().to_raw()),
        qp_type: ibv_qp_type::IBV_QPT_XRC_RECV,
        ..Default::default()
    };
    let mut ibv = ibv_qp_ex {
        qp_base: base,
        ..Default::default()
    };
    super::ops::install_qp_ops(&mut ibv);
    let raw = memory
        .place(QpShell {
            ibv: UnsafeCell::new(ibv),
            inner: Arc::clone(qp),
            batch: UnsafeCell::new(WrBatch::default()),
        })
        .cast::<ibv_qp>();
    qp.add_xrc_handle(raw as usize, xrcd);
    Ok(raw)
}

/// `ibv_create_qp_ex` with `IBV_QPT_XRC_RECV`: a target QP on `attr->xrcd` (its PD, CQs,
/// SRQ and capabilities are not used, as by mlx5; the granted caps are 0).
pub(crate) fn create_target_qp(ctx: *mut ibv_context, a: &mut ibv_qp_init_attr_ex) -> *mut ibv_qp {
    let xrcd_bit = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_XRCD.0;
    // SAFETY: the application's xrcd pointer (or NULL); ownership checked.
    let Some(xrcd) = (unsafe { our_xrcd(a.xrcd, ctx) }).filter(|_| a.comp_mask & xrcd_bit != 0)
    else {
        return <*mut ibv_qp>::fail(libc::EINVAL);
    };
    let created = Engine::get().map_err(VerbsError::from).and_then(|engine| {
        let qp = QueuePair::new_xrc_target(engine.allocate_qpn(), &xrcd.inner, engine.lid);
        let raw = target_shell(ctx, &qp, a.qp_context, &xrcd.inner)?;
        xrcd.inner.domain.add_target(&qp);
        engine.register_qp(qp.qp_num, qp);
        Ok(raw)
    });
    match created {
        Ok(raw) => {
            a.cap = ibv_qp_cap::default();
            // As libibverbs: the handle keeps the PD and CQs it was given (unused by the QP).
            let pd_bit = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0;
            // SAFETY: the shell just made; the application has not seen it yet.
            unsafe {
                (*raw).pd = if a.comp_mask & pd_bit != 0 {
                    a.pd
                } else {
                    std::ptr::null_mut()
                };
                (*raw).send_cq = a.send_cq;
                (*raw).recv_cq = a.recv_cq;
            }
            raw
        }
        Err(e) => <*mut ibv_qp>::fail(e.errno()),
    }
}

/// `verbs_context.open_qp`: another handle of the XRC target QP numbered `qp_num` in the
/// domain of `attr->xrcd` (EINVAL when there is none, as the kernel's).
pub(crate) unsafe extern "C" fn open_qp_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_open_attr,
) -> *mut ibv_qp {
    ffi_boundary!("ibv_open_qp", {
        if attr.is_null() {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { *attr };
        if a.comp_mask >= ibv_qp_open_attr_mask::IBV_QP_OPEN_ATTR_RESERVED.0 {
            return <*mut ibv_qp>::fail(libc::EOPNOTSUPP);
        }
        let needed = ibv_qp_open_attr_mask::IBV_QP_OPEN_ATTR_NUM.0
            | ibv_qp_open_attr_mask::IBV_QP_OPEN_ATTR_XRCD.0
            | ibv_qp_open_attr_mask::IBV_QP_OPEN_ATTR_TYPE.0;
        if a.comp_mask & needed != needed || a.qp_type != ibv_qp_type::IBV_QPT_XRC_RECV {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        // SAFETY: the application's xrcd pointer (or NULL); ownership checked.
        let Some(xrcd) = (unsafe { our_xrcd(a.xrcd, ctx) }) else {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        };
        let Some(qp) = xrcd.inner.domain.target(a.qp_num) else {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        };
        let qp_context = if a.comp_mask & ibv_qp_open_attr_mask::IBV_QP_OPEN_ATTR_CONTEXT.0 != 0 {
            a.qp_context
        } else {
            std::ptr::null_mut()
        };
        match target_shell(ctx, &qp, qp_context, &xrcd.inner) {
            Ok(raw) => raw,
            Err(e) => <*mut ibv_qp>::fail(e.errno()),
        }
    })
}

/// `ibv_destroy_qp` of one handle of an XRC target QP that has others: only the handle goes.
/// Returns false when `qp` was the last handle (the caller destroys the QP itself).
///
/// # Safety
/// `qp` is ugdr's QP `shell`, not used again when this returns true.
pub(crate) unsafe fn close_target_handle(qp: *mut ibv_qp, shell: &QpShell) -> bool {
    if shell.inner.xrc_domain().is_none() || shell.inner.remove_xrc_handle(qp as usize) {
        return false;
    }
    shell.inner.pd.context.forget_object(qp as usize);
    // SAFETY: forwarded contract.
    unsafe { QpShell::destroy(qp.cast()) };
    true
}
