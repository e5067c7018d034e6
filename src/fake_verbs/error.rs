//! The one table of errno values ugdr reports (man pages' RETURN VALUE sections, rxe).

use std::os::raw::c_int;

/// Why a verb failed, before it becomes an errno at the C edge.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VerbsError {
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("work queue full")]
    QueueFull,
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    #[error("resource busy: {0}")]
    Busy(&'static str),
    #[error("out of resources: {0}")]
    NoResources(&'static str),
    #[error("no such device")]
    NoDevice,
    #[error("would block")]
    WouldBlock,
    #[error("bad address: {0}")]
    BadAddress(&'static str),
    #[error("not found: {0}")]
    NotFound(&'static str),
    #[error("system error: {0}")]
    Os(i32),
    #[error("transport: {0}")]
    Transport(#[from] crate::ucp::Error),
}

impl VerbsError {
    /// The errno real verbs reports for this failure (rxe: a full queue is ENOMEM).
    pub fn errno(&self) -> c_int {
        match self {
            Self::Invalid(_) => libc::EINVAL,
            Self::QueueFull => libc::ENOMEM,
            Self::Unsupported(_) => libc::EOPNOTSUPP,
            Self::Busy(_) => libc::EBUSY,
            Self::NoResources(_) => libc::ENOMEM,
            Self::NoDevice => libc::ENODEV,
            Self::WouldBlock => libc::EAGAIN,
            Self::BadAddress(_) => libc::EFAULT,
            Self::NotFound(_) => libc::ENOENT,
            Self::Os(e) => *e,
            Self::Transport(e) => e.errno(),
        }
    }
}

/// The engine's failures as verbs report them.
impl From<crate::engine::EngineError> for VerbsError {
    fn from(e: crate::engine::EngineError) -> Self {
        use crate::engine::EngineError;
        match e {
            EngineError::Transport(t) => VerbsError::Transport(t),
            EngineError::Os(errno) => VerbsError::Os(errno),
            EngineError::Directory { errno, .. } | EngineError::Secret { errno, .. } => {
                VerbsError::Os(errno)
            }
            EngineError::Unreachable => VerbsError::Invalid("destination port not found"),
            EngineError::Config(_) => VerbsError::Invalid("a UGDR_* setting in the environment"),
            EngineError::Stopped => VerbsError::NoDevice,
        }
    }
}

impl From<std::io::Error> for VerbsError {
    fn from(e: std::io::Error) -> Self {
        if e.kind() == std::io::ErrorKind::WouldBlock {
            VerbsError::WouldBlock
        } else {
            VerbsError::Os(e.raw_os_error().unwrap_or(libc::EIO))
        }
    }
}
