//! Process lifetime hooks the safe layers need.

/// Has `f` run when the process exits normally (`exit`, return from `main`), before the
/// libraries' destructors: libc's `atexit`. False if libc could not register it.
pub fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments that lives as long as the library
    // (a cdylib is never unloaded while the process runs it).
    unsafe { libc::atexit(f) == 0 }
}
