//! `ucs_status_t` as a Rust error.

use crate::sys;
use std::ffi::CStr;

/// A UCX failure: the `ucs_status_t` code and UCX's own text for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    #[error("ucx: {text} ({code})")]
    Status { code: i8, text: String },
    #[error("cannot load UCX ({0}); install libucx0 (Debian: apt-get install libucx0)")]
    Load(String),
}

impl Error {
    pub(crate) fn from_status(status: sys::ucs_status_t) -> Error {
        let text = match super::library::Ucx::get() {
            Ok(lib) => {
                // SAFETY: ucs_status_string returns a static NUL-terminated string for any code.
                let p = unsafe { lib.api.ucs_status_string(status) };
                if p.is_null() {
                    String::from("unknown status")
                } else {
                    // SAFETY: non-NULL, static and NUL-terminated per UCX's contract.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            Err(_) => String::from("unknown status"),
        };
        Error::Status {
            code: status.0,
            text,
        }
    }

    /// Turns a status into `Ok(())` for `UCS_OK` and an error otherwise.
    pub(crate) fn check(status: sys::ucs_status_t) -> Result<(), Error> {
        if status == sys::ucs_status_t::UCS_OK {
            Ok(())
        } else {
            Err(Error::from_status(status))
        }
    }

    /// The UCX status code (`UCS_ERR_*`), 0 for load failures.
    pub fn code(&self) -> i8 {
        match self {
            Error::Status { code, .. } => *code,
            Error::Load(_) => 0,
        }
    }

    /// The errno a verbs caller sees for this failure.
    pub fn errno(&self) -> i32 {
        match self {
            Error::Load(_) => libc::ENODEV,
            Error::Status { code, .. } => match *code {
                -4 => libc::ENOMEM,           // UCS_ERR_NO_MEMORY
                -5 | -6 => libc::EINVAL,      // INVALID_PARAM, UNREACHABLE
                -22 => libc::EOPNOTSUPP,      // UNSUPPORTED
                -25 => libc::ECONNRESET,      // CONNECTION_RESET
                -80 | -27 => libc::ETIMEDOUT, // TIMED_OUT, ENDPOINT_TIMEOUT
                _ => libc::EIO,
            },
        }
    }
}
