//! rsockets (librdmacm's socket-like API over RDMA): not carried yet (issue 14 item 7).
//!
//! The real ones cannot run beside ugdr: they keep librdmacm's private state behind every
//! `rdma_cm_id`, and their own `rdma_*` calls land in ugdr's exports, whose ids have none
//! (measured: the real `rsocket()` "succeeds" on a ugdr id, then `rconnect` fails with
//! EINVAL). So ugdr exports the whole family and fails cleanly instead:
//! * `rsocket` fails with EOPNOTSUPP, so programs (and librspreload) fall back to sockets;
//! * no rsocket ever exists, so every call on a descriptor fails with EBADF, as rsockets does
//!   for a descriptor that is not one, and leaves real descriptors alone (`rclose(1)` does
//!   not close stdout);
//! * `rpoll`/`rselect` on plain descriptors are `poll`/`select`, as in rsockets.
//!
//! Failures follow the sockets convention: -1 (for `riowrite`, `(size_t)-1`) with errno set.

use super::boundary::{ffi_boundary, set_errno};
use libc::{fd_set, iovec, msghdr, nfds_t, off_t, pollfd, sockaddr, socklen_t, timeval};
use std::os::raw::{c_int, c_void};

/// The sockets failure value of a return type.
trait MinusOne {
    fn minus_one(errno: c_int) -> Self;
}

macro_rules! minus_one {
    ($($t:ty => $v:expr),*) => {$(
        impl MinusOne for $t {
            fn minus_one(errno: c_int) -> Self {
                set_errno(errno);
                $v
            }
        }
    )*};
}
minus_one!(c_int => -1, isize => -1, i64 => -1, usize => usize::MAX);

// off_t is the i64 the impls above cover (x86-64 and AArch64 Linux).
const _: () = assert!(std::mem::size_of::<off_t>() == std::mem::size_of::<i64>());

/// Defines exports that take an rsocket descriptor: there is none under ugdr, so EBADF.
macro_rules! no_rsocket {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $ret:ty;)*) => {$(
        /// No rsocket exists under ugdr: -1 with errno EBADF.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            ffi_boundary!(stringify!($name), on_panic = <$ret>::minus_one(libc::EIO), {
                $(let _ = $arg;)*
                tracing::debug!("{}: rsockets are not carried by ugdr", stringify!($name));
                <$ret>::minus_one(libc::EBADF)
            })
        }
    )*};
}

no_rsocket! {
    rbind(socket: c_int, addr: *const sockaddr, addrlen: socklen_t) -> c_int;
    rlisten(socket: c_int, backlog: c_int) -> c_int;
    raccept(socket: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) -> c_int;
    rconnect(socket: c_int, addr: *const sockaddr, addrlen: socklen_t) -> c_int;
    rshutdown(socket: c_int, how: c_int) -> c_int;
    rclose(socket: c_int) -> c_int;
    rrecv(socket: c_int, buf: *mut c_void, len: usize, flags: c_int) -> isize;
    rrecvfrom(socket: c_int, buf: *mut c_void, len: usize, flags: c_int, src_addr: *mut sockaddr, addrlen: *mut socklen_t) -> isize;
    rrecvmsg(socket: c_int, msg: *mut msghdr, flags: c_int) -> isize;
    rsend(socket: c_int, buf: *const c_void, len: usize, flags: c_int) -> isize;
    rsendto(socket: c_int, buf: *const c_void, len: usize, flags: c_int, dest_addr: *const sockaddr, addrlen: socklen_t) -> isize;
    rsendmsg(socket: c_int, msg: *const msghdr, flags: c_int) -> isize;
    rread(socket: c_int, buf: *mut c_void, count: usize) -> isize;
    rreadv(socket: c_int, iov: *const iovec, iovcnt: c_int) -> isize;
    rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize;
    rwritev(socket: c_int, iov: *const iovec, iovcnt: c_int) -> isize;
    rgetpeername(socket: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) -> c_int;
    rgetsockname(socket: c_int, addr: *mut sockaddr, addrlen: *mut socklen_t) -> c_int;
    rsetsockopt(socket: c_int, level: c_int, optname: c_int, optval: *const c_void, optlen: socklen_t) -> c_int;
    rgetsockopt(socket: c_int, level: c_int, optname: c_int, optval: *mut c_void, optlen: *mut socklen_t) -> c_int;
    // `int rfcntl(int socket, int cmd, ...)`: the variadic argument is never read, and the
    // x86-64 and AArch64 Linux ABIs let a callee ignore trailing arguments.
    rfcntl(socket: c_int, cmd: c_int) -> c_int;
    riomap(socket: c_int, buf: *mut c_void, len: usize, prot: c_int, flags: c_int, offset: off_t) -> off_t;
    riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int;
    riowrite(socket: c_int, buf: *const c_void, count: usize, offset: off_t, flags: c_int) -> usize;
}

/// Creates an rsocket: not carried, -1 with errno EOPNOTSUPP (rsockets' own answer for a
/// socket kind it does not offer).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rsocket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    ffi_boundary!("rsocket", on_panic = c_int::minus_one(libc::EIO), {
        tracing::debug!(
            "rsocket({domain}, {kind}, {protocol}): rsockets are not carried by ugdr (EOPNOTSUPP)"
        );
        c_int::minus_one(libc::EOPNOTSUPP)
    })
}

/// No descriptor is an rsocket: `poll(2)`, as rsockets polls plain descriptors.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rpoll(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int {
    ffi_boundary!("rpoll", on_panic = c_int::minus_one(libc::EIO), {
        // SAFETY: the caller's array of `nfds` pollfds, exactly as poll(2) takes it.
        unsafe { libc::poll(fds, nfds, timeout) }
    })
}

/// No descriptor is an rsocket: `select(2)`, as rsockets selects plain descriptors.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rselect(
    nfds: c_int,
    readfds: *mut fd_set,
    writefds: *mut fd_set,
    exceptfds: *mut fd_set,
    timeout: *mut timeval,
) -> c_int {
    ffi_boundary!("rselect", on_panic = c_int::minus_one(libc::EIO), {
        // SAFETY: the caller's sets and timeout (each may be NULL), exactly as select(2)
        // takes them.
        unsafe { libc::select(nfds, readfds, writefds, exceptfds, timeout) }
    })
}
