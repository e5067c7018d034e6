//! Connection-manager ids, their event channels, and the threads that run the CM protocol.

use super::wire::{Endpoint, Message};
use super::{CmError, address};
use crate::engine::Engine;
use crate::fake_verbs::event_queue::EventQueue;
use crate::fake_verbs::qp::{ModifyRequest, QpAttributes, QueuePair};
use crate::fake_verbs::qp_state::{AttrMask, QpState};
use socket2::{Domain, SockRef, Socket, Type};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Private data the IB CM carries: a REQ of an IP port space (its first 36 bytes hold the
/// CMA header), of RDMA_PS_IB, a REP, a REJ. Receivers always see the full field, zero-padded.
const PRIVATE_DATA_REQ_IP: usize = 56;
const PRIVATE_DATA_REQ_IB: usize = 92;
pub const PRIVATE_DATA_ACCEPT: usize = 196;
const PRIVATE_DATA_SIDR_REQ: usize = 180;
const PRIVATE_DATA_SIDR_REP: usize = 136;
const QPT_UD: u32 = 4;
pub const PRIVATE_DATA_REJECT: usize = 148;

/// IB CM reject reasons.
pub const REJ_INVALID_SERVICE_ID: u8 = 8;
pub const REJ_CONSUMER_DEFINED: u8 = 28;

/// How long an active side waits for the passive host to answer the connection (IB CM retries
/// a REQ for about this long before UNREACHABLE).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a connection to a port nobody listens on keeps being retried (see
/// `connect_patiently`).
const REFUSED_PATIENCE: Duration = Duration::from_millis(250);
/// How long a passive side waits for the REQ on a fresh connection.
const REQ_TIMEOUT: Duration = Duration::from_secs(10);

/// `enum rdma_port_space`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PortSpace {
    Ipoib,
    Tcp,
    Udp,
    Ib,
}

impl PortSpace {
    pub fn from_raw(v: u32) -> Option<PortSpace> {
        Some(match v {
            0x0002 => PortSpace::Ipoib,
            0x0106 => PortSpace::Tcp,
            0x0111 => PortSpace::Udp,
            0x013f => PortSpace::Ib,
            _ => return None,
        })
    }

    pub fn to_raw(self) -> u32 {
        match self {
            PortSpace::Ipoib => 0x0002,
            PortSpace::Tcp => 0x0106,
            PortSpace::Udp => 0x0111,
            PortSpace::Ib => 0x013f,
        }
    }

    /// The private data a connection request carries in this port space.
    pub fn request_private_len(self) -> usize {
        match self {
            PortSpace::Ib => PRIVATE_DATA_REQ_IB,
            _ => PRIVATE_DATA_REQ_IP,
        }
    }
}

/// `enum rdma_cm_event_type` (the values ugdr raises).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    AddrResolved = 0,
    AddrError = 1,
    RouteResolved = 2,
    RouteError = 3,
    ConnectRequest = 4,
    ConnectResponse = 5,
    ConnectError = 6,
    Unreachable = 7,
    Rejected = 8,
    Established = 9,
    Disconnected = 10,
}

impl EventKind {
    pub fn to_raw(self) -> u32 {
        self as u32
    }
}

/// `rdma_conn_param` as an event reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EventParam {
    pub private_data: Vec<u8>,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

impl EventParam {
    /// What the receiver of `ep`'s REQ or REP sees: the peer's depths swapped into the
    /// receiver's point of view (its responder resources serve the peer's initiator depth), the
    /// private data padded to the CM field size.
    fn from_peer(ep: &Endpoint, private: &[u8], field: usize) -> EventParam {
        EventParam {
            private_data: padded(private, field),
            responder_resources: ep.initiator_depth,
            initiator_depth: ep.responder_resources,
            flow_control: ep.flow_control,
            retry_count: ep.retry_count,
            rnr_retry_count: ep.rnr_retry_count,
            srq: u8::from(ep.srq),
            qp_num: ep.qpn,
        }
    }
}

fn padded(data: &[u8], field: usize) -> Vec<u8> {
    let mut v = data[..data.len().min(field)].to_vec();
    v.resize(field, 0);
    v
}

/// One `rdma_cm_event`.
pub struct CmEvent {
    pub id: Arc<CmId>,
    pub listen_id: Option<Arc<CmId>>,
    pub kind: EventKind,
    pub status: i32,
    pub param: EventParam,
}

/// An `rdma_event_channel`: events behind a real, pollable fd.
pub struct EventChannel {
    queue: EventQueue<CmEvent>,
    /// Created by ugdr for a synchronous id (the application passed no channel).
    sync: bool,
    shell: AtomicUsize,
    /// Threads inside [`EventChannel::next`].
    waiters: AtomicUsize,
}

impl EventChannel {
    pub fn new(sync: bool) -> Result<Arc<EventChannel>, CmError> {
        Ok(Arc::new(EventChannel {
            queue: EventQueue::new()?,
            sync,
            shell: AtomicUsize::new(0),
            waiters: AtomicUsize::new(0),
        }))
    }

    pub fn fd(&self) -> i32 {
        self.queue.fd()
    }

    pub fn is_sync(&self) -> bool {
        self.sync
    }

    /// The C object standing for this channel (set by the C layer; 0 until then).
    pub fn shell(&self) -> usize {
        self.shell.load(Ordering::Acquire)
    }

    pub fn set_shell(&self, shell: usize) {
        self.shell.store(shell, Ordering::Release);
    }

    fn push(&self, event: CmEvent) {
        tracing::debug!(
            "cm event {:?} status {} on id {:p}",
            event.kind,
            event.status,
            Arc::as_ptr(&event.id)
        );
        self.queue.push(event);
    }

    /// The next event: blocks while none is queued, unless the application made the fd
    /// non-blocking (then WouldBlock). Events of ids destroyed meanwhile are dropped.
    pub fn next(&self) -> Result<CmEvent, CmError> {
        self.waiters.fetch_add(1, Ordering::AcqRel);
        let event = self.next_live();
        self.waiters.fetch_sub(1, Ordering::AcqRel);
        event
    }

    /// Whether a thread is blocked in (or about to block in) [`EventChannel::next`].
    pub fn has_waiters(&self) -> bool {
        self.waiters.load(Ordering::Acquire) > 0
    }

    fn next_live(&self) -> Result<CmEvent, CmError> {
        loop {
            if let Some(event) = live(self.queue.wait()?) {
                return Ok(event);
            }
        }
    }

    /// Like [`EventChannel::next`] without blocking: `None` while no event is queued (the C
    /// layer then waits for the fd itself, where `pthread_cancel` may end the thread).
    pub fn try_next(&self) -> Result<Option<CmEvent>, CmError> {
        while let Some(event) = self.queue.try_wait()? {
            if let Some(event) = live(event) {
                return Ok(Some(event));
            }
        }
        Ok(None)
    }

    /// Whether the application made the channel's fd non-blocking.
    pub fn is_nonblocking(&self) -> bool {
        self.queue.is_nonblocking()
    }
}

/// The event, unless its id (or the listener it came to) was destroyed meanwhile.
fn live(event: CmEvent) -> Option<CmEvent> {
    if let Some(listener) = &event.listen_id {
        listener.request_taken();
        if listener.is_destroyed() {
            event.id.destroy();
            return None;
        }
    }
    if event.id.is_destroyed() {
        return None;
    }
    Some(event)
}

/// Where an id is in its life (librdmacm's and the IB CM's states, merged).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Idle,
    Bound,
    ResolvingAddr,
    AddrResolved,
    RouteResolved,
    Listening,
    /// Active side: REQ sent (or being sent), waiting for REP or REJ.
    Connecting,
    /// Active side: REP received, RTU not sent yet.
    ReplyReceived,
    /// Passive side: REQ received, the application has not answered.
    RequestReceived,
    /// Passive side: REP sent, waiting for RTU.
    ReplySent,
    Connected,
    /// DREQ sent, waiting for DREP.
    Disconnecting,
    Disconnected,
    Rejected,
    Failed,
}

/// What `rdma_init_qp_attr` needs to compute a QP's attributes for a state.
#[derive(Debug, Clone)]
pub struct QpParams {
    pub port_space: PortSpace,
    pub qp_type: u32,
    pub peer: Option<Endpoint>,
    pub local_psn: u32,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

struct State {
    phase: Phase,
    local: Option<SocketAddr>,
    remote: Option<SocketAddr>,
    /// Bound and not yet listening or connected (holds the port, as an RDMA CM bind does).
    socket: Option<Socket>,
    listener: Option<Arc<TcpListener>>,
    backlog: usize,
    pending_requests: usize,
    /// The CM connection to the peer id.
    link: Option<Arc<TcpStream>>,
    peer: Option<Endpoint>,
    local_psn: u32,
    responder_resources: u8,
    initiator_depth: u8,
    retry_count: u8,
    rnr_retry_count: u8,
    qp: Option<Arc<QueuePair>>,
    /// A passive id's listener (for its backlog).
    listen_id: Option<Arc<CmId>>,
}

/// An `rdma_cm_id`.
pub struct CmId {
    pub port_space: PortSpace,
    pub qp_type: u32,
    channel: Mutex<Arc<EventChannel>>,
    state: Mutex<State>,
    shell: AtomicUsize,
    destroyed: AtomicBool,
    /// Events handed to the application and not yet acknowledged (librdmacm's
    /// events_reported − events_completed).
    unacked: Mutex<usize>,
    acked: Condvar,
}

/// A fresh 24-bit starting PSN.
fn random_psn() -> u32 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    (h.finish() as u32) & 0xff_ffff
}

fn bind_socket(addr: SocketAddr) -> Result<Socket, CmError> {
    let sock = Socket::new(Domain::for_address(addr), Type::STREAM, None)?;
    sock.set_cloexec(true)?;
    // Connections of an earlier run in TIME_WAIT must not keep the port (an RDMA CM port has
    // no TIME_WAIT); a second live listener still gets EADDRINUSE.
    sock.set_reuse_address(true)?;
    if addr.is_ipv6() {
        sock.set_only_v6(false)?;
    }
    sock.bind(&addr.into())?;
    Ok(sock)
}

/// Sends one CM message without ever raising SIGPIPE in the application.
fn send(stream: &TcpStream, msg: &Message) -> io::Result<()> {
    let frame = msg.encode();
    let sock = SockRef::from(stream);
    let mut sent = 0;
    while sent < frame.len() {
        match sock.send_with_flags(&frame[sent..], libc::MSG_NOSIGNAL) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<(), CmError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map(drop)
        .map_err(|e| CmError::Os(e.raw_os_error().unwrap_or(libc::EAGAIN)))
}

/// Moves `qp` to ERR, flushing its outstanding work requests (the peer is gone).
fn flush(qp: &Arc<QueuePair>) {
    let Ok(engine) = Engine::get() else { return };
    let locked = engine.worker.lock();
    let req = ModifyRequest {
        mask: AttrMask::STATE,
        state: Some(QpState::Err),
        claimed_cur: None,
        attrs: QpAttributes::default(),
    };
    if let Err(e) = qp.modify(&locked, &req, None) {
        tracing::debug!("cm: cannot move qp {:#x} to ERR: {e}", qp.qp_num);
    }
}

impl CmId {
    pub fn new(channel: Arc<EventChannel>, port_space: PortSpace, qp_type: u32) -> Arc<CmId> {
        Arc::new(CmId {
            port_space,
            qp_type,
            channel: Mutex::new(channel),
            state: Mutex::new(State {
                phase: Phase::Idle,
                local: None,
                remote: None,
                socket: None,
                listener: None,
                backlog: 0,
                pending_requests: 0,
                link: None,
                peer: None,
                local_psn: random_psn(),
                responder_resources: 0,
                initiator_depth: 0,
                retry_count: 7,
                rnr_retry_count: 7,
                qp: None,
                listen_id: None,
            }),
            shell: AtomicUsize::new(0),
            destroyed: AtomicBool::new(false),
            unacked: Mutex::new(0),
            acked: Condvar::new(),
        })
    }

    /// UD ids connect by service ID resolution (SIDR): one request, one reply, no
    /// connection to keep.
    pub fn is_ud(&self) -> bool {
        self.qp_type == QPT_UD
    }

    /// The private data a connection request of this id carries (a SIDR REQ: 180 bytes).
    fn request_private_len(&self) -> usize {
        if self.is_ud() {
            PRIVATE_DATA_SIDR_REQ
        } else {
            self.port_space.request_private_len()
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn channel(&self) -> Arc<EventChannel> {
        Arc::clone(&self.channel.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// `rdma_migrate_id`: later events go to `channel`.
    pub fn migrate(&self, channel: Arc<EventChannel>) {
        *self.channel.lock().unwrap_or_else(|p| p.into_inner()) = channel;
    }

    /// The C object standing for this id (set by the C layer; 0 until then).
    pub fn shell(&self) -> usize {
        self.shell.load(Ordering::Acquire)
    }

    pub fn set_shell(&self, shell: usize) {
        self.shell.store(shell, Ordering::Release);
    }

    /// An event of this id reached the application.
    pub fn event_delivered(&self) {
        *self.unacked.lock().unwrap_or_else(|p| p.into_inner()) += 1;
    }

    /// The application acknowledged one of this id's events.
    pub fn event_acked(&self) {
        let mut n = self.unacked.lock().unwrap_or_else(|p| p.into_inner());
        *n = n.saturating_sub(1);
        if *n == 0 {
            self.acked.notify_all();
        }
    }

    /// Blocks until every event delivered for this id has been acknowledged (librdmacm's
    /// rdma_destroy_id and rdma_migrate_id do).
    pub fn wait_events_acked(&self) {
        let mut n = self.unacked.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = self.acked.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }

    pub fn is_destroyed(&self) -> bool {
        self.destroyed.load(Ordering::Acquire)
    }

    pub fn phase(&self) -> Phase {
        self.state().phase
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.state().local
    }

    pub fn remote_addr(&self) -> Option<SocketAddr> {
        self.state().remote
    }

    pub fn peer(&self) -> Option<Endpoint> {
        self.state().peer.clone()
    }

    pub fn qp_params(&self) -> QpParams {
        let s = self.state();
        QpParams {
            port_space: self.port_space,
            qp_type: self.qp_type,
            peer: s.peer.clone(),
            local_psn: s.local_psn,
            responder_resources: s.responder_resources,
            initiator_depth: s.initiator_depth,
            retry_count: s.retry_count,
            rnr_retry_count: s.rnr_retry_count,
        }
    }

    /// The QP the CM moves to ERR when the connection goes away.
    pub fn attach_qp(&self, qp: Option<Arc<QueuePair>>) {
        self.state().qp = qp;
    }

    fn emit(self: &Arc<Self>, kind: EventKind, status: i32, param: EventParam) {
        if self.is_destroyed() {
            return;
        }
        self.channel().push(CmEvent {
            id: Arc::clone(self),
            listen_id: None,
            kind,
            status,
            param,
        });
    }

    /// `rdma_bind_addr`.
    pub fn bind(&self, addr: SocketAddr) -> Result<SocketAddr, CmError> {
        let mut s = self.state();
        if s.phase != Phase::Idle {
            return Err(CmError::Invalid("id already bound"));
        }
        if !address::is_local(addr.ip()) {
            return Err(CmError::Os(libc::EADDRNOTAVAIL));
        }
        let sock = bind_socket(addr)?;
        let local = sock
            .local_addr()?
            .as_socket()
            .ok_or(CmError::Invalid("address family"))?;
        s.local = Some(local);
        s.socket = Some(sock);
        s.phase = Phase::Bound;
        Ok(local)
    }

    /// `rdma_resolve_addr`: picks the source address (routing table), binds to it, and
    /// raises ADDR_RESOLVED once the destination host answers — at once for this host's own
    /// addresses, else when a TCP connection attempt to it is answered at all (the ARP of the
    /// emulation) — or ADDR_ERROR when there is no route or `timeout` passes.
    pub fn resolve_addr(
        self: &Arc<Self>,
        src: Option<SocketAddr>,
        mut dst: SocketAddr,
        timeout: Duration,
    ) -> Result<(), CmError> {
        if dst.ip().is_unspecified() {
            dst.set_ip(match dst {
                SocketAddr::V4(_) => IpAddr::V4(Ipv4Addr::LOCALHOST),
                SocketAddr::V6(_) => IpAddr::V6(Ipv6Addr::LOCALHOST),
            });
        }
        let mut s = self.state();
        match s.phase {
            Phase::Idle | Phase::Bound => {}
            _ => return Err(CmError::Invalid("address already resolved")),
        }
        if s.phase == Phase::Idle {
            let src_ip = match src {
                Some(a) if !a.ip().is_unspecified() => a.ip(),
                _ => match address::route_source(dst.ip()) {
                    Ok(ip) => ip,
                    Err(e) => {
                        drop(s);
                        self.emit(
                            EventKind::AddrError,
                            -e.raw_os_error().unwrap_or(libc::ENETUNREACH),
                            EventParam::default(),
                        );
                        return Ok(());
                    }
                },
            };
            let port = src.map(|a| a.port()).unwrap_or(0);
            if !address::is_local(src_ip) {
                return Err(CmError::Os(libc::EADDRNOTAVAIL));
            }
            let sock = bind_socket(SocketAddr::new(src_ip, port))?;
            s.local = sock.local_addr()?.as_socket();
            s.socket = Some(sock);
        }
        s.remote = Some(dst);
        s.phase = Phase::ResolvingAddr;
        drop(s);
        if address::is_local(dst.ip()) {
            self.state().phase = Phase::AddrResolved;
            self.emit(EventKind::AddrResolved, 0, EventParam::default());
            return Ok(());
        }
        let id = Arc::clone(self);
        spawn("ugdr-cm-resolve", move || {
            let probe = SocketAddr::new(dst.ip(), crate::engine::address::query_port());
            let answer =
                match TcpStream::connect_timeout(&probe, timeout.max(Duration::from_millis(1))) {
                    Ok(_) => Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => Ok(()),
                    Err(e) if e.kind() == io::ErrorKind::TimedOut => Err(libc::ETIMEDOUT),
                    Err(e) => Err(e.raw_os_error().unwrap_or(libc::EHOSTUNREACH)),
                };
            let mut s = id.state();
            if s.phase != Phase::ResolvingAddr {
                return;
            }
            match answer {
                Ok(()) => {
                    s.phase = Phase::AddrResolved;
                    drop(s);
                    id.emit(EventKind::AddrResolved, 0, EventParam::default());
                }
                Err(errno) => {
                    tracing::debug!("cm: {dst} does not answer: errno {errno}");
                    s.phase = Phase::Bound;
                    s.remote = None;
                    drop(s);
                    id.emit(EventKind::AddrError, -errno, EventParam::default());
                }
            }
        })
    }

    /// `rdma_resolve_route`: the route to a resolved address is the address itself.
    pub fn resolve_route(self: &Arc<Self>) -> Result<(), CmError> {
        let mut s = self.state();
        if s.phase != Phase::AddrResolved {
            return Err(CmError::Invalid("address not resolved"));
        }
        s.phase = Phase::RouteResolved;
        drop(s);
        self.emit(EventKind::RouteResolved, 0, EventParam::default());
        Ok(())
    }

    /// `rdma_listen`. An unbound id listens on every address, on an ephemeral port.
    pub fn listen(self: &Arc<Self>, backlog: i32) -> Result<(), CmError> {
        let mut s = self.state();
        match s.phase {
            Phase::Idle => {
                let sock = bind_socket(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0))?;
                s.local = sock.local_addr()?.as_socket();
                s.socket = Some(sock);
            }
            Phase::Bound => {}
            Phase::Listening => return Ok(()),
            _ => return Err(CmError::Invalid("id is not bound")),
        }
        // ucma: a backlog of 0 or less (or too large) means the maximum, 1024.
        let backlog = if (1..=1024).contains(&backlog) {
            backlog as usize
        } else {
            1024
        };
        let sock = s.socket.take().ok_or(CmError::Invalid("id is not bound"))?;
        if let Err(e) = sock.listen(backlog as i32) {
            s.socket = Some(sock);
            return Err(e.into());
        }
        let listener = Arc::new(TcpListener::from(sock));
        s.listener = Some(Arc::clone(&listener));
        s.backlog = backlog;
        s.phase = Phase::Listening;
        drop(s);
        let id = Arc::clone(self);
        spawn("ugdr-cm-listen", move || serve_listener(id, listener))
    }

    fn request_taken(&self) {
        let mut s = self.state();
        s.pending_requests = s.pending_requests.saturating_sub(1);
    }

    /// `rdma_connect`: sends REQ with `local` (our port and QP) and `private_data`.
    pub fn connect(
        self: &Arc<Self>,
        mut local: Endpoint,
        private_data: Vec<u8>,
    ) -> Result<(), CmError> {
        if private_data.len() > self.request_private_len() {
            return Err(CmError::Invalid("private data longer than a REQ carries"));
        }
        let mut s = self.state();
        if s.phase != Phase::RouteResolved {
            return Err(CmError::Invalid("route not resolved"));
        }
        let sock = s.socket.take().ok_or(CmError::Invalid("id is not bound"))?;
        let remote = s.remote.ok_or(CmError::Invalid("no destination"))?;
        local.psn = s.local_psn;
        s.responder_resources = local.responder_resources;
        s.initiator_depth = local.initiator_depth;
        s.retry_count = local.retry_count;
        s.rnr_retry_count = local.rnr_retry_count;
        s.phase = Phase::Connecting;
        drop(s);
        let id = Arc::clone(self);
        let req = Message::Req {
            port_space: self.port_space.to_raw() as u16,
            endpoint: local,
            private_data,
        };
        spawn("ugdr-cm-conn", move || {
            let stream = match connect_patiently(sock, remote, &id) {
                Ok(stream) => stream,
                Err(e) => {
                    let mut s = id.state();
                    if s.phase != Phase::Connecting {
                        return;
                    }
                    drop(s.socket.take());
                    if e.kind() == io::ErrorKind::ConnectionRefused {
                        // Nobody listens on that port: the peer's CM rejects the REQ.
                        s.phase = Phase::Rejected;
                        drop(s);
                        id.emit(
                            EventKind::Rejected,
                            i32::from(REJ_INVALID_SERVICE_ID),
                            EventParam::default(),
                        );
                    } else {
                        s.phase = Phase::Failed;
                        drop(s);
                        let errno = if e.kind() == io::ErrorKind::TimedOut {
                            libc::ETIMEDOUT
                        } else {
                            e.raw_os_error().unwrap_or(libc::EHOSTUNREACH)
                        };
                        id.emit(EventKind::Unreachable, -errno, EventParam::default());
                    }
                    return;
                }
            };
            let _ = stream.set_nodelay(true);
            let link = Arc::new(stream);
            {
                let mut s = id.state();
                if id.is_destroyed() || s.phase != Phase::Connecting {
                    let _ = link.shutdown(Shutdown::Both);
                    return;
                }
                s.link = Some(Arc::clone(&link));
            }
            if let Err(e) = send(&link, &req) {
                tracing::debug!("cm: cannot send REQ: {e}");
            }
            serve_link(id, link);
        })
    }

    /// `rdma_accept` on a passive id: sends REP with `local` and `private_data`.
    pub fn accept(
        self: &Arc<Self>,
        mut local: Endpoint,
        private_data: &[u8],
    ) -> Result<(), CmError> {
        if private_data.len() > PRIVATE_DATA_ACCEPT {
            return Err(CmError::Invalid("private data longer than a REP carries"));
        }
        let mut s = self.state();
        if s.phase == Phase::Failed {
            // The requester went away before the answer: as a REP that is never answered.
            drop(s);
            self.emit(
                EventKind::Unreachable,
                -libc::ECONNRESET,
                EventParam::default(),
            );
            return Ok(());
        }
        if s.phase != Phase::RequestReceived {
            return Err(CmError::Invalid("no connection request to accept"));
        }
        local.psn = s.local_psn;
        s.responder_resources = local.responder_resources;
        s.initiator_depth = local.initiator_depth;
        let link = s.link.clone().ok_or(CmError::Invalid("no connection"))?;
        // A SIDR reply ends the exchange: the UD id is usable at once.
        s.phase = if self.is_ud() {
            Phase::Connected
        } else {
            Phase::ReplySent
        };
        drop(s);
        let rep = Message::Rep {
            endpoint: local,
            private_data: private_data.to_vec(),
        };
        if let Err(e) = send(&link, &rep) {
            tracing::debug!("cm: cannot send REP: {e}");
            let _ = link.shutdown(Shutdown::Both);
        }
        Ok(())
    }

    /// `rdma_reject`.
    pub fn reject(&self, private_data: &[u8], reason: u8) -> Result<(), CmError> {
        if private_data.len() > PRIVATE_DATA_REJECT {
            return Err(CmError::Invalid("private data longer than a REJ carries"));
        }
        let mut s = self.state();
        if s.phase != Phase::RequestReceived && s.phase != Phase::Failed {
            return Err(CmError::Invalid("no connection request to reject"));
        }
        s.phase = Phase::Rejected;
        if let Some(link) = s.link.take() {
            let rej = Message::Rej {
                reason,
                private_data: private_data.to_vec(),
            };
            let _ = send(&link, &rej);
            let _ = link.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    /// The active side is ready (its QP is RTS): sends RTU.
    pub fn establish(&self) -> Result<(), CmError> {
        let mut s = self.state();
        if s.phase != Phase::ReplyReceived {
            return Err(CmError::Invalid("no connection reply to establish"));
        }
        s.phase = Phase::Connected;
        if let Some(link) = &s.link {
            let _ = send(link, &Message::Rtu);
        }
        Ok(())
    }

    /// Gives up a connection whose reply could not be used (the QP did not reach RTS).
    pub fn abort(&self) {
        let mut s = self.state();
        s.phase = Phase::Failed;
        if let Some(link) = s.link.take() {
            let _ = link.shutdown(Shutdown::Both);
        }
    }

    /// `rdma_disconnect`: sends DREQ; DISCONNECTED follows when the peer answers (or goes).
    /// Disconnecting twice is harmless, as with the kernel CM.
    pub fn disconnect(self: &Arc<Self>) -> Result<(), CmError> {
        if self.is_ud() {
            return Err(CmError::Invalid("a UD id has no connection"));
        }
        let mut s = self.state();
        match s.phase {
            Phase::Connected | Phase::ReplyReceived | Phase::ReplySent => {}
            Phase::Disconnecting | Phase::Disconnected => return Ok(()),
            _ => return Err(CmError::Invalid("not connected")),
        }
        s.phase = Phase::Disconnecting;
        let link = s.link.clone();
        drop(s);
        let sent = link
            .as_ref()
            .is_some_and(|l| send(l, &Message::Dreq).is_ok());
        if !sent {
            self.finish_disconnect();
        }
        Ok(())
    }

    /// Enters Disconnected (once), flushing the QP and raising DISCONNECTED.
    fn finish_disconnect(self: &Arc<Self>) {
        let mut s = self.state();
        if s.phase == Phase::Disconnected {
            return;
        }
        s.phase = Phase::Disconnected;
        if let Some(link) = &s.link {
            let _ = link.shutdown(Shutdown::Write);
        }
        let qp = s.qp.clone();
        drop(s);
        if let Some(qp) = qp {
            flush(&qp);
        }
        self.emit(EventKind::Disconnected, 0, EventParam::default());
    }

    fn on_message(self: &Arc<Self>, msg: Message) {
        let phase = self.phase();
        match (msg, phase) {
            (
                Message::Rep {
                    endpoint,
                    private_data,
                },
                Phase::Connecting,
            ) => {
                if self.is_ud() {
                    let param =
                        EventParam::from_peer(&endpoint, &private_data, PRIVATE_DATA_SIDR_REP);
                    let mut s = self.state();
                    s.peer = Some(endpoint);
                    s.phase = Phase::Connected;
                    if let Some(link) = s.link.take() {
                        let _ = link.shutdown(Shutdown::Both);
                    }
                    drop(s);
                    self.emit(EventKind::Established, 0, param);
                    return;
                }
                let param = EventParam::from_peer(&endpoint, &private_data, PRIVATE_DATA_ACCEPT);
                let mut s = self.state();
                // The REP's depths are the passive side's: what it serves, we may initiate.
                s.responder_resources = endpoint.initiator_depth;
                s.initiator_depth = endpoint.responder_resources;
                s.rnr_retry_count = endpoint.rnr_retry_count;
                s.peer = Some(endpoint);
                s.phase = Phase::ReplyReceived;
                drop(s);
                self.emit(EventKind::ConnectResponse, 0, param);
            }
            (
                Message::Rej {
                    reason,
                    private_data,
                },
                Phase::Connecting,
            ) => {
                let mut s = self.state();
                s.phase = Phase::Rejected;
                if let Some(link) = s.link.take() {
                    let _ = link.shutdown(Shutdown::Write);
                }
                drop(s);
                let param = EventParam {
                    private_data: padded(&private_data, PRIVATE_DATA_REJECT),
                    ..EventParam::default()
                };
                self.emit(EventKind::Rejected, i32::from(reason), param);
            }
            (Message::Rtu, Phase::ReplySent) => {
                self.state().phase = Phase::Connected;
                self.emit(EventKind::Established, 0, EventParam::default());
            }
            (
                Message::Dreq,
                Phase::Connected
                | Phase::ReplyReceived
                | Phase::ReplySent
                | Phase::Disconnecting
                | Phase::Disconnected,
            ) => {
                if let Some(link) = self.state().link.clone() {
                    let _ = send(&link, &Message::Drep);
                }
                self.finish_disconnect();
            }
            (Message::Drep, Phase::Disconnecting) => self.finish_disconnect(),
            (msg, phase) => tracing::debug!("cm: ignoring {msg:?} in {phase:?}"),
        }
    }

    /// The CM connection closed (the peer shut it down or its process died).
    fn on_link_closed(self: &Arc<Self>) {
        let mut s = self.state();
        let phase = s.phase;
        s.link = None;
        if self.is_ud() && phase != Phase::Connecting {
            return;
        }
        match phase {
            Phase::Connecting | Phase::ReplySent => {
                s.phase = Phase::Failed;
                drop(s);
                self.emit(
                    EventKind::Unreachable,
                    -libc::ECONNRESET,
                    EventParam::default(),
                );
            }
            Phase::RequestReceived => s.phase = Phase::Failed,
            Phase::ReplyReceived | Phase::Connected | Phase::Disconnecting => {
                drop(s);
                self.finish_disconnect();
            }
            _ => {}
        }
    }

    /// `rdma_destroy_id`: closes the id's sockets (its threads end), drops its queued events.
    /// A request not yet answered is rejected; a connection is closed (the peer sees
    /// DISCONNECTED).
    pub fn destroy(&self) {
        if self.destroyed.swap(true, Ordering::AcqRel) {
            return;
        }
        let mut s = self.state();
        if s.phase == Phase::RequestReceived {
            if let Some(link) = &s.link {
                let _ = send(
                    link,
                    &Message::Rej {
                        reason: REJ_CONSUMER_DEFINED,
                        private_data: Vec::new(),
                    },
                );
            }
        }
        if let Some(link) = s.link.take() {
            let _ = link.shutdown(Shutdown::Both);
        }
        if let Some(listener) = s.listener.take() {
            // Wakes the accept thread (accept() fails with EINVAL on a shut-down listener).
            let _ = SockRef::from(&*listener).shutdown(Shutdown::Both);
        }
        s.socket = None;
        s.qp = None;
        s.listen_id = None;
        drop(s);
        let me: *const CmId = self;
        self.channel()
            .queue
            .discard(|e| std::ptr::eq(Arc::as_ptr(&e.id), me));
    }
}

/// Connects the CM connection. A refused connection (nobody listens on that port) is retried
/// for [`REFUSED_PATIENCE`] before it counts: ugdr resolves addresses and routes in
/// microseconds where a fabric takes milliseconds, and applications written against fabrics
/// connect right after their peer re-listens on the same port (perftest 4.5's `-R` client
/// does, between its control and its data connection).
fn connect_patiently(mut sock: Socket, remote: SocketAddr, id: &CmId) -> io::Result<TcpStream> {
    let deadline = std::time::Instant::now() + REFUSED_PATIENCE;
    loop {
        match sock.connect_timeout(&remote.into(), CONNECT_TIMEOUT) {
            Ok(()) => return Ok(TcpStream::from(sock)),
            Err(e)
                if e.kind() == io::ErrorKind::ConnectionRefused
                    && std::time::Instant::now() < deadline
                    && !id.is_destroyed() =>
            {
                std::thread::sleep(Duration::from_millis(10));
                // A socket whose connection was refused cannot connect again: a fresh one on
                // the same local address and port.
                let local = sock.local_addr()?.as_socket().ok_or(e)?;
                drop(sock);
                sock = bind_socket(local).map_err(|e| io::Error::from_raw_os_error(e.errno()))?;
            }
            Err(e) => return Err(e),
        }
    }
}

/// Accepts CM connections for a listening id until it is destroyed.
fn serve_listener(listen_id: Arc<CmId>, listener: Arc<TcpListener>) {
    loop {
        match listener.accept() {
            Ok((stream, _)) => {
                if listen_id.is_destroyed() {
                    return;
                }
                let id = Arc::clone(&listen_id);
                if let Err(e) = spawn("ugdr-cm-conn", move || serve_request(id, stream)) {
                    tracing::warn!("cm: cannot serve a connection request: {e}");
                }
            }
            Err(e) => {
                if listen_id.is_destroyed() {
                    return;
                }
                tracing::debug!("cm: accept: {e}");
                // Out of fds or similar: back off instead of spinning.
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// Reads a REQ on a fresh connection, raises CONNECT_REQUEST with a new id, then serves the
/// connection for that id.
fn serve_request(listen_id: Arc<CmId>, stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(REQ_TIMEOUT));
    let Ok(Message::Req {
        endpoint,
        private_data,
        ..
    }) = Message::read_from(&stream)
    else {
        return;
    };
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_nodelay(true);
    let (channel, full) = {
        let mut s = listen_id.state();
        if s.phase != Phase::Listening || listen_id.is_destroyed() {
            return;
        }
        let full = s.pending_requests >= s.backlog;
        if !full {
            s.pending_requests += 1;
        }
        (listen_id.channel(), full)
    };
    if full {
        let _ = send(
            &stream,
            &Message::Rej {
                reason: REJ_CONSUMER_DEFINED,
                private_data: Vec::new(),
            },
        );
        return;
    }
    // A synchronous listener's requests become synchronous ids, each with its own channel.
    let child_channel = if channel.is_sync() {
        match EventChannel::new(true) {
            Ok(c) => c,
            Err(_) => return,
        }
    } else {
        Arc::clone(&channel)
    };
    let child = CmId::new(child_channel, listen_id.port_space, listen_id.qp_type);
    let link = Arc::new(stream);
    {
        let mut s = child.state();
        s.phase = Phase::RequestReceived;
        s.local = link.local_addr().ok();
        s.remote = link.peer_addr().ok();
        s.link = Some(Arc::clone(&link));
        s.responder_resources = endpoint.initiator_depth;
        s.initiator_depth = endpoint.responder_resources;
        s.retry_count = endpoint.retry_count;
        s.rnr_retry_count = endpoint.rnr_retry_count;
        s.peer = Some(endpoint.clone());
        s.listen_id = Some(Arc::clone(&listen_id));
    }
    let param = EventParam::from_peer(&endpoint, &private_data, listen_id.request_private_len());
    channel.push(CmEvent {
        id: Arc::clone(&child),
        listen_id: Some(listen_id),
        kind: EventKind::ConnectRequest,
        status: 0,
        param,
    });
    serve_link(child, link);
}

/// Reads CM messages for `id` until the connection closes.
fn serve_link(id: Arc<CmId>, link: Arc<TcpStream>) {
    loop {
        match Message::read_from(&*link) {
            Ok(msg) => id.on_message(msg),
            Err(e) => {
                tracing::debug!("cm: connection closed: {e}");
                id.on_link_closed();
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoint(qpn: u32) -> Endpoint {
        Endpoint {
            lid: 1,
            gid: [0; 16],
            qpn,
            psn: 0,
            srq: false,
            responder_resources: 1,
            initiator_depth: 2,
            flow_control: 1,
            retry_count: 7,
            rnr_retry_count: 7,
        }
    }

    fn next(ch: &EventChannel) -> CmEvent {
        ch.next().expect("event")
    }

    #[test]
    fn connect_accept_disconnect_over_loopback() {
        let ch = EventChannel::new(false).unwrap();
        let listener = CmId::new(Arc::clone(&ch), PortSpace::Tcp, 2);
        let bound = listener.bind("127.0.0.1:0".parse().unwrap()).expect("bind");
        listener.listen(4).unwrap();

        let active = CmId::new(Arc::clone(&ch), PortSpace::Tcp, 2);
        active
            .resolve_addr(None, bound, Duration::from_secs(1))
            .unwrap();
        assert_eq!(next(&ch).kind, EventKind::AddrResolved);
        active.resolve_route().unwrap();
        assert_eq!(next(&ch).kind, EventKind::RouteResolved);
        active.connect(endpoint(0x11), b"hello".to_vec()).unwrap();

        let req = next(&ch);
        assert_eq!(req.kind, EventKind::ConnectRequest);
        assert_eq!(req.param.private_data.len(), 56);
        assert_eq!(&req.param.private_data[..5], b"hello");
        assert!(req.param.private_data[5..].iter().all(|&b| b == 0));
        assert_eq!(req.param.qp_num, 0x11);
        assert_eq!(
            (req.param.responder_resources, req.param.initiator_depth),
            (2, 1),
            "depths seen from the passive side"
        );
        let passive = Arc::clone(&req.id);
        assert_eq!(passive.remote_addr(), active.local_addr());
        passive.accept(endpoint(0x22), b"welcome").unwrap();

        let rep = next(&ch);
        assert_eq!(rep.kind, EventKind::ConnectResponse);
        assert_eq!(rep.param.private_data.len(), 196);
        assert_eq!(&rep.param.private_data[..7], b"welcome");
        assert_eq!(rep.param.qp_num, 0x22);
        active.establish().unwrap();
        let est = next(&ch);
        assert_eq!(est.kind, EventKind::Established);
        assert!(Arc::ptr_eq(&est.id, &passive));

        active.disconnect().unwrap();
        let mut got = [next(&ch), next(&ch)];
        got.sort_by_key(|e| Arc::ptr_eq(&e.id, &active));
        assert!(got.iter().all(|e| e.kind == EventKind::Disconnected));
        assert!(Arc::ptr_eq(&got[0].id, &passive) && Arc::ptr_eq(&got[1].id, &active));
        passive.disconnect().unwrap();
        assert_eq!(passive.phase(), Phase::Disconnected);
        for id in [&active, &passive, &listener] {
            id.destroy();
        }
    }

    #[test]
    fn a_port_nobody_listens_on_is_rejected_and_a_reject_carries_private_data() {
        let ch = EventChannel::new(false).unwrap();
        // A port that was free a moment ago.
        let free = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let active = CmId::new(Arc::clone(&ch), PortSpace::Tcp, 2);
        active
            .resolve_addr(None, free, Duration::from_secs(1))
            .unwrap();
        assert_eq!(next(&ch).kind, EventKind::AddrResolved);
        active.resolve_route().unwrap();
        next(&ch);
        active.connect(endpoint(1), Vec::new()).unwrap();
        let ev = next(&ch);
        assert_eq!(
            (ev.kind, ev.status),
            (EventKind::Rejected, i32::from(REJ_INVALID_SERVICE_ID))
        );

        let listener = CmId::new(Arc::clone(&ch), PortSpace::Tcp, 2);
        let bound = listener.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        listener.listen(0).unwrap();
        let active = CmId::new(Arc::clone(&ch), PortSpace::Tcp, 2);
        active
            .resolve_addr(None, bound, Duration::from_secs(1))
            .unwrap();
        next(&ch);
        active.resolve_route().unwrap();
        next(&ch);
        assert_eq!(
            active.connect(endpoint(1), vec![0; 57]),
            Err(CmError::Invalid("private data longer than a REQ carries"))
        );
        active.connect(endpoint(1), Vec::new()).unwrap();
        let req = next(&ch);
        req.id.reject(b"go away", REJ_CONSUMER_DEFINED).unwrap();
        let ev = next(&ch);
        assert_eq!((ev.kind, ev.status), (EventKind::Rejected, 28));
        assert_eq!(ev.param.private_data.len(), 148);
        assert_eq!(&ev.param.private_data[..7], b"go away");
    }
}
