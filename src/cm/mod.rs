//! The RDMA connection manager (librdmacm's `rdma_*`), emulated in user space.
//!
//! An `rdma_cm_id` is a [`CmId`]; its events go to an [`EventChannel`] whose fd the application
//! polls. The CM's port space is the host's TCP port space: binding an id binds a TCP socket to
//! the same address and port, listening listens on it, and a connection's CM messages (REQ,
//! REP, RTU, REJ, DREQ, DREP; [`wire`]) travel on one TCP connection between the two ids, which
//! stays open while they are connected. So a port nobody listens on is refused by the peer's
//! kernel (REJECTED, as IB's "invalid service ID"), a peer that dies closes the connection
//! (DISCONNECTED), and two network namespaces joined by veth connect exactly like two hosts.
//! The data path is untouched: REQ and REP carry each side's LID, GID, QPN and PSN, and the
//! queue pairs then talk through the engine like any others.
//!
//! Per connection one thread reads the CM connection; per listener one thread accepts. Both
//! end when the id is destroyed (its sockets are shut down).
//!
//! The files follow the roles the kernel splits between `addr.c`, `cma.c`, `cm.c` and
//! `ucma.c`:
//! * `id.rs` — ids and addressing: port spaces, an id's phase, bind, address and route
//!   resolution, the route an id reports, migrating and destroying ids.
//! * `event.rs` — the event channel: events, their queue behind a pollable fd, acknowledgement,
//!   how a synchronous id's call ends.
//! * `listener.rs` — `rdma_listen`, the per-listener thread, each REQ becoming a new id.
//! * `connect.rs` — the application's side of the handshake: connect, accept, reject,
//!   establish, disconnect, their parameters and the QP work around them.
//! * `link.rs` — the CM connection to the peer: the per-connection thread and what REP, RTU,
//!   REJ, DREQ, DREP or the connection closing do to the id.
//! * `qp.rs` — the attributes and states the CM drives an id's QP through.
//! * `sidr.rs` — UD ids, whose single REQ/REP exchange is service ID resolution.
//! * `wire.rs` — the messages on the CM connection; `address.rs` — this host's addresses and
//!   routes.

#![forbid(unsafe_code)]

mod address;
mod connect;
mod event;
mod id;
mod link;
mod listener;
mod multicast;
mod qp;
mod sidr;
pub mod wire;

pub use address::{is_local, route_source};
pub use connect::{
    PRIVATE_DATA_ACCEPT, PRIVATE_DATA_REJECT, REJ_CONSUMER_DEFINED, REJ_VENDOR_OPTION_NOT_SUPPORTED,
};
pub use event::{CmEvent, ConnParam, EventChannel, EventKind, request_result, sync_call_result};
pub use id::{
    CmId, DEFAULT_PKEY, HOP_LIMIT, PACKET_LIFE_TIME, PATH_MTU_4096, Phase, PortSpace, Route,
};
pub use multicast::{Group, JOIN_FULL_MEMBER, JOIN_SEND_ONLY_FULL_MEMBER};
pub use qp::{IdQp, QpParams};
pub use sidr::UDP_QKEY;

use std::os::raw::c_int;

/// Why a connection-manager call failed, before it becomes an errno at the C edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmError {
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    #[error("no RDMA device for this address")]
    NoDevice,
    #[error("would block")]
    WouldBlock,
    #[error("system error: {0}")]
    Os(i32),
}

impl CmError {
    pub fn errno(&self) -> c_int {
        match self {
            Self::Invalid(_) => libc::EINVAL,
            Self::Unsupported(_) => libc::EOPNOTSUPP,
            Self::NoDevice => libc::ENODEV,
            Self::WouldBlock => libc::EAGAIN,
            Self::Os(e) => *e,
        }
    }
}

impl From<std::io::Error> for CmError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            CmError::WouldBlock
        } else {
            CmError::Os(e.raw_os_error().unwrap_or(libc::EIO))
        }
    }
}

impl From<crate::fake_verbs::VerbsError> for CmError {
    fn from(e: crate::fake_verbs::VerbsError) -> Self {
        match e {
            crate::fake_verbs::VerbsError::WouldBlock => CmError::WouldBlock,
            other => CmError::Os(other.errno()),
        }
    }
}

/// Starts one of the CM's threads (address resolution, a listener, a connection).
fn spawn_cm_thread(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), CmError> {
    crate::sys::process::spawn_thread(name, f)
        .map(drop)
        .map_err(|e| CmError::Os(e.raw_os_error().unwrap_or(libc::EAGAIN)))
}
