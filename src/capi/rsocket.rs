//! rsockets (librdmacm's socket API over RDMA): the exports, thin over `crate::rsocket`.
//!
//! ugdr's exports come first in the process, so `rstream`, `riostream`, `rcopy` and
//! `librspreload.so` (which calls `rsocket`, `rsend`, … through librdmacm's symbols) reach
//! these. Failures follow the sockets convention: -1 (for `riowrite`, `(size_t)-1`) with
//! errno set; a descriptor that is no rsocket is EBADF (and left alone: `rclose(1)` does not
//! close stdout). A call that would block waits in `poll()` outside the boundary
//! ([`blocking`]), where `pthread_cancel` may end the thread, unless the socket is
//! non-blocking (O_NONBLOCK, MSG_DONTWAIT): then EAGAIN (EINPROGRESS for `rconnect`).
//! `rpoll`/`rselect` take rsockets and plain descriptors together.

use super::boundary::{Attempt, blocking, ffi_boundary, set_errno};
use crate::rsocket::{self, RsError, Rsocket, Wait};
use crate::ucp::AppRegion;
use libc::{fd_set, iovec, msghdr, nfds_t, off_t, pollfd, sockaddr, socklen_t, timeval};
use socket2::SockAddr;
use std::cell::Cell;
use std::net::SocketAddr;
use std::os::raw::{c_int, c_void};
use std::time::{Duration, Instant};

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

fn fail<T: MinusOne>(e: RsError) -> T {
    match e {
        RsError::Wait(_) | RsError::Again => spin_pause(),
        RsError::Os(errno) => tracing::debug!("rsocket: errno {errno}"),
    }
    T::minus_one(e.errno())
}

// Consecutive EAGAINs this thread got before one call went through.
thread_local!(static AGAIN_STREAK: Cell<u32> = const { Cell::new(0) });

/// How many EAGAINs in a row a non-blocking caller gets before it is paused once.
const AGAIN_BEFORE_PAUSE: u32 = 64;

/// A non-blocking caller spins on EAGAIN (its call progresses the worker itself, so nothing
/// needs another thread to run), but on a core it shares with the peer it waits for, a spin
/// that never lets go holds that core for a whole time slice per message: every
/// [`AGAIN_BEFORE_PAUSE`] failures in a row it sleeps for a moment. A sleep, not
/// `sched_yield`: under Linux's EEVDF scheduler each yield pushes the thread's deadline a
/// whole slice further, so a thread that yields on every EAGAIN starves beside busy threads
/// (rstream's default set on 2 cores beside 2 busy loops: past 2 minutes; seconds now).
fn spin_pause() {
    let streak = AGAIN_STREAK.with(|c| {
        let n = c.get().wrapping_add(1);
        c.set(n);
        n
    });
    if streak.is_multiple_of(AGAIN_BEFORE_PAUSE) {
        std::thread::sleep(Duration::from_micros(1));
    }
}

/// A call went through: the streak of EAGAINs ends.
fn streak_ended() {
    AGAIN_STREAK.with(|c| c.set(0));
}

/// # Safety
/// `addr` is NULL or points to `len` readable bytes.
unsafe fn read_addr(addr: *const sockaddr, len: socklen_t) -> Result<SocketAddr, RsError> {
    if addr.is_null() || (len as usize) < std::mem::size_of::<libc::sa_family_t>() {
        return Err(RsError::Os(libc::EINVAL));
    }
    // SAFETY: every sockaddr starts with its family.
    let family = i32::from(unsafe { (*addr).sa_family });
    let need = match family {
        libc::AF_INET => std::mem::size_of::<libc::sockaddr_in>(),
        libc::AF_INET6 => std::mem::size_of::<libc::sockaddr_in6>(),
        _ => return Err(RsError::Os(libc::EAFNOSUPPORT)),
    };
    if (len as usize) < need {
        return Err(RsError::Os(libc::EINVAL));
    }
    // SAFETY: plain C data.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    // SAFETY: the caller's `need` bytes (checked against `len`); storage is larger.
    unsafe {
        std::ptr::copy_nonoverlapping(
            addr.cast::<u8>(),
            std::ptr::addr_of_mut!(storage).cast::<u8>(),
            need,
        )
    };
    // SAFETY: storage holds an initialized address of `need` bytes.
    unsafe { SockAddr::new(storage, need as socklen_t) }
        .as_socket()
        .ok_or(RsError::Os(libc::EINVAL))
}

/// Writes `a` as `getsockname(2)` does: truncated to `*len`, `*len` set to the full size.
///
/// # Safety
/// `addr`/`len` are NULL or the caller's out-parameters (`*len` bytes at `addr`).
unsafe fn write_addr(a: SocketAddr, addr: *mut sockaddr, len: *mut socklen_t) -> c_int {
    if addr.is_null() || len.is_null() {
        return 0;
    }
    let sa = SockAddr::from(a);
    // SAFETY: the caller's length.
    let room = unsafe { *len } as usize;
    let n = (sa.len() as usize).min(room);
    // SAFETY: `sa` holds `sa.len()` bytes; the caller's buffer `room` bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(sa.as_ptr().cast::<u8>(), addr.cast::<u8>(), n);
        *len = sa.len();
    }
    0
}

/// Runs an rsocket call that may block: once when the socket is non-blocking (or `dontwait`),
/// else until it completes, waiting (cancellable) as it says.
fn run<R: MinusOne + 'static>(
    name: &str,
    s: &Rsocket,
    dontwait: bool,
    mut op: impl FnMut() -> Result<R, RsError>,
) -> R {
    let nonblocking = dontwait || s.is_nonblocking();
    blocking(
        name,
        || R::minus_one(libc::EIO),
        |_| match op() {
            Ok(r) => {
                streak_ended();
                Attempt::Done(r)
            }
            Err(RsError::Wait(w)) if !nonblocking => wait(w),
            Err(e) => Attempt::Done(fail(e)),
        },
    )
}

fn wait<R>(w: Wait) -> Attempt<R> {
    Attempt::Wait {
        fds: w.fds,
        count: w.count,
        timeout_ms: w.timeout_ms,
    }
}

/// The stream rsocket `fd` names (a datagram socket: EOPNOTSUPP, as UDP's for these calls).
fn stream(fd: c_int) -> Result<std::sync::Arc<rsocket::Stream>, RsError> {
    match rsocket::lookup(fd)? {
        Rsocket::Stream(s) => Ok(s),
        Rsocket::Datagram(_) => Err(RsError::Os(libc::EOPNOTSUPP)),
    }
}

/// The datagram rsocket `fd` names, if it names one.
fn datagram(fd: c_int) -> Option<std::sync::Arc<rsocket::Datagram>> {
    match rsocket::lookup(fd) {
        Ok(Rsocket::Datagram(d)) => Some(d),
        _ => None,
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rsocket(domain: c_int, kind: c_int, protocol: c_int) -> c_int {
    ffi_boundary!("rsocket", on_panic = c_int::minus_one(libc::EIO), {
        rsocket::socket(domain, kind, protocol).unwrap_or_else(fail)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rbind(socket: c_int, addr: *const sockaddr, addrlen: socklen_t) -> c_int {
    ffi_boundary!("rbind", on_panic = c_int::minus_one(libc::EIO), {
        let s = match rsocket::lookup(socket) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        // SAFETY: the caller's address of `addrlen` bytes.
        match unsafe { read_addr(addr, addrlen) }.and_then(|a| s.bind(a)) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rlisten(socket: c_int, backlog: c_int) -> c_int {
    ffi_boundary!("rlisten", on_panic = c_int::minus_one(libc::EIO), {
        match stream(socket).and_then(|s| s.listen(backlog)) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn raccept(
    socket: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> c_int {
    let s = match ffi_boundary!("raccept", on_panic = Err(RsError::Os(libc::EIO)), {
        rsocket::lookup(socket)
    }) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let listener = match &s {
        Rsocket::Stream(l) => std::sync::Arc::clone(l),
        Rsocket::Datagram(_) => return fail(RsError::Os(libc::EOPNOTSUPP)),
    };
    let addr_out = (addr as usize, addrlen as usize);
    run("raccept", &s, false, move || {
        let child = listener.accept()?;
        if let Ok(peer) = child.peer_addr() {
            // SAFETY: the caller's out-parameters (or NULL).
            unsafe {
                write_addr(
                    peer,
                    addr_out.0 as *mut sockaddr,
                    addr_out.1 as *mut socklen_t,
                )
            };
        }
        Ok(child.fd())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rconnect(
    socket: c_int,
    addr: *const sockaddr,
    addrlen: socklen_t,
) -> c_int {
    let prepared = ffi_boundary!("rconnect", on_panic = Err(RsError::Os(libc::EIO)), {
        let s = rsocket::lookup(socket)?;
        // SAFETY: the caller's address of `addrlen` bytes.
        let dst = unsafe { read_addr(addr, addrlen) }?;
        Ok::<_, RsError>((s, dst))
    });
    let (s, dst) = match prepared {
        Ok(p) => p,
        Err(e) => return fail(e),
    };
    let st = match &s {
        Rsocket::Stream(st) => std::sync::Arc::clone(st),
        // UDP's connect: the default destination, at once.
        Rsocket::Datagram(d) => {
            return ffi_boundary!("rconnect", on_panic = c_int::minus_one(libc::EIO), {
                match d.connect(dst) {
                    Ok(()) => 0,
                    Err(e) => fail(e),
                }
            });
        }
    };
    let nonblocking = s.is_nonblocking();
    let mut first = Some(dst);
    blocking(
        "rconnect",
        || c_int::minus_one(libc::EIO),
        |_| {
            let started = first.is_some();
            match st.connect(first.take()) {
                Ok(()) => Attempt::Done(0),
                Err(RsError::Wait(_)) if nonblocking && started => {
                    Attempt::Done(c_int::minus_one(libc::EINPROGRESS))
                }
                Err(RsError::Wait(_)) if nonblocking => {
                    Attempt::Done(c_int::minus_one(libc::EALREADY))
                }
                Err(RsError::Wait(w)) => wait(w),
                Err(e) => Attempt::Done(fail(e)),
            }
        },
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rshutdown(socket: c_int, how: c_int) -> c_int {
    ffi_boundary!("rshutdown", on_panic = c_int::minus_one(libc::EIO), {
        match rsocket::lookup(socket).and_then(|s| s.shutdown(how)) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rclose(socket: c_int) -> c_int {
    ffi_boundary!("rclose", on_panic = c_int::minus_one(libc::EIO), {
        match rsocket::close(socket) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

/// Receives into the caller's buffer: MSG_PEEK, MSG_DONTWAIT, MSG_WAITALL.
///
/// # Safety
/// `buf` is valid for `len` bytes of writes (or `len` is 0).
unsafe fn recv_into(
    name: &str,
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> isize {
    if let Some(d) = datagram(socket) {
        let none = std::ptr::null_mut();
        // SAFETY: the caller's buffer; no source address asked for.
        let got = unsafe { dgram_recv(name, &d, buf, len, flags, none, none.cast()) };
        return dgram_count(got, flags);
    }
    let s = match ffi_boundary!(name, on_panic = Err(RsError::Os(libc::EIO)), {
        stream(socket)
    }) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if len > 0 && buf.is_null() {
        return fail(RsError::Os(libc::EFAULT));
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let waitall = flags & libc::MSG_WAITALL != 0 && !peek;
    let (ptr, mut done) = (buf as usize, 0usize);
    let rs = Rsocket::Stream(std::sync::Arc::clone(&s));
    run(name, &rs, dontwait, move || {
        // Like a socket: with MSG_WAITALL a blocking receive goes on for the rest.
        transfer(&s, dontwait, len, waitall, &mut done, |done| {
            // SAFETY: the caller's buffer of `len` bytes; `done` <= len.
            let out =
                unsafe { std::slice::from_raw_parts_mut((ptr as *mut u8).add(done), len - done) };
            s.recv(out, peek)
        })
    })
}

/// One stream rsocket call over the caller's `len` bytes, `done` of them moved so far:
/// `step(done)` moves more. When `whole` and the call may block, one that moved some asks
/// again at once until all `len` moved: only the call that finds no room or no data says what
/// to wait on (asked afterwards, once credits had come in, the answer was "nothing will wake
/// you"). What moved before an error is returned instead of the error.
fn transfer(
    s: &rsocket::Stream,
    dontwait: bool,
    len: usize,
    whole: bool,
    done: &mut usize,
    mut step: impl FnMut(usize) -> Result<usize, RsError>,
) -> Result<isize, RsError> {
    let blocking = !dontwait && !s.is_nonblocking();
    loop {
        match step(*done) {
            Ok(0) => return Ok(*done as isize),
            Ok(n) => {
                *done += n;
                if !(whole && blocking && *done < len) {
                    return Ok(*done as isize);
                }
            }
            Err(RsError::Wait(w)) if *done > 0 && blocking => return Err(RsError::Wait(w)),
            Err(_) if *done > 0 => return Ok(*done as isize),
            Err(e) => return Err(e),
        }
    }
}

/// Sends the caller's bytes.
///
/// # Safety
/// `buf` is valid for `len` bytes of reads (or `len` is 0).
unsafe fn send_from(
    name: &str,
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    if let Some(d) = datagram(socket) {
        // SAFETY: the caller's buffer; the connected destination.
        return unsafe { dgram_send(name, &d, buf, len, flags, None) };
    }
    let s = match ffi_boundary!(name, on_panic = Err(RsError::Os(libc::EIO)), {
        stream(socket)
    }) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if len > 0 && buf.is_null() {
        return fail(RsError::Os(libc::EFAULT));
    }
    let (ptr, mut done) = (buf as usize, 0usize);
    let dontwait = flags & libc::MSG_DONTWAIT != 0;
    let rs = Rsocket::Stream(std::sync::Arc::clone(&s));
    run(name, &rs, dontwait, move || {
        // A blocking socket sends everything before it returns.
        transfer(&s, dontwait, len, true, &mut done, |done| {
            // SAFETY: the caller's buffer of `len` bytes; `done` <= len.
            let data =
                unsafe { std::slice::from_raw_parts((ptr as *const u8).add(done), len - done) };
            s.send(data)
        })
    })
}

/// Gathers an iovec array into one buffer (rsendmsg, rwritev).
///
/// # Safety
/// `iov` is NULL or `iovcnt` valid iovecs, each valid for its length.
unsafe fn gather_iov(iov: *const iovec, iovcnt: c_int) -> Result<Vec<u8>, RsError> {
    if iovcnt < 0 || (iovcnt > 0 && iov.is_null()) || iovcnt > libc::UIO_MAXIOV {
        return Err(RsError::Os(libc::EINVAL));
    }
    let mut out = Vec::new();
    for i in 0..iovcnt as usize {
        // SAFETY: the caller's array of `iovcnt` iovecs.
        let v = unsafe { &*iov.add(i) };
        if v.iov_len > 0 && !v.iov_base.is_null() {
            // SAFETY: each iovec names `iov_len` readable bytes.
            out.extend_from_slice(unsafe {
                std::slice::from_raw_parts(v.iov_base as *const u8, v.iov_len)
            });
        }
    }
    Ok(out)
}

/// The largest buffer a vectored receive gathers into at once (64 MiB): a stream receive may
/// return less than asked, and the iovecs' lengths are only the caller's claim.
const MAX_GATHERED_RECEIVE: usize = 64 << 20;

/// Receives into an iovec array (rrecvmsg, rreadv): into one buffer, then scattered.
///
/// # Safety
/// As [`gather_iov`], for writes.
unsafe fn recv_iov(
    name: &str,
    socket: c_int,
    iov: *const iovec,
    iovcnt: c_int,
    flags: c_int,
) -> isize {
    if iovcnt < 0 || (iovcnt > 0 && iov.is_null()) || iovcnt > libc::UIO_MAXIOV {
        return fail(RsError::Os(libc::EINVAL));
    }
    // SAFETY: the caller's iovecs.
    let vs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    if vs.iter().any(|v| v.iov_len > 0 && v.iov_base.is_null()) {
        return fail(RsError::Os(libc::EFAULT));
    }
    let Some(total) = vs
        .iter()
        .try_fold(0usize, |t, v| t.checked_add(v.iov_len))
        .filter(|&t| t <= isize::MAX as usize)
    else {
        return fail(RsError::Os(libc::EINVAL));
    };
    // One receive never returns more than the window of slots; a larger total is only a
    // claim (a stream receive may return less), so it does not size the buffer.
    let total = total.min(MAX_GATHERED_RECEIVE);
    let mut tmp = vec![0u8; total];
    // SAFETY: `tmp` holds `total` bytes.
    let n = unsafe { recv_into(name, socket, tmp.as_mut_ptr().cast(), total, flags) };
    if n > 0 {
        let mut off = 0usize;
        for v in vs {
            let k = v.iov_len.min(n as usize - off);
            if k > 0 {
                // SAFETY: each iovec names `iov_len` writable bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(tmp.as_ptr().add(off), v.iov_base.cast(), k)
                };
            }
            off += k;
        }
    }
    n
}

/// What one datagram receive took, or the errno (already set) it failed with.
struct Taken(Result<rsocket::Received, c_int>);

impl MinusOne for Taken {
    fn minus_one(errno: c_int) -> Self {
        set_errno(errno);
        Taken(Err(errno))
    }
}

/// Receives one datagram into `len` bytes at `buf` (what does not fit is discarded) and writes
/// its source to `src`/`srclen` (when not NULL): the bytes copied and the datagram's length,
/// or None (errno set).
///
/// # Safety
/// `buf` is valid for `len` bytes of writes (or `len` is 0); `src`/`srclen` as `write_addr`.
unsafe fn dgram_recv(
    name: &str,
    d: &std::sync::Arc<rsocket::Datagram>,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src: *mut sockaddr,
    srclen: *mut socklen_t,
) -> Option<(usize, usize)> {
    if len > 0 && buf.is_null() {
        let _: c_int = fail(RsError::Os(libc::EFAULT));
        return None;
    }
    let peek = flags & libc::MSG_PEEK != 0;
    let rs = Rsocket::Datagram(std::sync::Arc::clone(d));
    let ptr = buf as usize;
    let taken = run(name, &rs, flags & libc::MSG_DONTWAIT != 0, || {
        let out: &mut [u8] = if len == 0 {
            &mut []
        } else {
            // SAFETY: the caller's buffer of `len` bytes (not NULL: checked above).
            unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) }
        };
        match d.recv(out, peek)? {
            Some(r) => Ok(Taken(Ok(r))),
            // Shut down for reading: end of file, from nowhere.
            None => Ok(Taken(Ok(rsocket::Received {
                copied: 0,
                len: 0,
                from: SocketAddr::from(([0, 0, 0, 0], 0)),
            }))),
        }
    });
    let r = taken.0.ok()?;
    // SAFETY: the caller's out-parameters (or NULL).
    unsafe { write_addr(r.from, src, srclen) };
    Some((r.copied, r.len))
}

/// recvfrom(2)'s count on UDP: the bytes copied, or the datagram's length with MSG_TRUNC.
fn dgram_count(got: Option<(usize, usize)>, flags: c_int) -> isize {
    match got {
        None => -1,
        Some((_, len)) if flags & libc::MSG_TRUNC != 0 => len as isize,
        Some((copied, _)) => copied as isize,
    }
}

/// A datagram receive into an iovec array (rrecvmsg, rreadv): into one datagram-sized buffer,
/// then scattered. The count (as [`dgram_count`]) and whether the datagram was cut short.
///
/// # Safety
/// As [`gather_iov`], for writes; `src`/`srclen` as `write_addr`.
unsafe fn dgram_recv_iov(
    name: &str,
    d: &std::sync::Arc<rsocket::Datagram>,
    iov: *const iovec,
    iovcnt: c_int,
    flags: c_int,
    src: *mut sockaddr,
    srclen: *mut socklen_t,
) -> (isize, bool) {
    if iovcnt < 0 || (iovcnt > 0 && iov.is_null()) || iovcnt > libc::UIO_MAXIOV {
        return (fail(RsError::Os(libc::EINVAL)), false);
    }
    // SAFETY: the caller's iovecs.
    let vs = unsafe { std::slice::from_raw_parts(iov, iovcnt as usize) };
    if vs.iter().any(|v| v.iov_len > 0 && v.iov_base.is_null()) {
        return (fail(RsError::Os(libc::EFAULT)), false);
    }
    let total = vs
        .iter()
        .fold(0usize, |t, v| t.saturating_add(v.iov_len))
        .min(rsocket::MAX_DATAGRAM);
    let mut tmp = vec![0u8; total];
    // SAFETY: `tmp` holds `total` bytes; the caller's out-parameters.
    let got = unsafe { dgram_recv(name, d, tmp.as_mut_ptr().cast(), total, flags, src, srclen) };
    let Some((copied, len)) = got else {
        return (-1, false);
    };
    let mut off = 0usize;
    for v in vs {
        let k = v.iov_len.min(copied - off);
        if k > 0 {
            // SAFETY: each iovec names `iov_len` writable bytes.
            unsafe { std::ptr::copy_nonoverlapping(tmp.as_ptr().add(off), v.iov_base.cast(), k) };
        }
        off += k;
    }
    (dgram_count(got, flags), len > copied)
}

/// Sends `len` bytes at `buf` as one datagram to `dest` (None: the connected peer).
///
/// # Safety
/// `buf` is valid for `len` bytes of reads (or `len` is 0).
unsafe fn dgram_send(
    name: &str,
    d: &std::sync::Arc<rsocket::Datagram>,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dest: Option<SocketAddr>,
) -> isize {
    if len > 0 && buf.is_null() {
        return fail(RsError::Os(libc::EFAULT));
    }
    let rs = Rsocket::Datagram(std::sync::Arc::clone(d));
    let ptr = buf as usize;
    run(name, &rs, flags & libc::MSG_DONTWAIT != 0, || {
        let data: &[u8] = if len == 0 {
            &[]
        } else {
            // SAFETY: the caller's buffer of `len` bytes (not NULL: checked above).
            unsafe { std::slice::from_raw_parts(ptr as *const u8, len) }
        };
        d.send(dest, data).map(|n| n as isize)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rrecv(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { recv_into("rrecv", socket, buf, len, flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rread(socket: c_int, buf: *mut c_void, count: usize) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { recv_into("rread", socket, buf, count, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rrecvfrom(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    flags: c_int,
    src_addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> isize {
    if let Some(d) = datagram(socket) {
        // SAFETY: the caller's buffer and out-parameters.
        let got = unsafe { dgram_recv("rrecvfrom", &d, buf, len, flags, src_addr, addrlen) };
        return dgram_count(got, flags);
    }
    // SAFETY: the caller's buffer.
    let n = unsafe { recv_into("rrecvfrom", socket, buf, len, flags) };
    if n >= 0
        && let Ok(peer) = stream(socket).and_then(|s| s.peer_addr())
    {
        // SAFETY: the caller's out-parameters (or NULL).
        unsafe { write_addr(peer, src_addr, addrlen) };
    }
    n
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rrecvmsg(socket: c_int, msg: *mut msghdr, flags: c_int) -> isize {
    if msg.is_null() {
        return fail(RsError::Os(libc::EINVAL));
    }
    // SAFETY: the caller's msghdr.
    let m = unsafe { &mut *msg };
    m.msg_controllen = 0;
    m.msg_flags = 0;
    let Ok(iovlen) = c_int::try_from(m.msg_iovlen) else {
        return fail(RsError::Os(libc::EMSGSIZE));
    };
    if let Some(d) = datagram(socket) {
        let name = (
            m.msg_name.cast::<sockaddr>(),
            std::ptr::addr_of_mut!(m.msg_namelen),
        );
        let name = if m.msg_name.is_null() {
            (std::ptr::null_mut(), std::ptr::null_mut())
        } else {
            name
        };
        // SAFETY: the caller's iovecs and name buffer.
        let (n, truncated) =
            unsafe { dgram_recv_iov("rrecvmsg", &d, m.msg_iov, iovlen, flags, name.0, name.1) };
        if truncated {
            m.msg_flags |= libc::MSG_TRUNC;
        }
        return n;
    }
    // SAFETY: the caller's iovecs.
    unsafe { recv_iov("rrecvmsg", socket, m.msg_iov, iovlen, flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rreadv(socket: c_int, iov: *const iovec, iovcnt: c_int) -> isize {
    if let Some(d) = datagram(socket) {
        let none = std::ptr::null_mut();
        // SAFETY: the caller's iovecs.
        return unsafe { dgram_recv_iov("rreadv", &d, iov, iovcnt, 0, none, none.cast()) }.0;
    }
    // SAFETY: the caller's iovecs.
    unsafe { recv_iov("rreadv", socket, iov, iovcnt, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rsend(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { send_from("rsend", socket, buf, len, flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rwrite(socket: c_int, buf: *const c_void, count: usize) -> isize {
    // SAFETY: the caller's buffer.
    unsafe { send_from("rwrite", socket, buf, count, 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rsendto(
    socket: c_int,
    buf: *const c_void,
    len: usize,
    flags: c_int,
    dest_addr: *const sockaddr,
    addrlen: socklen_t,
) -> isize {
    if let Some(d) = datagram(socket) {
        let dest = if dest_addr.is_null() {
            None
        } else {
            // SAFETY: the caller's address of `addrlen` bytes.
            match unsafe { read_addr(dest_addr, addrlen) } {
                Ok(a) => Some(a),
                Err(e) => return fail(e),
            }
        };
        // SAFETY: the caller's buffer.
        return unsafe { dgram_send("rsendto", &d, buf, len, flags, dest) };
    }
    if !dest_addr.is_null() && stream(socket).is_ok() {
        // A connected stream socket ignores no address: sockets answer EISCONN.
        return fail(RsError::Os(libc::EISCONN));
    }
    let _ = addrlen;
    // SAFETY: the caller's buffer.
    unsafe { send_from("rsendto", socket, buf, len, flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rsendmsg(socket: c_int, msg: *const msghdr, flags: c_int) -> isize {
    if msg.is_null() {
        return fail(RsError::Os(libc::EINVAL));
    }
    // SAFETY: the caller's msghdr.
    let Ok(iovlen) = c_int::try_from(unsafe { (*msg).msg_iovlen }) else {
        return fail(RsError::Os(libc::EMSGSIZE));
    };
    // SAFETY: the caller's msghdr and iovecs.
    let data = match unsafe { gather_iov((*msg).msg_iov, iovlen) } {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    if let Some(d) = datagram(socket) {
        // SAFETY: the caller's msghdr.
        let (name, namelen) = unsafe { ((*msg).msg_name, (*msg).msg_namelen) };
        let dest = if name.is_null() {
            None
        } else {
            // SAFETY: the caller's address of `msg_namelen` bytes.
            match unsafe { read_addr(name.cast(), namelen) } {
                Ok(a) => Some(a),
                Err(e) => return fail(e),
            }
        };
        // SAFETY: `data` is ours.
        return unsafe {
            dgram_send(
                "rsendmsg",
                &d,
                data.as_ptr().cast(),
                data.len(),
                flags,
                dest,
            )
        };
    }
    // SAFETY: `data` is ours.
    unsafe { send_from("rsendmsg", socket, data.as_ptr().cast(), data.len(), flags) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rwritev(socket: c_int, iov: *const iovec, iovcnt: c_int) -> isize {
    // SAFETY: the caller's iovecs.
    let data = match unsafe { gather_iov(iov, iovcnt) } {
        Ok(d) => d,
        Err(e) => return fail(e),
    };
    // SAFETY: `data` is ours.
    unsafe { send_from("rwritev", socket, data.as_ptr().cast(), data.len(), 0) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rgetpeername(
    socket: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> c_int {
    ffi_boundary!("rgetpeername", on_panic = c_int::minus_one(libc::EIO), {
        if addr.is_null() || addrlen.is_null() {
            return fail(RsError::Os(libc::EFAULT));
        }
        match rsocket::lookup(socket).and_then(|s| s.peer_addr()) {
            // SAFETY: the caller's out-parameters.
            Ok(a) => unsafe { write_addr(a, addr, addrlen) },
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rgetsockname(
    socket: c_int,
    addr: *mut sockaddr,
    addrlen: *mut socklen_t,
) -> c_int {
    ffi_boundary!("rgetsockname", on_panic = c_int::minus_one(libc::EIO), {
        if addr.is_null() || addrlen.is_null() {
            return fail(RsError::Os(libc::EFAULT));
        }
        match rsocket::lookup(socket).and_then(|s| s.local_addr()) {
            // SAFETY: the caller's out-parameters.
            Ok(a) => unsafe { write_addr(a, addr, addrlen) },
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rsetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *const c_void,
    optlen: socklen_t,
) -> c_int {
    ffi_boundary!("rsetsockopt", on_panic = c_int::minus_one(libc::EIO), {
        let s = match rsocket::lookup(socket) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        if optval.is_null() && optlen > 0 {
            return fail(RsError::Os(libc::EFAULT));
        }
        let value = if optlen == 0 {
            &[][..]
        } else {
            // SAFETY: the caller's option value of `optlen` bytes.
            unsafe { std::slice::from_raw_parts(optval.cast::<u8>(), optlen as usize) }
        };
        match s.setsockopt(level, optname, value) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rgetsockopt(
    socket: c_int,
    level: c_int,
    optname: c_int,
    optval: *mut c_void,
    optlen: *mut socklen_t,
) -> c_int {
    ffi_boundary!("rgetsockopt", on_panic = c_int::minus_one(libc::EIO), {
        let s = match rsocket::lookup(socket) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        if optval.is_null() || optlen.is_null() {
            return fail(RsError::Os(libc::EFAULT));
        }
        match s.getsockopt(level, optname) {
            Ok(v) => {
                // SAFETY: the caller's buffer of `*optlen` bytes and its length.
                unsafe {
                    let n = v.len().min(*optlen as usize);
                    std::ptr::copy_nonoverlapping(v.as_ptr(), optval.cast::<u8>(), n);
                    *optlen = n as socklen_t;
                }
                0
            }
            Err(e) => fail(e),
        }
    })
}

/// `int rfcntl(int socket, int cmd, ... /* int arg */)`: F_GETFL and F_SETFL (O_NONBLOCK).
/// The variadic int is read as a third register argument, as the x86-64 and AArch64 Linux
/// ABIs pass it.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn rfcntl(socket: c_int, cmd: c_int, arg: c_int) -> c_int {
    ffi_boundary!("rfcntl", on_panic = c_int::minus_one(libc::EIO), {
        let s = match rsocket::lookup(socket) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        match cmd {
            libc::F_GETFL => {
                libc::O_RDWR
                    | if s.is_nonblocking() {
                        libc::O_NONBLOCK
                    } else {
                        0
                    }
            }
            libc::F_SETFL => {
                s.set_nonblocking(arg & libc::O_NONBLOCK != 0);
                0
            }
            _ => c_int::minus_one(libc::EINVAL),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn riomap(
    socket: c_int,
    buf: *mut c_void,
    len: usize,
    prot: c_int,
    flags: c_int,
    offset: off_t,
) -> off_t {
    ffi_boundary!("riomap", on_panic = i64::minus_one(libc::EIO), {
        let s = match stream(socket) {
            Ok(s) => s,
            Err(e) => return fail(e),
        };
        if buf.is_null() || len == 0 || flags != 0 || offset < -1 {
            return fail(RsError::Os(libc::EINVAL));
        }
        // SAFETY: rsocket(7)'s contract: the buffer stays mapped until riounmap (or rclose);
        // memory taken away earlier invalidates the region (libc_hooks).
        let region = unsafe { AppRegion::new(buf as u64, len as u64, true) };
        s.iomap(region, prot, offset).unwrap_or_else(fail)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn riounmap(socket: c_int, buf: *mut c_void, len: usize) -> c_int {
    ffi_boundary!("riounmap", on_panic = c_int::minus_one(libc::EIO), {
        match stream(socket).and_then(|s| s.iounmap(buf as u64, len as u64)) {
            Ok(()) => 0,
            Err(e) => fail(e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn riowrite(
    socket: c_int,
    buf: *const c_void,
    count: usize,
    offset: off_t,
    flags: c_int,
) -> usize {
    let s = match ffi_boundary!("riowrite", on_panic = Err(RsError::Os(libc::EIO)), {
        stream(socket)
    }) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    if (count > 0 && buf.is_null()) || offset < 0 {
        return fail(RsError::Os(libc::EINVAL));
    }
    let ptr = buf as usize;
    let rs = Rsocket::Stream(std::sync::Arc::clone(&s));
    run(
        "riowrite",
        &rs,
        flags & libc::MSG_DONTWAIT != 0,
        move || {
            // SAFETY: the caller's buffer of `count` bytes.
            let data = unsafe { std::slice::from_raw_parts(ptr as *const u8, count) };
            s.iowrite(data, offset as u64)
        },
    )
}

/// One round of `rpoll`: rsockets' readiness (after taking what arrived) and plain
/// descriptors' (by `poll(2)` with timeout 0 when any rsocket is ready). Returns the count
/// ready, and what to wait on otherwise.
fn poll_round(fds: &mut [pollfd]) -> (c_int, Vec<pollfd>, c_int) {
    let mut ready = 0;
    let mut waits = Vec::new();
    let mut timeout = -1;
    for p in fds.iter_mut() {
        p.revents = 0;
        if p.fd < 0 {
            continue;
        }
        match rsocket::lookup(p.fd) {
            Ok(s) => {
                let (rev, w) = s.poll(p.events);
                p.revents = rev;
                if rev != 0 {
                    ready += 1;
                }
                for &fd in &w.fds[..w.count] {
                    waits.push(pollfd {
                        fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
                if w.timeout_ms >= 0 && (timeout < 0 || w.timeout_ms < timeout) {
                    timeout = w.timeout_ms;
                }
            }
            Err(_) => waits.push(pollfd {
                fd: p.fd,
                events: p.events,
                revents: 0,
            }),
        }
    }
    (ready, waits, timeout)
}

unsafe extern "C-unwind" {
    /// glibc's `poll` (a cancellation point), by its exported alias (see `boundary`).
    #[link_name = "__poll"]
    fn poll_cancellable(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int;
}

/// What one `rpoll` round found.
enum Round {
    Ready(c_int),
    Failed(c_int),
    /// Nothing ready: wait on these (and at most `timeout` ms, -1: no bound), then again.
    Wait(Vec<pollfd>, c_int),
}

/// `d` in whole milliseconds, rounded up (a poll(2) timeout that does not return early).
fn ceil_ms(d: Duration) -> c_int {
    d.as_micros().div_ceil(1000).min(c_int::MAX as u128) as c_int
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rpoll(fds: *mut pollfd, nfds: nfds_t, timeout: c_int) -> c_int {
    if nfds > 0 && fds.is_null() {
        return c_int::minus_one(libc::EFAULT);
    }
    let deadline = (timeout >= 0).then(|| Instant::now() + Duration::from_millis(timeout as u64));
    loop {
        let round = ffi_boundary!("rpoll", on_panic = Round::Failed(libc::EIO), {
            // SAFETY: the caller's array of `nfds` pollfds.
            let fds = unsafe { std::slice::from_raw_parts_mut(fds, nfds as usize) };
            let (mut ready, waits, rs_timeout) = poll_round(fds);
            // Plain descriptors: their own state now.
            let plain: Vec<usize> = (0..fds.len())
                .filter(|&i| fds[i].fd >= 0 && !rsocket::is_rsocket(fds[i].fd))
                .collect();
            if !plain.is_empty() {
                let mut now: Vec<pollfd> = plain.iter().map(|&i| fds[i]).collect();
                // SAFETY: our own array.
                let n = unsafe { libc::poll(now.as_mut_ptr(), now.len() as nfds_t, 0) };
                if n < 0 {
                    let e = std::io::Error::last_os_error();
                    return Round::Failed(e.raw_os_error().unwrap_or(libc::EINVAL));
                }
                for (k, &i) in plain.iter().enumerate() {
                    fds[i].revents = now[k].revents;
                    if now[k].revents != 0 {
                        ready += 1;
                    }
                }
            }
            if ready > 0 {
                Round::Ready(ready)
            } else {
                Round::Wait(waits, rs_timeout)
            }
        });
        let (mut waits, rs_timeout) = match round {
            Round::Ready(n) => return n,
            Round::Failed(e) => return c_int::minus_one(e),
            Round::Wait(w, t) => (w, t),
        };
        // Rounded up: with 0.9 ms left, a 1 ms rpoll still waits (truncated to 0, it returned
        // at once, and udpong, resending on every timeout, read its own duplicate echoes).
        let left = deadline.map(|d| ceil_ms(d.saturating_duration_since(Instant::now())));
        if left == Some(0) {
            // A caller polling with timeout 0 spins (its rpoll progressed the worker): paused
            // as a spin on EAGAIN is, by a short sleep now and then, not a yield per call.
            spin_pause();
            return 0;
        }
        let t = match (left, rs_timeout) {
            (Some(l), r) if r >= 0 => l.min(r),
            (Some(l), _) => l,
            (None, r) => r.max(-1),
        };
        // SAFETY: our own array of pollfds; a cancellation point outside the boundary.
        unsafe { poll_cancellable(waits.as_mut_ptr(), waits.len() as nfds_t, t) };
    }
}

#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn rselect(
    nfds: c_int,
    readfds: *mut fd_set,
    writefds: *mut fd_set,
    exceptfds: *mut fd_set,
    timeout: *mut timeval,
) -> c_int {
    if !(0..=libc::FD_SETSIZE as c_int).contains(&nfds) {
        return c_int::minus_one(libc::EINVAL);
    }
    let mut pfds = Vec::new();
    for fd in 0..nfds {
        let mut events = 0;
        // SAFETY: the caller's sets (each may be NULL), `fd` < FD_SETSIZE.
        unsafe {
            if !readfds.is_null() && libc::FD_ISSET(fd, readfds) {
                events |= libc::POLLIN;
            }
            if !writefds.is_null() && libc::FD_ISSET(fd, writefds) {
                events |= libc::POLLOUT;
            }
            if !exceptfds.is_null() && libc::FD_ISSET(fd, exceptfds) {
                events |= libc::POLLPRI;
            }
        }
        if events != 0 {
            pfds.push(pollfd {
                fd,
                events,
                revents: 0,
            });
        }
    }
    let ms = if timeout.is_null() {
        -1
    } else {
        // SAFETY: the caller's timeout.
        let t = unsafe { &*timeout };
        // Rounded up, as select(2) never waits less than asked.
        (t.tv_sec.max(0).saturating_mul(1000) + (t.tv_usec.max(0) + 999) / 1000)
            .min(i64::from(c_int::MAX)) as c_int
    };
    // SAFETY: our own array.
    let n = unsafe { rpoll(pfds.as_mut_ptr(), pfds.len() as nfds_t, ms) };
    if n < 0 {
        return n;
    }
    // SAFETY: the caller's sets (each may be NULL).
    unsafe {
        for set in [readfds, writefds, exceptfds] {
            if !set.is_null() {
                libc::FD_ZERO(set);
            }
        }
    }
    let mut count = 0;
    for p in &pfds {
        // SAFETY: as above.
        unsafe {
            if !readfds.is_null()
                && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
                && p.events & libc::POLLIN != 0
            {
                libc::FD_SET(p.fd, readfds);
                count += 1;
            }
            if !writefds.is_null()
                && p.revents & (libc::POLLOUT | libc::POLLERR) != 0
                && p.events & libc::POLLOUT != 0
            {
                libc::FD_SET(p.fd, writefds);
                count += 1;
            }
            if !exceptfds.is_null() && p.revents & libc::POLLPRI != 0 {
                libc::FD_SET(p.fd, exceptfds);
                count += 1;
            }
        }
    }
    count
}
