//! What the engine delivers to: the interface a queue pair implements (the verbs layer above
//! registers its queue pairs by number), the connection a QP names its peer by, and the list
//! of QPs that owe their peer an ACK.
//!
//! The engine knows QP numbers, headers and endpoints, never verbs semantics: it routes a
//! message by its destination QP number and lets the receiver decide what it means.

use super::wire::Header;
use crate::ucp::{AmPayload, Endpoint, LockedWorker};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// The receiving end of one QP number. Every call runs inside progress (or a verbs call),
/// under the worker lock.
pub trait MessageReceiver: Send + Sync {
    /// A request (SEND, WRITE, READ request, atomic) for this QP. Returns true when the
    /// payload's data was kept (UCX must not free it yet).
    fn request_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool;

    /// The answer to one of this QP's READs or atomics (same return as above).
    fn response_arrived(
        self: Arc<Self>,
        locked: &LockedWorker<'_>,
        header: Header,
        payload: AmPayload<'_>,
    ) -> bool;

    /// An ACK or NAK from the peer's responder.
    fn ack_arrived(self: Arc<Self>, locked: &LockedWorker<'_>, header: &Header);

    /// Send the ACK this QP announced with [`owe_ack`], if it still owes one.
    fn send_owed_ack(self: Arc<Self>, locked: &LockedWorker<'_>);

    /// An endpoint to some peer process failed: a QP whose peer it was fails.
    fn peer_failed(self: Arc<Self>, locked: &LockedWorker<'_>);
}

/// The remote QP an RC/UC QP is connected to, and the endpoint to its process.
#[derive(Clone)]
pub struct Peer {
    pub endpoint: Arc<Endpoint>,
    pub qpn: u32,
    /// The LID of the peer's port.
    pub lid: u16,
    /// Its process's published memory, when it is on this host and may be mapped here.
    pub memory: Option<Arc<super::direct::PeerMemory>>,
}

/// QPs that owe their peer an ACK (by QP number), flushed by the engine when the application
/// or the progress thread runs out of work.
static OWED_ACKS: Mutex<Vec<u32>> = Mutex::new(Vec::new());
static OWED_COUNT: AtomicUsize = AtomicUsize::new(0);

/// QP `qpn` holds an ACK back, hoping to piggyback it: the engine sends it (through
/// [`MessageReceiver::send_owed_ack`]) when nothing else is going on.
pub fn owe_ack(qpn: u32) {
    OWED_ACKS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(qpn);
    OWED_COUNT.fetch_add(1, Ordering::AcqRel);
}

/// The QPs that owe an ACK, emptying the list (cheap when it is empty).
pub(super) fn take_owed_acks() -> Vec<u32> {
    if OWED_COUNT.load(Ordering::Acquire) == 0 {
        return Vec::new();
    }
    let mut owed = OWED_ACKS.lock().unwrap_or_else(|p| p.into_inner());
    OWED_COUNT.store(0, Ordering::Release);
    std::mem::take(&mut *owed)
}
