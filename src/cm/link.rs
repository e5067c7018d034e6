//! The CM connection to the peer id (the IB CM's message handling, the kernel's `cm.c`): the
//! active side's connection attempt, the per-connection thread that reads the connection, what
//! each arriving REP, RTU, REJ, DREQ and DREP — or the connection closing — does to the id, and
//! sending a message without raising SIGPIPE.

use super::connect::{PRIVATE_DATA_ACCEPT, PRIVATE_DATA_REJECT, REJ_INVALID_SERVICE_ID};
use super::event::{ConnParam, EventKind, padded};
use super::id::{CmId, Phase, bind_socket};
use super::qp::to_error;
use super::wire::Message;
use crate::engine::Engine;
use crate::fake_verbs::qp::QueuePair;
use socket2::{SockRef, Socket};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

/// How long an active side waits for the passive host to answer the connection (IB CM retries
/// a REQ for about this long before UNREACHABLE).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a connection to a port nobody listens on keeps being retried (see
/// `connect_patiently`).
const REFUSED_PATIENCE: Duration = Duration::from_millis(250);

/// Sends one CM message without ever raising SIGPIPE in the application.
pub(super) fn send_message(stream: &TcpStream, msg: &Message) -> io::Result<()> {
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

/// Moves `qp` to ERR, flushing its outstanding work requests (the peer is gone).
fn flush(qp: &Arc<QueuePair>) {
    let Ok(engine) = Engine::get() else { return };
    let locked = engine.worker.lock();
    if let Err(e) = qp.modify(&locked, &to_error(), None) {
        tracing::debug!("cm: cannot move qp {:#x} to ERR: {e}", qp.qp_num);
    }
}

/// The active side's connection thread: connects the CM connection from `sock` (the id's
/// bound socket) to `remote`, sends `req`, then serves the connection. A port nobody listens
/// on is REJECTED (IB's "invalid service ID"), a host that does not answer UNREACHABLE.
pub(super) fn run_active_link(id: Arc<CmId>, sock: Socket, remote: SocketAddr, req: Message) {
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
                    ConnParam::default(),
                );
            } else {
                s.phase = Phase::Failed;
                drop(s);
                let errno = if e.kind() == io::ErrorKind::TimedOut {
                    libc::ETIMEDOUT
                } else {
                    e.raw_os_error().unwrap_or(libc::EHOSTUNREACH)
                };
                id.emit(EventKind::Unreachable, -errno, ConnParam::default());
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
    if let Err(e) = send_message(&link, &req) {
        tracing::debug!("cm: cannot send REQ: {e}");
    }
    // The answer (REP or REJ) is awaited as long as a REQ is retried: a peer that accepted
    // the connection but never answers (a process that stopped, a service on that port that
    // is not a CM) leaves the id UNREACHABLE, not waiting for good.
    let _ = link.set_read_timeout(Some(CONNECT_TIMEOUT));
    serve_link(id, link);
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

/// The per-connection thread: reads CM messages for `id` until the connection closes. A read
/// timeout set on the connection (the active side's, for the answer to its REQ) holds only
/// while the id still waits for that answer.
pub(super) fn serve_link(id: Arc<CmId>, link: Arc<TcpStream>) {
    let mut timed = link.read_timeout().ok().flatten().is_some();
    loop {
        let read = Message::read_from(&*link);
        if timed && id.phase() != Phase::Connecting {
            timed = false;
            let _ = link.set_read_timeout(None);
        }
        match read {
            Ok(msg) => id.on_message(msg),
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                if id.phase() == Phase::Connecting {
                    tracing::debug!("cm: no answer to the REQ within {CONNECT_TIMEOUT:?}");
                    id.on_reply_timeout();
                    let _ = link.shutdown(Shutdown::Both);
                    return;
                }
            }
            Err(e) => {
                tracing::debug!("cm: connection closed: {e}");
                id.on_link_closed();
                return;
            }
        }
    }
}

impl CmId {
    /// Enters Disconnected (once), flushing the QP and raising DISCONNECTED.
    pub(super) fn finish_disconnect(self: &Arc<Self>) {
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
        self.emit(EventKind::Disconnected, 0, ConnParam::default());
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
                    self.on_sidr_reply(endpoint, &private_data);
                    return;
                }
                let param = ConnParam::from_peer(&endpoint, &private_data, PRIVATE_DATA_ACCEPT);
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
                let param = ConnParam {
                    private_data: padded(&private_data, PRIVATE_DATA_REJECT),
                    ..ConnParam::default()
                };
                self.emit(EventKind::Rejected, i32::from(reason), param);
            }
            (Message::Rtu, Phase::ReplySent) => {
                self.state().phase = Phase::Connected;
                self.emit(EventKind::Established, 0, ConnParam::default());
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
                    let _ = send_message(&link, &Message::Drep);
                }
                self.finish_disconnect();
            }
            (Message::Drep, Phase::Disconnecting) => self.finish_disconnect(),
            (msg, phase) => tracing::debug!("cm: ignoring {msg:?} in {phase:?}"),
        }
    }

    /// The QP's transport timer gave up on the peer (it stopped answering: a cut link, a
    /// host gone): the connection is closed as if the peer had closed it, so this side (and
    /// the peer, if it still hears) gets DISCONNECTED. Runs in the progress thread, under the
    /// worker lock: it only shuts the socket down, and the link's thread does the rest.
    pub(super) fn transport_failed(&self) {
        let s = self.state();
        if let (Some(link), Phase::Connected | Phase::ReplyReceived | Phase::ReplySent) =
            (&s.link, s.phase)
        {
            tracing::debug!("cm: the QP's peer stopped answering: disconnecting");
            let _ = link.shutdown(Shutdown::Both);
        }
    }

    /// No answer to the REQ in time: UNREACHABLE with ETIMEDOUT, as when the IB CM's REQ
    /// retries run out.
    fn on_reply_timeout(self: &Arc<Self>) {
        let mut s = self.state();
        if s.phase != Phase::Connecting {
            return;
        }
        s.phase = Phase::Failed;
        s.link = None;
        drop(s);
        self.emit(
            EventKind::Unreachable,
            -libc::ETIMEDOUT,
            ConnParam::default(),
        );
    }

    /// The CM connection closed (the peer shut it down or its process died).
    fn on_link_closed(self: &Arc<Self>) {
        let mut s = self.state();
        let phase = s.phase;
        s.link = None;
        // A SIDR exchange keeps no connection: only a REQ still unanswered notices its end.
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
                    ConnParam::default(),
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
}
