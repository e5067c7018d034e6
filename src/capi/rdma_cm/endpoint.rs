//! The synchronous endpoint API of `rdma_server`/`rdma_client` (librdmacm's `rdma_create_ep`,
//! `rdma_destroy_ep`, `rdma_get_request`): compositions of the other `rdma_*` calls on a
//! synchronous id, driven by an `rdma_addrinfo`.

use super::addrinfo::RAI_PASSIVE;
use super::event::next_sync_event;
use super::id::{
    create_id, our_id, rdma_bind_addr, rdma_destroy_id, rdma_resolve_addr, rdma_resolve_route,
};
use super::qp::{rdma_create_qp, rdma_destroy_qp, rdma_destroy_srq};
use super::{call_real, cm_boundary, cm_status, errno_or, fail, forward};
use crate::capi::boundary::{ffi_boundary, set_errno};
use crate::capi::caller::{Caller, export_with_caller};
use crate::capi::ibv_pd_mr::our_pd;
use crate::cm::request_result;
use crate::sys::*;
use std::os::raw::c_int;
use std::ptr;

/// How long `rdma_create_ep` lets address and route resolution take, in ms.
const RESOLVE_TIMEOUT_MS: c_int = 2000;

export_with_caller! {
    /// A synchronous endpoint of ugdr's; the real librdmacm's for a PD of a real device, or
    /// for a caller whose verbs are the real ones.
    fn rdma_create_ep(
        id: *mut *mut rdma_cm_id,
        res: *mut rdma_addrinfo,
        pd: *mut ibv_pd,
        qp_init_attr: *mut ibv_qp_init_attr
    ) -> c_int => create_ep_from, caller in "r8" / "x4"
}

unsafe extern "C" fn create_ep_from(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
    caller: Caller,
) -> c_int {
    cm_boundary!("rdma_create_ep", {
        // SAFETY: the caller's PD (or NULL): ugdr's, or a real device's.
        let real_pd = !pd.is_null() && unsafe { our_pd(pd) }.is_none();
        if real_pd || caller.real_verbs_user().is_some() {
            return call_real!(rdma_create_ep(id, res, pd, qp_init_attr) or fail(libc::ENODEV));
        }
        // SAFETY: the caller's addrinfo (or NULL).
        let Some(res) = (unsafe { res.as_ref() }) else {
            return fail(libc::EINVAL);
        };
        if id.is_null() {
            return fail(libc::EINVAL);
        }
        let mut cm_id: *mut rdma_cm_id = ptr::null_mut();
        let rc = create_id(
            ptr::null_mut(),
            &mut cm_id,
            ptr::null_mut(),
            res.ai_port_space as u32,
            res.ai_qp_type as u32,
        );
        if rc != 0 {
            return rc;
        }
        // SAFETY: every step below works on the id just created and the caller's pointers.
        let rc = unsafe { setup_ep(cm_id, res, pd, qp_init_attr) };
        if rc != 0 {
            let errno = errno_or(libc::EINVAL);
            // SAFETY: the id just created.
            unsafe { rdma_destroy_ep(cm_id) };
            return fail(errno);
        }
        // SAFETY: checked non-NULL.
        unsafe { *id = cm_id };
        0
    })
}

/// # Safety
/// `id` is a fresh synchronous id; `pd`, `qp_init_attr` are the caller's (or NULL).
unsafe fn setup_ep(
    id: *mut rdma_cm_id,
    res: &rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    if res.ai_flags & RAI_PASSIVE != 0 {
        // SAFETY: forwarding the caller's address.
        let rc = unsafe { rdma_bind_addr(id, res.ai_src_addr.cast()) };
        if rc != 0 {
            return rc;
        }
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        if !pd.is_null() {
            raw.pd = pd;
        }
        // SAFETY: the caller's attributes (or NULL); the id's own slot.
        if let Some(a) = unsafe { qp_init_attr.as_ref() } {
            let mut a = *a;
            a.qp_type = ibv_qp_type(res.ai_qp_type as u32);
            // SAFETY: see above.
            unsafe { *shell.qp_init_attr.get() = Some(a) };
        }
        return 0;
    }
    // SAFETY: forwarding the caller's addresses.
    let rc = unsafe {
        rdma_resolve_addr(
            id,
            res.ai_src_addr.cast(),
            res.ai_dst_addr.cast(),
            RESOLVE_TIMEOUT_MS,
        )
    };
    if rc != 0 {
        return rc;
    }
    // SAFETY: the id just resolved.
    let rc = unsafe { rdma_resolve_route(id, RESOLVE_TIMEOUT_MS) };
    if rc != 0 {
        return rc;
    }
    // SAFETY: the caller's attributes (or NULL).
    if let Some(a) = unsafe { qp_init_attr.as_mut() } {
        a.qp_type = ibv_qp_type(res.ai_qp_type as u32);
        // SAFETY: forwarding.
        let rc = unsafe { rdma_create_qp(id, pd, a) };
        if rc != 0 {
            return rc;
        }
    }
    if res.ai_connect_len > 0 && !res.ai_connect.is_null() {
        // SAFETY: the addrinfo's connect data of ai_connect_len bytes.
        let data =
            unsafe { std::slice::from_raw_parts(res.ai_connect.cast::<u8>(), res.ai_connect_len) };
        shell.inner.set_connect_prefix(data.to_vec());
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_ep", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_destroy_ep(id) or set_errno(libc::EINVAL));
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let (qp, srq) = unsafe { ((*shell.raw.get()).qp, (*shell.raw.get()).srq) };
        if !qp.is_null() {
            // SAFETY: the id's QP.
            unsafe { rdma_destroy_qp(id) };
        }
        if !srq.is_null() {
            // SAFETY: the id's SRQ.
            unsafe { rdma_destroy_srq(id) };
        }
        // SAFETY: the caller gives the id up.
        unsafe { rdma_destroy_id(id) };
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> c_int {
    cm_boundary!("rdma_get_request", {
        let Some(shell) = our_id(listen) else {
            return forward!(rdma_get_request(listen, id));
        };
        if !shell.inner.channel().is_sync() || id.is_null() {
            return fail(libc::EINVAL);
        }
        let delivered = match next_sync_event(shell) {
            Ok(d) => d,
            Err(errno) => return fail(errno),
        };
        // SAFETY: the listener's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        if let Err(e) = request_result(delivered.kind, delivered.status) {
            raw.event = delivered.event;
            return cm_status(Err(e));
        }
        // SAFETY: the event just made.
        let ev = unsafe { &*delivered.event };
        // SAFETY: the listener's stored attributes.
        if let Some(mut attr) = unsafe { *shell.qp_init_attr.get() } {
            // SAFETY: the new id and attributes.
            let rc = unsafe { rdma_create_qp(ev.id, raw.pd, &mut attr) };
            if rc != 0 {
                raw.event = delivered.event;
                return rc;
            }
        }
        // SAFETY: the caller's out-pointer; the new id keeps its request event.
        unsafe {
            *id = ev.id;
            (*ev.id).event = delivered.event;
        }
        0
    })
}
