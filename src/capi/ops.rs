//! The function tables inside every object ugdr hands out. Inline verbs (`ibv_post_send`,
//! `ibv_poll_cq`, `ibv_query_port`, the `ibv_wr_*` and `ibv_wc_read_*` families, …) jump
//! through them without checks, so every slot is filled: a real operation, or a stub that
//! fails as rdma-core's `dummy_ops.c` does (EOPNOTSUPP, or NULL with errno EOPNOTSUPP).

use super::boundary::set_errno;
use super::{
    ibv_cq as cq_exports, ibv_device as device_exports, ibv_dm as dm_exports,
    ibv_domain as domain_exports, ibv_mw as mw_exports, ibv_pd_mr as mr_exports,
    ibv_qp as qp_exports, ibv_srq as srq_exports, ibv_xrc as xrc_exports,
};
use crate::sys::*;
use std::os::raw::c_int;
use std::ptr::null_mut;

/// A stub for an op ugdr does not provide: `-> c_int` returns EOPNOTSUPP, `-> *mut T`
/// returns NULL with errno EOPNOTSUPP.
macro_rules! unsupported {
    (fn($($arg:ty),*) -> c_int) => {{
        unsafe extern "C" fn stub($(_: $arg),*) -> c_int {
            EOPNOTSUPP
        }
        Some(stub)
    }};
    (fn($($arg:ty),*) -> *mut $ret:ty) => {{
        unsafe extern "C" fn stub($(_: $arg),*) -> *mut $ret {
            set_errno(EOPNOTSUPP);
            null_mut()
        }
        Some(stub)
    }};
}

const EOPNOTSUPP: c_int = libc::EOPNOTSUPP;

/// Fills a fresh `verbs_context` (and its `ibv_context`): sizes, ABI marker and every op.
pub(crate) fn install_context_ops(vctx: &mut verbs_context) {
    vctx.sz = std::mem::size_of::<verbs_context>();
    vctx.context.abi_compat = crate::sys::verbs::VERBS_ABI_IS_EXTENDED;

    let ops = &mut vctx.context.ops;
    ops.poll_cq = Some(cq_exports::poll_cq);
    ops.req_notify_cq = Some(cq_exports::req_notify_cq);
    ops.post_send = Some(qp_exports::post_send);
    ops.post_recv = Some(qp_exports::post_recv);
    ops.post_srq_recv = Some(srq_exports::post_srq_recv);
    ops.alloc_mw = Some(mw_exports::alloc_mw_op);
    ops.bind_mw = Some(mw_exports::bind_mw_op);
    ops.dealloc_mw = Some(mw_exports::dealloc_mw_op);

    vctx.query_port = Some(device_exports::query_port_op);
    vctx.query_device_ex = Some(device_exports::query_device_ex_op);
    vctx.create_cq_ex = Some(cq_exports::create_cq_ex_op);
    vctx.create_qp_ex = Some(qp_exports::create_qp_ex_op);
    vctx.advise_mr = Some(mr_exports::advise_mr_op);
    vctx.alloc_null_mr = unsupported!(fn(*mut ibv_pd) -> *mut ibv_mr);
    vctx.read_counters = unsupported!(fn(*mut ibv_counters, *mut u64, u32, u32) -> c_int);
    vctx.attach_counters_point_flow =
        unsupported!(fn(*mut ibv_counters, *mut ibv_counter_attach_attr, *mut ibv_flow) -> c_int);
    vctx.create_counters =
        unsupported!(fn(*mut ibv_context, *mut ibv_counters_init_attr) -> *mut ibv_counters);
    vctx.destroy_counters = unsupported!(fn(*mut ibv_counters) -> c_int);
    vctx.reg_dm_mr = Some(dm_exports::reg_dm_mr_op);
    vctx.alloc_dm = Some(dm_exports::alloc_dm_op);
    vctx.free_dm = Some(dm_exports::free_dm_op);
    vctx.modify_flow_action_esp =
        unsupported!(fn(*mut ibv_flow_action, *mut ibv_flow_action_esp_attr) -> c_int);
    vctx.destroy_flow_action = unsupported!(fn(*mut ibv_flow_action) -> c_int);
    vctx.create_flow_action_esp =
        unsupported!(fn(*mut ibv_context, *mut ibv_flow_action_esp_attr) -> *mut ibv_flow_action);
    vctx.modify_qp_rate_limit = unsupported!(fn(*mut ibv_qp, *mut ibv_qp_rate_limit_attr) -> c_int);
    vctx.alloc_parent_domain = Some(domain_exports::alloc_parent_domain_op);
    vctx.dealloc_td = Some(domain_exports::dealloc_td_op);
    vctx.alloc_td = Some(domain_exports::alloc_td_op);
    vctx.modify_cq = unsupported!(fn(*mut ibv_cq, *mut ibv_modify_cq_attr) -> c_int);
    vctx.post_srq_ops = Some(post_srq_ops_unsupported);
    vctx.destroy_rwq_ind_table = unsupported!(fn(*mut ibv_rwq_ind_table) -> c_int);
    vctx.create_rwq_ind_table = unsupported!(
        fn(*mut ibv_context, *mut ibv_rwq_ind_table_init_attr) -> *mut ibv_rwq_ind_table
    );
    vctx.destroy_wq = unsupported!(fn(*mut ibv_wq) -> c_int);
    vctx.modify_wq = unsupported!(fn(*mut ibv_wq, *mut ibv_wq_attr) -> c_int);
    vctx.create_wq = unsupported!(fn(*mut ibv_context, *mut ibv_wq_init_attr) -> *mut ibv_wq);
    vctx.query_rt_values = Some(device_exports::query_rt_values_op);
    vctx.ibv_destroy_flow = unsupported!(fn(*mut ibv_flow) -> c_int);
    vctx.ibv_create_flow = unsupported!(fn(*mut ibv_qp, *mut ibv_flow_attr) -> *mut ibv_flow);
    vctx.ABI_placeholder1 = Some(abi_placeholder);
    vctx.ABI_placeholder2 = Some(abi_placeholder);
    vctx.open_qp = Some(xrc_exports::open_qp_op);
    vctx.get_srq_num = Some(xrc_exports::get_srq_num_op);
    vctx.create_srq_ex = Some(srq_exports::create_srq_ex_op);
    vctx.open_xrcd = Some(xrc_exports::open_xrcd_op);
    vctx.close_xrcd = Some(xrc_exports::close_xrcd_op);
}

/// `ABI_placeholder1/2` are never called by rdma-core 44's inlines (rdma-core copies the flow
/// ops there for binaries built against libibverbs 1.1.8); a harmless target all the same.
unsafe extern "C" fn abi_placeholder() {}

unsafe extern "C" fn post_srq_ops_unsupported(
    _: *mut ibv_srq,
    op: *mut ibv_ops_wr,
    bad: *mut *mut ibv_ops_wr,
) -> c_int {
    if !bad.is_null() {
        // SAFETY: `bad` is the caller's out-parameter.
        unsafe { *bad = op };
    }
    EOPNOTSUPP
}

/// Fills the `ibv_cq_ex` poll functions.
pub(crate) fn install_cq_ops(cq: &mut ibv_cq_ex) {
    cq_exports::install_poll_ops(cq);
}

/// Fills the `ibv_qp_ex` work-request builders.
pub(crate) fn install_qp_ops(qp: &mut ibv_qp_ex) {
    qp_exports::install_wr_ops(qp);
}

/// For tests: every op slot of a context is filled.
#[cfg(test)]
fn all_context_ops_filled(vctx: &verbs_context) -> bool {
    let o = &vctx.context.ops;
    let live = [
        o.poll_cq.is_some(),
        o.req_notify_cq.is_some(),
        o.post_send.is_some(),
        o.post_recv.is_some(),
        o.post_srq_recv.is_some(),
        o.alloc_mw.is_some(),
        o.bind_mw.is_some(),
        o.dealloc_mw.is_some(),
    ];
    let ext = [
        vctx.query_port.is_some(),
        vctx.advise_mr.is_some(),
        vctx.alloc_null_mr.is_some(),
        vctx.read_counters.is_some(),
        vctx.attach_counters_point_flow.is_some(),
        vctx.create_counters.is_some(),
        vctx.destroy_counters.is_some(),
        vctx.reg_dm_mr.is_some(),
        vctx.alloc_dm.is_some(),
        vctx.free_dm.is_some(),
        vctx.modify_flow_action_esp.is_some(),
        vctx.destroy_flow_action.is_some(),
        vctx.create_flow_action_esp.is_some(),
        vctx.modify_qp_rate_limit.is_some(),
        vctx.alloc_parent_domain.is_some(),
        vctx.dealloc_td.is_some(),
        vctx.alloc_td.is_some(),
        vctx.modify_cq.is_some(),
        vctx.post_srq_ops.is_some(),
        vctx.destroy_rwq_ind_table.is_some(),
        vctx.create_rwq_ind_table.is_some(),
        vctx.destroy_wq.is_some(),
        vctx.modify_wq.is_some(),
        vctx.create_wq.is_some(),
        vctx.query_rt_values.is_some(),
        vctx.create_cq_ex.is_some(),
        vctx.query_device_ex.is_some(),
        vctx.ibv_destroy_flow.is_some(),
        vctx.ABI_placeholder2.is_some(),
        vctx.ibv_create_flow.is_some(),
        vctx.ABI_placeholder1.is_some(),
        vctx.open_qp.is_some(),
        vctx.create_qp_ex.is_some(),
        vctx.get_srq_num.is_some(),
        vctx.create_srq_ex.is_some(),
        vctx.open_xrcd.is_some(),
        vctx.close_xrcd.is_some(),
    ];
    live.iter().chain(ext.iter()).all(|x| *x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_context_op_slot_is_filled() {
        let mut vctx = verbs_context::default();
        install_context_ops(&mut vctx);
        assert!(all_context_ops_filled(&vctx));
        assert_eq!(vctx.sz, 648);
        assert_eq!(
            vctx.context.abi_compat,
            crate::sys::verbs::VERBS_ABI_IS_EXTENDED
        );
    }

    #[test]
    fn every_cq_and_qp_op_slot_is_filled() {
        let mut cq = ibv_cq_ex::default();
        install_cq_ops(&mut cq);
        let cq_slots = [
            cq.start_poll.is_some(),
            cq.next_poll.is_some(),
            cq.end_poll.is_some(),
            cq.read_opcode.is_some(),
            cq.read_vendor_err.is_some(),
            cq.read_byte_len.is_some(),
            cq.read_imm_data.is_some(),
            cq.read_qp_num.is_some(),
            cq.read_src_qp.is_some(),
            cq.read_wc_flags.is_some(),
            cq.read_slid.is_some(),
            cq.read_sl.is_some(),
            cq.read_dlid_path_bits.is_some(),
            cq.read_completion_ts.is_some(),
            cq.read_cvlan.is_some(),
            cq.read_flow_tag.is_some(),
            cq.read_tm_info.is_some(),
            cq.read_completion_wallclock_ns.is_some(),
        ];
        assert!(cq_slots.iter().all(|x| *x));
        let mut qp = ibv_qp_ex::default();
        install_qp_ops(&mut qp);
        let qp_slots = [
            qp.wr_atomic_cmp_swp.is_some(),
            qp.wr_atomic_fetch_add.is_some(),
            qp.wr_bind_mw.is_some(),
            qp.wr_local_inv.is_some(),
            qp.wr_rdma_read.is_some(),
            qp.wr_rdma_write.is_some(),
            qp.wr_rdma_write_imm.is_some(),
            qp.wr_send.is_some(),
            qp.wr_send_imm.is_some(),
            qp.wr_send_inv.is_some(),
            qp.wr_send_tso.is_some(),
            qp.wr_set_ud_addr.is_some(),
            qp.wr_set_xrc_srqn.is_some(),
            qp.wr_set_inline_data.is_some(),
            qp.wr_set_inline_data_list.is_some(),
            qp.wr_set_sge.is_some(),
            qp.wr_set_sge_list.is_some(),
            qp.wr_start.is_some(),
            qp.wr_complete.is_some(),
            qp.wr_abort.is_some(),
            qp.wr_atomic_write.is_some(),
        ];
        assert!(qp_slots.iter().all(|x| *x));
    }
}
