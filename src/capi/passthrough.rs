//! The real libibverbs and librdmacm, for objects that are not ugdr's and for callers that
//! are not the application's.
//!
//! ugdr's exports are unversioned, so they interpose every IBVERBS_* and RDMACM_* version
//! node, also for libraries loaded later. When a call carries an object ugdr did not create
//! (a device or context of a real HCA, an id of the real librdmacm), or comes from a library
//! whose verbs are the real ones (`caller.rs`), it is forwarded to the real function, looked up
//! with its exact version node (`dlvsym(handle, name, "IBVERBS_1.1")`) in the real library
//! loaded in the application's namespace. The library is found by its soname with
//! `RTLD_NOLOAD`: it may be loaded `RTLD_LOCAL` (UCX's modules load it so), where
//! `RTLD_NEXT` would not find it. ugdr never loads it itself: an object of the real library,
//! or a library that calls it, means it is loaded. The handle is kept, so the library stays
//! loaded and the function pointers found in it stay valid.

use crate::sys::*;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::sync::OnceLock;

/// A real rdma-core library, found (never loaded) in the application's namespace.
pub(crate) struct RealLibrary {
    soname: &'static CStr,
    handle: OnceLock<usize>,
}

pub(crate) static LIBIBVERBS: RealLibrary = RealLibrary::new(c"libibverbs.so.1");
pub(crate) static LIBRDMACM: RealLibrary = RealLibrary::new(c"librdmacm.so.1");

impl RealLibrary {
    const fn new(soname: &'static CStr) -> RealLibrary {
        RealLibrary {
            soname,
            handle: OnceLock::new(),
        }
    }

    /// The library's handle, if it is loaded in this namespace (asked again until it is).
    fn handle(&self) -> Option<*mut c_void> {
        if let Some(h) = self.handle.get() {
            return Some(*h as *mut c_void);
        }
        // SAFETY: a NUL-terminated soname; RTLD_NOLOAD only looks the library up.
        let h = unsafe { libc::dlopen(self.soname.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
        if h.is_null() {
            return None;
        }
        if self.handle.set(h as usize).is_err() {
            // Another thread kept its reference first; give this one back.
            // SAFETY: the reference this call took.
            unsafe { libc::dlclose(h) };
        }
        self.handle.get().map(|h| *h as *mut c_void)
    }

    /// The address of `name` at version node `version` (both NUL-terminated) in this
    /// library, if it is loaded.
    pub(crate) fn symbol(&self, name: &[u8], version: &[u8]) -> Option<usize> {
        let name = CStr::from_bytes_with_nul(name).ok()?;
        let version = CStr::from_bytes_with_nul(version).ok()?;
        let handle = self.handle()?;
        // SAFETY: a live handle and NUL-terminated strings; dlvsym only reads them.
        let addr = unsafe { libc::dlvsym(handle, name.as_ptr(), version.as_ptr()) };
        (!addr.is_null()).then_some(addr as usize)
    }

    /// The file the library was loaded from (for the log), if it is loaded.
    pub(crate) fn path(&self) -> Option<String> {
        // SAFETY: a handle this library keeps open.
        unsafe { crate::sys::dl::object_path(self.handle()?) }
    }
}

/// Defines, per entry, a function returning the real library's function of that name and
/// version (None while the library is not loaded). `in LIB;` names the [`RealLibrary`]
/// (libibverbs when left out). Found pointers are kept; misses are asked again.
macro_rules! real_functions {
    (in $lib:path; $($name:ident @ $ver:literal : $([$unwind:ident])? fn($($arg:ty),*) -> $ret:ty;)*) => {$(
        $crate::capi::passthrough::real_functions!(@one $lib, $name, $ver, [$($unwind)?], ($($arg),*), $ret);
    )*};
    (@one $lib:path, $name:ident, $ver:literal, [], ($($arg:ty),*), $ret:ty) => {
        $crate::capi::passthrough::real_functions!(@abi $lib, $name, $ver, "C", ($($arg),*), $ret);
    };
    (@one $lib:path, $name:ident, $ver:literal, [unwind], ($($arg:ty),*), $ret:ty) => {
        $crate::capi::passthrough::real_functions!(@abi $lib, $name, $ver, "C-unwind", ($($arg),*), $ret);
    };
    (@abi $lib:path, $name:ident, $ver:literal, $abi:tt, ($($arg:ty),*), $ret:ty) => {
        /// The real function of this name and version, if its library is loaded.
        pub(crate) fn $name() -> Option<unsafe extern $abi fn($($arg),*) -> $ret> {
            static ADDR: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
            let addr = match ADDR.get() {
                Some(a) => *a,
                None => {
                    let found = $lib.symbol(
                        concat!(stringify!($name), "\0").as_bytes(),
                        concat!($ver, "\0").as_bytes(),
                    )?;
                    *ADDR.get_or_init(|| found)
                }
            };
            // SAFETY: the symbol of this name and version node has this C signature
            // (infiniband/verbs.h and rdma/rdma_cma.h of rdma-core 44).
            Some(unsafe { std::mem::transmute::<usize, unsafe extern $abi fn($($arg),*) -> $ret>(addr) })
        }
    };
    ($($name:ident @ $ver:literal : $([$unwind:ident])? fn($($arg:ty),*) -> $ret:ty;)*) => {
        $crate::capi::passthrough::real_functions! {
            in $crate::capi::passthrough::LIBIBVERBS;
            $($name @ $ver : $([$unwind])? fn($($arg),*) -> $ret;)*
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
