//! What bindgen cannot emit for the verbs ABI: `__VERBS_ABI_IS_EXTENDED`, and compile-time
//! checks that the structs ugdr hands to applications have the sizes and offsets that
//! applications built against rdma-core 44 rely on (../shared/design/verbs-abi.md §1.7).

use super::*;
use std::mem::{offset_of, size_of};

/// `#define __VERBS_ABI_IS_EXTENDED ((void *)UINTPTR_MAX)` (verbs.h): the marker in
/// `ibv_context.abi_compat` that tells the inline helpers a `verbs_context` sits in front.
pub const VERBS_ABI_IS_EXTENDED: *mut std::os::raw::c_void = usize::MAX as *mut _;

const _: () = {
    assert!(size_of::<verbs_context>() == 648);
    assert!(offset_of!(verbs_context, query_port) == 0);
    assert!(offset_of!(verbs_context, create_cq_ex) == 200);
    assert!(offset_of!(verbs_context, query_device_ex) == 216);
    assert!(offset_of!(verbs_context, create_qp_ex) == 264);
    assert!(offset_of!(verbs_context, close_xrcd) == 296);
    assert!(offset_of!(verbs_context, sz) == 312);
    assert!(offset_of!(verbs_context, context) == 320);
    assert!(size_of::<ibv_context>() == 328);
    assert!(offset_of!(ibv_context, ops) == 8);
    assert!(offset_of!(ibv_context, async_fd) == 268);
    assert!(offset_of!(ibv_context, num_comp_vectors) == 272);
    assert!(offset_of!(ibv_context, abi_compat) == 320);
    assert!(offset_of!(ibv_context_ops, poll_cq) == 88);
    assert!(offset_of!(ibv_context_ops, req_notify_cq) == 96);
    assert!(offset_of!(ibv_context_ops, post_srq_recv) == 160);
    assert!(offset_of!(ibv_context_ops, post_send) == 200);
    assert!(offset_of!(ibv_context_ops, post_recv) == 208);
    assert!(size_of::<ibv_device>() == 664);
    assert!(offset_of!(ibv_device, name) == 24);
    assert!(offset_of!(ibv_device, dev_name) == 88);
    assert!(offset_of!(ibv_device, ibdev_path) == 408);
    assert!(size_of::<ibv_qp>() == 160);
    assert!(size_of::<ibv_qp_ex>() == 352);
    assert!(offset_of!(ibv_qp_ex, wr_id) == 168);
    assert!(offset_of!(ibv_qp_ex, wr_flags) == 176);
    assert!(size_of::<ibv_cq>() == 128);
    assert!(size_of::<ibv_cq_ex>() == 288);
    assert!(offset_of!(ibv_cq_ex, status) == 132);
    assert!(offset_of!(ibv_cq_ex, wr_id) == 136);
    assert!(offset_of!(ibv_cq_ex, start_poll) == 144);
    assert!(offset_of!(ibv_cq_ex, read_completion_wallclock_ns) == 280);
    assert!(size_of::<ibv_port_attr>() == 52);
    assert!(offset_of!(ibv_port_attr, lid) == 34);
    assert!(offset_of!(ibv_port_attr, link_layer) == 46);
    assert!(size_of::<ibv_device_attr>() == 232);
    assert!(size_of::<ibv_device_attr_ex>() == 400);
    assert!(size_of::<ibv_srq>() == 128);
    assert!(size_of::<ibv_pd>() == 16);
    assert!(size_of::<ibv_mr>() == 48);
    assert!(size_of::<ibv_ah>() == 24);
    assert!(size_of::<ibv_comp_channel>() == 16);
    assert!(size_of::<ibv_wc>() == 48);
    assert!(size_of::<ibv_send_wr>() == 128);
    assert!(size_of::<ibv_recv_wr>() == 32);
    assert!(size_of::<ibv_qp_attr>() == 144);
    assert!(size_of::<ibv_qp_init_attr>() == 64);
    assert!(size_of::<ibv_qp_init_attr_ex>() == 136);
    assert!(size_of::<ibv_ah_attr>() == 32);
};
