//! The real libibverbs, for objects that are not ugdr's.
//!
//! ugdr's exports are unversioned, so they interpose every IBVERBS_* version node, also for
//! libraries loaded later. When a call carries an object ugdr did not create (a device or
//! context of a real HCA, say), it is forwarded to the real function, looked up with the
//! exact version node (`dlvsym(RTLD_NEXT, name, "IBVERBS_1.1")`), so the real library keeps
//! working beside ugdr.

use crate::sys::*;
use std::os::raw::{c_int, c_void};

/// Each entry is `name @ "VERSION": fn(args) -> ret;`, or `… : [unwind] fn(…)` for a function
/// that blocks in a cancellation point (its pointer is `extern "C-unwind"`, so that
/// `pthread_cancel`'s forced unwind may pass through it; see `boundary`).
macro_rules! real_functions {
    ($($name:ident @ $ver:literal : $([$unwind:ident])? fn($($arg:ty),*) -> $ret:ty;)*) => {$(
        real_functions!(@one $name, $ver, [$($unwind)?], ($($arg),*), $ret);
    )*};
    (@one $name:ident, $ver:literal, [], ($($arg:ty),*), $ret:ty) => {
        real_functions!(@abi $name, $ver, "C", ($($arg),*), $ret);
    };
    (@one $name:ident, $ver:literal, [unwind], ($($arg:ty),*), $ret:ty) => {
        real_functions!(@abi $name, $ver, "C-unwind", ($($arg),*), $ret);
    };
    (@abi $name:ident, $ver:literal, $abi:tt, ($($arg:ty),*), $ret:ty) => {
        /// The real libibverbs function of this name and version, if libibverbs is loaded.
        pub(crate) fn $name() -> Option<unsafe extern $abi fn($($arg),*) -> $ret> {
            static ADDR: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            let addr = *ADDR.get_or_init(|| {
                let name = concat!(stringify!($name), "\0");
                let ver = concat!($ver, "\0");
                // SAFETY: both strings are NUL-terminated literals; dlvsym only reads them.
                unsafe { libc::dlvsym(libc::RTLD_NEXT, name.as_ptr().cast(), ver.as_ptr().cast()) as usize }
            });
            if addr == 0 {
                return None;
            }
            // SAFETY: the symbol of this name and version node has this C signature
            // (infiniband/verbs.h of rdma-core 44).
            Some(unsafe { std::mem::transmute::<usize, unsafe extern $abi fn($($arg),*) -> $ret>(addr) })
        }
    };
}

pub(crate) use real_functions;

real_functions! {
    ibv_get_device_list @ "IBVERBS_1.1": fn(*mut c_int) -> *mut *mut ibv_device;
    ibv_free_device_list @ "IBVERBS_1.1": fn(*mut *mut ibv_device) -> ();
    ibv_get_device_guid @ "IBVERBS_1.1": fn(*mut ibv_device) -> u64;
    ibv_get_device_index @ "IBVERBS_1.9": fn(*mut ibv_device) -> c_int;
    ibv_open_device @ "IBVERBS_1.1": fn(*mut ibv_device) -> *mut ibv_context;
    ibv_close_device @ "IBVERBS_1.1": fn(*mut ibv_context) -> c_int;
    ibv_query_device @ "IBVERBS_1.1": fn(*mut ibv_context, *mut ibv_device_attr) -> c_int;
    ibv_query_port @ "IBVERBS_1.1": fn(*mut ibv_context, u8, *mut ibv_port_attr) -> c_int;
    ibv_query_gid @ "IBVERBS_1.1": fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int;
    ibv_query_gid_type @ "IBVERBS_PRIVATE_34": fn(*mut ibv_context, u8, c_uint_t, *mut u32) -> c_int;
    _ibv_query_gid_ex @ "IBVERBS_1.11": fn(*mut ibv_context, u32, u32, *mut ibv_gid_entry, u32, usize) -> c_int;
    _ibv_query_gid_table @ "IBVERBS_1.11": fn(*mut ibv_context, *mut ibv_gid_entry, usize, u32, usize) -> isize;
    ibv_query_pkey @ "IBVERBS_1.1": fn(*mut ibv_context, u8, c_int, *mut u16) -> c_int;
    ibv_get_pkey_index @ "IBVERBS_1.5": fn(*mut ibv_context, u8, u16) -> c_int;
    ibv_get_async_event @ "IBVERBS_1.1": [unwind] fn(*mut ibv_context, *mut ibv_async_event) -> c_int;
    ibv_ack_async_event @ "IBVERBS_1.1": fn(*mut ibv_async_event) -> ();
    ibv_alloc_pd @ "IBVERBS_1.1": fn(*mut ibv_context) -> *mut ibv_pd;
    ibv_dealloc_pd @ "IBVERBS_1.1": fn(*mut ibv_pd) -> c_int;
    ibv_reg_mr @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova @ "IBVERBS_1.7": fn(*mut ibv_pd, *mut c_void, usize, u64, c_int) -> *mut ibv_mr;
    ibv_reg_mr_iova2 @ "IBVERBS_1.8": fn(*mut ibv_pd, *mut c_void, usize, u64, u32) -> *mut ibv_mr;
    ibv_dereg_mr @ "IBVERBS_1.1": fn(*mut ibv_mr) -> c_int;
    ibv_create_comp_channel @ "IBVERBS_1.0": fn(*mut ibv_context) -> *mut ibv_comp_channel;
    ibv_destroy_comp_channel @ "IBVERBS_1.0": fn(*mut ibv_comp_channel) -> c_int;
    ibv_create_cq @ "IBVERBS_1.1": fn(*mut ibv_context, c_int, *mut c_void, *mut ibv_comp_channel, c_int) -> *mut ibv_cq;
    ibv_resize_cq @ "IBVERBS_1.1": fn(*mut ibv_cq, c_int) -> c_int;
    ibv_destroy_cq @ "IBVERBS_1.1": fn(*mut ibv_cq) -> c_int;
    ibv_get_cq_event @ "IBVERBS_1.1": [unwind] fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int;
    ibv_ack_cq_events @ "IBVERBS_1.1": fn(*mut ibv_cq, u32) -> ();
    ibv_create_qp @ "IBVERBS_1.1": fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp;
    ibv_query_qp @ "IBVERBS_1.1": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int, *mut ibv_qp_init_attr) -> c_int;
    ibv_modify_qp @ "IBVERBS_1.1": fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int;
    ibv_destroy_qp @ "IBVERBS_1.1": fn(*mut ibv_qp) -> c_int;
    ibv_qp_to_qp_ex @ "IBVERBS_1.6": fn(*mut ibv_qp) -> *mut ibv_qp_ex;
}

/// `unsigned int`, as bindgen spells it in these signatures.
#[allow(non_camel_case_types)]
pub(crate) type c_uint_t = std::os::raw::c_uint;
