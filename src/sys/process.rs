//! Process lifetime hooks the safe layers need.

/// Has `f` run when the process exits normally (`exit`, return from `main`), before the
/// libraries' destructors: libc's `atexit`. False if libc could not register it.
pub fn at_exit(f: extern "C" fn()) -> bool {
    // SAFETY: `f` is a plain function with no arguments that lives as long as the library
    // (a cdylib is never unloaded while the process runs it).
    unsafe { libc::atexit(f) == 0 }
}

/// The signals a fault raises in the faulting thread: they reach it whatever its mask, and
/// never interrupt another thread's wait.
pub const FAULT_SIGNALS: [i32; 6] = [
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGFPE,
    libc::SIGILL,
    libc::SIGTRAP,
    libc::SIGSYS,
];

/// The handler (its address) and the flags `signal` has now; None when it has none (default
/// action, ignored) or cannot have one (SIGKILL, SIGSTOP, glibc's internal signals).
pub fn signal_action(signal: i32) -> Option<(usize, i32)> {
    // SAFETY: all-zero is a valid `sigaction` (no handler, empty mask).
    let mut old: libc::sigaction = unsafe { std::mem::zeroed() };
    // SAFETY: a query (no new action); `old` is a valid out-parameter.
    let queried = unsafe { libc::sigaction(signal, std::ptr::null(), &mut old) } == 0;
    (queried && old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN)
        .then_some((old.sa_sigaction, old.sa_flags))
}

/// Runs `f` with every signal blocked in the calling thread but [`FAULT_SIGNALS`] (which
/// reach the faulting thread whatever its mask), then restores its mask (a signal that came
/// meanwhile is delivered then). Threads started inside inherit the mask: ugdr's own, and
/// UCX's (its async thread starts while the worker is made). rdma-core starts no thread, so a
/// signal sent to the process goes to one of the application's threads, where it runs the
/// application's handler and interrupts that thread's blocking call; the kernel picks any
/// thread that does not block it, which could have been ugdr's progress thread.
pub fn with_signals_blocked<T>(f: impl FnOnce() -> T) -> T {
    use nix::sys::signal::{SigSet, SigmaskHow, Signal, pthread_sigmask};
    let mut block = SigSet::all();
    for fault in FAULT_SIGNALS
        .into_iter()
        .filter_map(|s| Signal::try_from(s).ok())
    {
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
