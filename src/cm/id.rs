//! Ids and addressing: what an `rdma_cm_id` is and the phase it is in, the TCP socket that
//! holds its address and port (`rdma_bind_addr`), address and route resolution
//! (`rdma_resolve_addr`, `rdma_resolve_route`: the kernel's `addr.c` and the resolving half of
//! `cma.c`), the route it reports, the channel its events go to (`rdma_create_id`,
//! `rdma_migrate_id`), and its end (`rdma_destroy_id`).

use super::connect::REJ_CONSUMER_DEFINED;
use super::event::{ConnParam, EventChannel, EventKind};
use super::link::send_message;
use super::wire::{Endpoint, Message};
use super::{CmError, address, spawn_cm_thread};
use crate::engine::Engine;
use crate::fake_verbs::qp::QueuePair;
use crate::fake_verbs::qp_state::QpType;
use socket2::{Domain, SockRef, Socket, Type};
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// The partition key of every path (the default partition, full membership).
pub const DEFAULT_PKEY: u16 = 0xffff;
/// The path MTU, as `enum ibv_mtu` numbers it (`IBV_MTU_4096`).
pub const PATH_MTU_4096: u32 = 5;
/// The hop limit of every route: the peer is one hop away, on this or another host.
pub const HOP_LIMIT: u8 = 1;
/// The packet lifetime a path record reports (4.096 µs · 2^14, about 67 ms).
pub const PACKET_LIFE_TIME: u8 = 14;

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

    /// The QP type (`enum ibv_qp_type`) of an id `rdma_create_id` makes in this port space:
    /// UD for the datagram spaces, RC for the others.
    pub fn qp_type(self) -> u32 {
        match self {
            PortSpace::Ipoib | PortSpace::Udp => QpType::Ud.to_raw(),
            PortSpace::Tcp | PortSpace::Ib => QpType::Rc.to_raw(),
        }
    }
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

/// What an id's `route` reports: both addresses, and the path between the two ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    pub src: Option<SocketAddr>,
    pub dst: Option<SocketAddr>,
    pub sgid: [u8; 16],
    /// The peer's GID once its REQ or REP named it; before, the GID its IPv4 address maps to.
    pub dgid: [u8; 16],
    pub slid: u16,
    pub dlid: u16,
}

/// An id's mutable state; the roles' files (`connect`, `link`, `listener`, …) read and write
/// it under [`CmId::state`].
pub(super) struct State {
    pub(super) phase: Phase,
    pub(super) local: Option<SocketAddr>,
    pub(super) remote: Option<SocketAddr>,
    /// Bound and not yet listening or connected (holds the port, as an RDMA CM bind does).
    pub(super) socket: Option<Socket>,
    pub(super) listener: Option<Arc<TcpListener>>,
    pub(super) backlog: usize,
    pub(super) pending_requests: usize,
    /// The CM connection to the peer id.
    pub(super) link: Option<Arc<TcpStream>>,
    pub(super) peer: Option<Endpoint>,
    pub(super) local_psn: u32,
    pub(super) responder_resources: u8,
    pub(super) initiator_depth: u8,
    pub(super) retry_count: u8,
    pub(super) rnr_retry_count: u8,
    /// `RDMA_OPTION_ID_ACK_TIMEOUT`: the local ACK timeout code for the QP's RTS.
    pub(super) ack_timeout: Option<u8>,
    pub(super) qp: Option<Arc<QueuePair>>,
    /// A passive id's listener (for its backlog).
    pub(super) listen_id: Option<Arc<CmId>>,
    /// `rdma_create_ep`'s `ai_connect`: sent ahead of `rdma_connect`'s private data.
    pub(super) connect_prefix: Vec<u8>,
    /// Multicast groups joined (`multicast.rs`).
    pub(super) joins: Vec<super::multicast::Join>,
}

/// An `rdma_cm_id`.
pub struct CmId {
    pub port_space: PortSpace,
    pub qp_type: u32,
    pub(super) channel: Mutex<Arc<EventChannel>>,
    state: Mutex<State>,
    shell: AtomicUsize,
    destroyed: AtomicBool,
    /// Events handed to the application and not yet acknowledged (librdmacm's
    /// events_reported − events_completed).
    pub(super) unacked: Mutex<usize>,
    pub(super) acked: Condvar,
}

/// A fresh 24-bit starting PSN.
fn random_psn() -> u32 {
    crate::engine::random_u32() & crate::engine::wire::PSN_MASK
}

/// A TCP socket bound to `addr`: what holds an id's address and port.
pub(super) fn bind_socket(addr: SocketAddr) -> Result<Socket, CmError> {
    let sock = crate::sys::socket::new_socket(Domain::for_address(addr), Type::STREAM)?;
    // Connections of an earlier run in TIME_WAIT must not keep the port (an RDMA CM port has
    // no TIME_WAIT); a second live listener still gets EADDRINUSE.
    sock.set_reuse_address(true)?;
    if addr.is_ipv6() {
        sock.set_only_v6(false)?;
    }
    sock.bind(&addr.into())?;
    Ok(sock)
}

/// The IPv4 address a GID is derived from (an IPv4-mapped IPv6 address counts as IPv4).
fn ipv4_of(addr: Option<SocketAddr>) -> Ipv4Addr {
    match addr.map(|a| a.ip()) {
        Some(IpAddr::V4(v4)) => v4,
        Some(IpAddr::V6(v6)) => v6.to_ipv4_mapped().unwrap_or(Ipv4Addr::LOCALHOST),
        None => Ipv4Addr::UNSPECIFIED,
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
                ack_timeout: None,
                qp: None,
                listen_id: None,
                connect_prefix: Vec::new(),
                joins: Vec::new(),
            }),
            shell: AtomicUsize::new(0),
            destroyed: AtomicBool::new(false),
            unacked: Mutex::new(0),
            acked: Condvar::new(),
        })
    }

    /// `rdma_create_id`: an id on `channel`, or, without one, a synchronous id with a channel
    /// of its own (its calls wait for their events).
    pub fn create(
        channel: Option<Arc<EventChannel>>,
        port_space: PortSpace,
        qp_type: u32,
    ) -> Result<Arc<CmId>, CmError> {
        let channel = match channel {
            Some(c) => c,
            None => EventChannel::new(true)?,
        };
        Ok(CmId::new(channel, port_space, qp_type))
    }

    pub(super) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn channel(&self) -> Arc<EventChannel> {
        Arc::clone(&self.channel.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// The channel `rdma_migrate_id` moves this id to: `requested`, or for none a synchronous
    /// channel of its own (an id that is synchronous already cannot be made so again).
    pub fn migration_target(
        &self,
        requested: Option<Arc<EventChannel>>,
    ) -> Result<Arc<EventChannel>, CmError> {
        match requested {
            Some(c) => Ok(c),
            None if self.channel().is_sync() => Err(CmError::Invalid("id is synchronous already")),
            None => EventChannel::new(true),
        }
    }

    /// `rdma_migrate_id`: the events queued for this id on its channel move to `channel`, in
    /// order, and later events go there (librdmacm's man page; the kernel's ucma moves them).
    /// A listener's queued connection requests move too, with the ids they created (their
    /// events come on the channel the request was reported on).
    pub fn migrate(&self, channel: Arc<EventChannel>) {
        let mut current = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if !Arc::ptr_eq(&current, &channel) {
            for event in current.take_events_of(self) {
                if event.listen_id.is_some() && !std::ptr::eq(Arc::as_ptr(&event.id), self) {
                    event.id.follow_to(&current, &channel);
                }
                channel.push(event);
            }
        }
        *current = channel;
    }

    /// A requested id not yet taken by the application whose listener migrated: it moves from
    /// `old` to `new` as well (unless it has a channel of its own, a synchronous one).
    fn follow_to(&self, old: &Arc<EventChannel>, new: &Arc<EventChannel>) {
        let mut mine = self.channel.lock().unwrap_or_else(|p| p.into_inner());
        if Arc::ptr_eq(&mine, old) {
            *mine = Arc::clone(new);
        }
    }

    /// The C object standing for this id (set by the C layer; 0 until then).
    pub fn shell(&self) -> usize {
        self.shell.load(Ordering::Acquire)
    }

    pub fn set_shell(&self, shell: usize) {
        self.shell.store(shell, Ordering::Release);
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

    /// The id's route as librdmacm reports it in `id->route`: this port's GID and LID (once
    /// the engine runs), the peer's once known.
    pub fn route(&self) -> Route {
        let (src, dst, peer) = {
            let s = self.state();
            (s.local, s.remote, s.peer.clone())
        };
        let engine = Engine::running();
        Route {
            src,
            dst,
            sgid: engine.map(|e| e.gid).unwrap_or_default(),
            dgid: match &peer {
                Some(p) => p.gid,
                None => crate::engine::address::port_gid(ipv4_of(dst), 0),
            },
            slid: engine.map(|e| e.lid).unwrap_or(0),
            dlid: peer.map(|p| p.lid).unwrap_or(0),
        }
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
                            ConnParam::default(),
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
        // A multicast group has no host to answer: it resolves to the source's port.
        if address::is_local(dst.ip()) || dst.ip().is_multicast() {
            self.state().phase = Phase::AddrResolved;
            self.emit(EventKind::AddrResolved, 0, ConnParam::default());
            return Ok(());
        }
        let id = Arc::clone(self);
        spawn_cm_thread("ugdr-cm-resolve", move || {
            let probe = SocketAddr::new(dst.ip(), crate::engine::address::query_port());
            let answer = match crate::sys::socket::connect_tcp(
                &probe,
                timeout.max(Duration::from_millis(1)),
            ) {
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
                    id.emit(EventKind::AddrResolved, 0, ConnParam::default());
                }
                Err(errno) => {
                    tracing::debug!("cm: {dst} does not answer: errno {errno}");
                    s.phase = Phase::Bound;
                    s.remote = None;
                    drop(s);
                    id.emit(EventKind::AddrError, -errno, ConnParam::default());
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
        self.emit(EventKind::RouteResolved, 0, ConnParam::default());
        Ok(())
    }

    /// The QP the CM moves to ERR when the connection goes away; when its transport timer
    /// gives up on the peer, the connection goes away (DISCONNECTED).
    pub fn attach_qp(self: &Arc<Self>, qp: Option<Arc<QueuePair>>) {
        if let Some(qp) = &qp {
            let id = Arc::downgrade(self);
            qp.on_transport_error(Some(Arc::new(move || {
                if let Some(id) = id.upgrade() {
                    id.transport_failed();
                }
            })));
        }
        let new = qp.as_ref().map(Arc::as_ptr);
        let old = std::mem::replace(&mut self.state().qp, qp);
        if let Some(old) = old.filter(|o| Some(Arc::as_ptr(o)) != new) {
            old.on_transport_error(None);
        }
    }

    /// `rdma_destroy_id`: closes the id's sockets (its threads end), drops its queued events.
    /// A request not yet answered is rejected; a connection is closed (the peer sees
    /// DISCONNECTED).
    pub fn destroy(&self) {
        if self.destroyed.swap(true, Ordering::AcqRel) {
            return;
        }
        self.leave_all_groups();
        let mut s = self.state();
        if s.phase == Phase::RequestReceived
            && let Some(link) = &s.link
        {
            let _ = send_message(
                link,
                &Message::Rej {
                    reason: REJ_CONSUMER_DEFINED,
                    private_data: Vec::new(),
                },
            );
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
        self.channel().discard_events_of(self);
    }
}
