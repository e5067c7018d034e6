//! The real librdmacm's functions, by exact version node. ugdr forwards to them the objects the
//! real library created (for callers whose verbs are the real ones, `caller.rs`: an
//! application's own UCX, or librdmacm calling its own exports through its PLT), and the root
//! calls of those callers.

use crate::capi::passthrough::real_functions;
use crate::sys::*;
use std::os::raw::{c_int, c_void};

real_functions! {
    in crate::capi::passthrough::LIBRDMACM;
    rdma_create_event_channel @ "RDMACM_1.0": fn() -> *mut rdma_event_channel;
    rdma_destroy_event_channel @ "RDMACM_1.0": fn(*mut rdma_event_channel) -> ();
    rdma_get_cm_event @ "RDMACM_1.0": fn(*mut rdma_event_channel, *mut *mut rdma_cm_event) -> c_int;
    rdma_ack_cm_event @ "RDMACM_1.0": fn(*mut rdma_cm_event) -> c_int;
    rdma_create_id @ "RDMACM_1.0": fn(*mut rdma_event_channel, *mut *mut rdma_cm_id, *mut c_void, rdma_port_space) -> c_int;
    rdma_destroy_id @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> c_int;
    rdma_migrate_id @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut rdma_event_channel) -> c_int;
    rdma_bind_addr @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut sockaddr) -> c_int;
    rdma_resolve_addr @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut sockaddr, *mut sockaddr, c_int) -> c_int;
    rdma_resolve_route @ "RDMACM_1.0": fn(*mut rdma_cm_id, c_int) -> c_int;
    rdma_get_src_port @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> u16;
    rdma_get_dst_port @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> u16;
    rdma_set_option @ "RDMACM_1.0": fn(*mut rdma_cm_id, c_int, c_int, *mut c_void, usize) -> c_int;
    rdma_listen @ "RDMACM_1.0": fn(*mut rdma_cm_id, c_int) -> c_int;
    rdma_connect @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int;
    rdma_accept @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut rdma_conn_param) -> c_int;
    rdma_reject @ "RDMACM_1.0": fn(*mut rdma_cm_id, *const c_void, u8) -> c_int;
    rdma_reject_ece @ "RDMACM_1.3": fn(*mut rdma_cm_id, *const c_void, u8) -> c_int;
    rdma_establish @ "RDMACM_1.2": fn(*mut rdma_cm_id) -> c_int;
    rdma_disconnect @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> c_int;
    rdma_notify @ "RDMACM_1.0": fn(*mut rdma_cm_id, ibv_event_type) -> c_int;
    rdma_init_qp_attr @ "RDMACM_1.2": fn(*mut rdma_cm_id, *mut ibv_qp_attr, *mut c_int) -> c_int;
    rdma_create_qp @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut ibv_pd, *mut ibv_qp_init_attr) -> c_int;
    rdma_create_qp_ex @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut ibv_qp_init_attr_ex) -> c_int;
    rdma_destroy_qp @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> ();
    rdma_create_srq @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut ibv_pd, *mut ibv_srq_init_attr) -> c_int;
    rdma_create_srq_ex @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut ibv_srq_init_attr_ex) -> c_int;
    rdma_destroy_srq @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> ();
    rdma_create_ep @ "RDMACM_1.0": fn(*mut *mut rdma_cm_id, *mut rdma_addrinfo, *mut ibv_pd, *mut ibv_qp_init_attr) -> c_int;
    rdma_destroy_ep @ "RDMACM_1.0": fn(*mut rdma_cm_id) -> ();
    rdma_get_request @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut *mut rdma_cm_id) -> c_int;
    rdma_get_devices @ "RDMACM_1.0": fn(*mut c_int) -> *mut *mut ibv_context;
    rdma_free_devices @ "RDMACM_1.0": fn(*mut *mut ibv_context) -> ();
    rdma_join_multicast @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut sockaddr, *mut c_void) -> c_int;
    rdma_join_multicast_ex @ "RDMACM_1.1": fn(*mut rdma_cm_id, *mut c_void, *mut c_void) -> c_int;
    rdma_leave_multicast @ "RDMACM_1.0": fn(*mut rdma_cm_id, *mut sockaddr) -> c_int;
    rdma_set_local_ece @ "RDMACM_1.3": fn(*mut rdma_cm_id, *mut ibv_ece) -> c_int;
    rdma_get_remote_ece @ "RDMACM_1.3": fn(*mut rdma_cm_id, *mut ibv_ece) -> c_int;
}
