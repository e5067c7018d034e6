//! Event channels and events at the C boundary: the `rdma_event_channel` and `rdma_cm_event`
//! shells, turning a [`CmEvent`] into the `rdma_cm_event` the application reads (a new id for
//! a connection request, the id's fields after resolution, the QP work
//! [`CmId::on_delivery`] prescribes), and the wait a synchronous id's call makes for its event.

use super::id::{IdShell, fill_path, new_id_shell, our_id, refresh};
use super::qp::{VerbsQp, dyn_qp};
use super::{call_real, cm_boundary, cm_status, device::cm_device, fail, forward};
use crate::capi::boundary::{Attempt, blocking, ffi_boundary, set_errno};
use crate::capi::caller::{Caller, export_with_caller};
use crate::capi::ibv_qp::av_to;
use crate::cm::{CmEvent, CmId, EventChannel, EventKind, sync_call_result};
use crate::sys::*;
use dashmap::{DashMap, DashSet};
use rustc_hash::FxBuildHasher;
use std::cell::UnsafeCell;
use std::os::raw::{c_char, c_int};
use std::ptr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// `rdma_event_channel` (the channel behind it is the registry's, [`CHANNELS`]).
#[repr(C)]
pub(super) struct ChannelShell {
    raw: UnsafeCell<rdma_event_channel>,
}

/// `rdma_cm_event` plus the private data it points to.
#[repr(C)]
struct EventShell {
    raw: UnsafeCell<rdma_cm_event>,
    private_data: Vec<u8>,
    /// The id the event counts against until acknowledged (the listener for a request).
    counted: Arc<CmId>,
}

/// ugdr's channel shells, by address, with the channel each stands for: a lookup hands out
/// its own reference, so a thread that found a channel keeps using it safely while another
/// destroys the shell (rping's CM thread asks for its next event as the main thread exits).
static CHANNELS: LazyLock<DashMap<usize, Arc<EventChannel>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);
static EVENTS: LazyLock<DashSet<usize, FxBuildHasher>> = LazyLock::new(DashSet::default);

/// Channels destroyed lately (most recent last, bounded).
static RETIRED_CHANNELS: LazyLock<std::sync::Mutex<std::collections::VecDeque<usize>>> =
    LazyLock::new(Default::default);

/// How long a call on a just-destroyed channel waits before it fails.
const RETIRED_GRACE: Duration = Duration::from_secs(1);

pub(super) fn our_channel(ch: *mut rdma_event_channel) -> Option<Arc<EventChannel>> {
    CHANNELS.get(&(ch as usize)).map(|c| Arc::clone(c.value()))
}

/// A channel ugdr did not create and has not destroyed lately: the real librdmacm's.
pub(super) fn not_ours_channel(ch: *mut rdma_event_channel) -> bool {
    our_channel(ch).is_none() && !retired_channel(ch)
}

/// One of ugdr's channels, destroyed lately.
fn retired_channel(ch: *mut rdma_event_channel) -> bool {
    RETIRED_CHANNELS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&(ch as usize))
}

/// A channel the real librdmacm just created, perhaps where one of ugdr's was: no longer
/// one of ugdr's retired channels.
fn unretire(ch: *mut rdma_event_channel) {
    RETIRED_CHANNELS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .retain(|c| *c != ch as usize);
}

/// The channel an application names for an id: none (NULL: the id is to be synchronous) or
/// one of ours (anything else is EINVAL).
pub(super) fn requested_channel(
    ch: *mut rdma_event_channel,
) -> Result<Option<Arc<EventChannel>>, c_int> {
    if ch.is_null() {
        return Ok(None);
    }
    our_channel(ch).map(Some).ok_or(libc::EINVAL)
}

/// The C object for `channel`, created the first time (channels of synchronous ids).
pub(super) fn channel_shell(channel: &Arc<EventChannel>) -> *mut rdma_event_channel {
    let existing = channel.shell();
    if existing != 0 {
        return existing as *mut rdma_event_channel;
    }
    let shell = Box::into_raw(Box::new(ChannelShell {
        raw: UnsafeCell::new(rdma_event_channel { fd: channel.fd() }),
    }));
    CHANNELS.insert(shell as usize, Arc::clone(channel));
    channel.set_shell(shell as usize);
    shell.cast()
}

pub(super) fn free_channel_shell(ch: *mut rdma_event_channel) {
    if let Some((_, channel)) = CHANNELS.remove(&(ch as usize)) {
        let mut retired = RETIRED_CHANNELS.lock().unwrap_or_else(|p| p.into_inner());
        retired.push_back(ch as usize);
        if retired.len() > 64 {
            retired.pop_front();
        }
        drop(retired);
        // SAFETY: registered, so a live ChannelShell from Box::into_raw; unregistered above.
        drop(unsafe { Box::from_raw(ch as *mut ChannelShell) });
        channel.set_shell(0);
        if channel.has_waiters() {
            // Another thread is blocked reading this channel. With the kernel's CM it stays
            // blocked (its read holds the file open); closing our pipe would wake it with an
            // end of file instead, so its fds stay open.
            std::mem::forget(channel);
        }
    }
}

/// An event handed to the application, with the kind and status it reports.
pub(super) struct Delivered {
    pub(super) event: *mut rdma_cm_event,
    pub(super) kind: EventKind,
    pub(super) status: i32,
}

/// Takes the next event of `channel` and turns it into an `rdma_cm_event`.
pub(super) fn next_event(channel: &EventChannel) -> Result<Delivered, c_int> {
    loop {
        let event = channel.next().map_err(|e| e.errno())?;
        if let Some(delivered) = convert_event(event) {
            return Ok(delivered);
        }
    }
}

/// Like `next_event`, without blocking: `None` while no event is queued.
fn try_next_event(channel: &EventChannel) -> Result<Option<Delivered>, c_int> {
    while let Some(event) = channel.try_next().map_err(|e| e.errno())? {
        if let Some(delivered) = convert_event(event) {
            return Ok(Some(delivered));
        }
    }
    Ok(None)
}

/// Builds the `rdma_cm_event` for `event`, doing what librdmacm does on the way: a new id for
/// a connection request, the id's fields after address and route resolution and on a reply,
/// and the QP work of [`CmId::on_delivery`]. None when the id is gone.
fn convert_event(event: CmEvent) -> Option<Delivered> {
    let CmEvent {
        id,
        listen_id,
        kind,
        status,
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
            let route = refresh(shell, true);
            fill_path(shell, &route);
            child
        }
        None => id.shell() as *mut rdma_cm_id,
    };
    let shell = our_id(id_ptr)?;
    match kind {
        EventKind::AddrResolved => {
            refresh(shell, true);
        }
        EventKind::RouteResolved | EventKind::ConnectResponse => {
            let route = refresh(shell, true);
            fill_path(shell, &route);
        }
        _ => {}
    }
    let qp = VerbsQp::of(shell);
    let (kind, status) = id.on_delivery(kind, status, dyn_qp(&qp));
    let group = param.group;
    // UD ids report the peer's address as an address vector, its QPN and Q_Key; a multicast
    // event the group's (and the join's context as private data, as librdmacm).
    let (kind, status, ud_peer) = match &group {
        Some(g) => {
            let (kind, status) = id.on_multicast_delivery(kind, status, g);
            (kind, status, Some(id.group_attributes(g)))
        }
        None => (kind, status, id.is_ud().then(|| id.ud_peer_attributes())),
    };
    let private_data = param.private_data;
    let event_shell = Box::new(EventShell {
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
    event_shell.counted.event_delivered();
    let conn = rdma_conn_param {
        private_data: if event_shell.private_data.is_empty() {
            ptr::null()
        } else {
            event_shell.private_data.as_ptr().cast()
        },
        private_data_len: u8::try_from(event_shell.private_data.len()).unwrap_or(u8::MAX),
        responder_resources: param.responder_resources,
        initiator_depth: param.initiator_depth,
        flow_control: param.flow_control,
        retry_count: param.retry_count,
        rnr_retry_count: param.rnr_retry_count,
        srq: param.srq,
        qp_num: param.qp_num,
    };
    if let Some(peer) = ud_peer {
        let (private_data, private_data_len) = match &group {
            Some(g) => (g.context as *const std::os::raw::c_void, 0),
            None => (conn.private_data, conn.private_data_len),
        };
        let ud_param = rdma_ud_param {
            private_data,
            private_data_len,
            ah_attr: av_to(&peer.ah),
            qp_num: conn.qp_num,
            qkey: peer.qkey,
        };
        // SAFETY: the event is ours until published below.
        unsafe { (*event_shell.raw.get()).param.ud = ud_param };
    } else {
        // SAFETY: the event is ours until published below.
        unsafe { (*event_shell.raw.get()).param.conn = conn };
    }
    let ptr = Box::into_raw(event_shell);
    EVENTS.insert(ptr as usize);
    Some(Delivered {
        event: ptr.cast(),
        kind,
        status,
    })
}

/// Frees an event of ours and counts it acknowledged; false for anything else.
fn free_event(event: *mut rdma_cm_event) -> bool {
    if EVENTS.remove(&(event as usize)).is_none() {
        return false;
    }
    // SAFETY: registered, so a live EventShell from Box::into_raw; unregistered above.
    let shell = unsafe { Box::from_raw(event as *mut EventShell) };
    shell.counted.event_acked();
    true
}

/// Acknowledges the event a synchronous id kept in `id->event`, if any.
pub(super) fn release_kept_event(raw: &mut rdma_cm_id) {
    if !raw.event.is_null() {
        free_event(raw.event);
        raw.event = ptr::null_mut();
    }
}

/// The next event of a synchronous id's own channel; the previous one it kept is
/// acknowledged first.
pub(super) fn next_sync_event(shell: &IdShell) -> Result<Delivered, c_int> {
    let channel = shell.inner.channel();
    // SAFETY: the id's fields, written by librdmacm's calls on the caller's thread.
    release_kept_event(unsafe { &mut *shell.raw.get() });
    let ch = our_channel(channel_shell(&channel)).ok_or(libc::EINVAL)?;
    next_event(&ch)
}

/// librdmacm's ucma_complete: a synchronous id waits for the event its call raises, keeps it
/// in `id->event`, and fails the call when the event reports an error.
pub(super) fn complete(shell: &IdShell) -> c_int {
    if !shell.inner.channel().is_sync() {
        return 0;
    }
    match next_sync_event(shell) {
        Ok(delivered) => {
            // SAFETY: as in next_sync_event.
            unsafe { (*shell.raw.get()).event = delivered.event };
            cm_status(sync_call_result(delivered.kind, delivered.status))
        }
        Err(errno) => fail(errno),
    }
}

export_with_caller! {
    /// ugdr's channel; the real librdmacm's for a caller whose verbs are the real ones (an
    /// application's own UCX, librdmacm itself).
    fn rdma_create_event_channel() -> *mut rdma_event_channel
        => create_event_channel_from, caller in "rdi" / "x0"
}

unsafe extern "C" fn create_event_channel_from(caller: Caller) -> *mut rdma_event_channel {
    ffi_boundary!("rdma_create_event_channel", {
        if let Some(user) = caller.real_verbs_user() {
            tracing::debug!("rdma_create_event_channel from {user}: the real librdmacm's");
            let ch = call_real!(rdma_create_event_channel() or {
                set_errno(libc::ENODEV);
                ptr::null_mut()
            });
            unretire(ch);
            return ch;
        }
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
        if our_channel(channel).is_some() {
            free_channel_shell(channel);
        } else if not_ours_channel(channel) {
            forward!(rdma_destroy_event_channel(channel) or ())
        }
    })
}

/// Blocks until the next event (EAGAIN on a non-blocking channel). The wait is a cancellation
/// point, as librdmacm's `read()` (see `boundary`); while it waits, the thread keeps the
/// channel open, as the kernel keeps a file open under a blocked read.
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
                if retired_channel(channel) {
                    // A thread that comes back for the next event just after another destroyed
                    // the channel (rping 44's CM thread does at exit). With the kernel that call
                    // was usually in flight already and stays blocked until the process exits;
                    // here it waits a while for that exit, then fails as a closed fd does.
                    std::thread::sleep(RETIRED_GRACE);
                    return Attempt::Done(fail(libc::EBADF));
                }
                // Not ugdr's: the real librdmacm's channel.
                return Attempt::Done(forward!(rdma_get_cm_event(channel, event)));
            };
            if event.is_null() {
                return Attempt::Done(fail(libc::EINVAL));
            }
            match try_next_event(&ch) {
                Ok(Some(delivered)) => {
                    // SAFETY: checked non-NULL; the caller's out-pointer.
                    unsafe { *event = delivered.event };
                    Attempt::Done(0)
                }
                Ok(None) if ch.is_nonblocking() => Attempt::Done(fail(libc::EAGAIN)),
                Ok(None) => {
                    let fd = ch.fd();
                    waiting_on = Some(ch);
                    Attempt::Wait {
                        fds: [fd, -1],
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
            forward!(rdma_ack_cm_event(event))
        }
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
