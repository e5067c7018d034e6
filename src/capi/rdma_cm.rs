//! librdmacm's `rdma_*` exports: ids, event channels, events, connection setup and the QPs
//! the CM creates. The protocol lives in [`crate::cm`]; this file converts C structs, fills the
//! fields applications read directly (`id->verbs`, `id->route`, `id->qp`, …; librdmacm writes
//! them in the same calls), and drives the QP through INIT/RTR/RTS with `ibv_modify_qp` as
//! librdmacm does. rdma-core's convention: 0, or -1 with errno.

use super::boundary::{Attempt, blocking, ffi_boundary, set_errno};
use super::ibv_cq::{
    ibv_create_comp_channel, ibv_create_cq, ibv_destroy_comp_channel, ibv_destroy_cq,
};
use super::ibv_device::{device, ibv_open_device, ibv_query_device};
use super::ibv_pd_mr::ibv_alloc_pd;
use super::ibv_qp::{create_qp_ex_op, ibv_destroy_qp, ibv_modify_qp, our_qp};
use super::ibv_srq::{ibv_create_srq, ibv_destroy_srq};
use super::rdma_addrinfo::RAI_PASSIVE;
use crate::cm::wire::Endpoint;
use crate::cm::{CmError, CmEvent, CmId, EventChannel, EventKind, Phase, PortSpace, QpParams};
use crate::engine::Engine;
use crate::sys::*;
use dashmap::DashSet;
use rustc_hash::FxBuildHasher;
use socket2::SockAddr;
use std::cell::UnsafeCell;
use std::net::{IpAddr, SocketAddr};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, LazyLock, OnceLock};
use std::time::Duration;

/// Like `ffi_boundary!`, with librdmacm's failure value: -1 and errno.
macro_rules! cm_boundary {
    ($name:expr, $body:block) => {
        ffi_boundary!(
            $name,
            on_panic = {
                set_errno(libc::EIO);
                -1
            },
            $body
        )
    };
}

const QPT_UD: u32 = 4;
/// `RDMA_UDP_QKEY`.
const UDP_QKEY: u32 = 0x0123_4567;
/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: "use the device maximum".
const DEPTH_MAX: u8 = 255;
/// IB CM reject reasons.
const REJ_CONSUMER_DEFINED: u8 = 28;
const REJ_VENDOR_OPTION_NOT_SUPPORTED: u8 = 35;

fn fail(errno: c_int) -> c_int {
    set_errno(errno);
    -1
}

fn cm_status(r: Result<(), CmError>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::debug!("rdma_cm: {e}");
            fail(e.errno())
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The device librdmacm opens once per process.

struct CmDevice {
    context: usize,
    pd: usize,
    max_rd_atom: u8,
}

/// ugdr0's context and default PD, opened once and kept for the life of the process: every
/// `rdma_get_devices` and every `id->verbs` is this same pointer (SPDK compares them).
fn cm_device() -> Result<&'static CmDevice, c_int> {
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

fn errno_or(default: c_int) -> c_int {
    match std::io::Error::last_os_error().raw_os_error() {
        Some(e) if e != 0 => e,
        _ => default,
    }
}

// ---------------------------------------------------------------------------------------------
// Shells.

/// `rdma_event_channel` plus the channel behind it.
#[repr(C)]
struct ChannelShell {
    raw: UnsafeCell<rdma_event_channel>,
    inner: Arc<EventChannel>,
}

/// `rdma_cm_id` plus the id behind it.
#[repr(C)]
struct IdShell {
    raw: UnsafeCell<rdma_cm_id>,
    inner: Arc<CmId>,
    /// The one path record `id->route.path_rec` points to once the route is resolved.
    path: UnsafeCell<ibv_sa_path_rec>,
    /// `rdma_create_ep` on a passive endpoint: the QP `rdma_get_request` creates per request.
    qp_init_attr: UnsafeCell<Option<ibv_qp_init_attr>>,
    /// `ai_connect` of `rdma_create_ep`: sent ahead of `rdma_connect`'s private data.
    connect_prefix: UnsafeCell<Vec<u8>>,
    /// A synchronous id's `rdma_disconnect` waited for DISCONNECTED already.
    disconnect_waited: AtomicBool,
}

/// `rdma_cm_event` plus the private data it points to.
#[repr(C)]
struct EventShell {
    raw: UnsafeCell<rdma_cm_event>,
    private_data: Vec<u8>,
    /// The id the event counts against until acknowledged (the listener for a request).
    counted: Arc<CmId>,
}

static CHANNELS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);
static IDS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);
static EVENTS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);

// SAFETY (for the three lookups below): a pointer found in its registry was published by
// `Box::into_raw` of that shell type and is unregistered before it is freed.
fn our_channel<'a>(ch: *mut rdma_event_channel) -> Option<&'a ChannelShell> {
    CHANNELS
        .contains(&(ch as usize))
        // SAFETY: see above.
        .then(|| unsafe { &*(ch as *const ChannelShell) })
}

fn our_id<'a>(id: *mut rdma_cm_id) -> Option<&'a IdShell> {
    IDS.contains(&(id as usize))
        // SAFETY: see above.
        .then(|| unsafe { &*(id as *const IdShell) })
}

/// The C object for `channel`, created the first time (channels of synchronous ids).
fn channel_shell(channel: &Arc<EventChannel>) -> *mut rdma_event_channel {
    let existing = channel.shell();
    if existing != 0 {
        return existing as *mut rdma_event_channel;
    }
    let shell = Box::into_raw(Box::new(ChannelShell {
        raw: UnsafeCell::new(rdma_event_channel { fd: channel.fd() }),
        inner: Arc::clone(channel),
    }));
    CHANNELS.insert(shell as usize);
    channel.set_shell(shell as usize);
    shell.cast()
}

/// Channels destroyed lately (most recent last, bounded).
static RETIRED_CHANNELS: LazyLock<std::sync::Mutex<std::collections::VecDeque<usize>>> =
    LazyLock::new(Default::default);

/// How long a call on a just-destroyed channel waits before it fails.
const RETIRED_GRACE: Duration = Duration::from_secs(1);

fn free_channel_shell(ch: *mut rdma_event_channel) {
    if CHANNELS.remove(&(ch as usize)).is_some() {
        let mut retired = RETIRED_CHANNELS.lock().unwrap_or_else(|p| p.into_inner());
        retired.push_back(ch as usize);
        if retired.len() > 64 {
            retired.pop_front();
        }
        drop(retired);
        // SAFETY: registered, so a live ChannelShell from Box::into_raw; unregistered above.
        let shell = unsafe { Box::from_raw(ch as *mut ChannelShell) };
        shell.inner.set_shell(0);
        if shell.inner.has_waiters() {
            // Another thread is blocked reading this channel. With the kernel's CM it stays
            // blocked (its read holds the file open); closing our socket pair would wake it
            // with an error instead, so its two fds stay open.
            std::mem::forget(Arc::clone(&shell.inner));
        }
    }
}

fn new_id_shell(inner: Arc<CmId>, context: *mut c_void) -> *mut rdma_cm_id {
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
        connect_prefix: UnsafeCell::new(Vec::new()),
        disconnect_waited: AtomicBool::new(false),
    }));
    IDS.insert(shell as usize);
    inner.set_shell(shell as usize);
    shell.cast()
}

// ---------------------------------------------------------------------------------------------
// Addresses.

/// # Safety
/// `sa` is NULL or points to a sockaddr of its family's size.
unsafe fn read_sockaddr(sa: *const sockaddr) -> Option<SocketAddr> {
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

fn ipv4_of(addr: Option<SocketAddr>) -> std::net::Ipv4Addr {
    match addr.map(|a| a.ip()) {
        Some(IpAddr::V4(v4)) => v4,
        Some(IpAddr::V6(v6)) => v6.to_ipv4_mapped().unwrap_or(std::net::Ipv4Addr::LOCALHOST),
        None => std::net::Ipv4Addr::UNSPECIFIED,
    }
}

/// Refreshes the fields librdmacm fills from the kernel's view of an id: its addresses, and
/// (once it has a device) `verbs`, `port_num`, `pd` and the IB address.
fn refresh(shell: &IdShell, attach_device: bool) {
    let inner = &shell.inner;
    let local = inner.local_addr();
    let remote = inner.remote_addr();
    let peer = inner.peer();
    let device = if attach_device {
        cm_device().ok()
    } else {
        None
    };
    let engine = Engine::running();
    // SAFETY: the application reads these fields; librdmacm writes them in the same calls
    // (bind, resolve, get_cm_event), from the thread making the call.
    let raw = unsafe { &mut *shell.raw.get() };
    // SAFETY: the src/dst unions are storage-sized; we write the storage member.
    unsafe {
        write_sockaddr(&mut raw.route.addr.__bindgen_anon_1.src_storage, local);
        write_sockaddr(&mut raw.route.addr.__bindgen_anon_2.dst_storage, remote);
    }
    if let Some(dev) = device {
        raw.verbs = dev.context as *mut ibv_context;
        raw.port_num = 1;
        if raw.pd.is_null() {
            raw.pd = dev.pd as *mut ibv_pd;
        }
    }
    let sgid = engine.map(|e| e.gid).unwrap_or_default();
    let dgid = match &peer {
        Some(p) => p.gid,
        None => crate::engine::address::port_gid(ipv4_of(remote), 0),
    };
    raw.route.addr.addr.ibaddr = rdma_ib_addr {
        sgid: ibv_gid { raw: sgid },
        dgid: ibv_gid { raw: dgid },
        pkey: 0xffffu16.to_be(),
    };
}

/// Points `id->route.path_rec` at the id's one path record.
fn fill_path(shell: &IdShell) {
    let peer = shell.inner.peer();
    let engine = Engine::running();
    // SAFETY: as in refresh.
    let raw = unsafe { &mut *shell.raw.get() };
    // SAFETY: the id's own record, read by the application only through route.path_rec.
    let path = unsafe { &mut *shell.path.get() };
    // SAFETY: the only member of the union, written by refresh (or zero).
    let ib = unsafe { raw.route.addr.addr.ibaddr };
    path.sgid = ib.sgid;
    path.dgid = ib.dgid;
    path.slid = engine.map(|e| e.lid).unwrap_or(0).to_be();
    path.dlid = peer.map(|p| p.lid).unwrap_or(0).to_be();
    path.pkey = 0xffffu16.to_be();
    path.hop_limit = 1;
    path.reversible = 1;
    path.numb_path = 1;
    path.mtu_selector = 2;
    path.mtu = ibv_mtu::IBV_MTU_4096.0 as u8;
    path.rate_selector = 2;
    path.packet_life_time_selector = 2;
    path.packet_life_time = 14;
    raw.route.path_rec = path;
    raw.route.num_paths = 1;
}

// ---------------------------------------------------------------------------------------------
// QP attributes the CM computes (the kernel's rdma_init_qp_attr).

const ACCESS_REMOTE_WRITE: u32 = ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0;
const ACCESS_REMOTE_READ_ATOMIC: u32 =
    ibv_access_flags::IBV_ACCESS_REMOTE_READ.0 | ibv_access_flags::IBV_ACCESS_REMOTE_ATOMIC.0;

/// The attributes and mask that move a CM id's QP into `state`.
fn qp_attr_for(p: &QpParams, state: ibv_qp_state) -> Result<(ibv_qp_attr, c_int), c_int> {
    use ibv_qp_attr_mask as m;
    let mut a = ibv_qp_attr {
        qp_state: state,
        ..Default::default()
    };
    let ud = p.qp_type == QPT_UD;
    let mask = match state {
        ibv_qp_state::IBV_QPS_INIT => {
            a.pkey_index = 0;
            a.port_num = 1;
            if ud {
                a.qkey = UDP_QKEY;
                m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_QKEY.0
            } else {
                // Before a connection exists the kernel grants nothing; once it does, remote
                // writes, and reads and atomics when this side serves any.
                a.qp_access_flags = match &p.peer {
                    None => 0,
                    Some(_) if p.responder_resources > 0 => {
                        ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ_ATOMIC
                    }
                    Some(_) => ACCESS_REMOTE_WRITE,
                };
                m::IBV_QP_STATE.0
                    | m::IBV_QP_PKEY_INDEX.0
                    | m::IBV_QP_PORT.0
                    | m::IBV_QP_ACCESS_FLAGS.0
            }
        }
        ibv_qp_state::IBV_QPS_RTR if ud => m::IBV_QP_STATE.0,
        ibv_qp_state::IBV_QPS_RTR => {
            let peer = p.peer.as_ref().ok_or(libc::EINVAL)?;
            a.ah_attr = ibv_ah_attr {
                grh: ibv_global_route {
                    dgid: ibv_gid { raw: peer.gid },
                    hop_limit: 1,
                    ..Default::default()
                },
                dlid: peer.lid,
                is_global: 1,
                port_num: 1,
                ..Default::default()
            };
            a.path_mtu = ibv_mtu::IBV_MTU_4096;
            a.dest_qp_num = peer.qpn;
            a.rq_psn = peer.psn;
            a.max_dest_rd_atomic = p.responder_resources;
            a.min_rnr_timer = 12;
            m::IBV_QP_STATE.0
                | m::IBV_QP_AV.0
                | m::IBV_QP_PATH_MTU.0
                | m::IBV_QP_DEST_QPN.0
                | m::IBV_QP_RQ_PSN.0
                | m::IBV_QP_MAX_DEST_RD_ATOMIC.0
                | m::IBV_QP_MIN_RNR_TIMER.0
        }
        ibv_qp_state::IBV_QPS_RTS if ud => {
            a.sq_psn = 0;
            m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0
        }
        ibv_qp_state::IBV_QPS_RTS => {
            if p.peer.is_none() {
                return Err(libc::EINVAL);
            }
            a.timeout = 14;
            a.retry_cnt = p.retry_count.min(7);
            a.rnr_retry = p.rnr_retry_count.min(7);
            a.sq_psn = p.local_psn;
            a.max_rd_atomic = p.initiator_depth;
            m::IBV_QP_STATE.0
                | m::IBV_QP_TIMEOUT.0
                | m::IBV_QP_RETRY_CNT.0
                | m::IBV_QP_RNR_RETRY.0
                | m::IBV_QP_SQ_PSN.0
                | m::IBV_QP_MAX_QP_RD_ATOMIC.0
        }
        _ => return Err(libc::EINVAL),
    };
    Ok((a, mask as c_int))
}

/// Moves `qp` through `states` with the CM's attributes (librdmacm's ucma_modify_qp_*).
fn drive_qp(qp: *mut ibv_qp, p: &QpParams, states: &[ibv_qp_state]) -> Result<(), c_int> {
    for &state in states {
        let (mut attr, mask) = qp_attr_for(p, state)?;
        // SAFETY: `qp` is the id's QP (ugdr's), `attr` a valid attribute struct.
        let rc = unsafe { ibv_modify_qp(qp, &mut attr, mask) };
        if rc != 0 {
            return Err(rc);
        }
    }
    Ok(())
}

fn qp_to_error(qp: *mut ibv_qp) {
    if qp.is_null() {
        return;
    }
    let mut attr = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_ERR,
        ..Default::default()
    };
    // SAFETY: the id's QP and a valid attribute struct.
    unsafe { ibv_modify_qp(qp, &mut attr, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) };
}

const CONNECT_STATES: [ibv_qp_state; 3] = [
    ibv_qp_state::IBV_QPS_INIT,
    ibv_qp_state::IBV_QPS_RTR,
    ibv_qp_state::IBV_QPS_RTS,
];

// ---------------------------------------------------------------------------------------------
// Events.

/// Takes the next event of `channel` and turns it into an `rdma_cm_event`, doing what
/// librdmacm does on the way: a new id for a connection request, the id's fields after address
/// and route resolution, RTR/RTS and RTU for a connection reply to an id with a QP.
fn next_event(channel: &ChannelShell) -> Result<*mut rdma_cm_event, c_int> {
    loop {
        let event = channel.inner.next().map_err(|e| e.errno())?;
        if let Some(ev) = convert_event(event) {
            return Ok(ev);
        }
    }
}

/// Like `next_event`, without blocking: `None` while no event is queued.
fn try_next_event(channel: &ChannelShell) -> Result<Option<*mut rdma_cm_event>, c_int> {
    while let Some(event) = channel.inner.try_next().map_err(|e| e.errno())? {
        if let Some(ev) = convert_event(event) {
            return Ok(Some(ev));
        }
    }
    Ok(None)
}

fn convert_event(event: CmEvent) -> Option<*mut rdma_cm_event> {
    let CmEvent {
        id,
        listen_id,
        mut kind,
        mut status,
        param,
    } = event;
    let mut listen_ptr: *mut rdma_cm_id = ptr::null_mut();
    let id_ptr = match &listen_id {
        Some(listener) => {
            listen_ptr = listener.shell() as *mut rdma_cm_id;
            let listen_shell = our_id(listen_ptr)?;
            // SAFETY: the listener's fields, read on the thread that owns the event.
            let context = unsafe { (*listen_shell.raw.get()).context };
            let child = new_id_shell(Arc::clone(&id), context);
            let shell = our_id(child)?;
            refresh(shell, true);
            fill_path(shell);
            child
        }
        None => id.shell() as *mut rdma_cm_id,
    };
    let shell = our_id(id_ptr)?;
    // SAFETY: see refresh.
    let raw = unsafe { &mut *shell.raw.get() };
    match kind {
        EventKind::AddrResolved => refresh(shell, true),
        EventKind::RouteResolved => {
            refresh(shell, true);
            fill_path(shell);
        }
        EventKind::ConnectResponse => {
            refresh(shell, true);
            fill_path(shell);
            if !raw.qp.is_null() {
                match drive_qp(raw.qp, &id.qp_params(), &CONNECT_STATES)
                    .and_then(|()| id.establish().map_err(|e| e.errno()))
                {
                    Ok(()) => kind = EventKind::Established,
                    Err(errno) => {
                        tracing::debug!("rdma_cm: connection reply unusable: errno {errno}");
                        id.abort();
                        qp_to_error(raw.qp);
                        kind = EventKind::ConnectError;
                        status = -errno;
                    }
                }
            }
        }
        EventKind::Rejected => qp_to_error(raw.qp),
        _ => {}
    }
    let ud = id.is_ud();
    let peer = id.peer();
    let private_data = param.private_data;
    let shell = Box::new(EventShell {
        raw: UnsafeCell::new(rdma_cm_event {
            id: id_ptr,
            listen_id: listen_ptr,
            event: rdma_cm_event_type(kind.to_raw()),
            status,
            // SAFETY: plain C data, filled below.
            param: unsafe { std::mem::zeroed() },
        }),
        private_data,
        counted: listen_id.unwrap_or(id),
    });
    shell.counted.event_delivered();
    let conn = rdma_conn_param {
        private_data: if shell.private_data.is_empty() {
            ptr::null()
        } else {
            shell.private_data.as_ptr().cast()
        },
        private_data_len: u8::try_from(shell.private_data.len()).unwrap_or(u8::MAX),
        responder_resources: param.responder_resources,
        initiator_depth: param.initiator_depth,
        flow_control: param.flow_control,
        retry_count: param.retry_count,
        rnr_retry_count: param.rnr_retry_count,
        srq: param.srq,
        qp_num: param.qp_num,
    };
    if ud {
        // UD ids report the peer's address as an address vector, its QPN and Q_Key.
        let ah_attr = match peer {
            Some(p) => ibv_ah_attr {
                grh: ibv_global_route {
                    dgid: ibv_gid { raw: p.gid },
                    hop_limit: 1,
                    ..Default::default()
                },
                dlid: p.lid,
                is_global: 1,
                port_num: 1,
                ..Default::default()
            },
            None => ibv_ah_attr::default(),
        };
        let ud_param = rdma_ud_param {
            private_data: conn.private_data,
            private_data_len: conn.private_data_len,
            ah_attr,
            qp_num: conn.qp_num,
            qkey: UDP_QKEY,
        };
        // SAFETY: the event is ours until published below.
        unsafe { (*shell.raw.get()).param.ud = ud_param };
    } else {
        // SAFETY: the event is ours until published below.
        unsafe { (*shell.raw.get()).param.conn = conn };
    }
    let ptr = Box::into_raw(shell);
    EVENTS.insert(ptr as usize);
    Some(ptr.cast())
}

fn free_event(event: *mut rdma_cm_event) -> bool {
    if EVENTS.remove(&(event as usize)).is_none() {
        return false;
    }
    // SAFETY: registered, so a live EventShell from Box::into_raw; unregistered above.
    let shell = unsafe { Box::from_raw(event as *mut EventShell) };
    shell.counted.event_acked();
    true
}

/// librdmacm's ucma_complete: a synchronous id waits for the event its call raises, keeps it
/// in `id->event`, and fails the call when the event reports an error.
fn complete(shell: &IdShell) -> c_int {
    let channel = shell.inner.channel();
    if !channel.is_sync() {
        return 0;
    }
    // SAFETY: see refresh.
    let raw = unsafe { &mut *shell.raw.get() };
    if !raw.event.is_null() {
        free_event(raw.event);
        raw.event = ptr::null_mut();
    }
    let Some(ch) = our_channel(channel_shell(&channel)) else {
        return fail(libc::EINVAL);
    };
    match next_event(ch) {
        Ok(ev) => {
            raw.event = ev;
            // SAFETY: the event just made.
            let (kind, status) = unsafe { ((*ev).event, (*ev).status) };
            if status == 0 {
                0
            } else if kind == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED {
                fail(libc::ECONNREFUSED)
            } else {
                fail(status.abs())
            }
        }
        Err(errno) => fail(errno),
    }
}

// ---------------------------------------------------------------------------------------------
// Exports: channels and ids.

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_event_channel() -> *mut rdma_event_channel {
    ffi_boundary!("rdma_create_event_channel", {
        if let Err(e) = cm_device() {
            set_errno(e);
            return ptr::null_mut();
        }
        match EventChannel::new(false) {
            Ok(ch) => channel_shell(&ch),
            Err(e) => {
                set_errno(e.errno());
                ptr::null_mut()
            }
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_event_channel(channel: *mut rdma_event_channel) {
    ffi_boundary!("rdma_destroy_event_channel", {
        free_channel_shell(channel);
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_id(
    channel: *mut rdma_event_channel,
    id: *mut *mut rdma_cm_id,
    context: *mut c_void,
    ps: rdma_port_space,
) -> c_int {
    cm_boundary!("rdma_create_id", {
        let qp_type = match PortSpace::from_raw(ps.0) {
            Some(PortSpace::Ipoib | PortSpace::Udp) => QPT_UD,
            Some(_) => ibv_qp_type::IBV_QPT_RC.0,
            None => return fail(libc::EINVAL),
        };
        create_id(channel, id, context, ps.0, qp_type)
    })
}

fn create_id(
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
    let channel = if channel.is_null() {
        match EventChannel::new(true) {
            Ok(c) => c,
            Err(e) => return fail(e.errno()),
        }
    } else {
        match our_channel(channel) {
            Some(c) => Arc::clone(&c.inner),
            None => return fail(libc::EINVAL),
        }
    };
    let inner = CmId::new(channel, port_space, qp_type);
    // SAFETY: checked non-NULL; the caller's out-pointer.
    unsafe { *id = new_id_shell(inner, context) };
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_id(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_destroy_id", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        if !raw.event.is_null() {
            free_event(raw.event);
            raw.event = ptr::null_mut();
        }
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
            return fail(libc::EINVAL);
        };
        let old = shell.inner.channel();
        let new = if channel.is_null() {
            if old.is_sync() {
                return fail(libc::EINVAL);
            }
            match EventChannel::new(true) {
                Ok(c) => c,
                Err(e) => return fail(e.errno()),
            }
        } else {
            match our_channel(channel) {
                Some(c) => Arc::clone(&c.inner),
                None => return fail(libc::EINVAL),
            }
        };
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        if old.is_sync() {
            if !raw.event.is_null() {
                free_event(raw.event);
                raw.event = ptr::null_mut();
            }
            free_channel_shell(raw.channel);
        }
        shell.inner.wait_events_acked();
        raw.channel = channel_shell(&new);
        shell.inner.migrate(new);
        0
    })
}

/// Blocks until the next event (EAGAIN on a non-blocking channel). The wait is a cancellation
/// point, as librdmacm's `read()` (see `boundary`); while it waits, the thread keeps the
/// channel's fds open, as the kernel keeps a file open under a blocked read.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rdma_get_cm_event(
    channel: *mut rdma_event_channel,
    event: *mut *mut rdma_cm_event,
) -> c_int {
    let mut waiting_on: Option<Arc<EventChannel>> = None;
    blocking(
        "rdma_get_cm_event",
        || fail(libc::EIO),
        |_| {
            let Some(ch) = our_channel(channel) else {
                let retired = RETIRED_CHANNELS
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .contains(&(channel as usize));
                if retired {
                    // A thread that comes back for the next event just after another destroyed
                    // the channel (rping 44's CM thread does at exit). With the kernel that call
                    // was usually in flight already and stays blocked until the process exits;
                    // here it waits a while for that exit, then fails as a closed fd does.
                    std::thread::sleep(RETIRED_GRACE);
                    return Attempt::Done(fail(libc::EBADF));
                }
                return Attempt::Done(fail(libc::EINVAL));
            };
            if event.is_null() {
                return Attempt::Done(fail(libc::EINVAL));
            }
            match try_next_event(ch) {
                Ok(Some(ev)) => {
                    // SAFETY: checked non-NULL; the caller's out-pointer.
                    unsafe { *event = ev };
                    Attempt::Done(0)
                }
                Ok(None) if ch.inner.is_nonblocking() => Attempt::Done(fail(libc::EAGAIN)),
                Ok(None) => {
                    waiting_on = Some(Arc::clone(&ch.inner));
                    Attempt::Wait {
                        fds: [ch.inner.fd(), -1],
                        count: 1,
                        timeout_ms: -1,
                    }
                }
                Err(errno) => Attempt::Done(fail(errno)),
            }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_ack_cm_event(event: *mut rdma_cm_event) -> c_int {
    cm_boundary!("rdma_ack_cm_event", {
        if free_event(event) {
            0
        } else {
            fail(libc::EINVAL)
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Exports: addressing.

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_bind_addr(id: *mut rdma_cm_id, addr: *mut sockaddr) -> c_int {
    cm_boundary!("rdma_bind_addr", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
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
            return fail(libc::EINVAL);
        };
        // SAFETY: the caller's sockaddrs (or NULL).
        let (src, dst) = unsafe { (read_sockaddr(src_addr), read_sockaddr(dst_addr)) };
        let Some(dst) = dst else {
            return fail(libc::EINVAL);
        };
        if !src_addr.is_null() && src.is_none() {
            return fail(libc::EINVAL);
        }
        // SAFETY: see refresh.
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
pub unsafe extern "C" fn rdma_resolve_route(id: *mut rdma_cm_id, _timeout_ms: c_int) -> c_int {
    cm_boundary!("rdma_resolve_route", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        if let Err(e) = shell.inner.resolve_route() {
            return cm_status(Err(e));
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_listen(id: *mut rdma_cm_id, backlog: c_int) -> c_int {
    cm_boundary!("rdma_listen", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        let r = shell.inner.listen(backlog);
        if r.is_ok() {
            // SAFETY: see refresh.
            let bound_device = unsafe { !(*shell.raw.get()).verbs.is_null() };
            refresh(shell, bound_device);
        }
        cm_status(r)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_src_port(id: *mut rdma_cm_id) -> u16 {
    ffi_boundary!("rdma_get_src_port", on_panic = 0, {
        our_id(id)
            .and_then(|s| s.inner.local_addr())
            .map_or(0, |a| a.port().to_be())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_dst_port(id: *mut rdma_cm_id) -> u16 {
    ffi_boundary!("rdma_get_dst_port", on_panic = 0, {
        our_id(id)
            .and_then(|s| s.inner.remote_addr())
            .map_or(0, |a| a.port().to_be())
    })
}

// ---------------------------------------------------------------------------------------------
// Exports: connections.

/// The depth a side asks for: RDMA_MAX_* means the device maximum (capped by `cap`).
fn depth(requested: Option<u8>, cap: u8) -> u8 {
    match requested {
        Some(d) if d != DEPTH_MAX => d,
        _ => cap,
    }
}

/// librdmacm's ucma_valid_param: RDMA_PS_TCP needs a QP or parameters, and depths the device
/// can serve.
fn valid_param(shell: &IdShell, param: Option<&rdma_conn_param>, max: u8) -> Result<(), c_int> {
    if shell.inner.port_space != PortSpace::Tcp {
        return Ok(());
    }
    // SAFETY: see refresh.
    let has_qp = unsafe { !(*shell.raw.get()).qp.is_null() };
    let Some(p) = param else {
        return if has_qp { Ok(()) } else { Err(libc::EINVAL) };
    };
    let too_deep = |d: u8| d != DEPTH_MAX && d > max;
    if too_deep(p.responder_resources) || too_deep(p.initiator_depth) {
        return Err(libc::EINVAL);
    }
    Ok(())
}

/// # Safety
/// `data` points to `len` readable bytes when non-NULL.
unsafe fn private_bytes(data: *const c_void, len: u8) -> Vec<u8> {
    if data.is_null() || len == 0 {
        return Vec::new();
    }
    // SAFETY: the caller's buffer of `len` bytes.
    unsafe { std::slice::from_raw_parts(data.cast::<u8>(), usize::from(len)) }.to_vec()
}

/// Our half of a connection: the port's LID and GID, and the QP (the id's, or the one the
/// application named in the parameters).
fn local_endpoint(
    raw: &rdma_cm_id,
    param: Option<&rdma_conn_param>,
    responder_resources: u8,
    initiator_depth: u8,
) -> Result<Endpoint, c_int> {
    let engine = Engine::get().map_err(|e| e.errno())?;
    let (qpn, srq) = if raw.qp.is_null() {
        param.map_or((0, false), |p| (p.qp_num, p.srq != 0))
    } else {
        // SAFETY: the id's QP, created by rdma_create_qp.
        unsafe { ((*raw.qp).qp_num, !(*raw.qp).srq.is_null()) }
    };
    Ok(Endpoint {
        lid: engine.lid,
        gid: engine.gid,
        qpn,
        psn: 0,
        srq,
        responder_resources,
        initiator_depth,
        flow_control: param.map_or(0, |p| p.flow_control),
        retry_count: param.map_or(7, |p| p.retry_count.min(7)),
        rnr_retry_count: param.map_or(7, |p| p.rnr_retry_count.min(7)),
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_connect(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    cm_boundary!("rdma_connect", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        let dev = match cm_device() {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        // SAFETY: the caller's parameters (or NULL).
        let param = unsafe { conn_param.as_ref() };
        if let Err(e) = valid_param(shell, param, dev.max_rd_atom) {
            return fail(e);
        }
        let rr = depth(param.map(|p| p.responder_resources), dev.max_rd_atom);
        let id_depth = depth(param.map(|p| p.initiator_depth), dev.max_rd_atom);
        // SAFETY: see refresh.
        let raw = unsafe { &*shell.raw.get() };
        let local = match local_endpoint(raw, param, rr, id_depth) {
            Ok(e) => e,
            Err(errno) => return fail(errno),
        };
        // SAFETY: the id's own prefix, touched only by create_ep and here.
        let mut private = std::mem::take(unsafe { &mut *shell.connect_prefix.get() });
        if let Some(p) = param {
            // SAFETY: the caller's private data of private_data_len bytes.
            private.extend(unsafe { private_bytes(p.private_data, p.private_data_len) });
        }
        if let Err(e) = shell.inner.connect(local, private) {
            return cm_status(Err(e));
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_accept(
    id: *mut rdma_cm_id,
    conn_param: *mut rdma_conn_param,
) -> c_int {
    cm_boundary!("rdma_accept", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        let dev = match cm_device() {
            Ok(d) => d,
            Err(e) => return fail(e),
        };
        // SAFETY: the caller's parameters (or NULL).
        let param = unsafe { conn_param.as_ref() };
        if let Err(e) = valid_param(shell, param, dev.max_rd_atom) {
            return fail(e);
        }
        let mut params = shell.inner.qp_params();
        params.responder_resources = depth(
            param.map(|p| p.responder_resources),
            params.responder_resources.min(dev.max_rd_atom),
        );
        params.initiator_depth = depth(
            param.map(|p| p.initiator_depth),
            params.initiator_depth.min(dev.max_rd_atom),
        );
        // SAFETY: see refresh.
        let raw = unsafe { &*shell.raw.get() };
        let ud = shell.inner.is_ud();
        if !ud && !raw.qp.is_null() {
            if let Err(errno) = drive_qp(raw.qp, &params, &CONNECT_STATES) {
                return fail(errno);
            }
        }
        let local = match local_endpoint(
            raw,
            param,
            params.responder_resources,
            params.initiator_depth,
        ) {
            Ok(e) => e,
            Err(errno) => return fail(errno),
        };
        // SAFETY: the caller's private data of private_data_len bytes.
        let private = param.map_or(Vec::new(), |p| unsafe {
            private_bytes(p.private_data, p.private_data_len)
        });
        if let Err(e) = shell.inner.accept(local, &private) {
            qp_to_error(raw.qp);
            return cm_status(Err(e));
        }
        if ud {
            // A SIDR reply raises no event here; a synchronous id lets its request go.
            // SAFETY: see refresh.
            let raw = unsafe { &mut *shell.raw.get() };
            if shell.inner.channel().is_sync() && !raw.event.is_null() {
                free_event(raw.event);
                raw.event = ptr::null_mut();
            }
            return 0;
        }
        complete(shell)
    })
}

fn reject(id: *mut rdma_cm_id, data: *const c_void, len: u8, reason: u8) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    // SAFETY: the caller's private data of `len` bytes.
    let private = unsafe { private_bytes(data, len) };
    cm_status(shell.inner.reject(&private, reason))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    cm_boundary!("rdma_reject", {
        reject(id, private_data, private_data_len, REJ_CONSUMER_DEFINED)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_reject_ece(
    id: *mut rdma_cm_id,
    private_data: *const c_void,
    private_data_len: u8,
) -> c_int {
    cm_boundary!("rdma_reject_ece", {
        reject(
            id,
            private_data,
            private_data_len,
            REJ_VENDOR_OPTION_NOT_SUPPORTED,
        )
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_establish(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_establish", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: see refresh.
        if unsafe { !(*shell.raw.get()).qp.is_null() } {
            return fail(libc::EINVAL);
        }
        cm_status(shell.inner.establish())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_disconnect(id: *mut rdma_cm_id) -> c_int {
    cm_boundary!("rdma_disconnect", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let qp = unsafe { (*shell.raw.get()).qp };
        qp_to_error(qp);
        if let Err(e) = shell.inner.disconnect() {
            return cm_status(Err(e));
        }
        if shell.disconnect_waited.swap(true, Ordering::AcqRel) {
            return 0;
        }
        complete(shell)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_notify(id: *mut rdma_cm_id, _event: ibv_event_type) -> c_int {
    cm_boundary!("rdma_notify", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        match shell.inner.phase() {
            Phase::ReplySent | Phase::ReplyReceived | Phase::Connected => 0,
            _ => fail(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_init_qp_attr(
    id: *mut rdma_cm_id,
    qp_attr: *mut ibv_qp_attr,
    qp_attr_mask: *mut c_int,
) -> c_int {
    cm_boundary!("rdma_init_qp_attr", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        if qp_attr.is_null() || qp_attr_mask.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let state = unsafe { (*qp_attr).qp_state };
        match qp_attr_for(&shell.inner.qp_params(), state) {
            Ok((attr, mask)) => {
                // SAFETY: the caller's out-structs, checked non-NULL.
                unsafe {
                    *qp_attr = attr;
                    *qp_attr_mask = mask;
                }
                0
            }
            Err(errno) => fail(errno),
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
        if our_id(id).is_none() || optval.is_null() {
            return fail(libc::EINVAL);
        }
        // The options change nothing ugdr models (TOS, timeouts, reuse: the bind already
        // reuses ports in TIME_WAIT), so they are checked and accepted.
        let expected = match (level as u32, optname as u32) {
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_TOS.0 => Some(1),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_REUSEADDR.0 => Some(4),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_AFONLY.0 => Some(4),
            (l, o) if l == RDMA_OPTION_ID.0 && o == RDMA_OPTION_ID_ACK_TIMEOUT.0 => Some(1),
            (l, o) if l == RDMA_OPTION_IB.0 && o == RDMA_OPTION_IB_PATH.0 => None,
            _ => return fail(libc::ENOSYS),
        };
        match expected {
            Some(len) if optlen != len => fail(libc::EINVAL),
            _ => 0,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Exports: QPs and SRQs the CM creates.

fn create_cq(
    raw: &mut rdma_cm_id,
    id: *mut rdma_cm_id,
    size: u32,
    send: bool,
) -> Result<(), c_int> {
    if size == 0 {
        return Ok(());
    }
    // SAFETY: the id's context (ugdr's).
    let channel = unsafe { ibv_create_comp_channel(raw.verbs) };
    if channel.is_null() {
        return Err(errno_or(libc::ENOMEM));
    }
    // SAFETY: as above; cq_context is the id, as librdmacm's rdma_get_*_comp expect.
    let cq = unsafe { ibv_create_cq(raw.verbs, size as c_int, id.cast(), channel, 0) };
    if cq.is_null() {
        let errno = errno_or(libc::ENOMEM);
        // SAFETY: the channel just created.
        unsafe { ibv_destroy_comp_channel(channel) };
        return Err(errno);
    }
    if send {
        raw.send_cq_channel = channel;
        raw.send_cq = cq;
    } else {
        raw.recv_cq_channel = channel;
        raw.recv_cq = cq;
    }
    Ok(())
}

fn destroy_cqs(raw: &mut rdma_cm_id) {
    if !raw.recv_cq.is_null() {
        // SAFETY: CQs and channels here are the ones the CM created for this id.
        unsafe { ibv_destroy_cq(raw.recv_cq) };
    }
    if !raw.send_cq.is_null() && raw.send_cq != raw.recv_cq {
        // SAFETY: see above.
        unsafe { ibv_destroy_cq(raw.send_cq) };
    }
    if !raw.recv_cq_channel.is_null() {
        // SAFETY: see above.
        unsafe { ibv_destroy_comp_channel(raw.recv_cq_channel) };
    }
    if !raw.send_cq_channel.is_null() && raw.send_cq_channel != raw.recv_cq_channel {
        // SAFETY: see above.
        unsafe { ibv_destroy_comp_channel(raw.send_cq_channel) };
    }
    raw.recv_cq = ptr::null_mut();
    raw.send_cq = ptr::null_mut();
    raw.recv_cq_channel = ptr::null_mut();
    raw.send_cq_channel = ptr::null_mut();
}

fn create_qp(id: *mut rdma_cm_id, attr: &mut ibv_qp_init_attr_ex) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    // SAFETY: see refresh.
    let raw = unsafe { &mut *shell.raw.get() };
    if !raw.qp.is_null() {
        return fail(libc::EINVAL);
    }
    let pd_bit = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0;
    if attr.comp_mask & pd_bit == 0 || attr.pd.is_null() {
        attr.comp_mask |= pd_bit;
        attr.pd = raw.pd;
    // SAFETY: a non-NULL PD from the application has a readable context.
    } else if unsafe { (*attr.pd).context } != raw.verbs {
        return fail(libc::EINVAL);
    }
    if attr.pd.is_null() || raw.verbs.is_null() {
        return fail(libc::EINVAL);
    }
    if (!raw.recv_cq.is_null() && !attr.recv_cq.is_null() && raw.recv_cq != attr.recv_cq)
        || (!raw.send_cq.is_null() && !attr.send_cq.is_null() && raw.send_cq != attr.send_cq)
    {
        return fail(libc::EINVAL);
    }
    let send_size = if attr.send_cq.is_null() && raw.send_cq.is_null() {
        attr.cap.max_send_wr
    } else {
        0
    };
    let recv_size = if attr.recv_cq.is_null() && raw.recv_cq.is_null() {
        attr.cap.max_recv_wr
    } else {
        0
    };
    if let Err(errno) =
        create_cq(raw, id, recv_size, false).and_then(|()| create_cq(raw, id, send_size, true))
    {
        destroy_cqs(raw);
        return fail(errno);
    }
    if attr.send_cq.is_null() {
        attr.send_cq = raw.send_cq;
    }
    if attr.recv_cq.is_null() {
        attr.recv_cq = raw.recv_cq;
    }
    if attr.srq.is_null() {
        attr.srq = raw.srq;
    }
    // SAFETY: the id's context (ugdr's) and the caller's attributes.
    let qp = unsafe { create_qp_ex_op(raw.verbs, attr) };
    if qp.is_null() {
        let errno = errno_or(libc::EINVAL);
        destroy_cqs(raw);
        return fail(errno);
    }
    let params = shell.inner.qp_params();
    let states: &[ibv_qp_state] = if shell.inner.qp_type == QPT_UD {
        &CONNECT_STATES
    } else {
        &CONNECT_STATES[..1]
    };
    if let Err(errno) = drive_qp(qp, &params, states) {
        // SAFETY: the QP just created.
        unsafe { ibv_destroy_qp(qp) };
        destroy_cqs(raw);
        return fail(errno);
    }
    // SAFETY: our QP (just created).
    if let Some(q) = unsafe { our_qp(qp) } {
        shell.inner.attach_qp(Some(Arc::clone(&q.inner)));
    }
    // SAFETY: our QP's pd field.
    raw.pd = unsafe { (*qp).pd };
    raw.qp = qp;
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp_ex(
    id: *mut rdma_cm_id,
    qp_init_attr: *mut ibv_qp_init_attr_ex,
) -> c_int {
    cm_boundary!("rdma_create_qp_ex", {
        // SAFETY: the caller's attribute struct (or NULL).
        match unsafe { qp_init_attr.as_mut() } {
            Some(attr) => create_qp(id, attr),
            None => fail(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_qp(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    cm_boundary!("rdma_create_qp", {
        // SAFETY: the caller's attribute struct (or NULL).
        let Some(a) = (unsafe { qp_init_attr.as_mut() }) else {
            return fail(libc::EINVAL);
        };
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let id_pd = unsafe { (*shell.raw.get()).pd };
        let mut ex = ibv_qp_init_attr_ex {
            qp_context: a.qp_context,
            send_cq: a.send_cq,
            recv_cq: a.recv_cq,
            srq: a.srq,
            cap: a.cap,
            qp_type: a.qp_type,
            sq_sig_all: a.sq_sig_all,
            comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0,
            pd: if pd.is_null() { id_pd } else { pd },
            ..Default::default()
        };
        let rc = create_qp(id, &mut ex);
        a.send_cq = ex.send_cq;
        a.recv_cq = ex.recv_cq;
        a.srq = ex.srq;
        a.cap = ex.cap;
        rc
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_qp(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_qp", {
        let Some(shell) = our_id(id) else {
            return set_errno(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        shell.inner.attach_qp(None);
        if !raw.qp.is_null() {
            // SAFETY: the id's QP.
            unsafe { ibv_destroy_qp(raw.qp) };
            raw.qp = ptr::null_mut();
        }
        destroy_cqs(raw);
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_srq(
    id: *mut rdma_cm_id,
    pd: *mut ibv_pd,
    attr: *mut ibv_srq_init_attr,
) -> c_int {
    cm_boundary!("rdma_create_srq", {
        let Some(shell) = our_id(id) else {
            return fail(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        let pd = if pd.is_null() { raw.pd } else { pd };
        if attr.is_null() || pd.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: the id's (or caller's) PD and the caller's attributes.
        let srq = unsafe { ibv_create_srq(pd, attr) };
        if srq.is_null() {
            return fail(errno_or(libc::EINVAL));
        }
        raw.srq = srq;
        raw.pd = pd;
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_srq_ex(
    id: *mut rdma_cm_id,
    attr: *mut ibv_srq_init_attr_ex,
) -> c_int {
    cm_boundary!("rdma_create_srq_ex", {
        // SAFETY: the caller's attributes (or NULL).
        let Some(a) = (unsafe { attr.as_ref() }) else {
            return fail(libc::EINVAL);
        };
        if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_TYPE.0 != 0
            && a.srq_type != ibv_srq_type::IBV_SRQT_BASIC
        {
            return fail(libc::EOPNOTSUPP);
        }
        let pd = if a.comp_mask & ibv_srq_init_attr_mask::IBV_SRQ_INIT_ATTR_PD.0 != 0 {
            a.pd
        } else {
            ptr::null_mut()
        };
        let mut basic = ibv_srq_init_attr {
            srq_context: a.srq_context,
            attr: a.attr,
        };
        // SAFETY: forwarding valid pointers.
        unsafe { rdma_create_srq(id, pd, &mut basic) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_srq(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_srq", {
        let Some(shell) = our_id(id) else {
            return set_errno(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        if !raw.srq.is_null() {
            // SAFETY: the id's SRQ.
            unsafe { ibv_destroy_srq(raw.srq) };
            raw.srq = ptr::null_mut();
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Exports: endpoints (the synchronous API of rdma_server/rdma_client).

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_create_ep(
    id: *mut *mut rdma_cm_id,
    res: *mut rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    cm_boundary!("rdma_create_ep", {
        // SAFETY: the caller's addrinfo (or NULL).
        let Some(res) = (unsafe { res.as_ref() }) else {
            return fail(libc::EINVAL);
        };
        if id.is_null() {
            return fail(libc::EINVAL);
        }
        let mut cm_id: *mut rdma_cm_id = ptr::null_mut();
        let rc = create_id(
            ptr::null_mut(),
            &mut cm_id,
            ptr::null_mut(),
            res.ai_port_space as u32,
            res.ai_qp_type as u32,
        );
        if rc != 0 {
            return rc;
        }
        // SAFETY: every step below works on the id just created and the caller's pointers.
        let rc = unsafe { setup_ep(cm_id, res, pd, qp_init_attr) };
        if rc != 0 {
            let errno = errno_or(libc::EINVAL);
            // SAFETY: the id just created.
            unsafe { rdma_destroy_ep(cm_id) };
            return fail(errno);
        }
        // SAFETY: checked non-NULL.
        unsafe { *id = cm_id };
        0
    })
}

/// # Safety
/// `id` is a fresh synchronous id; `pd`, `qp_init_attr` are the caller's (or NULL).
unsafe fn setup_ep(
    id: *mut rdma_cm_id,
    res: &rdma_addrinfo,
    pd: *mut ibv_pd,
    qp_init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    let Some(shell) = our_id(id) else {
        return fail(libc::EINVAL);
    };
    if res.ai_flags & RAI_PASSIVE != 0 {
        // SAFETY: forwarding the caller's address.
        let rc = unsafe { rdma_bind_addr(id, res.ai_src_addr.cast()) };
        if rc != 0 {
            return rc;
        }
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        if !pd.is_null() {
            raw.pd = pd;
        }
        // SAFETY: the caller's attributes (or NULL); the id's own slot.
        if let Some(a) = unsafe { qp_init_attr.as_ref() } {
            let mut a = *a;
            a.qp_type = ibv_qp_type(res.ai_qp_type as u32);
            // SAFETY: see above.
            unsafe { *shell.qp_init_attr.get() = Some(a) };
        }
        return 0;
    }
    // SAFETY: forwarding the caller's addresses.
    let rc = unsafe { rdma_resolve_addr(id, res.ai_src_addr.cast(), res.ai_dst_addr.cast(), 2000) };
    if rc != 0 {
        return rc;
    }
    // SAFETY: the id just resolved.
    let rc = unsafe { rdma_resolve_route(id, 2000) };
    if rc != 0 {
        return rc;
    }
    // SAFETY: the caller's attributes (or NULL).
    if let Some(a) = unsafe { qp_init_attr.as_mut() } {
        a.qp_type = ibv_qp_type(res.ai_qp_type as u32);
        // SAFETY: forwarding.
        let rc = unsafe { rdma_create_qp(id, pd, a) };
        if rc != 0 {
            return rc;
        }
    }
    if res.ai_connect_len > 0 && !res.ai_connect.is_null() {
        // SAFETY: the addrinfo's connect data of ai_connect_len bytes.
        let data =
            unsafe { std::slice::from_raw_parts(res.ai_connect.cast::<u8>(), res.ai_connect_len) };
        // SAFETY: the id's own prefix.
        unsafe { *shell.connect_prefix.get() = data.to_vec() };
    }
    0
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_destroy_ep(id: *mut rdma_cm_id) {
    ffi_boundary!("rdma_destroy_ep", {
        let Some(shell) = our_id(id) else {
            return set_errno(libc::EINVAL);
        };
        // SAFETY: see refresh.
        let (qp, srq) = unsafe { ((*shell.raw.get()).qp, (*shell.raw.get()).srq) };
        if !qp.is_null() {
            // SAFETY: the id's QP.
            unsafe { rdma_destroy_qp(id) };
        }
        if !srq.is_null() {
            // SAFETY: the id's SRQ.
            unsafe { rdma_destroy_srq(id) };
        }
        // SAFETY: the caller gives the id up.
        unsafe { rdma_destroy_id(id) };
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_request(
    listen: *mut rdma_cm_id,
    id: *mut *mut rdma_cm_id,
) -> c_int {
    cm_boundary!("rdma_get_request", {
        let Some(shell) = our_id(listen) else {
            return fail(libc::EINVAL);
        };
        let channel = shell.inner.channel();
        if !channel.is_sync() || id.is_null() {
            return fail(libc::EINVAL);
        }
        // SAFETY: see refresh.
        let raw = unsafe { &mut *shell.raw.get() };
        if !raw.event.is_null() {
            free_event(raw.event);
            raw.event = ptr::null_mut();
        }
        let Some(ch) = our_channel(channel_shell(&channel)) else {
            return fail(libc::EINVAL);
        };
        let event = match next_event(ch) {
            Ok(ev) => ev,
            Err(errno) => return fail(errno),
        };
        // SAFETY: the event just made.
        let ev = unsafe { &*event };
        let errno = if ev.event == rdma_cm_event_type::RDMA_CM_EVENT_REJECTED {
            libc::ECONNREFUSED
        } else if ev.status != 0 {
            ev.status.abs()
        } else if ev.event != rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST {
            libc::EINVAL
        } else {
            0
        };
        if errno != 0 {
            raw.event = event;
            return fail(errno);
        }
        // SAFETY: the listener's stored attributes.
        if let Some(mut attr) = unsafe { *shell.qp_init_attr.get() } {
            // SAFETY: the new id and attributes.
            let rc = unsafe { rdma_create_qp(ev.id, raw.pd, &mut attr) };
            if rc != 0 {
                raw.event = event;
                return rc;
            }
        }
        // SAFETY: the caller's out-pointer; the new id keeps its request event.
        unsafe {
            *id = ev.id;
            (*ev.id).event = event;
        }
        0
    })
}

// ---------------------------------------------------------------------------------------------
// Exports: devices, strings, and what ugdr does not offer.

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_get_devices(num_devices: *mut c_int) -> *mut *mut ibv_context {
    ffi_boundary!("rdma_get_devices", {
        let dev = match cm_device() {
            Ok(d) => d,
            Err(e) => {
                set_errno(e);
                return ptr::null_mut();
            }
        };
        // SAFETY: a NULL-terminated array of two pointers, freed by rdma_free_devices.
        let list = unsafe { libc::calloc(2, std::mem::size_of::<*mut ibv_context>()) }
            as *mut *mut ibv_context;
        if list.is_null() {
            set_errno(libc::ENOMEM);
            return ptr::null_mut();
        }
        // SAFETY: the array just allocated.
        unsafe { *list = dev.context as *mut ibv_context };
        if !num_devices.is_null() {
            // SAFETY: the caller's out-pointer.
            unsafe { *num_devices = 1 };
        }
        list
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_free_devices(list: *mut *mut ibv_context) {
    ffi_boundary!("rdma_free_devices", {
        // SAFETY: an array from rdma_get_devices (or NULL); the contexts stay open.
        unsafe { libc::free(list.cast()) };
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_event_str(event: rdma_cm_event_type) -> *const c_char {
    ffi_boundary!("rdma_event_str", on_panic = c"UNKNOWN EVENT".as_ptr(), {
        const NAMES: [&std::ffi::CStr; 18] = [
            c"RDMA_CM_EVENT_ADDR_RESOLVED",
            c"RDMA_CM_EVENT_ADDR_ERROR",
            c"RDMA_CM_EVENT_ROUTE_RESOLVED",
            c"RDMA_CM_EVENT_ROUTE_ERROR",
            c"RDMA_CM_EVENT_CONNECT_REQUEST",
            c"RDMA_CM_EVENT_CONNECT_RESPONSE",
            c"RDMA_CM_EVENT_CONNECT_ERROR",
            c"RDMA_CM_EVENT_UNREACHABLE",
            c"RDMA_CM_EVENT_REJECTED",
            c"RDMA_CM_EVENT_ESTABLISHED",
            c"RDMA_CM_EVENT_DISCONNECTED",
            c"RDMA_CM_EVENT_DEVICE_REMOVAL",
            c"RDMA_CM_EVENT_MULTICAST_JOIN",
            c"RDMA_CM_EVENT_MULTICAST_ERROR",
            c"RDMA_CM_EVENT_ADDR_CHANGE",
            c"RDMA_CM_EVENT_TIMEWAIT_EXIT",
            c"RDMA_CM_EVENT_ADDRINFO_RESOLVED",
            c"RDMA_CM_EVENT_ADDRINFO_ERROR",
        ];
        NAMES
            .get(event.0 as usize)
            .map_or(c"UNKNOWN EVENT".as_ptr(), |s| s.as_ptr())
    })
}

/// Multicast and ECE: ugdr's fabric has neither.
macro_rules! not_offered {
    ($name:ident ( $($arg:ident : $ty:ty),* )) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> c_int {
            cm_boundary!(stringify!($name), {
                $(let _ = $arg;)*
                tracing::debug!(concat!(stringify!($name), ": not offered by ugdr"));
                fail(libc::EOPNOTSUPP)
            })
        }
    };
}

not_offered!(rdma_join_multicast(id: *mut rdma_cm_id, addr: *mut sockaddr, context: *mut c_void));
not_offered!(rdma_join_multicast_ex(id: *mut rdma_cm_id, attr: *mut c_void, context: *mut c_void));
not_offered!(rdma_leave_multicast(id: *mut rdma_cm_id, addr: *mut sockaddr));
not_offered!(rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece));
not_offered!(rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece));
