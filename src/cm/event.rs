//! The event channel (`rdma_create_event_channel`, `rdma_get_cm_event`, `rdma_ack_cm_event`;
//! the kernel's `ucma.c`): the events the CM raises, the channel that queues them behind a
//! pollable fd (blocking, or EAGAIN when the application made the fd non-blocking), the count
//! of events an id has out unacknowledged, and how a synchronous id's call ends with the event
//! it raised.

use super::CmError;
use super::id::CmId;
use super::wire::Endpoint;
use crate::fake_verbs::event_queue::EventQueue;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// `enum rdma_cm_event_type` (the values ugdr raises).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    AddrResolved = 0,
    AddrError = 1,
    RouteResolved = 2,
    RouteError = 3,
    ConnectRequest = 4,
    ConnectResponse = 5,
    ConnectError = 6,
    Unreachable = 7,
    Rejected = 8,
    Established = 9,
    Disconnected = 10,
    MulticastJoin = 12,
    MulticastError = 13,
}

impl EventKind {
    pub fn to_raw(self) -> u32 {
        self as u32
    }
}

/// `rdma_conn_param`: what a side asks for in `rdma_connect` and `rdma_accept`, and what an
/// event reports of the peer's.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConnParam {
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
    /// A multicast event's group.
    pub group: Option<super::multicast::Group>,
}

impl ConnParam {
    /// What the receiver of `ep`'s REQ or REP sees: the peer's depths swapped into the
    /// receiver's point of view (its responder resources serve the peer's initiator depth), the
    /// private data padded to the CM field size.
    pub(super) fn from_peer(ep: &Endpoint, private: &[u8], field: usize) -> ConnParam {
        ConnParam {
            private_data: padded(private, field),
            responder_resources: ep.initiator_depth,
            initiator_depth: ep.responder_resources,
            flow_control: ep.flow_control,
            retry_count: ep.retry_count,
            rnr_retry_count: ep.rnr_retry_count,
            srq: u8::from(ep.srq),
            qp_num: ep.qpn,
            group: None,
        }
    }
}

/// Private data as the receiver sees it: always the full CM field, zero-padded.
pub(super) fn padded(data: &[u8], field: usize) -> Vec<u8> {
    let mut v = data[..data.len().min(field)].to_vec();
    v.resize(field, 0);
    v
}

/// One `rdma_cm_event`.
pub struct CmEvent {
    pub id: Arc<CmId>,
    pub listen_id: Option<Arc<CmId>>,
    pub kind: EventKind,
    pub status: i32,
    pub param: ConnParam,
}

/// An `rdma_event_channel`: events behind a real, pollable fd.
pub struct EventChannel {
    queue: EventQueue<CmEvent>,
    /// Created by ugdr for a synchronous id (the application passed no channel).
    sync: bool,
    shell: AtomicUsize,
    /// Threads inside [`EventChannel::next`].
    waiters: AtomicUsize,
}

impl EventChannel {
    pub fn new(sync: bool) -> Result<Arc<EventChannel>, CmError> {
        Ok(Arc::new(EventChannel {
            queue: EventQueue::new()?,
            sync,
            shell: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
        }))
    }

    pub fn fd(&self) -> i32 {
        self.queue.fd()
    }

    pub fn is_sync(&self) -> bool {
        self.sync
    }

    /// The C object standing for this channel (set by the C layer; 0 until then).
    pub fn shell(&self) -> usize {
        self.shell.load(Ordering::Acquire)
    }

    pub fn set_shell(&self, shell: usize) {
        self.shell.store(shell, Ordering::Release);
    }

    pub(super) fn push(&self, event: CmEvent) {
        tracing::debug!(
            "cm event {:?} status {} on id {:p}",
            event.kind,
            event.status,
            Arc::as_ptr(&event.id)
        );
        self.queue.push(event);
    }

    /// Drops the queued events of `id` (it is being destroyed).
    pub(super) fn discard_events_of(&self, id: &CmId) {
        let me: *const CmId = id;
        self.queue.discard(|e| std::ptr::eq(Arc::as_ptr(&e.id), me));
    }

    /// Takes the queued events that belong to `id`, in order: its own, and for a listener the
    /// connection requests that came to it (`rdma_migrate_id` moves them, as the kernel's
    /// ucma does).
    pub(super) fn take_events_of(&self, id: &CmId) -> Vec<CmEvent> {
        let me: *const CmId = id;
        self.queue.take(|e| {
            std::ptr::eq(Arc::as_ptr(&e.id), me)
                || e.listen_id
                    .as_ref()
                    .is_some_and(|l| std::ptr::eq(Arc::as_ptr(l), me))
        })
    }

    /// The next event: blocks while none is queued, unless the application made the fd
    /// non-blocking (then WouldBlock). Events of ids destroyed meanwhile are dropped.
    pub fn next(&self) -> Result<CmEvent, CmError> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let event = self.next_live();
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        event
    }

    /// Whether a thread is blocked in (or about to block in) [`EventChannel::next`].
    pub fn has_waiters(&self) -> bool {
        self.waiters.load(Ordering::Acquire) > 0
    }

    fn next_live(&self) -> Result<CmEvent, CmError> {
        loop {
            if let Some(event) = live(self.queue.wait()?) {
                return Ok(event);
            }
        }
    }

    /// Like [`EventChannel::next`] without blocking: `None` while no event is queued (the C
    /// layer then waits for the fd itself, where `pthread_cancel` may end the thread).
    pub fn try_next(&self) -> Result<Option<CmEvent>, CmError> {
        while let Some(event) = self.queue.try_wait()? {
            if let Some(event) = live(event) {
                return Ok(Some(event));
            }
        }
        Ok(None)
    }

    /// Whether the application made the channel's fd non-blocking.
    pub fn is_nonblocking(&self) -> bool {
        self.queue.is_nonblocking()
    }
}

/// The event, unless its id (or the listener it came to) was destroyed meanwhile.
fn live(event: CmEvent) -> Option<CmEvent> {
    if let Some(listener) = &event.listen_id {
        listener.request_taken();
        if listener.is_destroyed() {
            event.id.destroy();
            return None;
        }
    }
    if event.id.is_destroyed() {
        return None;
    }
    Some(event)
}

impl CmId {
    /// Queues an event of this id on its channel (none once the id is destroyed).
    pub(super) fn emit(self: &Arc<Self>, kind: EventKind, status: i32, param: ConnParam) {
        if self.is_destroyed() {
            return;
        }
        self.push_on_channel(CmEvent {
            id: Arc::clone(self),
            listen_id: None,
            kind,
            status,
            param,
        });
    }

    /// Queues `event` on this id's channel, under the id's channel lock, so that an
    /// `rdma_migrate_id` either finds it queued and moves it or sends it to the new channel.
    pub(super) fn push_on_channel(&self, event: CmEvent) {
        self.channel
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(event);
    }

    /// An event of this id reached the application.
    pub fn event_delivered(&self) {
        *self.unacked.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    /// The application acknowledged one of this id's events.
    pub fn event_acked(&self) {
        let mut n = self.unacked.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.acked.notify_all();
        }
    }

    /// Blocks until every event delivered for this id has been acknowledged (librdmacm's
    /// rdma_destroy_id and rdma_migrate_id do).
    pub fn wait_events_acked(&self) {
        let mut n = self.unacked.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = self.acked.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// How a synchronous id's call ends once the event it raised arrives (librdmacm's
/// ucma_complete): a reject is ECONNREFUSED, any other failure its status as an errno.
pub fn sync_call_result(kind: EventKind, status: i32) -> Result<(), CmError> {
    if status == 0 {
        Ok(())
    } else if kind == EventKind::Rejected {
        Err(CmError::Os(libc::ECONNREFUSED))
    } else {
        Err(CmError::Os(status.abs()))
    }
}

/// How `rdma_get_request` ends with the event it read: only a connection request is one.
pub fn request_result(kind: EventKind, status: i32) -> Result<(), CmError> {
    if kind == EventKind::Rejected {
        Err(CmError::Os(libc::ECONNREFUSED))
    } else if status != 0 {
        Err(CmError::Os(status.abs()))
    } else if kind != EventKind::ConnectRequest {
        Err(CmError::Invalid("not a connection request"))
    } else {
        Ok(())
    }
}
