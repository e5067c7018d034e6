//! SOCK_DGRAM rsockets: UDP semantics (rsocket(7), librdmacm's datagram rsockets) with the
//! data on a UD queue pair ([`UdPort`]).
//!
//! Each socket owns a real UDP socket (made by system call, `sys::socket`): its descriptor
//! names the rsocket, its address is the socket's (`rbind`, `rconnect`, `rgetsockname` and
//! `rgetpeername` are the kernel's, ports included), and it carries ugdr's address resolution
//! — nothing else. Data goes only over UD.
//!
//! Resolution (both ends ugdr; every byte from the network is checked, nothing trusted that
//! was not proven):
//! * The first datagram to an address whose UD address is unknown waits in its send slot while
//!   a REQ goes to that address over UDP: our QP number and GID, and a random token of ours for
//!   that address. Every message the peer sends us over UD carries that token, which is how a
//!   datagram is attributed to its source address (a message with a token we did not issue is
//!   dropped).
//! * The socket at that address answers ANS: its QP number and GID, its own token for us, and
//!   ours echoed. An ANS whose echo is not the token we sent to the address it came from is
//!   ignored. REQs are sent again (20 ms, doubling to 500 ms) for about 2.6 s; then the waiting
//!   datagrams are dropped, as UDP loses a datagram to an address nobody listens on.
//! * A side that answered a REQ learns the peer's UD address only from the peer's first UD
//!   message carrying the token it answered with: the completion's source QP and the GRH's
//!   source GID (written by ugdr's engine, not by the peer). Until then its own datagrams to
//!   that address resolve it as above.
//!
//! Nothing blocks here. Resolution progresses whenever the application calls into the socket
//! (a blocked call waits on the UDP socket and the CQ's channel, and on the next REQ retry)
//! and, as UDP needs no call after `sendto` for a datagram to go, in the process's resolution
//! service thread (`ugdr-rs-dgram`, started with the first datagram socket): it sleeps in
//! `poll` on every datagram socket's UDP port until a resolution message arrives or a REQ is
//! due, and answers REQs, takes ANSs (posting the datagrams that waited) and runs the retries.
//! Arrivals are the engine's: they land in the posted receives without any call. A datagram is at most [`MAX_PAYLOAD`] bytes (EMSGSIZE above); one that finds no
//! posted receive at its destination is lost, as UDP loses one that finds a full buffer.

use super::options::{Options, SOL_RDMA};
use super::ud::{HDR_LEN, MAX_PAYLOAD, Route, UdPort, ring_sizes};
use super::{RsError, Wait};
use crate::fake_verbs::device::GRH_LEN;
use crate::fake_verbs::work::{WC_GRH, WcStatus, WorkCompletion};
use socket2::{Domain, SockRef, Type};
use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// "UGRQ": resolution messages over UDP.
const RES_MAGIC: u32 = 0x5547_5251;
/// "UGDG": the header of every datagram over UD.
const DATA_MAGIC: u32 = 0x5547_4447;
const VERSION: u8 = 1;
const REQ: u8 = 1;
const ANS: u8 = 2;
/// The size of a resolution message: magic, version, kind, 2 zero bytes, QP number, 4 zero
/// bytes, token, echo, GID.
const RES_LEN: usize = 48;
/// The first REQ retry, the longest interval, and how many REQs before giving up.
const ASK_FIRST: Duration = Duration::from_millis(20);
const ASK_MAX: Duration = Duration::from_millis(500);
const ASK_TRIES: u32 = 10;
/// The most peers a socket remembers; beyond, an idle one is forgotten (one never proven
/// first, then the least recently used).
const MAX_PEERS: usize = 4096;
/// Resolution messages read per progress pass (the rest wait for the next one).
const UDP_BATCH: usize = 64;
/// How long `rclose` waits for datagrams still resolving or in flight without SO_LINGER.
const CLOSE_LINGER: Duration = Duration::from_secs(1);

/// A resolution message (REQ or ANS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Resolution {
    kind: u8,
    qpn: u32,
    token: u64,
    echo: u64,
    gid: [u8; 16],
}

impl Resolution {
    fn encode(&self) -> [u8; RES_LEN] {
        let mut b = [0u8; RES_LEN];
        b[0..4].copy_from_slice(&RES_MAGIC.to_le_bytes());
        b[4] = VERSION;
        b[5] = self.kind;
        b[8..12].copy_from_slice(&self.qpn.to_le_bytes());
        b[16..24].copy_from_slice(&self.token.to_le_bytes());
        b[24..32].copy_from_slice(&self.echo.to_le_bytes());
        b[32..48].copy_from_slice(&self.gid);
        b
    }

    /// A well-formed message, or None: exact length, magic, version, a known kind, zero
    /// padding, a 24-bit QP number, a non-zero token, a ugdr GID.
    fn decode(b: &[u8]) -> Option<Resolution> {
        if b.len() != RES_LEN {
            return None;
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let m = Resolution {
            kind: b[5],
            qpn: u32_at(8),
            token: u64_at(16),
            echo: u64_at(24),
            gid: b[32..48].try_into().expect("16 bytes"),
        };
        let ok = u32_at(0) == RES_MAGIC
            && b[4] == VERSION
            && matches!(m.kind, REQ | ANS)
            && b[6..8] == [0, 0]
            && u32_at(12) == 0
            && m.qpn <= 0xff_ffff
            && m.qpn > 1
            && m.token != 0
            && (m.kind == REQ || m.echo != 0)
            && crate::engine::address::parse_gid(&m.gid).is_some();
        ok.then_some(m)
    }
}

fn data_header(token: u64) -> [u8; HDR_LEN] {
    let mut h = [0u8; HDR_LEN];
    h[0..4].copy_from_slice(&DATA_MAGIC.to_le_bytes());
    h[4] = VERSION;
    h[8..16].copy_from_slice(&token.to_le_bytes());
    h
}

/// The token of a well-formed datagram header.
fn header_token(h: &[u8; HDR_LEN]) -> Option<u64> {
    let ok = h[0..4] == DATA_MAGIC.to_le_bytes() && h[4] == VERSION && h[5..8] == [0, 0, 0];
    let token = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    (ok && token != 0).then_some(token)
}

/// The form addresses are compared in: IPv4-mapped IPv6 as IPv4, no flow label or scope.
fn canonical(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

fn random_token() -> u64 {
    let mut b = [0u8; 8];
    while getrandom::fill(&mut b).is_err() || b == [0; 8] {}
    u64::from_le_bytes(b)
}

/// A REQ in flight to a peer.
#[derive(Debug, Clone, Copy)]
struct Ask {
    next: Instant,
    interval: Duration,
    tries: u32,
}

/// What the socket knows of one address.
struct Peer {
    /// As reported to the application (as it named it, or as the kernel reported the REQ's
    /// source).
    addr: SocketAddr,
    /// Our token for this peer: its datagrams to us carry it.
    token_in: u64,
    /// The peer's token for us (from its REQ or ANS): our datagrams to it carry it.
    token_out: Option<u64>,
    route: Option<Route>,
    /// Send slots (and lengths) waiting for the route.
    pending: VecDeque<(u32, usize)>,
    ask: Option<Ask>,
    used: Instant,
}

/// One datagram received and not yet read.
struct Arrival {
    slot: u32,
    len: usize,
    from: SocketAddr,
}

/// What a receive took: bytes copied, the datagram's full length, its source.
#[derive(Debug, Clone, Copy)]
pub struct Received {
    pub copied: usize,
    pub len: usize,
    pub from: SocketAddr,
}

struct State {
    /// The socket's UDP socket; None once closed (`rclose` frees the port at once).
    udp: Option<UdpSocket>,
    opts: Options,
    nonblocking: bool,
    port: Option<UdPort>,
    peers: HashMap<SocketAddr, Peer>,
    by_token: HashMap<u64, SocketAddr>,
    /// Peers with a REQ in flight.
    asking: Vec<SocketAddr>,
    ready: VecDeque<Arrival>,
    /// `rconnect`ed to (canonical).
    connected: Option<SocketAddr>,
    shut_rd: bool,
    shut_wr: bool,
    /// `rclose`d: the service leaves it alone.
    closed: bool,
}

impl State {
    fn udp(&self) -> Result<&UdpSocket, RsError> {
        self.udp.as_ref().ok_or(RsError::Os(libc::EBADF))
    }
}

pub struct Datagram {
    fd: RawFd,
    st: Mutex<State>,
}

impl Datagram {
    pub fn new(domain: i32, nonblocking: bool) -> Result<Arc<Datagram>, RsError> {
        let domain = if domain == libc::AF_INET6 {
            Domain::IPV6
        } else {
            Domain::IPV4
        };
        let sock = crate::sys::socket::new_socket(domain, Type::DGRAM)?;
        sock.set_nonblocking(true)?;
        let udp = UdpSocket::from(sock);
        Ok(Arc::new(Datagram {
            fd: udp.as_raw_fd(),
            st: Mutex::new(State {
                udp: Some(udp),
                opts: Options::default(),
                nonblocking,
                port: None,
                peers: HashMap::new(),
                by_token: HashMap::new(),
                asking: Vec::new(),
                ready: VecDeque::new(),
                connected: None,
                shut_rd: false,
                shut_wr: false,
                closed: false,
            }),
        }))
    }

    pub fn fd(&self) -> RawFd {
        self.fd
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_nonblocking(&self) -> bool {
        self.state().nonblocking
    }

    pub fn set_nonblocking(&self, on: bool) {
        self.state().nonblocking = on;
    }

    /// `rbind`: the UDP socket's bind (its errors: EADDRINUSE, EINVAL when bound, ...).
    pub fn bind(&self, addr: SocketAddr) -> Result<(), RsError> {
        let mut st = self.state();
        SockRef::from(st.udp()?).bind(&addr.into())?;
        ensure_port(&mut st)?;
        Ok(())
    }

    pub fn local_addr(&self) -> Result<SocketAddr, RsError> {
        Ok(self.state().udp()?.local_addr()?)
    }

    pub fn peer_addr(&self) -> Result<SocketAddr, RsError> {
        Ok(self.state().udp()?.peer_addr()?)
    }

    /// `rconnect`: the default destination and the only source accepted from now on; its
    /// resolution starts at once.
    pub fn connect(&self, addr: SocketAddr) -> Result<(), RsError> {
        let mut st = self.state();
        ensure_port(&mut st)?;
        SockRef::from(st.udp()?).connect(&addr.into())?;
        let key = canonical(addr);
        st.connected = Some(key);
        // Datagrams from elsewhere that wait are no longer this socket's.
        let stale: Vec<u32> = st
            .ready
            .iter()
            .filter(|a| canonical(a.from) != key)
            .map(|a| a.slot)
            .collect();
        st.ready.retain(|a| canonical(a.from) == key);
        for slot in stale {
            repost(&mut st, slot);
        }
        peer_entry(&mut st, addr).ok_or(RsError::Os(libc::ENOBUFS))?;
        if needs_ask(&st, key) {
            ask(&mut st, key)?;
        }
        Ok(())
    }

    /// What to wait on: the UDP socket, the CQ's channel, the next REQ retry.
    fn wait(&self, st: &State) -> Wait {
        let Some(port) = &st.port else {
            return Wait::on(&[self.fd], -1);
        };
        let mut timeout = -1;
        if port.arm() {
            timeout = 0;
        } else if let Some(ms) = next_ask_ms(st) {
            timeout = ms;
        }
        Wait::on(&[self.fd, port.wait_fd()], timeout)
    }

    /// `rsendto` (`dest`) or `rsend` on a connected socket: one datagram of `data`.
    pub fn send(&self, dest: Option<SocketAddr>, data: &[u8]) -> Result<usize, RsError> {
        if data.len() > MAX_PAYLOAD {
            return Err(RsError::Os(libc::EMSGSIZE));
        }
        let mut st = self.state();
        if st.shut_wr {
            return Err(RsError::Os(libc::EPIPE));
        }
        let dest = match (dest, st.connected) {
            (Some(d), _) => d,
            (None, Some(_)) => st.udp()?.peer_addr()?,
            (None, None) => return Err(RsError::Os(libc::EDESTADDRREQ)),
        };
        ensure_port(&mut st)?;
        progress(&mut st);
        let port = st.port.as_mut().expect("ensured");
        let Some(slot) = port.take_slot() else {
            return Err(RsError::Wait(self.wait(&st)));
        };
        port.fill_slot(slot, HDR_LEN, data);
        let key = canonical(dest);
        if peer_entry(&mut st, dest).is_none() {
            release(&mut st, slot);
            return Err(RsError::Os(libc::ENOBUFS));
        }
        let len = HDR_LEN + data.len();
        let peer = st.peers.get_mut(&key).expect("entry made");
        peer.used = Instant::now();
        if peer.route.is_some() && peer.token_out.is_some() {
            peer.pending.push_back((slot, len));
            flush(&mut st, key);
            return Ok(data.len());
        }
        peer.pending.push_back((slot, len));
        if needs_ask(&st, key)
            && let Err(e) = ask(&mut st, key)
        {
            // The address cannot be sent to at all (another family, no route): as sendto.
            if let Some(p) = st.peers.get_mut(&key) {
                p.pending.retain(|&(s, _)| s != slot);
            }
            release(&mut st, slot);
            return Err(e);
        }
        Ok(data.len())
    }

    /// `rrecvfrom`: the next datagram into `buf` (the rest of it discarded), or Wait.
    pub fn recv(&self, buf: &mut [u8], peek: bool) -> Result<Option<Received>, RsError> {
        let mut st = self.state();
        ensure_port(&mut st)?;
        progress_now(&mut st);
        let Some(a) = st.ready.front() else {
            if st.shut_rd {
                return Ok(None);
            }
            return Err(RsError::Wait(self.wait(&st)));
        };
        let (slot, len, from) = (a.slot, a.len, a.from);
        let n = len.min(buf.len());
        let port = st.port.as_ref().expect("ensured");
        let copied = port.read_recv(slot, GRH_LEN + HDR_LEN, &mut buf[..n]);
        if !peek {
            st.ready.pop_front();
            repost(&mut st, slot);
        }
        Ok(Some(Received { copied, len, from }))
    }

    /// `rpoll`'s view: the events ready now, and what to wait on.
    pub fn poll(&self, events: i16) -> (i16, Wait) {
        let mut st = self.state();
        let mut rev = 0;
        if ensure_port(&mut st).is_err() {
            rev |= libc::POLLERR;
        }
        progress_now(&mut st);
        if !st.ready.is_empty() || st.shut_rd {
            rev |= libc::POLLIN;
        }
        if st.port.as_ref().is_some_and(|p| p.has_free_slot()) || st.shut_wr {
            rev |= libc::POLLOUT;
        }
        let rev = rev & (events | libc::POLLERR | libc::POLLHUP | libc::POLLNVAL);
        (rev, self.wait(&st))
    }

    /// `rshutdown`: as UDP's, only on a connected socket.
    pub fn shutdown(&self, how: i32) -> Result<(), RsError> {
        let mut st = self.state();
        if st.connected.is_none() {
            return Err(RsError::Os(libc::ENOTCONN));
        }
        match how {
            libc::SHUT_RD => st.shut_rd = true,
            libc::SHUT_WR => st.shut_wr = true,
            libc::SHUT_RDWR => (st.shut_rd, st.shut_wr) = (true, true),
            _ => return Err(RsError::Os(libc::EINVAL)),
        }
        Ok(())
    }

    /// `rclose`: datagrams still resolving or in flight go first (bounded), then the verbs.
    pub fn close(&self) {
        let mut st = self.state();
        let had_port = st.port.is_some();
        let within = if st.opts.linger.0 {
            Duration::from_secs(u64::from(st.opts.linger.1))
        } else {
            CLOSE_LINGER
        };
        let deadline = Instant::now() + within;
        while st.port.is_some() {
            progress(&mut st);
            let waiting = st.peers.values().any(|p| !p.pending.is_empty());
            let sending = st.port.as_ref().is_some_and(|p| p.sending());
            if !(waiting || sending) || Instant::now() >= deadline {
                break;
            }
            drop(st);
            std::thread::sleep(Duration::from_micros(200));
            st = self.state();
        }
        st.closed = true;
        st.peers.clear();
        st.by_token.clear();
        st.ready.clear();
        if let Some(port) = st.port.take() {
            port.destroy();
        }
        // The port is free when rclose returns, as close(2) frees it: the descriptor is closed
        // here, and the service, whose `poll` holds a reference to the socket while it sleeps,
        // is woken and waited for (bounded).
        let watched = st.udp.take().is_some() && had_port;
        drop(st);
        if watched {
            service::let_go();
        }
    }

    pub fn setsockopt(&self, level: i32, name: i32, value: &[u8]) -> Result<(), RsError> {
        let mut st = self.state();
        if level == libc::IPPROTO_TCP || (level == SOL_RDMA && st.port.is_some()) {
            return Err(RsError::Os(libc::ENOPROTOOPT));
        }
        st.opts.set(level, name, value)?;
        if (level, name) == (libc::SOL_SOCKET, libc::SO_REUSEADDR) {
            SockRef::from(st.udp()?).set_reuse_address(st.opts.reuseaddr)?;
        }
        Ok(())
    }

    pub fn getsockopt(&self, level: i32, name: i32) -> Result<Vec<u8>, RsError> {
        let st = self.state();
        match (level, name) {
            (libc::SOL_SOCKET, libc::SO_ERROR) => Ok(0i32.to_ne_bytes().to_vec()),
            (libc::SOL_SOCKET, libc::SO_TYPE) => Ok(libc::SOCK_DGRAM.to_ne_bytes().to_vec()),
            (libc::IPPROTO_TCP, _) => Err(RsError::Os(libc::ENOPROTOOPT)),
            _ => st.opts.get(level, name),
        }
    }
}

/// The UD port, made on first use with the rings the options ask for (and the service told
/// to watch the socket from now on).
fn ensure_port(st: &mut State) -> Result<(), RsError> {
    if st.port.is_none() {
        let (rq, sq) = ring_sizes(st.opts.rcvbuf, st.opts.sndbuf);
        let (rq, sq) = (st.opts.rqsize.unwrap_or(rq), st.opts.sqsize.unwrap_or(sq));
        let (rq, sq) = (rq.clamp(2, 1024), sq.clamp(2, 1024));
        st.port = Some(UdPort::new(rq, sq)?);
        service::notify();
    }
    Ok(())
}

/// Milliseconds until the next REQ retry of the socket (rounded up), if one is due.
fn next_ask_ms(st: &State) -> Option<i32> {
    let next = st
        .asking
        .iter()
        .filter_map(|k| st.peers.get(k)?.ask.map(|a| a.next))
        .min()?;
    let left = next.saturating_duration_since(Instant::now());
    Some((left.as_millis() as i32).saturating_add(1))
}

/// The process's resolution service (see the module comment).
mod service {
    use super::Datagram;
    use std::net::{SocketAddr, UdpSocket};
    use std::os::fd::{AsRawFd, RawFd};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, OnceLock};
    use std::time::{Duration, Instant};

    /// Times the thread came back from `poll` (releasing its references to the sockets).
    static ROUNDS: AtomicU64 = AtomicU64::new(0);
    /// How long `let_go` waits for the thread.
    const LET_GO: Duration = Duration::from_millis(200);

    /// A loopback UDP socket the thread also waits on: a byte to it makes the thread look at
    /// the sockets again (a new one, a new REQ timer).
    struct Waker {
        sock: UdpSocket,
        addr: SocketAddr,
    }

    fn waker() -> Option<&'static Waker> {
        static WAKER: OnceLock<Option<Waker>> = OnceLock::new();
        WAKER
            .get_or_init(|| {
                let sock =
                    crate::sys::socket::bind_udp(SocketAddr::from(([127, 0, 0, 1], 0))).ok()?;
                sock.set_nonblocking(true).ok()?;
                let addr = sock.local_addr().ok()?;
                let w = Waker { sock, addr };
                let fd = w.sock.as_raw_fd();
                crate::sys::process::spawn_thread("ugdr-rs-dgram", move || serve(fd)).ok()?;
                Some(w)
            })
            .as_ref()
    }

    /// Makes the thread (started now if need be) look at the sockets again.
    pub(super) fn notify() {
        if let Some(w) = waker() {
            let _ = w.sock.send_to(&[0], w.addr);
        }
    }

    /// Wakes the thread and waits (bounded) until it came back from `poll`, so that it holds
    /// no reference to a socket closed before the call.
    pub(super) fn let_go() {
        let seen = ROUNDS.load(Ordering::Acquire);
        notify();
        let deadline = Instant::now() + LET_GO;
        while ROUNDS.load(Ordering::Acquire) == seen && Instant::now() < deadline {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// The sockets to watch and the next REQ due among them.
    fn watched() -> (Vec<Arc<Datagram>>, i32) {
        let mut timeout = -1;
        let socks: Vec<Arc<Datagram>> = super::super::datagrams()
            .into_iter()
            .filter(|d| {
                let st = d.state();
                if st.closed || st.port.is_none() {
                    return false;
                }
                if let Some(ms) = super::next_ask_ms(&st)
                    && (timeout < 0 || ms < timeout)
                {
                    timeout = ms;
                }
                true
            })
            .collect();
        (socks, timeout)
    }

    fn serve(waker_fd: RawFd) {
        let mut drain = [0u8; 16];
        loop {
            let (socks, timeout) = watched();
            let mut fds = vec![waker_fd];
            fds.extend(socks.iter().map(|d| d.fd()));
            let ready = crate::ucp::wait_readable(&fds, timeout);
            ROUNDS.fetch_add(1, Ordering::AcqRel);
            if ready.contains(&0)
                && let Some(w) = waker()
            {
                while w.sock.recv_from(&mut drain).is_ok() {}
            }
            for (i, d) in socks.iter().enumerate() {
                let mut st = d.state();
                if st.closed || st.port.is_none() {
                    continue;
                }
                if ready.contains(&(i + 1)) {
                    super::read_resolutions(&mut st);
                }
                super::run_timers(&mut st);
            }
        }
    }
}

fn release(st: &mut State, slot: u32) {
    if let Some(p) = st.port.as_mut() {
        p.release_slot(slot);
    }
}

fn repost(st: &mut State, slot: u32) {
    if let Some(p) = st.port.as_ref()
        && let Err(e) = p.post_recv(slot)
    {
        tracing::debug!("rsocket: cannot post a datagram receive again: {e:?}");
    }
}

/// The entry of `addr`, made if new (None: the table is full of peers with datagrams waiting).
fn peer_entry(st: &mut State, addr: SocketAddr) -> Option<&mut Peer> {
    let key = canonical(addr);
    if !st.peers.contains_key(&key) {
        if st.peers.len() >= MAX_PEERS {
            let idle = st
                .peers
                .iter()
                .filter(|(k, p)| p.pending.is_empty() && Some(**k) != st.connected)
                // Addresses that only asked (never proven by a datagram) go first: a flood of
                // REQs from made-up addresses must not push out the peers in use.
                .min_by_key(|(_, p)| (p.route.is_some(), p.used))
                .map(|(k, _)| *k)?;
            forget(st, idle);
        }
        let mut token = random_token();
        while st.by_token.contains_key(&token) {
            token = random_token();
        }
        st.by_token.insert(token, key);
        st.peers.insert(
            key,
            Peer {
                addr,
                token_in: token,
                token_out: None,
                route: None,
                pending: VecDeque::new(),
                ask: None,
                used: Instant::now(),
            },
        );
    }
    st.peers.get_mut(&key)
}

fn forget(st: &mut State, key: SocketAddr) {
    if let Some(p) = st.peers.remove(&key) {
        st.by_token.remove(&p.token_in);
        st.asking.retain(|k| *k != key);
    }
}

/// Whether `key` (an entry) has neither a route nor a REQ in flight.
fn needs_ask(st: &State, key: SocketAddr) -> bool {
    st.peers
        .get(&key)
        .is_some_and(|p| (p.route.is_none() || p.token_out.is_none()) && p.ask.is_none())
}

/// Sends the first REQ to `key`.
fn ask(st: &mut State, key: SocketAddr) -> Result<(), RsError> {
    send_resolution(st, key, REQ, 0)?;
    let p = st.peers.get_mut(&key).expect("an entry");
    p.ask = Some(Ask {
        next: Instant::now() + ASK_FIRST,
        interval: ASK_FIRST,
        tries: 1,
    });
    st.asking.push(key);
    service::notify();
    Ok(())
}

/// Sends a REQ or an ANS (echoing `echo`) to the peer `key`. A full socket buffer is no
/// error (the REQ is sent again; the peer asks again).
fn send_resolution(st: &State, key: SocketAddr, kind: u8, echo: u64) -> Result<(), RsError> {
    let (Some(port), Some(p)) = (&st.port, st.peers.get(&key)) else {
        return Ok(());
    };
    let msg = Resolution {
        kind,
        qpn: port.qp.qp_num,
        token: p.token_in,
        echo,
        gid: port.gid(),
    };
    match st.udp()?.send_to(&msg.encode(), p.addr) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// Posts the datagrams waiting for `key`'s route.
fn flush(st: &mut State, key: SocketAddr) {
    let (Some(port), Some(p)) = (st.port.as_mut(), st.peers.get_mut(&key)) else {
        return;
    };
    let (Some(route), Some(token)) = (&p.route, p.token_out) else {
        return;
    };
    let header = data_header(token);
    while let Some((slot, len)) = p.pending.pop_front() {
        port.fill_slot(slot, 0, &header);
        if let Err(e) = port.send(slot, len, route) {
            tracing::debug!("rsocket: a datagram to {} not sent: {e:?}", p.addr);
        }
    }
}

/// [`progress`], and when nothing has arrived, the engine's worker progressed from this
/// thread (if no other thread is at it) and the CQ looked at again, as `ibv_poll_cq` on an empty CQ does: a
/// receiver that polls (udpong's server spins on `rrecvfrom`, its client on `rpoll` with a
/// 1 ms timeout) gets its datagrams without waiting for the progress thread to be scheduled
/// beside it.
fn progress_now(st: &mut State) {
    progress(st);
    if st.ready.is_empty()
        && st.port.is_some()
        && let Some(engine) = crate::engine::Engine::running()
    {
        engine.progress_from_app();
        take_arrivals(st);
    }
}

/// Takes what arrived: resolution messages, completions; runs the REQ timers.
fn progress(st: &mut State) {
    if st.port.is_none() {
        return;
    }
    read_resolutions(st);
    take_arrivals(st);
    run_timers(st);
}

/// Takes the datagrams the port's CQ holds.
fn take_arrivals(st: &mut State) {
    let mut arrived: Vec<WorkCompletion> = Vec::new();
    if let Some(port) = st.port.as_mut() {
        port.poll(|_, wc| arrived.push(*wc));
    }
    for wc in &arrived {
        on_receive(st, wc);
    }
}

fn read_resolutions(st: &mut State) {
    let mut buf = [0u8; RES_LEN + 1];
    for _ in 0..UDP_BATCH {
        let Ok(udp) = st.udp() else { return };
        let (n, from) = match udp.recv_from(&mut buf) {
            Ok(r) => r,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
            // A connected socket hears of an earlier REQ that found no socket (ICMP): the
            // datagrams to it are lost anyway, as UDP's.
            Err(_) => continue,
        };
        let Some(msg) = Resolution::decode(&buf[..n]) else {
            tracing::trace!("rsocket: {n} bytes from {from} that are no resolution message");
            continue;
        };
        match msg.kind {
            REQ => on_request(st, from, &msg),
            _ => on_answer(st, from, &msg),
        }
    }
}

/// A REQ from `from`: remember its token for our datagrams to it, answer with ours.
fn on_request(st: &mut State, from: SocketAddr, msg: &Resolution) {
    let key = canonical(from);
    if st.connected.is_some_and(|c| c != key) {
        return;
    }
    let Some(p) = peer_entry(st, from) else {
        return;
    };
    if p.token_out != Some(msg.token) {
        // A new socket at that address (or the first REQ): what we knew of it is stale.
        p.token_out = Some(msg.token);
        p.route = None;
    }
    p.used = Instant::now();
    if let Err(e) = send_resolution(st, key, ANS, msg.token) {
        tracing::debug!("rsocket: cannot answer {from}: {e:?}");
    }
}

/// An ANS from `from`: valid only as the answer to our REQ to that address.
fn on_answer(st: &mut State, from: SocketAddr, msg: &Resolution) {
    let key = canonical(from);
    let Some(pd) = st.port.as_ref().map(|p| std::sync::Arc::clone(p.pd())) else {
        return;
    };
    let Some(p) = st.peers.get_mut(&key) else {
        return;
    };
    if p.token_in != msg.echo {
        return;
    }
    let stale = p.route.as_ref().is_some_and(|r| r.qpn() != msg.qpn);
    if p.route.is_none() || stale {
        match Route::new(&pd, msg.gid, msg.qpn) {
            Ok(r) => p.route = Some(r),
            Err(e) => {
                tracing::debug!("rsocket: no route to {from}: {e:?}");
                return;
            }
        }
    }
    p.token_out = Some(msg.token);
    p.ask = None;
    st.asking.retain(|k| *k != key);
    flush(st, key);
}

/// A receive completion: a datagram from a peer we can name, or dropped (receive posted again).
fn on_receive(st: &mut State, wc: &WorkCompletion) {
    let slot = wc.wr_id as u32;
    let Some(port) = st.port.as_ref() else { return };
    if slot >= port.rq {
        return;
    }
    let len = wc.byte_len as usize;
    if wc.status != WcStatus::Success
        || !(GRH_LEN + HDR_LEN..=GRH_LEN + super::ud::MTU).contains(&len)
    {
        if wc.status != WcStatus::WrFlushErr {
            repost(st, slot);
        }
        return;
    }
    let mut header = [0u8; HDR_LEN];
    port.read_recv(slot, GRH_LEN, &mut header);
    let Some(key) = header_token(&header).and_then(|t| st.by_token.get(&t).copied()) else {
        tracing::trace!("rsocket: a datagram with no token of ours dropped");
        repost(st, slot);
        return;
    };
    if st.connected.is_some_and(|c| c != key) {
        repost(st, slot);
        return;
    }
    let mut grh = [0u8; GRH_LEN];
    if wc.wc_flags & WC_GRH != 0 {
        port.read_recv(slot, 0, &mut grh);
    }
    let pd = std::sync::Arc::clone(port.pd());
    let p = st.peers.get_mut(&key).expect("tokens name entries");
    match &p.route {
        Some(r) if r.qpn() == wc.src_qp && r.lid == wc.slid => {}
        Some(_) => {
            // Not the QP that address resolved to: not from that address.
            repost(st, slot);
            return;
        }
        None => {
            // The first datagram of a peer that asked us: its QP (the completion's) and GID
            // (the GRH, written by the engine) are where that address's datagrams come from.
            let sgid: [u8; 16] = grh[8..24].try_into().expect("16 bytes");
            let gid_lid = crate::engine::address::parse_gid(&sgid).map(|(_, lid)| lid);
            if wc.wc_flags & WC_GRH == 0 || gid_lid != Some(wc.slid) {
                repost(st, slot);
                return;
            }
            match Route::new(&pd, sgid, wc.src_qp) {
                Ok(r) => p.route = Some(r),
                Err(_) => {
                    repost(st, slot);
                    return;
                }
            }
            if p.token_out.is_some() && p.ask.take().is_some() {
                st.asking.retain(|k| *k != key);
            }
        }
    }
    let p = st.peers.get_mut(&key).expect("tokens name entries");
    p.used = Instant::now();
    let from = p.addr;
    if !p.pending.is_empty() {
        flush(st, key);
    }
    st.ready.push_back(Arrival {
        slot,
        len: len - GRH_LEN - HDR_LEN,
        from,
    });
}

/// Sends REQs again that were not answered in time; gives up on those asked long enough
/// (their datagrams are lost).
fn run_timers(st: &mut State) {
    if st.asking.is_empty() {
        return;
    }
    let now = Instant::now();
    for key in st.asking.clone() {
        let Some(a) = st.peers.get(&key).and_then(|p| p.ask) else {
            st.asking.retain(|k| *k != key);
            continue;
        };
        if now < a.next {
            continue;
        }
        if a.tries >= ASK_TRIES {
            let p = st.peers.get_mut(&key).expect("asked");
            p.ask = None;
            let lost: Vec<u32> = p.pending.drain(..).map(|(s, _)| s).collect();
            tracing::debug!(
                "rsocket: nobody answers at {}: {} datagrams lost",
                p.addr,
                lost.len()
            );
            for s in lost {
                release(st, s);
            }
            st.asking.retain(|k| *k != key);
            continue;
        }
        let _ = send_resolution(st, key, REQ, 0);
        let interval = (a.interval * 2).min(ASK_MAX);
        if let Some(p) = st.peers.get_mut(&key) {
            p.ask = Some(Ask {
                next: now + interval,
                interval,
                tries: a.tries + 1,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Resolution {
        Resolution {
            kind: ANS,
            qpn: 0x12_3456,
            token: 7,
            echo: 9,
            gid: crate::engine::address::port_gid(std::net::Ipv4Addr::new(10, 0, 0, 1), 0x0102),
        }
    }

    #[test]
    fn resolution_messages_round_trip_and_malformed_ones_are_refused() {
        let m = sample();
        let b = m.encode();
        assert_eq!(Resolution::decode(&b), Some(m));
        assert_eq!(Resolution::decode(&b[..RES_LEN - 1]), None);
        let mut longer = b.to_vec();
        longer.push(0);
        assert_eq!(Resolution::decode(&longer), None);
        for (i, v) in [(0, 0u8), (4, 2), (5, 3), (6, 1), (12, 1), (11, 1), (32, 0)] {
            let mut bad = b;
            bad[i] = v;
            if i == 32 {
                bad[40] ^= 0xff; // not a ugdr GID
                bad[41] ^= 0xff;
            }
            assert_eq!(Resolution::decode(&bad), None, "byte {i} = {v}");
        }
        let zero_token = Resolution { token: 0, ..m };
        assert_eq!(Resolution::decode(&zero_token.encode()), None);
        let answer_without_echo = Resolution { echo: 0, ..m };
        assert_eq!(Resolution::decode(&answer_without_echo.encode()), None);
    }

    #[test]
    fn datagram_headers_carry_a_non_zero_token_only() {
        assert_eq!(header_token(&data_header(42)), Some(42));
        assert_eq!(header_token(&data_header(0)), None);
        let mut h = data_header(42);
        h[5] = 1;
        assert_eq!(header_token(&h), None);
        assert_eq!(header_token(&[0u8; HDR_LEN]), None);
    }

    #[test]
    fn addresses_compare_in_canonical_form() {
        let mapped: SocketAddr = "[::ffff:127.0.0.1]:5".parse().unwrap();
        let v4: SocketAddr = "127.0.0.1:5".parse().unwrap();
        assert_eq!(canonical(mapped), v4);
    }
}
