//! rsockets (librdmacm's socket API over RDMA, rsocket(7)) on ugdr's own connection manager
//! and verbs. The real librdmacm's rsockets cannot run on ugdr's ids (they reach into
//! librdmacm's private id structures), so ugdr carries its own; both ends must be ugdr (the
//! protocol is ugdr's: `transport.rs`).
//!
//! * `stream.rs` — SOCK_STREAM: a CM id on an event channel of its own, an RC QP
//!   (`transport.rs`) once connected; connect, listen/accept, send/recv, shutdown, close,
//!   `riomap`/`riowrite`;
//! * `datagram.rs` — SOCK_DGRAM: a UDP socket of its own (address, port, resolution) and a UD
//!   QP (`ud.rs`) for the data;
//! * `options.rs` — the socket options rsocket(7) lists.
//!
//! Every rsocket is named by a real file descriptor ugdr owns (a stream's event channel, a
//! datagram socket's UDP socket), so its
//! number never collides with the application's own descriptors, and `rpoll`/`rselect` can
//! mix both. Calls never block here: a call that would is answered [`RsError::Wait`] with
//! the descriptors to wait on, and the C layer waits (cancellable) or answers EAGAIN.

#![forbid(unsafe_code)]

mod datagram;
mod options;
mod stream;
mod transport;
mod ud;

pub use datagram::{Datagram, Received};
pub use options::Options;
pub use stream::Stream;
pub use ud::MAX_PAYLOAD as MAX_DATAGRAM;

use crate::cm::CmError;
use crate::fake_verbs::VerbsError;
use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::{Arc, LazyLock, Mutex};

/// What a blocked call waits for: up to two descriptors to become readable, or a timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wait {
    pub fds: [RawFd; 2],
    pub count: usize,
    /// -1: no timeout.
    pub timeout_ms: i32,
}

impl Wait {
    pub fn on(fds: &[RawFd], timeout_ms: i32) -> Wait {
        let mut w = Wait {
            fds: [-1; 2],
            count: fds.len().min(2),
            timeout_ms,
        };
        w.fds[..w.count].copy_from_slice(&fds[..w.count]);
        w
    }
}

/// Why an rsocket call did not complete, before it becomes an errno at the C edge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RsError {
    /// It would block: wait as told, then call again.
    Wait(Wait),
    /// Internal: no resource right now (the caller turns it into a [`RsError::Wait`]).
    Again,
    Os(i32),
}

impl RsError {
    pub fn errno(&self) -> i32 {
        match self {
            RsError::Wait(_) | RsError::Again => libc::EAGAIN,
            RsError::Os(e) => *e,
        }
    }
}

impl From<CmError> for RsError {
    fn from(e: CmError) -> Self {
        RsError::Os(e.errno())
    }
}

impl From<VerbsError> for RsError {
    fn from(e: VerbsError) -> Self {
        RsError::Os(e.errno())
    }
}

impl From<std::io::Error> for RsError {
    fn from(e: std::io::Error) -> Self {
        RsError::Os(e.raw_os_error().unwrap_or(libc::EIO))
    }
}

/// One rsocket.
#[derive(Clone)]
pub enum Rsocket {
    Stream(Arc<Stream>),
    Datagram(Arc<Datagram>),
}

/// Every open rsocket, by descriptor.
static TABLE: LazyLock<Mutex<HashMap<RawFd, Rsocket>>> = LazyLock::new(Default::default);

fn table() -> std::sync::MutexGuard<'static, HashMap<RawFd, Rsocket>> {
    TABLE.lock().unwrap_or_else(|p| p.into_inner())
}

fn insert(fd: RawFd, s: Rsocket) -> RawFd {
    table().insert(fd, s);
    fd
}

/// The rsocket `fd` names: EBADF for any other descriptor.
pub fn lookup(fd: RawFd) -> Result<Rsocket, RsError> {
    table().get(&fd).cloned().ok_or(RsError::Os(libc::EBADF))
}

/// Every open datagram rsocket (for the resolution service, `datagram.rs`).
fn datagrams() -> Vec<Arc<Datagram>> {
    table()
        .values()
        .filter_map(|s| match s {
            Rsocket::Datagram(d) => Some(Arc::clone(d)),
            Rsocket::Stream(_) => None,
        })
        .collect()
}

/// Whether `fd` is an rsocket.
pub fn is_rsocket(fd: RawFd) -> bool {
    table().contains_key(&fd)
}

/// `rsocket(domain, type, protocol)`: PF_INET or PF_INET6, SOCK_STREAM or SOCK_DGRAM
/// (SOCK_NONBLOCK honoured, SOCK_CLOEXEC ignored).
pub fn socket(domain: i32, kind: i32, protocol: i32) -> Result<RawFd, RsError> {
    if domain != libc::AF_INET && domain != libc::AF_INET6 {
        return Err(RsError::Os(libc::EAFNOSUPPORT));
    }
    let nonblocking = kind & libc::SOCK_NONBLOCK != 0;
    match kind & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) {
        libc::SOCK_STREAM if matches!(protocol, 0 | libc::IPPROTO_TCP) => {
            let s = Stream::new(nonblocking)?;
            Ok(insert(s.fd(), Rsocket::Stream(s)))
        }
        libc::SOCK_DGRAM if matches!(protocol, 0 | libc::IPPROTO_UDP) => {
            let d = Datagram::new(domain, nonblocking)?;
            Ok(insert(d.fd(), Rsocket::Datagram(d)))
        }
        libc::SOCK_DGRAM => Err(RsError::Os(libc::EPROTONOSUPPORT)),
        libc::SOCK_STREAM => Err(RsError::Os(libc::EPROTONOSUPPORT)),
        _ => Err(RsError::Os(libc::ESOCKTNOSUPPORT)),
    }
}

/// Registers a stream `raccept` produced.
fn adopt(s: Arc<Stream>) -> RawFd {
    insert(s.fd(), Rsocket::Stream(s))
}

/// `rclose`: the descriptor is no rsocket any more once this returns.
pub fn close(fd: RawFd) -> Result<(), RsError> {
    let s = table().remove(&fd).ok_or(RsError::Os(libc::EBADF))?;
    match s {
        Rsocket::Stream(s) => s.close(),
        Rsocket::Datagram(d) => d.close(),
    }
    Ok(())
}

impl Rsocket {
    pub fn is_nonblocking(&self) -> bool {
        match self {
            Rsocket::Stream(s) => s.is_nonblocking(),
            Rsocket::Datagram(s) => s.is_nonblocking(),
        }
    }

    pub fn set_nonblocking(&self, on: bool) {
        match self {
            Rsocket::Stream(s) => s.set_nonblocking(on),
            Rsocket::Datagram(s) => s.set_nonblocking(on),
        }
    }

    /// `poll(2)` events ready now (after taking what arrived), and what to wait on for more.
    pub fn poll(&self, events: i16) -> (i16, Wait) {
        match self {
            Rsocket::Stream(s) => s.poll(events),
            Rsocket::Datagram(s) => s.poll(events),
        }
    }

    pub fn local_addr(&self) -> Result<std::net::SocketAddr, RsError> {
        match self {
            Rsocket::Stream(s) => s.local_addr(),
            Rsocket::Datagram(s) => s.local_addr(),
        }
    }

    pub fn bind(&self, addr: std::net::SocketAddr) -> Result<(), RsError> {
        match self {
            Rsocket::Stream(s) => s.bind(addr),
            Rsocket::Datagram(s) => s.bind(addr),
        }
    }

    pub fn setsockopt(&self, level: i32, name: i32, value: &[u8]) -> Result<(), RsError> {
        match self {
            Rsocket::Stream(s) => s.setsockopt(level, name, value),
            Rsocket::Datagram(s) => s.setsockopt(level, name, value),
        }
    }

    pub fn getsockopt(&self, level: i32, name: i32) -> Result<Vec<u8>, RsError> {
        match self {
            Rsocket::Stream(s) => s.getsockopt(level, name),
            Rsocket::Datagram(s) => s.getsockopt(level, name),
        }
    }

    pub fn peer_addr(&self) -> Result<std::net::SocketAddr, RsError> {
        match self {
            Rsocket::Stream(s) => s.peer_addr(),
            Rsocket::Datagram(s) => s.peer_addr(),
        }
    }

    pub fn shutdown(&self, how: i32) -> Result<(), RsError> {
        match self {
            Rsocket::Stream(s) => s.shutdown(how),
            Rsocket::Datagram(s) => s.shutdown(how),
        }
    }
}
