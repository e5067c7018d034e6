//! `rdma_join_multicast`, `rdma_join_multicast_ex` and `rdma_leave_multicast` for ugdr's
//! UD ids (`cm/multicast.rs`); another library's id goes to the real librdmacm. A
//! synchronous id's join returns once MULTICAST_JOIN (or the error) arrived.

use super::event::complete;
use super::id::{IdShell, our_id, read_sockaddr};
use super::{cm_boundary, cm_status, fail, forward};
use crate::cm::JOIN_FULL_MEMBER;
use crate::sys::*;
use std::os::raw::{c_int, c_void};

/// Joins the group at `addr` with librdmacm's `join_flags`.
///
/// # Safety
/// `addr` is NULL or a sockaddr of its family's size.
unsafe fn join(shell: &IdShell, addr: *const sockaddr, flags: u32, context: *mut c_void) -> c_int {
    // SAFETY: the caller's sockaddr (or NULL).
    let Some(addr) = (unsafe { read_sockaddr(addr) }) else {
        return fail(libc::EINVAL);
    };
    if let Err(e) = shell.inner.join_multicast(addr, flags, context as usize) {
        return cm_status(Err(e));
    }
    complete(shell)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_join_multicast(
    id: *mut rdma_cm_id,
    addr: *mut sockaddr,
    context: *mut c_void,
) -> c_int {
    cm_boundary!("rdma_join_multicast", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_join_multicast(id, addr, context));
        };
        // SAFETY: the caller's sockaddr.
        unsafe { join(shell, addr, JOIN_FULL_MEMBER, context) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_join_multicast_ex(
    id: *mut rdma_cm_id,
    attr: *mut c_void,
    context: *mut c_void,
) -> c_int {
    cm_boundary!("rdma_join_multicast_ex", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_join_multicast_ex(id, attr, context));
        };
        // SAFETY: the caller's `rdma_cm_join_mc_attr_ex` (or NULL).
        let Some(a) = (unsafe { attr.cast::<rdma_cm_join_mc_attr_ex>().as_ref() }) else {
            return fail(libc::EINVAL);
        };
        // librdmacm's checks, in its order.
        if a.comp_mask >= rdma_cm_join_mc_attr_mask::RDMA_CM_JOIN_MC_ATTR_RESERVED.0 {
            return fail(libc::ENOTSUP);
        }
        if a.comp_mask & rdma_cm_join_mc_attr_mask::RDMA_CM_JOIN_MC_ATTR_ADDRESS.0 == 0 {
            return fail(libc::EINVAL);
        }
        if a.comp_mask & rdma_cm_join_mc_attr_mask::RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS.0 == 0
            || a.join_flags >= rdma_cm_mc_join_flags::RDMA_MC_JOIN_FLAG_RESERVED.0
        {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller's sockaddr.
        unsafe { join(shell, a.addr, a.join_flags, context) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_leave_multicast(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
    cm_boundary!("rdma_leave_multicast", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_leave_multicast(id, addr));
        };
        // SAFETY: the caller's sockaddr (or NULL).
        let Some(addr) = (unsafe { read_sockaddr(addr) }) else {
            return fail(libc::EINVAL);
        };
        cm_status(shell.inner.leave_multicast(addr))
    })
}
