//! The connection handshake at the C boundary: `rdma_listen`, `rdma_connect`, `rdma_accept`,
//! `rdma_reject` (and `_ece`), `rdma_establish`, `rdma_disconnect` and `rdma_notify` read
//! `rdma_conn_param`, hand the id's QP to [`crate::cm`] and, for a synchronous id, wait for
//! the event the call raises.

use super::device::cm_device;
use super::event::{complete, release_kept_event};
use super::id::{IdShell, our_id, refresh};
use super::qp::{VerbsQp, dyn_qp};
use super::{cm_boundary, cm_status, fail, forward};
use crate::cm::{
    CmError, CmId, ConnParam, IdQp, REJ_CONSUMER_DEFINED, REJ_VENDOR_OPTION_NOT_SUPPORTED,
};
use crate::sys::*;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// # Safety
/// `data` points to `len` readable bytes when non-NULL.
unsafe fn private_bytes(data: *const c_void, len: u8) -> Vec<u8> {
    if data.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's buffer of `len` bytes.
    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }.to_vec()
}

/// The application's `rdma_conn_param` (NULL: none).
///
/// # Safety
/// `param` is NULL or a valid `rdma_conn_param` whose private data has `private_data_len`
/// readable bytes.
unsafe fn read_conn_param(param: *const rdma_conn_param) -> Option<ConnParam> {
    // SAFETY: the caller's parameters (or NULL).
    let p = unsafe { param.as_ref() }?;
    Some(ConnParam {
        // SAFETY: the caller's private data of private_data_len bytes.
        private_data: unsafe { private_bytes(p.private_data, p.private_data_len) },
        responder_resources: p.responder_resources,
        initiator_depth: p.initiator_depth,
        flow_control: p.flow_control,
        retry_count: p.retry_count,
        rnr_retry_count: p.rnr_retry_count,
        srq: p.srq,
        qp_num: p.qp_num,
        group: None,
    })
}

/// [`CmId::connect_with`] or [`CmId::accept_with`].
type HandshakeSide =
    fn(&Arc<CmId>, Option<&ConnParam>, Option<&dyn IdQp>, u8) -> Result<(), CmError>;

/// What `rdma_connect` and `rdma_accept` share: `side` (the CM's connect or accept) called
/// with the application's parameters, the id's QP and the device's depth limit. Returns the
/// id, or the call's failure value.
///
/// # Safety
/// `conn_param` as for [`read_conn_param`].
unsafe fn connect_or_accept<'a>(
    id: *mut rdma_cm_id,
    conn_param: *const rdma_conn_param,
    side: HandshakeSide,
) -> Result<&'a IdShell, c_int> {
    let shell = our_id(id).ok_or_else(|| fail(libc::EINVAL))?;
    let dev = cm_device().map_err(fail)?;
    // SAFETY: the caller's parameters (or NULL).
    let param = unsafe { read_conn_param(conn_param) };
    let qp = VerbsQp::of(shell);
    match side(&shell.inner, param.as_ref(), dyn_qp(&qp), dev.max_rd_atom) {
        Ok(()) => Ok(shell),
        Err(e) => Err(cm_status(Err(e))),
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    cm_boundary!("rdma_listen", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_listen(id, backlog));
        };
        let r = shell.inner.listen(backlog);
        if r.is_ok() {
            // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
            let bound_device = unsafe { !(*shell.raw.get()).verbs.is_null() };
            refresh(shell, bound_device);
        }
        cm_status(r)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_connect(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    cm_boundary!("rdma_connect", {
        if our_id(id).is_none() {
            return forward!(rdma_connect(id, conn_param));
        }
        // SAFETY: the caller's parameters (or NULL).
        match unsafe { connect_or_accept(id, conn_param, CmId::connect_with) } {
            Ok(shell) => complete(shell),
            Err(rc) => rc,
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_accept(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    cm_boundary!("rdma_accept", {
        if our_id(id).is_none() {
            return forward!(rdma_accept(id, conn_param));
        }
        // SAFETY: the caller's parameters (or NULL).
        let shell = match unsafe { connect_or_accept(id, conn_param, CmId::accept_with) } {
            Ok(shell) => shell,
            Err(rc) => return rc,
        };
        if !shell.inner.accept_raises_event() {
            // No event to wait for: a synchronous id lets its request go.
            if shell.inner.channel().is_sync() {
                // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
                release_kept_event(unsafe { &mut *shell.raw.get() });
            }
            return 0;
        }
        complete(shell)
    })
}

fn reject(id: *mut rdma_cm_id, data: *const c_void, len: u8, reason: u8) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    // SAFETY: the caller's private data of `len` bytes.
    let private = unsafe { private_bytes(data, len) };
    cm_status(shell.inner.reject(&private, reason))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    cm_boundary!("rdma_reject", {
        if our_id(id).is_none() {
            return forward!(rdma_reject(id, private_data, private_data_len));
        }
        reject(id, private_data, private_data_len, REJ_CONSUMER_DEFINED)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    cm_boundary!("rdma_reject_ece", {
        if our_id(id).is_none() {
            return forward!(rdma_reject_ece(id, private_data, private_data_len));
        }
        reject(
            id,
            private_data,
            private_data_len,
            REJ_VENDOR_OPTION_NOT_SUPPORTED,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_establish", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_establish(id));
        };
        let qp = VerbsQp::of(shell);
        cm_status(shell.inner.establish_own_qp(dyn_qp(&qp)))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_disconnect", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_disconnect(id));
        };
        let qp = VerbsQp::of(shell);
        match shell.inner.disconnect_with(dyn_qp(&qp)) {
            Err(e) => return cm_status(Err(e)),
            // No connection to tear down yet (or any more): nothing for a sync id to wait for.
            Ok(false) => return 0,
            Ok(true) => {}
        }
        if shell.disconnect_waited.swap(true, Ordering::AcqRel) {
            return 0;
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_notify(id: *mut rdma_cm_id, event: ibv_event_type) -> c_int {
    cm_boundary!("rdma_notify", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_notify(id, event));
        };
        cm_status(shell.inner.notify())
    })
}
