//! The rarely used libibverbs entry points that can be handed ugdr's objects but have
//! nothing behind them in ugdr: the receive-side data-placement order query, and Ethernet
//! neighbour resolution (sharing objects between contexts is `ibv_import`). Each answers for
//! ugdr's objects as rdma-core answers for a provider without the op
//! (`libibverbs/dummy_ops.c`); other libraries' objects go to the real function (by exact
//! version node). Left to the real library they would read ugdr's objects as its own
//! (`get_ops(context)`) and crash.

use super::boundary::{Fallback, ffi_boundary, set_errno};
use super::ibv_device::ibv_query_gid;
use super::layout::{ContextShell, owned_context};
use super::passthrough::real_functions;
use crate::sys::*;
use std::os::raw::c_int;

/// The real library's functions of the same names.
mod real {
    use super::*;

    real_functions! {
    ibv_query_qp_data_in_order @ "IBVERBS_1.14": fn(*mut ibv_qp, ibv_wr_opcode, u32) -> c_int;
    ibv_resolve_eth_l2_from_gid @ "IBVERBS_1.1": fn(*mut ibv_context, *mut ibv_ah_attr, *mut u8, *mut u16) -> c_int;
    }
}

/// Whether data lands in order within a message, so a reader may poll the data instead of
/// the completion. Not for ugdr's QPs: received data is copied with `memcpy`, whose stores
/// can become visible out of order (glibc copies large blocks with `rep movsb` or writes the
/// first vector last), so the answer is 0, as rdma-core's default. With rdma-core 45's
/// `IBV_QUERY_QP_DATA_IN_ORDER_RETURN_CAPS` flag 0 means "no in-order capability" too.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_qp_data_in_order(
    qp: *mut ibv_qp,
    op: ibv_wr_opcode,
    flags: u32,
) -> c_int {
    ffi_boundary!("ibv_query_qp_data_in_order", on_panic = 0, {
        if qp.is_null() {
            return 0;
        }
        // SAFETY: a valid ibv_qp (ugdr's or the real library's) has a readable context field;
        // owned_context only compares the pointer against ugdr's registry.
        if unsafe { owned_context((*qp).context) }.is_some() {
            return 0;
        }
        match real::ibv_query_qp_data_in_order() {
            // SAFETY: not ugdr's QP, so the real library's.
            Some(real) => unsafe { real(qp, op, flags) },
            None => 0,
        }
    })
}

/// The Ethernet MAC (and VLAN) behind a RoCE GID. ugdr's port is InfiniBand: its GID is no
/// interface's IP address, so, as rdma-core after its neighbour lookup finds no interface,
/// -EINVAL, with nothing written. A source GID the port lacks fails first, with the
/// `ibv_query_gid` result (-1, errno EINVAL), as in rdma-core.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_resolve_eth_l2_from_gid(
    context: *mut ibv_context,
    attr: *mut ibv_ah_attr,
    eth_mac: *mut u8,
    vid: *mut u16,
) -> c_int {
    ffi_boundary!("ibv_resolve_eth_l2_from_gid", {
        if !ContextShell::is_ours(context) {
            return match real::ibv_resolve_eth_l2_from_gid() {
                // SAFETY: not ugdr's context, so the real library's.
                Some(real) if !context.is_null() => unsafe { real(context, attr, eth_mac, vid) },
                _ => c_int::fail(libc::EINVAL),
            };
        }
        if attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's address attributes, checked non-NULL.
        let (port, sgid_index) = unsafe { ((*attr).port_num, (*attr).grh.sgid_index) };
        let mut sgid = ibv_gid::default();
        // SAFETY: ugdr's context and a local out-parameter.
        let err = unsafe { ibv_query_gid(context, port, c_int::from(sgid_index), &mut sgid) };
        if err != 0 {
            return err;
        }
        tracing::debug!(
            "ibv_resolve_eth_l2_from_gid: an InfiniBand port has no Ethernet neighbour"
        );
        set_errno(libc::EINVAL);
        -libc::EINVAL
    })
}
