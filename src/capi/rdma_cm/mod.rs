//! librdmacm's `rdma_*` exports. The connection manager itself lives in [`crate::cm`]; these
//! files hold only what the C boundary needs: checking pointers, converting C structs, filling
//! the fields applications read directly (`id->verbs`, `id->route`, `id->qp`, `id->event`, …;
//! librdmacm writes them in the same calls), and rdma-core's convention: 0, or -1 with errno.
//!
//! One file per role, as in [`crate::cm`]:
//! * `device.rs` — the device and context every id shares (`rdma_get_devices`).
//! * `id.rs` — ids and addressing (`rdma_create_id`, `rdma_bind_addr`, `rdma_resolve_*`,
//!   `rdma_migrate_id`, ports, options) and the `rdma_cm_id` shell.
//! * `event.rs` — event channels and events (`rdma_get_cm_event`, `rdma_ack_cm_event`), and the
//!   wait a synchronous id's call makes for its event.
//! * `connect.rs` — the handshake (`rdma_listen`, `rdma_connect`, `rdma_accept`, `rdma_reject`,
//!   `rdma_establish`, `rdma_disconnect`, `rdma_notify`).
//! * `qp.rs` — the QPs, CQs and SRQs the CM creates for an id, and `rdma_init_qp_attr`.
//! * `endpoint.rs` — the synchronous endpoint API of `rdma_server`/`rdma_client`
//!   (`rdma_create_ep`, `rdma_get_request`).
//! * `addrinfo.rs` — `rdma_getaddrinfo`.
//! * `multicast.rs` — joining and leaving multicast groups.
//! * `not_offered.rs` — ECE, which ugdr's fabric has not.
//! * `real.rs` — the real librdmacm, for ids, channels, events and device lists it created
//!   (for callers whose verbs are the real ones: an application's own UCX, `caller.rs`).

mod addrinfo;
mod connect;
mod device;
mod endpoint;
mod event;
mod id;
mod multicast;
mod not_offered;
mod qp;
mod real;

use super::boundary::set_errno;
use crate::cm::CmError;
use std::os::raw::c_int;

/// Like `ffi_boundary!`, with librdmacm's failure value: -1 and errno.
macro_rules! cm_boundary {
    ($name:expr, $body:block) => {
        $crate::capi::boundary::ffi_boundary!(
            $name,
            on_panic = {
                $crate::capi::boundary::set_errno(libc::EIO);
                -1
            },
            $body
        )
    };
}
use cm_boundary;

/// The real librdmacm's function of the same name called with these arguments, or `or` when
/// the real library is not loaded.
macro_rules! call_real {
    ($name:ident($($arg:expr),*) or $or:expr) => {
        match $crate::capi::rdma_cm::real::$name() {
            // SAFETY: the real function of this name and version, with the arguments the
            // application (or the library calling) passed to ugdr's export.
            Some(real) => unsafe { real($($arg),*) },
            None => $or,
        }
    };
}
use call_real;

/// For an object ugdr did not create: the real librdmacm's function of the same name (the
/// object is one it created, so it is loaded), called with the same arguments. NULL, or no
/// real librdmacm in the process, fails with `or` (default -1 and EINVAL).
macro_rules! forward {
    ($name:ident($first:expr $(, $arg:expr)*)) => {
        $crate::capi::rdma_cm::forward!($name($first $(, $arg)*) or $crate::capi::rdma_cm::fail(libc::EINVAL))
    };
    ($name:ident($first:expr $(, $arg:expr)*) or $or:expr) => {
        if $first.is_null() {
            $or
        } else {
            $crate::capi::rdma_cm::call_real!($name($first $(, $arg)*) or $or)
        }
    };
}
use forward;

/// librdmacm's failure: -1 with errno.
fn fail(errno: c_int) -> c_int {
    set_errno(errno);
    -1
}

/// A connection-manager result as librdmacm returns it.
fn cm_status(r: Result<(), CmError>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::debug!("rdma_cm: {e}");
            fail(e.errno())
        }
    }
}

/// The errno the last failed call left, or `default` when it left none.
fn errno_or(default: c_int) -> c_int {
    match std::io::Error::last_os_error().raw_os_error() {
        Some(e) if e != 0 => e,
        _ => default,
    }
}
