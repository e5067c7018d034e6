//! An opened device (`ibv_context`): owns the asynchronous-event queue and counts children.

use super::VerbsError;
use super::event_queue::EventQueue;
use std::sync::atomic::{AtomicUsize, Ordering};

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

pub struct DeviceContext {
    pub async_events: EventQueue<AsyncEvent>,
    children: AtomicUsize,
}

impl DeviceContext {
    pub fn new() -> Result<DeviceContext, VerbsError> {
        Ok(DeviceContext {
            async_events: EventQueue::new()?,
            children: AtomicUsize::new(0),
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
}
