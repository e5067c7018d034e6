//! Ids and addressing at the C boundary: the `rdma_cm_id` shell and the fields librdmacm
//! fills in it (addresses, `verbs`, `pd`, the route and its path record), sockaddr
//! conversion, and `rdma_create_id`, `rdma_destroy_id`, `rdma_migrate_id`,
//! `rdma_bind_addr`, `rdma_resolve_addr`, `rdma_resolve_route`, the port getters and
//! `rdma_set_option`.

use super::device::cm_device;
use super::event::{
    channel_shell, complete, free_channel_shell, not_ours_channel, release_kept_event,
    requested_channel,
};
use super::{call_real, cm_boundary, cm_status, fail, forward};
use crate::capi::boundary::ffi_boundary;
use crate::capi::caller::{Caller, export_with_caller};
use crate::cm::{CmId, DEFAULT_PKEY, HOP_LIMIT, PACKET_LIFE_TIME, PATH_MTU_4096, PortSpace, Route};
use crate::sys::*;
use dashmap::DashSet;
use rustc_hash::FxBuildHasher;
use socket2::SockAddr;
use std::cell::UnsafeCell;
use std::net::SocketAddr;
use std::os::raw::{c_int, c_void};
use std::ptr;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// `rdma_cm_id` plus the id behind it.
#[repr(C)]
pub(super) struct IdShell {
    pub(super) raw: UnsafeCell<rdma_cm_id>,
    pub(super) inner: Arc<CmId>,
    /// The one path record `id->route.path_rec` points to once the route is resolved.
    path: UnsafeCell<ibv_sa_path_rec>,
    /// `rdma_create_ep` on a passive endpoint: the QP `rdma_get_request` creates per request.
    pub(super) qp_init_attr: UnsafeCell<Option<ibv_qp_init_attr>>,
    /// A synchronous id's `rdma_disconnect` waited for DISCONNECTED already.
    pub(super) disconnect_waited: AtomicBool,
}

static IDS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);

pub(super) fn our_id<'a>(id: *mut rdma_cm_id) -> Option<&'a IdShell> {
    IDS.contains(&(id as usize))
        // SAFETY: a registered pointer was published by `Box::into_raw` of an IdShell and is
        // unregistered before it is freed.
        .then(|| unsafe { &*(id as *const IdShell) })
}

pub(super) fn new_id_shell(inner: Arc<CmId>, context: *mut c_void) -> *mut rdma_cm_id {
    let channel = channel_shell(&inner.channel());
    let raw = rdma_cm_id {
        channel,
        context,
        ps: rdma_port_space(inner.port_space.to_raw()),
        qp_type: ibv_qp_type(inner.qp_type),
        // SAFETY: rdma_cm_id is plain C data; all-zero is its librdmacm initial state.
        ..unsafe { std::mem::zeroed() }
    };
    let shell = Box::into_raw(Box::new(IdShell {
        raw: UnsafeCell::new(raw),
        inner: Arc::clone(&inner),
        // SAFETY: plain C data.
        path: UnsafeCell::new(unsafe { std::mem::zeroed() }),
        qp_init_attr: UnsafeCell::new(None),
        disconnect_waited: AtomicBool::new(false),
    }));
    IDS.insert(shell as usize);
    inner.set_shell(shell as usize);
    shell.cast()
}

/// # Safety
/// `sa` is NULL or points to a sockaddr of its family's size.
pub(super) unsafe fn read_sockaddr(sa: *const sockaddr) -> Option<SocketAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: every sockaddr starts with its family.
    let family = i32::from(unsafe { (*sa).sa_family });
    let len = match family {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return None,
    };
    // SAFETY: plain C data.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's sockaddr has `len` bytes for its family; storage is larger.
    unsafe { ptr::copy_nonoverlapping(sa.cast::<u8>(), ptr::addr_of_mut!(storage).cast(), len) };
    // SAFETY: storage holds an initialized address of `len` bytes.
    unsafe { SockAddr::new(storage, len as libc::socklen_t) }.as_socket()
}

/// Writes `addr` (or zeros) into a `sockaddr_storage`.
fn write_sockaddr(dst: &mut sockaddr_storage, addr: Option<SocketAddr>) {
    // SAFETY: plain C data.
    *dst = unsafe { std::mem::zeroed() };
    if let Some(a) = addr {
        let sa = SockAddr::from(a);
        let len = (sa.len() as usize).min(std::mem::size_of::<sockaddr_storage>());
        // SAFETY: `sa` holds `len` initialized bytes; dst is a sockaddr_storage (128 bytes).
        unsafe {
            ptr::copy_nonoverlapping(
                sa.as_ptr().cast::<u8>(),
                (dst as *mut sockaddr_storage).cast(),
                len,
            )
        };
    }
}

/// Refreshes the fields librdmacm fills from the kernel's view of an id: its addresses, and
/// (once it has a device) `verbs`, `port_num`, `pd` and the IB address. Returns the route
/// written, for [`fill_path`].
pub(super) fn refresh(shell: &IdShell, attach_device: bool) -> Route {
    let device = if attach_device {
        cm_device().ok()
    } else {
        None
    };
    let route = shell.inner.route();
    // SAFETY: the application reads these fields; librdmacm writes them in the same calls
    // (bind, resolve, get_cm_event), from the thread making the call.
    let raw = unsafe { &mut *shell.raw.get() };
    // SAFETY: the src/dst unions are storage-sized; we write the storage member.
    unsafe {
        write_sockaddr(&mut raw.route.addr.__bindgen_anon_1.src_storage, route.src);
        write_sockaddr(&mut raw.route.addr.__bindgen_anon_2.dst_storage, route.dst);
    }
    if let Some(dev) = device {
        raw.verbs = dev.context as *mut ibv_context;
        raw.port_num = 1;
        if raw.pd.is_null() {
            raw.pd = dev.pd as *mut ibv_pd;
        }
    }
    raw.route.addr.addr.ibaddr = rdma_ib_addr {
        sgid: ibv_gid { raw: route.sgid },
        dgid: ibv_gid { raw: route.dgid },
        pkey: DEFAULT_PKEY.to_be(),
    };
    route
}

/// Points `id->route.path_rec` at the id's one path record, filled from `route`.
pub(super) fn fill_path(shell: &IdShell, route: &Route) {
    // SAFETY: as in refresh.
    let raw = unsafe { &mut *shell.raw.get() };
    // SAFETY: the id's own record, read by the application only through route.path_rec.
    let path = unsafe { &mut *shell.path.get() };
    // Selectors: 2 is "exactly this value".
    path.sgid = ibv_gid { raw: route.sgid };
    path.dgid = ibv_gid { raw: route.dgid };
    path.slid = route.slid.to_be();
    path.dlid = route.dlid.to_be();
    path.pkey = DEFAULT_PKEY.to_be();
    path.hop_limit = HOP_LIMIT;
    path.reversible = 1;
    path.numb_path = 1;
    path.mtu_selector = 2;
    path.mtu = PATH_MTU_4096 as u8;
    path.rate_selector = 2;
    path.packet_life_time_selector = 2;
    path.packet_life_time = PACKET_LIFE_TIME;
    raw.route.path_rec = path;
    raw.route.num_paths = 1;
}

/// `rdma_create_id` with the QP type given (`rdma_create_ep` takes it from the addrinfo).
pub(super) fn create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: u32,
    qp_type: u32,
) -> c_int {
    let Some(port_space) = PortSpace::from_raw(ps) else {
        return fail(libc::EINVAL);
    };
    if id.is_null() {
        return fail(libc::EINVAL);
    }
    if let Err(e) = cm_device() {
        return fail(e);
    }
    let channel = match requested_channel(channel) {
        Ok(c) => c,
        Err(errno) => return fail(errno),
    };
    let inner = match CmId::create(channel, port_space, qp_type) {
        Ok(i) => i,
        Err(e) => return fail(e.errno()),
    };
    // SAFETY: checked non-NULL; the caller's out-pointer.
    unsafe { *id = new_id_shell(inner, context) };
    0
}

export_with_caller! {
    /// An id on one of ugdr's channels (or, without a channel, a synchronous id), ugdr's; on
    /// a channel of the real librdmacm, or without one for a caller whose verbs are the real
    /// ones (an application's own UCX, librdmacm itself), the real library's.
    fn rdma_create_id(
        channel: *mut rdma_event_channel,
        id: *mut *mut rdma_cm_id,
        context: *mut c_void,
        ps: rdma_port_space
    ) -> c_int => create_id_from, caller in "r8" / "x4"
}

unsafe extern "C" fn create_id_from(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
    caller: Caller,
) -> c_int {
    cm_boundary!("rdma_create_id", {
        if !channel.is_null() && not_ours_channel(channel) {
            return forward!(rdma_create_id(channel, id, context, ps));
        }
        if channel.is_null()
            && let Some(user) = caller.real_verbs_user()
        {
            tracing::debug!("rdma_create_id from {user}: the real librdmacm's");
            return call_real!(rdma_create_id(channel, id, context, ps) or fail(libc::ENODEV));
        }
        let Some(port_space) = PortSpace::from_raw(ps.0) else {
            return fail(libc::EINVAL);
        };
        create_id(channel, id, context, ps.0, port_space.qp_type())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_destroy_id", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_destroy_id(id));
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        release_kept_event(raw);
        // As librdmacm: the events the application holds for this id are acknowledged first
        // (an event handler that destroys its own id before acking it waits forever there too).
        shell.inner.wait_events_acked();
        IDS.remove(&(id as usize));
        shell.inner.destroy();
        shell.inner.set_shell(0);
        let channel = shell.inner.channel();
        if channel.is_sync() {
            free_channel_shell(raw.channel);
        }
        // SAFETY: unregistered above; the Box was leaked by new_id_shell.
        drop(unsafe { Box::from_raw(id as *mut IdShell) });
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_migrate_id(
    id: *mut rdma_cm_id,
    channel: *mut rdma_event_channel,
) -> c_int {
    cm_boundary!("rdma_migrate_id", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_migrate_id(id, channel));
        };
        let requested = match requested_channel(channel) {
            Ok(c) => c,
            Err(errno) => return fail(errno),
        };
        let new = match shell.inner.migration_target(requested) {
            Ok(c) => c,
            Err(e) => return cm_status(Err(e)),
        };
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        if shell.inner.channel().is_sync() {
            release_kept_event(raw);
            free_channel_shell(raw.channel);
        }
        shell.inner.wait_events_acked();
        raw.channel = channel_shell(&new);
        shell.inner.migrate(new);
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
    cm_boundary!("rdma_bind_addr", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_bind_addr(id, addr));
        };
        // SAFETY: the caller's sockaddr (or NULL).
        let Some(addr) = (unsafe { read_sockaddr(addr) }) else {
            return fail(libc::EINVAL);
        };
        match shell.inner.bind(addr) {
            Ok(_) => {
                // Binding a concrete address attaches the device; a wildcard leaves verbs NULL.
                refresh(shell, !addr.ip().is_unspecified());
                0
            }
            Err(e) => cm_status(Err(e)),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_resolve_addr(
    id: *mut rdma_cm_id,
    src_addr: *mut sockaddr,
    dst_addr: *mut sockaddr,
    timeout_ms: c_int,
) -> c_int {
    cm_boundary!("rdma_resolve_addr", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_resolve_addr(id, src_addr, dst_addr, timeout_ms));
        };
        // SAFETY: the caller's sockaddrs (or NULL).
        let (src, dst) = unsafe { (read_sockaddr(src_addr), read_sockaddr(dst_addr)) };
        let Some(dst) = dst else {
            return fail(libc::EINVAL);
        };
        if !src_addr.is_null() && src.is_none() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
        let raw = unsafe { &mut *shell.raw.get() };
        // SAFETY: the storage member of the destination union.
        write_sockaddr(
            unsafe { &mut raw.route.addr.__bindgen_anon_2.dst_storage },
            Some(dst),
        );
        let timeout = Duration::from_millis(u64::try_from(timeout_ms).unwrap_or(0));
        if let Err(e) = shell.inner.resolve_addr(src, dst, timeout) {
            return cm_status(Err(e));
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, timeout_ms: c_int) -> c_int {
    cm_boundary!("rdma_resolve_route", {
        let Some(shell) = our_id(id) else {
            return forward!(rdma_resolve_route(id, timeout_ms));
        };
        if let Err(e) = shell.inner.resolve_route() {
            return cm_status(Err(e));
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    ffi_boundary!("rdma_get_src_port", on_panic = 0, {
        match our_id(id) {
            Some(s) => s.inner.local_addr().map_or(0, |a| a.port().to_be()),
            None => forward!(rdma_get_src_port(id) or 0),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    ffi_boundary!("rdma_get_dst_port", on_panic = 0, {
        match our_id(id) {
            Some(s) => s.inner.remote_addr().map_or(0, |a| a.port().to_be()),
            None => forward!(rdma_get_dst_port(id) or 0),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_set_option(
    id: *mut rdma_cm_id,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: usize,
) -> c_int {
    cm_boundary!("rdma_set_option", {
        if our_id(id).is_none() {
            return forward!(rdma_set_option(id, level, optname, optval, optlen));
        }
        if optval.is_null() {
            return fail(libc::EINVAL);
        }
        // TOS, reuse and AFONLY change nothing ugdr models (the bind already reuses ports in
        // TIME_WAIT), so they are checked and accepted; the ACK timeout is the QP's.
        let expected = match (level as u32, optname as u32) {
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_TOS.0 => Some(1),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_REUSEADDR.0 => Some(4),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_AFONLY.0 => Some(4),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_ACK_TIMEOUT.0 => {
                if optlen != 1 {
                    return fail(libc::EINVAL);
                }
                // SAFETY: optval is non-null and the caller says it holds optlen (1) bytes.
                let code = unsafe { *(optval as *const u8) };
                return match our_id(id).map(|s| s.inner.set_ack_timeout(code)) {
                    Some(Err(e)) => fail(e.errno()),
                    _ => 0,
                };
            }
            (l, o) if l == RDMA_OPTION_IB.0 && o == RDMA_OPTION_IB_PATH.0 => None,
            _ => return fail(libc::ENOSYS),
        };
        match expected {
            Some(len) if optlen != len => fail(libc::EINVAL),
            _ => 0,
        }
    })
}
