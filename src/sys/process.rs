//! Process lifetime hooks the safe layers need.

/// Has `f` run when the process exits normally (`exit`, return from `main`), before the
/// libraries' destructors: libc's `atexit`. False if libc could not register it.
pub fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments that lives as long as the library
    // (a cdylib is never unloaded while the process runs it).
    unsafe { libc::atexit(f) == 0 }
}

/// Runs `f` with every signal blocked in the calling thread but those a fault raises (which
/// reach the faulting thread whatever its mask), then restores its mask (a signal that came
/// meanwhile is delivered then). Threads started inside inherit the mask: ugdr's own, and
/// UCX's (its async thread starts while the worker is made). rdma-core starts no thread, so a
/// signal sent to the process goes to one of the application's threads, where it runs the
/// application's handler and interrupts that thread's blocking call; the kernel picks any
/// thread that does not block it, which could have been ugdr's progress thread.
pub fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
    let mut block = SigSet::all();
    for fault in [
        Signal::SIGSEGV,
        Signal::SIGBUS,
        Signal::SIGFPE,
        Signal::SIGILL,
        Signal::SIGTRAP,
        Signal::SIGSYS,
    ] {
        block.remove(fault);
    }
    /// Restores the caller's mask, also if `f` unwinds.
    struct Restore(Option<SigSet>);
    impl Drop for Restore {
        fn drop(&mut self) {
            if let Some(old) = &self.0 {
                let _ = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(old), None);
            }
        }
    }
    let mut old = SigSet::empty();
    let masked = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&block), Some(&mut old)).is_ok();
    let _restore = Restore(masked.then_some(old));
    f()
}

/// Starts one of ugdr's own threads, named `name`, with the signals of
/// [`with_signals_blocked`] blocked.
pub fn spawn_thread<F, T>(name: &str, f: F) -> std::io::Result<std::thread::JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    with_signals_blocked(|| std::thread::Builder::new().name(name.into()).spawn(f))
}
