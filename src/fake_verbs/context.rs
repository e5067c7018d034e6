//! An opened device (`ibv_context`): owns the asynchronous-event queue and counts children.
//!
//! Asynchronous events follow the kernel's uverbs rules, which applications rely on to free
//! objects safely: an event about a QP, SRQ or CQ that the application has not read yet is
//! dropped when that object is destroyed, and destroying it waits while the application holds
//! an event about it that it has not acknowledged (`ibv_destroy_qp` compares the events
//! reported with `events_completed`). Device-level (port) events are not tied to an object.

use super::VerbsError;
use super::event_queue::EventQueue;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};

/// An asynchronous event (`ibv_async_event`): the event type and the C handle of the object
/// it concerns (a CQ, QP or SRQ pointer, or the port number).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsyncEvent {
    pub event_type: u32,
    pub element: usize,
}

/// `enum ibv_event_type` values ugdr raises.
pub const EVENT_CQ_ERR: u32 = 0;
pub const EVENT_QP_FATAL: u32 = 1;
pub const EVENT_QP_REQ_ERR: u32 = 2;
pub const EVENT_QP_ACCESS_ERR: u32 = 3;
pub const EVENT_COMM_EST: u32 = 4;
pub const EVENT_SQ_DRAINED: u32 = 5;
pub const EVENT_PORT_ACTIVE: u32 = 9;
pub const EVENT_SRQ_LIMIT_REACHED: u32 = 15;
pub const EVENT_QP_LAST_WQE_REACHED: u32 = 16;

/// Which member of `ibv_async_event.element` an event type uses (rdma-core's verbs.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventElement {
    Cq,
    Qp,
    Srq,
    Wq,
    /// Device- and port-level events: `port_num` (not tied to an object).
    Port,
}

impl EventElement {
    pub fn of(event_type: u32) -> EventElement {
        match event_type {
            EVENT_CQ_ERR => EventElement::Cq,
            // QP_FATAL … PATH_MIG_ERR, and QP_LAST_WQE_REACHED.
            1..=7 | EVENT_QP_LAST_WQE_REACHED => EventElement::Qp,
            // SRQ_ERR, SRQ_LIMIT_REACHED.
            14 | EVENT_SRQ_LIMIT_REACHED => EventElement::Srq,
            // WQ_FATAL.
            19 => EventElement::Wq,
            _ => EventElement::Port,
        }
    }

    /// Whether the event names an object (whose destroy drops and waits for it).
    pub fn is_object(self) -> bool {
        self != EventElement::Port
    }
}

pub struct DeviceContext {
    pub async_events: EventQueue<AsyncEvent>,
    children: AtomicUsize,
    /// Per object handle: events the application read and has not acknowledged yet.
    held: Mutex<HashMap<usize, u32>>,
    acked: Condvar,
}

impl DeviceContext {
    pub fn new() -> Result<DeviceContext, VerbsError> {
        Ok(DeviceContext {
            async_events: EventQueue::new()?,
            children: AtomicUsize::new(0),
            held: Mutex::new(HashMap::new()),
            acked: Condvar::new(),
        })
    }

    pub fn adopt_child(&self) {
        self.children.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_child(&self) {
        self.children.fetch_sub(1, Ordering::AcqRel);
    }

    /// Closing fails with EBUSY while PDs, CQs or channels created on it remain.
    pub fn check_closable(&self) -> Result<(), VerbsError> {
        if self.children.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy(
                "context still has PDs, CQs or completion channels",
            ));
        }
        Ok(())
    }

    pub fn raise(&self, event_type: u32, element: usize) {
        tracing::debug!("async event {event_type} on {element:#x}");
        self.async_events.push(AsyncEvent {
            event_type,
            element,
        });
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<usize, u32>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `ibv_get_async_event`: the next event (blocking unless the fd is non-blocking). An
    /// event about an object counts as held until [`DeviceContext::ack_event`], counted in the
    /// same step as it leaves the queue, so a destroy never misses it.
    pub fn next_event(&self) -> Result<AsyncEvent, VerbsError> {
        self.async_events.wait_with(|ev| {
            if EventElement::of(ev.event_type).is_object() {
                *self.held().entry(ev.element).or_insert(0) += 1;
            }
        })
    }

    /// Like [`DeviceContext::next_event`] without blocking: `None` while none is queued.
    pub fn try_next_event(&self) -> Result<Option<AsyncEvent>, VerbsError> {
        self.async_events.try_wait_with(|ev| {
            if EventElement::of(ev.event_type).is_object() {
                *self.held().entry(ev.element).or_insert(0) += 1;
            }
        })
    }

    /// Whether the application made the async-event fd non-blocking.
    pub fn async_events_nonblocking(&self) -> bool {
        self.async_events.is_nonblocking()
    }

    /// The fd the application polls for async events.
    pub fn async_fd(&self) -> i32 {
        self.async_events.fd()
    }

    /// `ibv_ack_async_event` for an event [`DeviceContext::next_event`] returned.
    pub fn ack_event(&self, event_type: u32, element: usize) {
        if !EventElement::of(event_type).is_object() {
            return;
        }
        let mut held = self.held();
        if let Some(n) = held.get_mut(&element) {
            *n -= 1;
            if *n == 0 {
                held.remove(&element);
            }
            self.acked.notify_all();
        }
    }

    /// The object `element` (a QP, SRQ or CQ handle) is destroyed and raises nothing more:
    /// drops its events the application has not read, then waits until it acknowledged the
    /// ones it read (as the kernel's uverbs and rdma-core's destroy calls do).
    pub fn forget_object(&self, element: usize) {
        self.async_events
            .discard(|e| e.element == element && EventElement::of(e.event_type).is_object());
        let mut held = self.held();
        while held.contains_key(&element) {
            held = self.acked.wait(held).unwrap_or_else(|p| p.into_inner());
        }
    }
}
