//! Verbs ugdr does not carry yet (ECE, dma-buf MRs). Each is exported all the same: given one of ugdr's objects it fails as a
//! device without the feature does (NULL/errno EOPNOTSUPP, or EOPNOTSUPP), instead of letting
//! the real libibverbs read ugdr's objects as its own; given a real library's object it
//! forwards to the real function (by exact version node).

use super::boundary::Fallback;
use super::passthrough::real_functions;
use crate::sys::*;
use std::os::raw::c_int;

/// The real library's functions of the same names.
mod real {
    use super::*;

    real_functions! {
    ibv_query_ece @ "IBVERBS_1.10": fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
    ibv_set_ece @ "IBVERBS_1.10": fn(*mut ibv_qp, *mut ibv_ece) -> c_int;
    ibv_reg_dmabuf_mr @ "IBVERBS_1.12": fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr;
    }
}

/// Defines an export whose first argument is an object with a `context` field (`$ctx` reads
/// it): ugdr's → `$ours`; another library's → the real function (`real::$name`, a
/// `real_functions!` entry at the call site); NULL → EINVAL.
macro_rules! not_yet {
    ($(#[$doc:meta])* $name:ident($first:ident: $fty:ty $(, $arg:ident: $ty:ty)*) -> $ret:ty, context = $ctx:expr, ours = $ours:expr;) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($first: $fty $(, $arg: $ty)*) -> $ret {
            $crate::capi::boundary::ffi_boundary!(stringify!($name), {
                if $first.is_null() {
                    return <$ret as $crate::capi::boundary::Fallback>::fail(libc::EINVAL);
                }
                #[allow(unused_unsafe)]
                // SAFETY: a valid object of the real library or of ugdr: its context field is readable.
                let context = unsafe { $ctx };
                // SAFETY: owned_context only compares the pointer against ugdr's registry.
                if unsafe { $crate::capi::layout::owned_context(context) }.is_some() {
                    tracing::debug!("{}: not supported by ugdr", stringify!($name));
                    return $ours;
                }
                match real::$name() {
                    // SAFETY: not ugdr's object, so the real library's.
                    Some(real) => unsafe { real($first $(, $arg)*) },
                    None => <$ret as $crate::capi::boundary::Fallback>::fail(libc::EINVAL),
                }
            })
        }
    };
}
pub(super) use not_yet;

not_yet! {
    ibv_query_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int,
    context = (*qp).context, ours = c_int::fail(libc::EOPNOTSUPP);
}
not_yet! {
    ibv_set_ece(qp: *mut ibv_qp, ece: *mut ibv_ece) -> c_int,
    context = (*qp).context, ours = c_int::fail(libc::EOPNOTSUPP);
}
not_yet! {
    /// dma-buf memory (GPU memory through a dma-buf fd): not available.
    ibv_reg_dmabuf_mr(pd: *mut ibv_pd, offset: u64, length: usize, iova: u64, fd: c_int, access: c_int) -> *mut ibv_mr,
    context = (*pd).context, ours = <*mut ibv_mr>::fail(libc::EOPNOTSUPP);
}
