//! The C boundary: every export runs inside [`ffi_boundary!`], which catches panics (a panic
//! unwinding into C aborts the process) and turns them into the failure value of the
//! function's return type, with errno set.
//!
//! **Thread cancellation.** glibc cancels a thread (`pthread_cancel`, `pthread_exit`) by a
//! *forced unwind* that must run through every frame up to the thread's start. Measured with
//! Rust 1.95 (x86_64, glibc 2.36): `catch_unwind` catches that foreign unwind and, on deleting
//! it, glibc aborts ("FATAL: exception not rethrown"); an `extern "C"` frame it reaches aborts
//! ("panic in a function that cannot unwind"); through `extern "C-unwind"` frames and Rust
//! frames it passes, running their destructors, except in a frame whose call into C was
//! declared `extern "C"` (that call site gets no landing pad, so its drops are skipped). Hence:
//! * inside the boundary, cancellation is disabled (`pthread_setcancelstate`, the caller's
//!   state restored on the way out), so a pending cancel never acts in ugdr's own code, UCX's,
//!   or a log write (all full of cancellation points), and the thread is cancelled at its
//!   next cancellation point after the call, as with rdma-core, whose calls have none. The
//!   two calls cost about 50 ns per export on the 2-core CI VM (two uncontended CAS there
//!   cost 27 ns), too much for `ibv_poll_cq` spin loops, so they are made only once the
//!   process has cancelled a thread: `pthread_cancel` is interposed (`libc_hooks`) and sets
//!   [`CANCEL_USED`] before it acts. Until then one relaxed load decides. The window left: a
//!   thread already inside a call when the process's *first* `pthread_cancel` targets it;
//!   the waits below and the libc hooks disable cancellation always;
//! * the calls that block as rdma-core's do in `read()` (`ibv_get_cq_event`,
//!   `ibv_get_async_event`, `rdma_get_cm_event`) are `extern "C-unwind"` and run as
//!   [`blocking`]: non-blocking attempts inside the boundary, and between them a `poll()` outside
//!   it, the one place they can be cancelled. `poll` is declared `C-unwind` under glibc's
//!   public alias `__poll`, so that no `extern "C"` declaration of the same symbol elsewhere in
//!   the crate graph can strip the call's unwind edge. Cancelled there, nothing of ugdr is held
//!   (no lock, no event taken), so the objects stay usable and destroyable. A signal handler
//!   that runs there ends the call with EINTR, as it ends that `read()`, unless it was
//!   installed with `SA_RESTART` ([`blocking`]).

use std::os::fd::RawFd;
use std::os::raw::c_int;
use std::sync::atomic::{AtomicBool, Ordering};

unsafe extern "C" {
    fn pthread_setcancelstate(state: c_int, old: *mut c_int) -> c_int;
}

unsafe extern "C-unwind" {
    /// glibc's `poll` (a cancellation point), by its exported alias; see the module comment.
    #[link_name = "__poll"]
    fn poll_cancellable(fds: *mut libc::pollfd, nfds: libc::nfds_t, timeout: c_int) -> c_int;
}

/// `PTHREAD_CANCEL_DISABLE` (glibc).
const CANCEL_DISABLE: c_int = 1;

/// Set (for good) by the interposed `pthread_cancel` before it cancels a thread.
pub(crate) static CANCEL_USED: AtomicBool = AtomicBool::new(false);

/// Keeps cancellation disabled on this thread while alive; restores the caller's state.
pub(crate) struct NoCancel(c_int);

impl NoCancel {
    /// Disables cancellation.
    #[inline]
    pub(crate) fn new() -> NoCancel {
        let mut old = 0;
        // SAFETY: sets the calling thread's own state; `old` is a valid out-parameter.
        unsafe { pthread_setcancelstate(CANCEL_DISABLE, &mut old) };
        NoCancel(old)
    }

    /// Disables cancellation if the process ever cancelled a thread (see the module comment).
    #[inline]
    pub(crate) fn if_cancel_used() -> NoCancel {
        if CANCEL_USED.load(Ordering::Relaxed) {
            NoCancel::new()
        } else {
            NoCancel(CANCEL_DISABLE) // nothing to restore
        }
    }
}

impl Drop for NoCancel {
    #[inline]
    fn drop(&mut self) {
        if self.0 != CANCEL_DISABLE {
            // SAFETY: as above; restoring does not act on a pending cancel (deferred type).
            unsafe { pthread_setcancelstate(self.0, std::ptr::null_mut()) };
        }
    }
}

/// Sets the calling thread's errno.
pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns a valid pointer to the thread-local errno.
    unsafe { *libc::__errno_location() = e }
}

/// The value an export returns when it fails with `errno` (rdma-core's conventions).
pub(crate) trait Fallback {
    fn fail(errno: c_int) -> Self;
}

/// Functions returning `int` return the errno value itself (and errno is set too).
impl Fallback for c_int {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        e
    }
}

/// Functions returning a pointer return NULL with errno set.
impl<T> Fallback for *mut T {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        std::ptr::null_mut()
    }
}

impl<T> Fallback for *const T {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        std::ptr::null()
    }
}

impl Fallback for () {
    fn fail(e: c_int) -> Self {
        set_errno(e);
    }
}

impl Fallback for u32 {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        0
    }
}

impl Fallback for u64 {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        0
    }
}

impl Fallback for u8 {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        0
    }
}

impl Fallback for u16 {
    fn fail(e: c_int) -> Self {
        set_errno(e);
        0
    }
}

/// Runs `$body` (which returns the export's type), catching panics, with thread cancellation
/// disabled (once the process used `pthread_cancel`; always with `quiet`). The optional `on_panic = expr` overrides the failure value (e.g. -1 for
/// `ibv_poll_cq`). `quiet` skips the logger's lazy set-up (for the libc interposers, which
/// run before and during it).
macro_rules! ffi_boundary {
    (@catch $name:expr, $fallback:expr, $body:block) => {
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(ret) => ret,
            Err(_) => {
                ::tracing::error!("{}: panic caught at the C boundary", $name);
                $fallback
            }
        }
    };
    ($name:expr, $body:block) => {
        $crate::capi::boundary::ffi_boundary!(
            $name,
            on_panic = $crate::capi::boundary::Fallback::fail(::libc::EIO),
            $body
        )
    };
    ($name:expr, on_panic = $fallback:expr, $body:block) => {{
        let _no_cancel = $crate::capi::boundary::NoCancel::if_cancel_used();
        $crate::log::init();
        $crate::capi::boundary::ffi_boundary!(@catch $name, $fallback, $body)
    }};
    ($name:expr, quiet, on_panic = $fallback:expr, $body:block) => {{
        let _no_cancel = $crate::capi::boundary::NoCancel::new();
        $crate::capi::boundary::ffi_boundary!(@catch $name, $fallback, $body)
    }};
}
pub(crate) use ffi_boundary;

/// Converts a core result for an `int`-returning verb: 0, or the errno (also set in errno).
pub(crate) fn status(r: Result<(), crate::fake_verbs::VerbsError>) -> c_int {
    match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::debug!("{e}");
            c_int::fail(e.errno())
        }
    }
}

/// What one non-blocking attempt of a [`blocking`] export found.
pub(crate) enum Attempt<R> {
    /// The export's result.
    Done(R),
    /// Nothing yet: wait until one of `fds` is readable (or `timeout_ms` passes; -1: never),
    /// then attempt again, told which of them were readable.
    Wait {
        fds: [RawFd; 2],
        count: usize,
        timeout_ms: c_int,
    },
    /// Not ugdr's object: run this outside the boundary (the real library's blocking call,
    /// itself cancellable).
    Outside(Box<dyn FnOnce() -> R>),
}

/// Runs an export that blocks until an event, cancellable as rdma-core's `read()` is (see the
/// module comment), and interruptible as it is: a signal whose handler was installed without
/// `SA_RESTART` ends the wait with `fail()` and errno EINTR (see [`signal_ends_wait`]).
/// `attempt` runs inside the boundary and must not block; it is told which fds of the last
/// `Wait` were readable (none on the first call). `fail` gives the export's failure value
/// (also after a panic).
///
/// Call only from an `extern "C-unwind"` export.
pub(crate) fn blocking<R>(
    name: &str,
    fail: impl Fn() -> R,
    mut attempt: impl FnMut([bool; 2]) -> Attempt<R>,
) -> R {
    let mut ready = [false; 2];
    loop {
        // Always without cancellation: these threads are the ones applications cancel.
        let no_cancel = NoCancel::new();
        let step = ffi_boundary!(name, on_panic = Attempt::Done(fail()), { attempt(ready) });
        drop(no_cancel);
        match step {
            Attempt::Done(r) => return r,
            Attempt::Outside(call) => return call(),
            Attempt::Wait {
                fds,
                count,
                timeout_ms,
            } => match wait_readable(&fds[..count.min(2)], timeout_ms) {
                Waited::Ready(r) => ready = r,
                Waited::Interrupted if signal_ends_wait() => {
                    let r = fail();
                    set_errno(libc::EINTR);
                    return r;
                }
                Waited::Interrupted => ready = [false; 2],
            },
        }
    }
}

/// How a wait of [`blocking`] ended.
enum Waited {
    /// Which of its fds are readable (none: the timeout passed).
    Ready([bool; 2]),
    /// A signal handler ran (EINTR).
    Interrupted,
}

/// Whether a signal that interrupted a blocking wait ends it with EINTR, as it ends the
/// `read()` rdma-core and librdmacm block in: the kernel restarts that read after a handler
/// installed with `SA_RESTART` (the caller never sees the signal) and fails it with EINTR
/// after any other. `poll()` says only that some handler ran, not whose: the wait ends when
/// some asynchronous signal has an application's handler without `SA_RESTART` (an
/// application that installs one is written for EINTR from its blocking calls), and goes on
/// otherwise. Left out: signals a fault raises in the faulting thread, which never interrupt
/// a wait, and the handlers UCX installed as it loaded (its debug signal, SIGHUP, has one
/// without `SA_RESTART` in every process).
fn signal_ends_wait() -> bool {
    use crate::sys::process::{FAULT_SIGNALS, signal_action};
    let ucx = crate::ucp::Ucx::get().ok();
    (1..=libc::SIGRTMAX())
        .filter(|sig| !FAULT_SIGNALS.contains(sig))
        .any(|sig| {
            signal_action(sig).is_some_and(|(handler, flags)| {
                flags & libc::SA_RESTART == 0
                    && !ucx.is_some_and(|u| u.installed_handler(sig, handler))
            })
        })
}

/// Blocks in `poll()` — a cancellation point, so only outside the boundary — until one of
/// `fds` is readable, the timeout passes or a signal handler runs.
fn wait_readable(fds: &[RawFd], timeout_ms: c_int) -> Waited {
    let mut pfds = [libc::pollfd {
        fd: -1,
        events: libc::POLLIN,
        revents: 0,
    }; 2];
    for (p, &fd) in pfds.iter_mut().zip(fds) {
        p.fd = fd;
    }
    // SAFETY: `pfds` holds `fds.len()` (<= 2) initialized pollfd structs.
    let n = unsafe { poll_cancellable(pfds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    if n < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
        return Waited::Interrupted;
    }
    if n <= 0 {
        return Waited::Ready([false; 2]); // the timeout, or a failure: attempt again
    }
    Waited::Ready([pfds[0].revents != 0, pfds[1].revents != 0])
}
