//! The QPs, CQs and SRQs the CM creates for an id (`rdma_create_qp`, `rdma_create_srq`, their
//! `_ex` forms and destroys), `rdma_init_qp_attr`, and [`VerbsQp`]: an id's `ibv_qp` as the CM
//! drives it, through `ibv_modify_qp` as librdmacm does.

use super::id::{IdShell, our_id};
use super::{cm_boundary, cm_status, errno_or, fail, forward};
use crate::capi::boundary::{ffi_boundary, set_errno};
use crate::capi::ibv_cq::{
    ibv_create_comp_channel, ibv_create_cq, ibv_destroy_comp_channel, ibv_destroy_cq,
};
use crate::capi::ibv_qp::{create_qp_ex_op, ibv_destroy_qp, ibv_modify_qp, our_qp, qp_attr_from};
use crate::capi::ibv_srq::{ibv_create_srq, ibv_destroy_srq};
use crate::cm::{CmError, IdQp};
use crate::fake_verbs::qp::ModifyRequest;
use crate::fake_verbs::qp_state::QpState;
use crate::sys::*;
use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

/// An id's QP (ugdr's own `ibv_qp`), as the CM drives it.
pub(super) struct VerbsQp(*mut ibv_qp);

impl VerbsQp {
    /// The QP of the id behind `shell`, if it has one.
    pub(super) fn of(shell: &IdShell) -> Option<VerbsQp> {
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let qp = unsafe { (*shell.raw.get()).qp };
        (!qp.is_null()).then_some(VerbsQp(qp))
    }
}

/// The QP as the CM's calls take it.
pub(super) fn dyn_qp(qp: &Option<VerbsQp>) -> Option<&dyn IdQp> {
    qp.as_ref().map(|q| q as &dyn IdQp)
}

/// A modify the CM computed, as `ibv_qp_attr` and mask.
fn qp_attr_of(req: &ModifyRequest) -> (ibv_qp_attr, c_int) {
    let raw_state = |s: Option<QpState>| ibv_qp_state(s.map_or(0, QpState::to_raw));
    let attr = qp_attr_from(
        raw_state(req.state),
        raw_state(req.claimed_cur),
        &req.attrs,
        ibv_qp_cap::default(),
    );
    (attr, req.mask.bits() as c_int)
}

impl IdQp for VerbsQp {
    fn qp_num(&self) -> u32 {
        // SAFETY: a non-NULL QP of an id, created by rdma_create_qp.
        unsafe { (*self.0).qp_num }
    }

    fn has_srq(&self) -> bool {
        // SAFETY: as in qp_num.
        unsafe { !(*self.0).srq.is_null() }
    }

    fn modify(&self, req: &ModifyRequest) -> Result<(), CmError> {
        let (mut attr, mask) = qp_attr_of(req);
        // SAFETY: the id's QP (ugdr's) and a valid attribute struct.
        match unsafe { ibv_modify_qp(self.0, &mut attr, mask) } {
            0 => Ok(()),
            rc => Err(CmError::Os(rc)),
        }
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    qp_attr: *mut ibv_qp_attr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    cm_boundary!("rdma_init_qp_attr", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_init_qp_attr(id, qp_attr, qp_attr_mask));
        };
        if qp_attr.is_null() || qp_attr_mask.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let state = unsafe { (*qp_attr).qp_state };
        match shell.inner.init_qp_attr(QpState::from_raw(state.0)) {
            Ok(req) => {
                let (attr, mask) = qp_attr_of(&req);
                // SAFETY: the caller's out-structs, checked non-NULL.
                unsafe {
                    *qp_attr = attr;
                    *qp_attr_mask = mask;
                }
                0
            }
            Err(e) => cm_status(Err(e)),
        }
    })
}

fn create_cq(
    raw: &mut rdma_cm_id,
    id: *mut rdma_cm_id,
    size: u32,
    send: bool,
) -> Result<(), c_int> {
    if size == 0 {
        return Ok(());
    }
    // SAFETY: the id's context (ugdr's).
    let channel = unsafe { ibv_create_comp_channel(raw.verbs) };
    if channel.is_null() {
        return Err(errno_or(libc::ENOMEM));
    }
    // SAFETY: as above; cq_context is the id, as librdmacm's rdma_get_*_comp expect.
    let cq = unsafe { ibv_create_cq(raw.verbs, size as c_int, id.cast(), channel, 0) };
    if cq.is_null() {
        let errno = errno_or(libc::ENOMEM);
        // SAFETY: the channel just created.
        unsafe { ibv_destroy_comp_channel(channel) };
        return Err(errno);
    }
    if send {
        raw.send_cq_channel = channel;
        raw.send_cq = cq;
    } else {
        raw.recv_cq_channel = channel;
        raw.recv_cq = cq;
    }
    Ok(())
}

fn destroy_cqs(raw: &mut rdma_cm_id) {
    if raw.qp_type == ibv_qp_type::IBV_QPT_XRC_RECV && !raw.srq.is_null() {
        return; // the XRC SRQ completes on the id's receive CQ: they go with it
    }
    if !raw.recv_cq.is_null() {
        // SAFETY: CQs and channels here are the ones the CM created for this id.
        unsafe { ibv_destroy_cq(raw.recv_cq) };
    }
    if !raw.send_cq.is_null() && raw.send_cq != raw.recv_cq {
        // SAFETY: see above.
        unsafe { ibv_destroy_cq(raw.send_cq) };
    }
    if !raw.recv_cq_channel.is_null() {
        // SAFETY: see above.
        unsafe { ibv_destroy_comp_channel(raw.recv_cq_channel) };
    }
    if !raw.send_cq_channel.is_null() && raw.send_cq_channel != raw.recv_cq_channel {
        // SAFETY: see above.
        unsafe { ibv_destroy_comp_channel(raw.send_cq_channel) };
    }
    raw.recv_cq = ptr::null_mut();
    raw.send_cq = ptr::null_mut();
    raw.recv_cq_channel = ptr::null_mut();
    raw.send_cq_channel = ptr::null_mut();
}

fn create_qp(id: *mut rdma_cm_id, attr: &mut ibv_qp_init_attr_ex) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
    let raw = unsafe { &mut *shell.raw.get() };
    if !raw.qp.is_null() {
        return fail(libc::EINVAL);
    }
    let pd_bit = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0;
    if attr.comp_mask & pd_bit == 0 || attr.pd.is_null() {
        attr.comp_mask |= pd_bit;
        attr.pd = raw.pd;
    // SAFETY: a non-NULL PD from the application has a readable context.
    } else if unsafe { (*attr.pd).context } != raw.verbs {
        return fail(libc::EINVAL);
    }
    if attr.pd.is_null() || raw.verbs.is_null() {
        return fail(libc::EINVAL);
    }
    let xrcd_bit = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_XRCD.0;
    if raw.qp_type == ibv_qp_type::IBV_QPT_XRC_RECV
        && (attr.comp_mask & xrcd_bit == 0 || attr.xrcd.is_null())
    {
        match cm_xrcd(raw.verbs) {
            Ok(x) => attr.xrcd = x,
            Err(errno) => return fail(errno),
        }
        attr.comp_mask |= xrcd_bit;
    }
    if (!raw.recv_cq.is_null() && !attr.recv_cq.is_null() && raw.recv_cq != attr.recv_cq)
        || (!raw.send_cq.is_null() && !attr.send_cq.is_null() && raw.send_cq != attr.send_cq)
    {
        return fail(libc::EINVAL);
    }
    let send_size = if attr.send_cq.is_null() && raw.send_cq.is_null() {
        attr.cap.max_send_wr
    } else {
        0
    };
    let recv_size = if attr.recv_cq.is_null() && raw.recv_cq.is_null() {
        attr.cap.max_recv_wr
    } else {
        0
    };
    if let Err(errno) =
        create_cq(raw, id, recv_size, false).and_then(|()| create_cq(raw, id, send_size, true))
    {
        destroy_cqs(raw);
        return fail(errno);
    }
    if attr.send_cq.is_null() {
        attr.send_cq = raw.send_cq;
    }
    if attr.recv_cq.is_null() {
        attr.recv_cq = raw.recv_cq;
    }
    if attr.srq.is_null() {
        attr.srq = raw.srq;
    }
    // SAFETY: the id's context (ugdr's) and the caller's attributes.
    let qp = unsafe { create_qp_ex_op(raw.verbs, attr) };
    if qp.is_null() {
        let errno = errno_or(libc::EINVAL);
        destroy_cqs(raw);
        return fail(errno);
    }
    if let Err(e) = shell.inner.ready_new_qp(&VerbsQp(qp)) {
        // SAFETY: the QP just created.
        unsafe { ibv_destroy_qp(qp) };
        destroy_cqs(raw);
        return fail(e.errno());
    }
    // SAFETY: our QP (just created).
    if let Some(q) = unsafe { our_qp(qp) } {
        shell.inner.attach_qp(Some(Arc::clone(&q.inner)));
    }
    // SAFETY: our QP's pd field.
    raw.pd = unsafe { (*qp).pd };
    raw.qp = qp;
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    qp_init_attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    cm_boundary!("rdma_create_qp_ex", {
        if our_id(id).is_none() {
            return forward!(rdma_create_qp_ex(id, qp_init_attr));
        }
        // SAFETY: the caller's attribute struct (or NULL).
        match unsafe { qp_init_attr.as_mut() } {
            Some(attr) => create_qp(id, attr),
            None => fail(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    cm_boundary!("rdma_create_qp", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_create_qp(id, pd, qp_init_attr));
        };
        // SAFETY: the caller's attribute struct (or NULL).
        let Some(a) = (unsafe { qp_init_attr.as_mut() }) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let id_pd = unsafe { (*shell.raw.get()).pd };
        let mut ex = ibv_qp_init_attr_ex {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
            comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0,
            pd: if pd.is_null() { id_pd } else { pd },
            ..Default::default()
        };
        let rc = create_qp(id, &mut ex);
        a.send_cq = ex.send_cq;
        a.recv_cq = ex.recv_cq;
        a.srq = ex.srq;
        a.cap = ex.cap;
        rc
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_qp", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_destroy_qp(id) or set_errno(libc::EINVAL));
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        shell.inner.attach_qp(None);
        if !raw.qp.is_null() {
            // SAFETY: the id's QP.
            unsafe { ibv_destroy_qp(raw.qp) };
            raw.qp = ptr::null_mut();
        }
        destroy_cqs(raw);
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    cm_boundary!("rdma_create_srq", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_create_srq(id, pd, attr));
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        let pd = if pd.is_null() { raw.pd } else { pd };
        if attr.is_null() || pd.is_null() {
            return fail(libc::EINVAL);
        }
        let srq = if raw.qp_type == ibv_qp_type::IBV_QPT_XRC_RECV {
            // SAFETY: the caller's attributes, checked non-NULL.
            let basic = unsafe { &mut *attr };
            let mut ex = ibv_srq_init_attr_ex {
                srq_context: basic.srq_context,
                attr: basic.attr,
                comp_mask: ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0,
                pd,
                ..Default::default()
            };
            let created = create_xrc_srq(raw, id, &mut ex);
            basic.attr = ex.attr;
            match created {
                Ok(srq) => srq,
                Err(errno) => return fail(errno),
            }
        } else {
            // SAFETY: the id's (or caller's) PD and the caller's attributes.
            unsafe { ibv_create_srq(pd, attr) }
        };
        if srq.is_null() {
            return fail(errno_or(libc::EINVAL));
        }
        raw.srq = srq;
        raw.pd = pd;
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> c_int {
    cm_boundary!("rdma_create_srq_ex", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_create_srq_ex(id, attr));
        };
        // SAFETY: the caller's attributes (or NULL).
        let Some(a) = (unsafe { attr.as_mut() }) else {
            return fail(libc::EINVAL);
        };
        let typed = a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0 != 0;
        if typed && a.srq_type == ibv_srq_type::IBV_SRQT_TM {
            return fail(libc::EOPNOTSUPP);
        }
        if typed && a.srq_type == ibv_srq_type::IBV_SRQT_XRC {
            // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
            let raw = unsafe { &mut *shell.raw.get() };
            let pd_bit = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0;
            if a.comp_mask & pd_bit == 0 || a.pd.is_null() {
                a.pd = raw.pd;
                a.comp_mask |= pd_bit;
            }
            return match create_xrc_srq(raw, id, a) {
                Ok(srq) => {
                    raw.srq = srq;
                    raw.pd = a.pd;
                    0
                }
                Err(errno) => fail(errno),
            };
        }
        let pd = if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0 != 0 {
            a.pd
        } else {
            ptr::null_mut()
        };
        let mut basic = ibv_srq_init_attr {
            srq_context: a.srq_context,
            attr: a.attr,
        };
        // SAFETY: forwarding valid pointers.
        unsafe { rdma_create_srq(id, pd, &mut basic) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_srq", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_destroy_srq(id) or set_errno(libc::EINVAL));
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        if !raw.srq.is_null() {
            // SAFETY: the id's SRQ.
            unsafe { ibv_destroy_srq(raw.srq) };
            raw.srq = ptr::null_mut();
            if raw.qp_type == ibv_qp_type::IBV_QPT_XRC_RECV && raw.qp.is_null() {
                destroy_cqs(raw); // kept for the XRC SRQ by rdma_destroy_qp
            }
        }
    })
}

/// The XRC domain of the CM's device (librdmacm's `ucma_get_xrcd`: one, no file, opened on
/// first use and kept, as the device itself is).
fn cm_xrcd(verbs: *mut ibv_context) -> Result<*mut ibv_xrcd, c_int> {
    static XRCD: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());
    let mut all = XRCD.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(&(_, x)) = all.iter().find(|(c, _)| *c == verbs as usize) {
        return Ok(x as *mut ibv_xrcd);
    }
    let mut attr = ibv_xrcd_init_attr {
        comp_mask: ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0
            | ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0,
        fd: -1,
        oflags: libc::O_CREAT,
    };
    // SAFETY: the id's context (ugdr's) and a valid attribute struct.
    let x = unsafe { crate::capi::ibv_xrc::open_xrcd_op(verbs, &mut attr) };
    if x.is_null() {
        return Err(errno_or(libc::ENOMEM));
    }
    all.push((verbs as usize, x as usize));
    Ok(x)
}

/// An XRC SRQ for an id (`rdma_create_srq` on an XRC_RECV id, `rdma_create_srq_ex` with
/// `IBV_SRQT_XRC`): in the CM's domain unless `ex` names one, completing on `ex`'s CQ or the
/// id's receive CQ (made here when the id has none), as librdmacm's.
fn create_xrc_srq(
    raw: &mut rdma_cm_id,
    id: *mut rdma_cm_id,
    ex: &mut ibv_srq_init_attr_ex,
) -> Result<*mut ibv_srq, c_int> {
    let xrcd_bit = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_XRCD.0;
    let cq_bit = ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_CQ.0;
    if ex.comp_mask & xrcd_bit == 0 || ex.xrcd.is_null() {
        ex.xrcd = cm_xrcd(raw.verbs)?;
    }
    if ex.comp_mask & cq_bit == 0 || ex.cq.is_null() {
        if raw.recv_cq.is_null() {
            create_cq(raw, id, ex.attr.max_wr, false)?;
        }
        ex.cq = raw.recv_cq;
    }
    ex.comp_mask |= xrcd_bit | cq_bit | ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0;
    ex.srq_type = ibv_srq_type::IBV_SRQT_XRC;
    let srq = crate::capi::ibv_xrc::create_xrc_srq(raw.verbs, ex);
    if srq.is_null() {
        return Err(errno_or(libc::EINVAL));
    }
    Ok(srq)
}
