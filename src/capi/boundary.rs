//! The C boundary: every export runs inside [`ffi_boundary!`], which catches panics (a panic
//! unwinding into C aborts the process) and turns them into the failure value of the
//! function's return type, with errno set.

use std::os::raw::c_int;

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

/// Runs `$body` (which returns the export's type), catching panics. The optional
/// `on_panic = expr` overrides the failure value (e.g. -1 for `ibv_poll_cq`).
macro_rules! ffi_boundary {
    ($name:expr, $body:block) => {
        $crate::capi::boundary::ffi_boundary!(
            $name,
            on_panic = $crate::capi::boundary::Fallback::fail(::libc::EIO),
            $body
        )
    };
    ($name:expr, on_panic = $fallback:expr, $body:block) => {{
        $crate::log::init();
        match ::std::panic::catch_unwind(::std::panic::AssertUnwindSafe(|| $body)) {
            Ok(ret) => ret,
            Err(_) => {
                ::tracing::error!("{}: panic caught at the C boundary", $name);
                $fallback
            }
        }
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
