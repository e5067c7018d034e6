//! Listening ids (`rdma_listen`; the kernel's cma listen and the IB CM's REQ handler): the TCP
//! listener that holds the port, the per-listener thread that accepts CM connections, and the
//! per-request work that reads the REQ, applies the backlog and raises CONNECT_REQUEST with a
//! new id, whose connection the same thread then serves.

use super::connect::REJ_CONSUMER_DEFINED;
use super::event::{CmEvent, ConnParam, EventChannel, EventKind};
use super::id::{CmId, Phase, bind_socket};
use super::link::{send_message, serve_link};
use super::wire::Message;
use super::{CmError, spawn_cm_thread};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// How long a passive side waits for the REQ on a fresh connection.
const REQ_TIMEOUT: Duration = Duration::from_secs(10);

/// At most this many of a listener's connections wait for their REQ at once: each holds a
/// thread and a descriptor of the application's process until its REQ comes (or
/// [`REQ_TIMEOUT`]), so connections that send nothing must not take them all. Beyond it a new
/// connection is closed at once, as a full SYN queue drops a connection attempt. A real
/// requester sends its REQ as soon as it is connected, but a burst of them (cmtime connects
/// 100 at once) can be accepted faster than their threads read, on a loaded host: room for
/// such a burst.
const MAX_AWAITING_REQ: usize = 128;

impl CmId {
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
        spawn_cm_thread("ugdr-cm-listen", move || serve_listener(id, listener))
    }

    /// The application took one of this listener's requests off its channel.
    pub(super) fn request_taken(&self) {
        let mut s = self.state();
        s.pending_requests = s.pending_requests.saturating_sub(1);
    }
}

/// Accepts CM connections for a listening id until it is destroyed.
fn serve_listener(listen_id: Arc<CmId>, listener: Arc<TcpListener>) {
    let awaiting = Arc::new(AtomicUsize::new(0));
    loop {
        match listener.accept() {
            Ok((stream, from)) => {
                if listen_id.is_destroyed() {
                    return;
                }
                if awaiting.load(Ordering::Acquire) >= MAX_AWAITING_REQ {
                    tracing::debug!(
                        "cm: {MAX_AWAITING_REQ} connections wait for their REQ already: \
                         closing the one from {from}"
                    );
                    continue;
                }
                awaiting.fetch_add(1, Ordering::AcqRel);
                let turn = AwaitingReq(Arc::clone(&awaiting));
                let id = Arc::clone(&listen_id);
                if let Err(e) =
                    spawn_cm_thread("ugdr-cm-conn", move || serve_request(id, stream, turn))
                {
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

/// One of a listener's connections waiting for its REQ (see [`MAX_AWAITING_REQ`]); counted
/// out when dropped.
struct AwaitingReq(Arc<AtomicUsize>);

impl Drop for AwaitingReq {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Reads a REQ on a fresh connection, raises CONNECT_REQUEST with a new id, then serves the
/// connection for that id.
fn serve_request(listen_id: Arc<CmId>, stream: TcpStream, turn: AwaitingReq) {
    let _ = stream.set_read_timeout(Some(REQ_TIMEOUT));
    let Ok(Message::Req {
        endpoint,
        private_data,
        ..
    }) = Message::read_from(&stream)
    else {
        drop(stream); // closed before its turn goes back
        return;
    };
    drop(turn);
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_nodelay(true);
    let full = {
        let mut s = listen_id.state();
        if s.phase != Phase::Listening || listen_id.is_destroyed() {
            return;
        }
        let full = s.pending_requests >= s.backlog;
        if !full {
            s.pending_requests += 1;
        }
        full
    };
    if full {
        let _ = send_message(
            &stream,
            &Message::Rej {
                reason: REJ_CONSUMER_DEFINED,
                private_data: Vec::new(),
            },
        );
        return;
    }
    // The listener's channel stays put until the request is queued on it (an
    // `rdma_migrate_id` of the listener moves both).
    let channel = listen_id.channel.lock().unwrap_or_else(|p| p.into_inner());
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
    let param = ConnParam::from_peer(&endpoint, &private_data, listen_id.request_private_len());
    channel.push(CmEvent {
        id: Arc::clone(&child),
        listen_id: Some(Arc::clone(&listen_id)),
        kind: EventKind::ConnectRequest,
        status: 0,
        param,
    });
    drop(channel);
    serve_link(child, link);
}
