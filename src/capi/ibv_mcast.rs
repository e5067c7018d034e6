//! `ibv_attach_mcast` and `ibv_detach_mcast` (UD multicast; the rules are the QP's,
//! `fake_verbs/qp/multicast.rs`). A real library's QP goes to the real functions.

use super::boundary::Fallback;
use super::ibv_not_yet::not_yet;
use super::ibv_qp::our_qp;
use super::passthrough::real_functions;
use crate::sys::*;
use std::os::raw::c_int;

/// The real library's functions of the same names.
mod real {
    use super::*;

    real_functions! {
    ibv_attach_mcast @ "IBVERBS_1.1": fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    ibv_detach_mcast @ "IBVERBS_1.1": fn(*mut ibv_qp, *const ibv_gid, u16) -> c_int;
    }
}

/// Attaches (or detaches) one of ugdr's QPs; 0 or the errno. Called only by the two exports
/// below, with the application's pointers: `qp` one of ugdr's QPs, `gid` NULL or readable.
fn multicast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16, attach: bool) -> c_int {
    if gid.is_null() {
        return c_int::fail(libc::EINVAL);
    }
    // SAFETY: the caller's QP, whose context is ours.
    let Some(shell) = (unsafe { our_qp(qp) }) else {
        return c_int::fail(libc::EINVAL);
    };
    // SAFETY: checked non-NULL; every bit pattern of the union is a valid `raw`.
    let mgid = unsafe { (*gid).raw };
    let done = if attach {
        shell.inner.attach_multicast(&mgid, lid)
    } else {
        shell.inner.detach_multicast(&mgid, lid)
    };
    match done {
        Ok(()) => 0,
        Err(e) => {
            tracing::debug!(
                "{}: {e}",
                if attach {
                    "ibv_attach_mcast"
                } else {
                    "ibv_detach_mcast"
                }
            );
            c_int::fail(e.errno())
        }
    }
}

not_yet! {
    /// Attaches a UD QP to a multicast group (MGID and MLID).
    ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int,
    context = (*qp).context, ours = multicast(qp, gid, lid, true);
}
not_yet! {
    /// Detaches a UD QP from a multicast group it is attached to.
    ibv_detach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int,
    context = (*qp).context, ours = multicast(qp, gid, lid, false);
}
