//! SOCK_STREAM rsockets: a CM id (RDMA_PS_TCP) on an event channel of the socket's own, whose
//! fd names the socket; once connected, a [`Conn`] (RC QP and rings).
//!
//! Connecting runs through the id's events as any rdma_cm application does (address, route,
//! REQ with our [`Hello`], REP with the peer's, ESTABLISHED); listening takes each connection
//! request as it arrives, gives the new id a channel of its own and accepts it at once, so
//! `raccept` hands out sockets whose receives are posted. Nothing here blocks except
//! `rclose`/`rshutdown`, which wait (bounded, SO_LINGER) until what was sent has arrived.

use super::options::Options;
use super::transport::{
    Conn, Hello, MSG_DATA, MSG_FIN, MSG_IOMAP, MSG_IOUNMAP, QpRef, RemoteMap, SEG,
};
use super::{RsError, Wait};
use crate::cm::{CmEvent, CmId, ConnParam, EventChannel, EventKind, PortSpace};
use crate::fake_verbs::mr::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, MemoryRegion};
use crate::ucp::AppRegion;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long address resolution may take.
const RESOLVE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `rclose` waits for sends in flight without SO_LINGER.
const CLOSE_LINGER: Duration = Duration::from_secs(2);
/// How often a call waiting for the peer's credits looks at its credit word again (credits
/// arrive by RDMA WRITE, which raises no completion).
const CREDIT_POLL_MS: i32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Fresh,
    Bound,
    Listening,
    /// Active side: address, route, REQ sent.
    Connecting,
    /// Passive side: accepted, waiting for ESTABLISHED (receiving works already).
    Accepted,
    Connected,
    /// The connection attempt failed (its errno is in `so_error`).
    Failed,
}

/// A buffer this side mapped for the peer's `riowrite`.
struct LocalMap {
    map: RemoteMap,
    mr: Arc<MemoryRegion>,
}

struct State {
    id: Arc<CmId>,
    phase: Phase,
    opts: Options,
    nonblocking: bool,
    conn: Option<Conn>,
    so_error: i32,
    shut_rd: bool,
    shut_wr: bool,
    fin_sent: bool,
    /// The peer closed (DISCONNECTED): end of stream after the data, EPIPE on send.
    peer_gone: bool,
    /// Listening: accepted connections not yet taken by `raccept`, at most `backlog`.
    accepted: VecDeque<Arc<Stream>>,
    backlog: usize,
    local_maps: Vec<LocalMap>,
    /// Mappings (or their ends) the peer has not been told about yet.
    map_notices: VecDeque<(u32, RemoteMap)>,
}

pub struct Stream {
    channel: Arc<EventChannel>,
    st: Mutex<State>,
}

impl Stream {
    pub fn new(nonblocking: bool) -> Result<Arc<Stream>, RsError> {
        let channel = EventChannel::new(false)?;
        let id = CmId::create(
            Some(Arc::clone(&channel)),
            PortSpace::Tcp,
            PortSpace::Tcp.qp_type(),
        )?;
        Ok(Self::with(
            channel,
            id,
            Phase::Fresh,
            Options::default(),
            nonblocking,
        ))
    }

    fn with(
        channel: Arc<EventChannel>,
        id: Arc<CmId>,
        phase: Phase,
        opts: Options,
        nonblocking: bool,
    ) -> Arc<Stream> {
        Arc::new(Stream {
            channel,
            st: Mutex::new(State {
                id,
                phase,
                opts,
                nonblocking,
                conn: None,
                so_error: 0,
                shut_rd: false,
                shut_wr: false,
                fin_sent: false,
                peer_gone: false,
                accepted: VecDeque::new(),
                backlog: 0,
                local_maps: Vec::new(),
                map_notices: VecDeque::new(),
            }),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.channel.fd()
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

    pub fn bind(&self, addr: SocketAddr) -> Result<(), RsError> {
        let mut st = self.state();
        if st.phase != Phase::Fresh {
            return Err(RsError::Os(libc::EINVAL));
        }
        st.id.bind(addr)?;
        st.phase = Phase::Bound;
        Ok(())
    }

    pub fn listen(&self, backlog: i32) -> Result<(), RsError> {
        let mut st = self.state();
        match st.phase {
            Phase::Fresh | Phase::Bound | Phase::Listening => {}
            _ => return Err(RsError::Os(libc::EINVAL)),
        }
        st.id.listen(backlog)?;
        // As listen(2): a backlog below 1 means 1, and SOMAXCONN at most.
        st.backlog = backlog.clamp(1, libc::SOMAXCONN) as usize;
        st.phase = Phase::Listening;
        Ok(())
    }

    pub fn local_addr(&self) -> Result<SocketAddr, RsError> {
        let st = self.state();
        Ok(st.id.local_addr().unwrap_or_else(|| {
            SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 0)
        }))
    }

    pub fn peer_addr(&self) -> Result<SocketAddr, RsError> {
        let st = self.state();
        match st.phase {
            Phase::Connected | Phase::Accepted => st.id.remote_addr(),
            _ => None,
        }
        .ok_or(RsError::Os(libc::ENOTCONN))
    }

    /// What to wait on for this socket: its CM events and, once connected, its completions;
    /// `sending`: the caller waits for room to send, which the peer's credits give too, and
    /// those arrive by RDMA WRITE, raising no completion: the credit word is looked at
    /// again every [`CREDIT_POLL_MS`], and a wait decided after credits arrived (since the
    /// caller found no room) does not wait at all.
    fn wait(&self, st: &State, sending: bool) -> Wait {
        match &st.conn {
            Some(c) => {
                let timeout = if c.arm() {
                    0
                } else if sending && st.phase == Phase::Connected && c.has_free_slot() {
                    if c.can_send() { 0 } else { CREDIT_POLL_MS }
                } else {
                    -1
                };
                Wait::on(&[self.fd(), c.wait_fd()], timeout)
            }
            None => Wait::on(&[self.fd()], -1),
        }
    }

    fn would_block(&self, st: &State) -> RsError {
        RsError::Wait(self.wait(st, false))
    }

    /// Takes the CM events and completions that arrived.
    fn progress(&self, st: &mut State) {
        while let Ok(Some(ev)) = self.channel.try_next() {
            self.on_event(st, ev);
        }
        let spinning = st.nonblocking;
        if let Some(c) = st.conn.as_mut() {
            c.progress(spinning);
        }
        flush_map_notices(st);
    }

    fn fail(st: &mut State, errno: i32) {
        st.phase = Phase::Failed;
        st.so_error = errno;
    }

    fn on_event(&self, st: &mut State, ev: CmEvent) {
        tracing::debug!("rsocket {}: {:?} status {}", self.fd(), ev.kind, ev.status);
        let errno_of = |status: i32, default: i32| if status != 0 { status.abs() } else { default };
        match ev.kind {
            EventKind::ConnectRequest => self.on_request(st, ev),
            EventKind::AddrResolved => {
                if let Err(e) = st.id.resolve_route() {
                    Self::fail(st, e.errno());
                }
            }
            EventKind::RouteResolved => {
                if let Err(e) = connect_route(st) {
                    Self::fail(st, e.errno());
                }
            }
            EventKind::ConnectResponse => {
                let peer = Hello::decode(&ev.param.private_data);
                let Some(conn) = st.conn.as_mut() else { return };
                conn.peer = peer;
                let (kind, status) = if peer.is_some() {
                    st.id
                        .on_delivery(ev.kind, ev.status, Some(&QpRef(&conn.qp)))
                } else {
                    // Not a ugdr rsocket (or another segment size): refuse it.
                    st.id.abort();
                    (EventKind::Rejected, 0)
                };
                if kind == EventKind::Established {
                    st.phase = Phase::Connected;
                } else {
                    Self::fail(st, errno_of(status, libc::ECONNREFUSED));
                }
            }
            EventKind::Established => {
                if st.phase == Phase::Accepted {
                    st.phase = Phase::Connected;
                }
            }
            EventKind::Rejected => Self::fail(st, libc::ECONNREFUSED),
            EventKind::AddrError | EventKind::RouteError => {
                Self::fail(st, errno_of(ev.status, libc::EHOSTUNREACH))
            }
            EventKind::Unreachable | EventKind::ConnectError => {
                Self::fail(st, errno_of(ev.status, libc::ETIMEDOUT))
            }
            EventKind::Disconnected => {
                st.peer_gone = true;
                if matches!(st.phase, Phase::Connecting | Phase::Accepted) {
                    Self::fail(st, libc::ECONNRESET);
                }
            }
            // A stream socket never joins a multicast group.
            EventKind::MulticastJoin | EventKind::MulticastError => {}
        }
    }

    /// A connection request to this listener: a new socket with a channel of its own,
    /// accepted at once (its receives posted before the REP goes).
    fn on_request(&self, st: &mut State, ev: CmEvent) {
        let id = ev.id;
        if st.accepted.len() >= st.backlog {
            // Each waiting connection holds its rings: a full backlog refuses, as a
            // listening socket's does.
            tracing::debug!(
                "rsocket: backlog of {} full, connection refused",
                st.backlog
            );
            let _ = id.reject(&[], crate::cm::REJ_CONSUMER_DEFINED);
            id.destroy();
            return;
        }
        let Some(peer) = Hello::decode(&ev.param.private_data) else {
            tracing::debug!("rsocket: a connection request that is no ugdr rsocket");
            let _ = id.reject(&[], crate::cm::REJ_CONSUMER_DEFINED);
            id.destroy();
            return;
        };
        let child = (|| -> Result<Arc<Stream>, RsError> {
            let channel = EventChannel::new(false)?;
            id.migrate(Arc::clone(&channel));
            let mut conn = Conn::new(&id, st.opts.rq(), st.opts.sq())?;
            conn.peer = Some(peer);
            id.attach_qp(Some(Arc::clone(&conn.qp)));
            id.accept_with(Some(&conn_param(conn.hello())), Some(&QpRef(&conn.qp)), 0)?;
            let child = Stream::with(
                channel,
                Arc::clone(&id),
                Phase::Accepted,
                st.opts.clone(),
                false,
            );
            child.state().conn = Some(conn);
            Ok(child)
        })();
        match child {
            Ok(c) => st.accepted.push_back(c),
            Err(e) => {
                tracing::debug!("rsocket: cannot accept a connection: {e:?}");
                let _ = id.reject(&[], crate::cm::REJ_CONSUMER_DEFINED);
                id.destroy();
            }
        }
    }

    /// `raccept`: a connection that arrived, or Wait.
    pub fn accept(&self) -> Result<Arc<Stream>, RsError> {
        let mut st = self.state();
        if st.phase != Phase::Listening {
            return Err(RsError::Os(libc::EINVAL));
        }
        self.progress(&mut st);
        let child = st.accepted.pop_front();
        match child {
            Some(c) => {
                super::adopt(Arc::clone(&c));
                Ok(c)
            }
            None => Err(self.would_block(&st)),
        }
    }

    /// `rconnect`: starts connecting (`first`), or looks whether the connection is up.
    /// Wait while it is under way; the result (0 or the errno) stays in SO_ERROR.
    pub fn connect(&self, addr: Option<SocketAddr>) -> Result<(), RsError> {
        let mut st = self.state();
        match (st.phase, addr) {
            (Phase::Fresh | Phase::Bound, Some(mut dst)) => {
                if let (SocketAddr::V6(_), Some(SocketAddr::V4(_))) = (dst, st.id.local_addr()) {
                    dst = SocketAddr::new(dst.ip().to_canonical(), dst.port());
                }
                let src = st.id.local_addr();
                st.id.resolve_addr(src, dst, RESOLVE_TIMEOUT)?;
                st.phase = Phase::Connecting;
            }
            (Phase::Fresh | Phase::Bound, None) => return Err(RsError::Os(libc::EINVAL)),
            (Phase::Connecting, Some(_)) if st.nonblocking => {
                return Err(RsError::Os(libc::EALREADY));
            }
            (Phase::Connected | Phase::Accepted, Some(_)) => {
                return Err(RsError::Os(libc::EISCONN));
            }
            (Phase::Listening, _) => return Err(RsError::Os(libc::EINVAL)),
            _ => {}
        }
        self.progress(&mut st);
        match st.phase {
            Phase::Connected => Ok(()),
            Phase::Failed => {
                let e = std::mem::take(&mut st.so_error);
                Err(RsError::Os(if e == 0 { libc::ECONNREFUSED } else { e }))
            }
            _ => Err(self.would_block(&st)),
        }
    }

    /// `rsend`: as much of `data` as the peer has room for now (at least one byte), or Wait.
    pub fn send(&self, data: &[u8]) -> Result<usize, RsError> {
        let mut st = self.state();
        self.progress(&mut st);
        match st.phase {
            Phase::Connected => {}
            Phase::Accepted | Phase::Connecting => return Err(self.would_block(&st)),
            _ => return Err(RsError::Os(libc::ENOTCONN)),
        }
        if st.shut_wr || st.peer_gone {
            return Err(RsError::Os(libc::EPIPE));
        }
        let conn = st.conn.as_mut().ok_or(RsError::Os(libc::ENOTCONN))?;
        if let Some(e) = conn.error {
            return Err(RsError::Os(e));
        }
        if data.is_empty() {
            return Ok(0);
        }
        let mut done = 0;
        while done < data.len() && conn.can_send() {
            done += conn.send(MSG_DATA, &data[done..])?;
        }
        if done > 0 {
            Ok(done)
        } else {
            Err(RsError::Wait(self.wait(&st, true)))
        }
    }

    /// `rrecv`: received bytes (0: end of stream), or Wait.
    pub fn recv(&self, buf: &mut [u8], peek: bool) -> Result<usize, RsError> {
        let mut st = self.state();
        self.progress(&mut st);
        match st.phase {
            Phase::Connected | Phase::Accepted => {}
            Phase::Connecting => return Err(self.would_block(&st)),
            _ => return Err(RsError::Os(libc::ENOTCONN)),
        }
        if st.shut_rd {
            return Ok(0);
        }
        let peer_gone = st.peer_gone;
        let conn = st.conn.as_mut().ok_or(RsError::Os(libc::ENOTCONN))?;
        if buf.is_empty() {
            return Ok(0);
        }
        if conn.readable() {
            return Ok(conn.read(buf, peek));
        }
        if conn.fin || peer_gone {
            return Ok(0);
        }
        if let Some(e) = conn.error {
            return Err(RsError::Os(if e == libc::EPIPE {
                libc::ECONNRESET
            } else {
                e
            }));
        }
        Err(self.would_block(&st))
    }

    /// `rpoll`'s view: the events ready now, and what to wait on.
    pub fn poll(&self, events: i16) -> (i16, Wait) {
        let mut st = self.state();
        self.progress(&mut st);
        let mut rev = 0;
        match st.phase {
            Phase::Listening => {
                if !st.accepted.is_empty() {
                    rev |= libc::POLLIN;
                }
            }
            Phase::Failed => rev |= libc::POLLOUT | libc::POLLERR | libc::POLLHUP,
            Phase::Fresh | Phase::Bound => rev |= libc::POLLOUT | libc::POLLHUP,
            Phase::Connecting => {}
            Phase::Connected | Phase::Accepted => {
                if let Some(c) = &st.conn {
                    if c.readable() || c.fin || st.peer_gone || st.shut_rd {
                        rev |= libc::POLLIN;
                    }
                    if st.phase == Phase::Connected
                        && (c.can_send() || st.shut_wr || st.peer_gone || c.error.is_some())
                    {
                        rev |= libc::POLLOUT;
                    }
                    // A connection the peer ended is hung up, not failed, whatever its
                    // last sends met (librdmacm: DISCONNECTED turns rs_error into
                    // rs_disconnected, which polls as POLLHUP alone). The hang-up shows
                    // once the bytes that came before it are read, as a stream socket's
                    // end does: librdmacm reports it at once, and rstream -T a, which
                    // polls before each read and fails on POLLHUP, then fails whenever
                    // its peer closes with bytes still unread.
                    if st.peer_gone && !c.readable() {
                        rev |= libc::POLLHUP;
                    } else if c.error.is_some() {
                        rev |= libc::POLLERR;
                    }
                }
            }
        }
        let rev = rev & (events | libc::POLLERR | libc::POLLHUP | libc::POLLNVAL);
        (rev, self.wait(&st, events & libc::POLLOUT != 0))
    }

    /// Waits (bounded) until the sends in flight completed and a FIN went, if asked.
    fn settle(&self, st: &mut MutexGuard<'_, State>, fin: bool, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            self.progress(st);
            let (gone, fin_sent) = (st.peer_gone, st.fin_sent);
            let Some(c) = st.conn.as_mut() else { return };
            if c.error.is_some() || gone {
                return;
            }
            if fin && !fin_sent && c.can_send() && c.send(MSG_FIN, &[]).is_ok() {
                st.fin_sent = true;
            }
            let c = st.conn.as_ref().expect("checked above");
            if (!fin || st.fin_sent) && !c.sending() || Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// `rshutdown`.
    pub fn shutdown(&self, how: i32) -> Result<(), RsError> {
        let mut st = self.state();
        if !matches!(st.phase, Phase::Connected | Phase::Accepted) {
            return Err(RsError::Os(libc::ENOTCONN));
        }
        match how {
            libc::SHUT_RD => st.shut_rd = true,
            libc::SHUT_WR | libc::SHUT_RDWR => {
                st.shut_rd |= how == libc::SHUT_RDWR;
                if !st.shut_wr {
                    st.shut_wr = true;
                    let linger = linger(&st.opts);
                    self.settle(&mut st, true, linger);
                }
            }
            _ => return Err(RsError::Os(libc::EINVAL)),
        }
        Ok(())
    }

    /// `rclose`: what was sent arrives first (bounded by SO_LINGER), then the connection and
    /// the socket go.
    pub fn close(&self) {
        let mut st = self.state();
        if st.conn.is_some() && matches!(st.phase, Phase::Connected | Phase::Accepted) {
            let linger = linger(&st.opts);
            let fin = !st.shut_wr;
            self.settle(&mut st, fin, linger);
        }
        for child in std::mem::take(&mut st.accepted) {
            child.close();
        }
        for m in std::mem::take(&mut st.local_maps) {
            // Only ugdr holds these keys: no memory window can be bound to the region.
            let _ = m.mr.deregister();
        }
        let id = Arc::clone(&st.id);
        if let Some(conn) = st.conn.take() {
            let _ = id.disconnect_with(Some(&QpRef(&conn.qp)));
            id.attach_qp(None);
            id.destroy();
            conn.destroy();
        } else {
            id.destroy();
        }
    }

    pub fn setsockopt(&self, level: i32, name: i32, value: &[u8]) -> Result<(), RsError> {
        self.state().opts.set(level, name, value)
    }

    pub fn getsockopt(&self, level: i32, name: i32) -> Result<Vec<u8>, RsError> {
        let mut st = self.state();
        if (level, name) == (libc::SOL_SOCKET, libc::SO_ERROR) {
            self.progress(&mut st);
            let e = std::mem::take(&mut st.so_error);
            return Ok(e.to_ne_bytes().to_vec());
        }
        st.opts.get(level, name)
    }

    /// `riomap`: maps `region` for the peer's `riowrite` at `offset` (-1: ugdr picks one),
    /// or only locally for PROT_NONE (nothing to do: ugdr copies). The offset.
    pub fn iomap(&self, region: AppRegion, prot: i32, offset: i64) -> Result<i64, RsError> {
        let mut st = self.state();
        if prot & libc::PROT_WRITE == 0 {
            return Ok(offset.max(0));
        }
        if st.local_maps.len() as u32 >= st.opts.iomapsize {
            return Err(RsError::Os(libc::ENOMEM));
        }
        let len = region.len();
        let offset = if offset == -1 {
            st.local_maps
                .iter()
                .map(|m| m.map.offset + m.map.len)
                .max()
                .unwrap_or(0)
        } else {
            u64::try_from(offset).map_err(|_| RsError::Os(libc::EINVAL))?
        };
        // The range must end within off_t, as the offsets riowrite takes.
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= i64::MAX as u64)
            .ok_or(RsError::Os(libc::EINVAL))?;
        if st
            .local_maps
            .iter()
            .any(|m| offset < m.map.offset + m.map.len && m.map.offset < end)
        {
            return Err(RsError::Os(libc::EINVAL));
        }
        let addr = region.addr();
        let pd = super::transport::pd()?;
        let mr =
            MemoryRegion::register(&pd, region, addr, ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE)?;
        let map = RemoteMap {
            offset,
            addr,
            len,
            rkey: mr.rkey(),
        };
        st.local_maps.push(LocalMap { map, mr });
        st.map_notices.push_back((MSG_IOMAP, map));
        flush_map_notices(&mut st);
        Ok(offset as i64)
    }

    /// `riounmap`.
    pub fn iounmap(&self, addr: u64, len: u64) -> Result<(), RsError> {
        let mut st = self.state();
        let i = st
            .local_maps
            .iter()
            .position(|m| m.map.addr == addr && m.map.len == len)
            .ok_or(RsError::Os(libc::EINVAL))?;
        let m = st.local_maps.remove(i);
        // Only ugdr holds these keys: no memory window can be bound to the region.
        let _ = m.mr.deregister();
        st.map_notices.push_back((MSG_IOUNMAP, m.map));
        flush_map_notices(&mut st);
        Ok(())
    }

    /// `riowrite`: RDMA WRITE into the peer's mapping at `offset` (up to its end); the bytes
    /// written, or Wait.
    pub fn iowrite(&self, data: &[u8], offset: u64) -> Result<usize, RsError> {
        let mut st = self.state();
        self.progress(&mut st);
        if st.phase != Phase::Connected {
            return Err(RsError::Os(libc::ENOTCONN));
        }
        if st.shut_wr || st.peer_gone {
            return Err(RsError::Os(libc::EPIPE));
        }
        let conn = st.conn.as_mut().ok_or(RsError::Os(libc::ENOTCONN))?;
        if let Some(e) = conn.error {
            return Err(RsError::Os(e));
        }
        let map = *conn
            .remote_maps
            .iter()
            .find(|m| offset >= m.offset && offset < m.offset + m.len)
            .ok_or(RsError::Os(libc::EINVAL))?;
        let room = (map.offset + map.len - offset).min(data.len() as u64) as usize;
        let mut done = 0;
        while done < room && conn.has_free_slot() {
            let at = map.addr + (offset - map.offset) + done as u64;
            done += conn.write(&data[done..room], at, map.rkey)?;
        }
        if done > 0 || data.is_empty() {
            Ok(done)
        } else {
            Err(self.would_block(&st))
        }
    }
}

/// Sends the mapping notices the peer is owed, in order, while it has room.
fn flush_map_notices(st: &mut State) {
    let Some(conn) = st.conn.as_mut() else { return };
    if st.phase != Phase::Connected {
        return;
    }
    while let Some((kind, map)) = st.map_notices.front().copied() {
        if !conn.can_send() || conn.send_map(kind, &map).is_err() {
            return;
        }
        st.map_notices.pop_front();
    }
}

fn linger(o: &Options) -> Duration {
    if o.linger.0 {
        Duration::from_secs(u64::from(o.linger.1))
    } else {
        CLOSE_LINGER
    }
}

/// The parameters of REQ and REP: our ring, in the private data.
fn conn_param(hello: Hello) -> ConnParam {
    ConnParam {
        private_data: hello.encode(),
        retry_count: 7,
        rnr_retry_count: 7,
        ..ConnParam::default()
    }
}

/// The route is resolved: the QP and rings, then REQ.
fn connect_route(st: &mut State) -> Result<(), RsError> {
    let conn = Conn::new(&st.id, st.opts.rq(), st.opts.sq())?;
    st.id.attach_qp(Some(Arc::clone(&conn.qp)));
    let param = conn_param(conn.hello());
    let r = st.id.connect_with(Some(&param), Some(&QpRef(&conn.qp)), 0);
    st.conn = Some(conn);
    r.map_err(RsError::from)
}

/// Checks that a stream segment fits the wire (compile time).
const _: () = assert!(SEG as usize <= 1 << 30);
