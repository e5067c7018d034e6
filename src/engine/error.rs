//! Why the engine could not do something; the verbs layer maps these to its own errors.

/// An engine failure (typed; turned into an errno only at the C edge, via the verbs layer).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    #[error("transport: {0}")]
    Transport(#[from] crate::ucp::Error),
    #[error("system error: {0}")]
    Os(i32),
    #[error("{message}")]
    Directory { errno: i32, message: String },
    /// No usable secret to authenticate peers with (`engine::auth`).
    #[error("{message}")]
    Secret { errno: i32, message: String },
    /// A setting in the environment that ugdr refuses (named in the message).
    #[error("{0}")]
    Config(String),
    #[error("destination port not found")]
    Unreachable,
    #[error("the engine is shutting down")]
    Stopped,
}

impl EngineError {
    /// The errno a verb reports for this failure (as `VerbsError::from(self).errno()`).
    pub fn errno(&self) -> i32 {
        match self {
            EngineError::Transport(t) => t.errno(),
            EngineError::Os(e) => *e,
            EngineError::Directory { errno, .. } | EngineError::Secret { errno, .. } => *errno,
            EngineError::Unreachable | EngineError::Config(_) => libc::EINVAL,
            EngineError::Stopped => libc::ENODEV,
        }
    }
}

impl From<super::auth::SecretError> for EngineError {
    fn from(e: super::auth::SecretError) -> Self {
        EngineError::Secret {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

impl From<std::io::Error> for EngineError {
    fn from(e: std::io::Error) -> Self {
        EngineError::Os(e.raw_os_error().unwrap_or(libc::EIO))
    }
}
