//! The device every id shares: ugdr0's context and default PD, opened once per process as
//! librdmacm does (`rdma_get_devices`, and `id->verbs` of every id bound to an address), and
//! the device list: ugdr0 first, then the real librdmacm's devices.

use super::{call_real, errno_or, real};
use crate::capi::boundary::{ffi_boundary, set_errno};
use crate::capi::caller::{Caller, export_with_caller};
use crate::capi::ibv_device::{device, ibv_open_device, ibv_query_device};
use crate::capi::ibv_pd_mr::ibv_alloc_pd;
use crate::capi::passthrough::LIBRDMACM;
use crate::sys::*;
use std::os::raw::c_int;
use std::ptr;
use std::sync::OnceLock;

pub(super) struct CmDevice {
    pub(super) context: usize,
    pub(super) pd: usize,
    pub(super) max_rd_atom: u8,
}

/// ugdr0's context and default PD, opened once and kept for the life of the process: every
/// `rdma_get_devices` and every `id->verbs` is this same pointer (SPDK compares them).
pub(super) fn cm_device() -> Result<&'static CmDevice, c_int> {
    static DEVICE: OnceLock<Result<CmDevice, c_int>> = OnceLock::new();
    thread_local! {
        static OPENING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if let Some(done) = DEVICE.get() {
        return done.as_ref().map_err(|e| *e);
    }
    // Opening the device starts the engine, whose UCX may call rdma_* itself (an application
    // that loaded UCX's rdmacm module before ugdr's engine started): that inner call finds no
    // device, as librdmacm does on a host without RDMA.
    if OPENING.with(|o| o.replace(true)) {
        return Err(libc::ENODEV);
    }
    let device = DEVICE.get_or_init(|| {
        // SAFETY: ugdr's own device; open_device returns NULL+errno on failure.
        let ctx = unsafe { ibv_open_device(device().as_raw()) };
        if ctx.is_null() {
            return Err(errno_or(libc::ENODEV));
        }
        // SAFETY: the context just opened.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(errno_or(libc::ENOMEM));
        }
        let mut attr = ibv_device_attr::default();
        // SAFETY: our context and a valid out-struct.
        unsafe { ibv_query_device(ctx, &mut attr) };
        Ok(CmDevice {
            context: ctx as usize,
            pd: pd as usize,
            max_rd_atom: u8::try_from(attr.max_qp_rd_atom).unwrap_or(u8::MAX),
        })
    });
    OPENING.with(|o| o.set(false));
    device.as_ref().map_err(|e| *e)
}

export_with_caller! {
    /// ugdr0's context, then those of the real librdmacm's devices (none on a host without
    /// RDMA hardware); a caller whose verbs are the real ones gets the real list alone.
    fn rdma_get_devices(num_devices: *mut c_int) -> *mut *mut ibv_context
        => get_devices_from, caller in "rsi" / "x1"
}

unsafe extern "C" fn get_devices_from(
    num_devices: *mut c_int,
    caller: Caller,
) -> *mut *mut ibv_context {
    ffi_boundary!("rdma_get_devices", {
        if let Some(user) = caller.real_verbs_user() {
            tracing::debug!("rdma_get_devices from {user}: the real librdmacm's list");
            return call_real!(rdma_get_devices(num_devices) or {
                set_errno(libc::ENODEV);
                ptr::null_mut()
            });
        }
        let dev = match cm_device() {
            Ok(d) => d,
            Err(e) => {
                set_errno(e);
                return ptr::null_mut();
            }
        };
        let mut contexts = vec![dev.context as *mut ibv_context];
        contexts.extend(real_contexts());
        // SAFETY: a NULL-terminated array, freed by rdma_free_devices (free, as librdmacm's).
        let list =
            unsafe { libc::calloc(contexts.len() + 1, std::mem::size_of::<*mut ibv_context>()) }
                as *mut *mut ibv_context;
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return ptr::null_mut();
        }
        // SAFETY: the array just allocated holds contexts.len() + 1 entries.
        unsafe { ptr::copy_nonoverlapping(contexts.as_ptr(), list, contexts.len()) };
        if !num_devices.is_null() {
            // SAFETY: the caller's out-pointer.
            unsafe { *num_devices = contexts.len() as c_int };
        }
        set_errno(0);
        list
    })
}

/// The contexts the real librdmacm lists (it opens them and keeps them open), when it is
/// loaded; none on a host without RDMA hardware, where it fails (ENODEV or ENOSYS).
fn real_contexts() -> Vec<*mut ibv_context> {
    let (Some(get), Some(free)) = (real::rdma_get_devices(), real::rdma_free_devices()) else {
        tracing::debug!("rdma_get_devices: no real librdmacm loaded, ugdr0 alone");
        return Vec::new();
    };
    let mut n: c_int = 0;
    // SAFETY: the real function with a valid out-parameter.
    let list = unsafe { get(&mut n) };
    if list.is_null() {
        tracing::debug!(
            "rdma_get_devices: the real librdmacm ({}) lists no device ({})",
            LIBRDMACM.path().unwrap_or_default(),
            std::io::Error::last_os_error()
        );
        return Vec::new();
    }
    let count = usize::try_from(n).unwrap_or(0);
    // SAFETY: the real list holds `n` entries.
    let contexts = unsafe { std::slice::from_raw_parts(list, count) }.to_vec();
    // SAFETY: the array the real library returned; the contexts stay open in it.
    unsafe { free(list) };
    tracing::debug!("rdma_get_devices: ugdr0 and {count} devices of the real librdmacm");
    contexts
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    ffi_boundary!("rdma_free_devices", {
        // SAFETY: an array from rdma_get_devices (or NULL); the contexts stay open.
        unsafe { libc::free(list.cast()) };
    })
}
