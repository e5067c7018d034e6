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

#![forbid(unsafe_code)]

mod address;
mod id;
pub mod wire;

pub use address::{is_local, route_source};
pub use id::{
    CmEvent, CmId, EventChannel, EventKind, EventParam, PRIVATE_DATA_ACCEPT, PRIVATE_DATA_REJECT,
    Phase, PortSpace, QpParams,
};

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
