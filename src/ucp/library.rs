//! Loading libucp on demand.
//!
//! ugdr is preloaded into every process a user starts (`LD_PRELOAD` is inherited by shells and
//! children), so it must not load UCX until a verbs call needs it: linking libucp would run
//! libucs's constructor, and its signal handlers, in every one of them. Before the first
//! `ucp_init` ugdr sets UCX's `MODULES` option to `^ib,rdmacm`, so that UCX never loads its
//! own InfiniBand modules into a process ugdr serves: those would call `ibv_*` and bind to
//! ugdr's exports (docs/design.md, "Loading UCX").

use super::Error;
use crate::sys;
use std::ffi::CStr;
use std::sync::OnceLock;

/// The UCX entry points, resolved from `libucp.so.0` once per process.
pub struct Ucx {
    pub(crate) api: sys::UcxLibrary,
}

static UCX: OnceLock<Result<Ucx, Error>> = OnceLock::new();

/// UCX's module list with the modules that would call back into ugdr removed.
const UCX_MODULES_WITHOUT_VERBS: &CStr = c"^ib,rdmacm";

impl Ucx {
    /// Loads libucp (once) and keeps UCX's IB and rdmacm modules out of this process.
    pub fn get() -> Result<&'static Ucx, Error> {
        UCX.get_or_init(Ucx::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Ucx, Error> {
        // SAFETY: loading libucp runs its constructors (libucs's ucs_init), which is what any
        // UCX user does; the library is kept loaded for the life of the process.
        let api = unsafe { sys::UcxLibrary::new("libucp.so.0") }
            .map_err(|e| Error::Load(e.to_string()))?;
        // SAFETY: both strings are NUL-terminated and outlive the call; UCX copies the value.
        let status = unsafe {
            api.ucs_global_opts_set_value(c"MODULES".as_ptr(), UCX_MODULES_WITHOUT_VERBS.as_ptr())
        };
        if status != sys::ucs_status_t::UCS_OK {
            tracing::warn!("ucx: cannot set MODULES=^ib,rdmacm (status {})", status.0);
        }
        Ok(Ucx { api })
    }
}

/// UCX's version string, e.g. "1.13.1".
pub fn ucx_version() -> Result<String, Error> {
    let lib = Ucx::get()?;
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { lib.api.ucp_get_version_string() };
    if p.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-NULL static NUL-terminated string per UCX's contract.
    Ok(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}
