//! The application's side of the connection handshake (`rdma_connect`, `rdma_accept`,
//! `rdma_reject`, `rdma_establish`, `rdma_disconnect`, `rdma_notify`; the kernel's cma
//! connect/accept paths): checking and settling the connection parameters, sending REQ, REP,
//! RTU, REJ and DREQ, and the QP work librdmacm does on the application's thread around them.
//! What arrives from the peer is handled in [`super::link`].

use super::event::{ConnParam, EventKind};
use super::id::{CmId, Phase, PortSpace};
use super::link::{run_active_link, send_message};
use super::qp::{CONNECT_STATES, IdQp, move_to_error};
use super::sidr::PRIVATE_DATA_SIDR_REQ;
use super::wire::{Endpoint, Message};
use super::{CmError, spawn_cm_thread};
use crate::engine::Engine;
use std::net::Shutdown;
use std::sync::Arc;

/// Private data the IB CM carries: a REQ of an IP port space (its first 36 bytes hold the
/// CMA header), of RDMA_PS_IB, a REP, a REJ. Receivers always see the full field, zero-padded.
const PRIVATE_DATA_REQ_IP: usize = 56;
const PRIVATE_DATA_REQ_IB: usize = 92;
pub const PRIVATE_DATA_ACCEPT: usize = 196;
pub const PRIVATE_DATA_REJECT: usize = 148;

/// IB CM reject reasons.
pub const REJ_INVALID_SERVICE_ID: u8 = 8;
pub const REJ_CONSUMER_DEFINED: u8 = 28;
pub const REJ_VENDOR_OPTION_NOT_SUPPORTED: u8 = 35;

/// `RDMA_MAX_RESP_RES` / `RDMA_MAX_INIT_DEPTH`: "use the device maximum".
const DEPTH_MAX: u8 = 255;

/// The responder resources and initiator depth a side asks for: what `param` names, where
/// it names RDMA_MAX_* (or there is no `param`) the caps.
fn settle_depths(param: Option<&ConnParam>, caps: (u8, u8)) -> (u8, u8) {
    let depth = |requested: Option<u8>, cap: u8| match requested {
        Some(d) if d != DEPTH_MAX => d,
        _ => cap,
    };
    (
        depth(param.map(|p| p.responder_resources), caps.0),
        depth(param.map(|p| p.initiator_depth), caps.1),
    )
}

/// Our half of a connection: the port's LID and GID, and the QP (the id's, or the one the
/// application named in the parameters).
fn local_endpoint(
    param: Option<&ConnParam>,
    qp: Option<&dyn IdQp>,
    responder_resources: u8,
    initiator_depth: u8,
) -> Result<Endpoint, CmError> {
    let engine = Engine::get().map_err(crate::fake_verbs::VerbsError::from)?;
    let (qpn, srq) = match qp {
        Some(qp) => (qp.qp_num(), qp.has_srq()),
        None => param.map_or((0, false), |p| (p.qp_num, p.srq != 0)),
    };
    Ok(Endpoint {
        lid: engine.lid,
        gid: engine.gid,
        qpn,
        psn: 0,
        srq,
        responder_resources,
        initiator_depth,
        flow_control: param.map_or(0, |p| p.flow_control),
        retry_count: param.map_or(7, |p| p.retry_count.min(7)),
        rnr_retry_count: param.map_or(7, |p| p.rnr_retry_count.min(7)),
    })
}

impl CmId {
    /// The private data a connection request of this id carries (a SIDR REQ: 180 bytes).
    pub(super) fn request_private_len(&self) -> usize {
        if self.is_ud() {
            PRIVATE_DATA_SIDR_REQ
        } else if self.port_space == PortSpace::Ib {
            PRIVATE_DATA_REQ_IB
        } else {
            PRIVATE_DATA_REQ_IP
        }
    }

    /// librdmacm's ucma_valid_param: RDMA_PS_TCP needs a QP or parameters, and depths the
    /// device can serve (`max_rd_atom`).
    fn check_param(
        &self,
        param: Option<&ConnParam>,
        has_qp: bool,
        max_rd_atom: u8,
    ) -> Result<(), CmError> {
        if self.port_space != PortSpace::Tcp {
            return Ok(());
        }
        let Some(p) = param else {
            return if has_qp {
                Ok(())
            } else {
                Err(CmError::Invalid("neither a QP nor connection parameters"))
            };
        };
        let too_deep = |d: u8| d != DEPTH_MAX && d > max_rd_atom;
        if too_deep(p.responder_resources) || too_deep(p.initiator_depth) {
            return Err(CmError::Invalid("depth above the device maximum"));
        }
        Ok(())
    }

    /// `rdma_create_ep`'s `ai_connect`: private data that goes ahead of `rdma_connect`'s.
    pub fn set_connect_prefix(&self, prefix: Vec<u8>) {
        self.state().connect_prefix = prefix;
    }

    /// `rdma_connect` as the application calls it: checks `param`, settles the depths (capped
    /// by the device's `max_rd_atom`) and sends REQ for `qp` (or the QP `param` names).
    pub fn connect_with(
        self: &Arc<Self>,
        param: Option<&ConnParam>,
        qp: Option<&dyn IdQp>,
        max_rd_atom: u8,
    ) -> Result<(), CmError> {
        self.check_param(param, qp.is_some(), max_rd_atom)?;
        let (responder_resources, initiator_depth) =
            settle_depths(param, (max_rd_atom, max_rd_atom));
        let local = local_endpoint(param, qp, responder_resources, initiator_depth)?;
        let mut private = std::mem::take(&mut self.state().connect_prefix);
        if let Some(p) = param {
            private.extend_from_slice(&p.private_data);
        }
        self.connect(local, private)
    }

    /// Sends REQ with `local` (our port and QP) and `private_data`.
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
        spawn_cm_thread("ugdr-cm-conn", move || {
            run_active_link(id, sock, remote, req)
        })
    }

    /// `rdma_accept` as the application calls it: checks `param`, settles the depths (what
    /// the requester asked for, capped by the device's `max_rd_atom`), moves a connected id's
    /// QP to RTS and sends REP. A REP that cannot be sent leaves the QP in ERR.
    pub fn accept_with(
        self: &Arc<Self>,
        param: Option<&ConnParam>,
        qp: Option<&dyn IdQp>,
        max_rd_atom: u8,
    ) -> Result<(), CmError> {
        self.check_param(param, qp.is_some(), max_rd_atom)?;
        let mut params = self.qp_params();
        (params.responder_resources, params.initiator_depth) = settle_depths(
            param,
            (
                params.responder_resources.min(max_rd_atom),
                params.initiator_depth.min(max_rd_atom),
            ),
        );
        if let Some(qp) = qp.filter(|_| !self.is_ud()) {
            params.drive(qp, &CONNECT_STATES)?;
        }
        let local = local_endpoint(
            param,
            qp,
            params.responder_resources,
            params.initiator_depth,
        )?;
        let private = param.map_or(&[][..], |p| &p.private_data);
        if let Err(e) = self.accept(local, private) {
            if let Some(qp) = qp {
                move_to_error(qp);
            }
            return Err(e);
        }
        Ok(())
    }

    /// Sends REP with `local` and `private_data` on a passive id.
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
                ConnParam::default(),
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
        if let Err(e) = send_message(&link, &rep) {
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
            let _ = send_message(&link, &rej);
            let _ = link.shutdown(Shutdown::Write);
        }
        Ok(())
    }

    /// What the application's thread does with an event before the application sees it, as
    /// librdmacm does: a reply to an id with a QP moves the QP to RTS and sends RTU, and the
    /// event becomes ESTABLISHED (CONNECT_ERROR, the errno as its status, when the QP cannot
    /// move); a reject moves the QP to ERR. Returns the kind and status to report.
    pub fn on_delivery(
        &self,
        kind: EventKind,
        status: i32,
        qp: Option<&dyn IdQp>,
    ) -> (EventKind, i32) {
        match (kind, qp) {
            (EventKind::ConnectResponse, Some(qp)) => {
                let used = self
                    .qp_params()
                    .drive(qp, &CONNECT_STATES)
                    .and_then(|()| self.establish());
                match used {
                    Ok(()) => (EventKind::Established, status),
                    Err(e) => {
                        tracing::debug!("rdma_cm: connection reply unusable: {e}");
                        self.abort();
                        move_to_error(qp);
                        (EventKind::ConnectError, -e.errno())
                    }
                }
            }
            (EventKind::Rejected, Some(qp)) => {
                move_to_error(qp);
                (kind, status)
            }
            _ => (kind, status),
        }
    }

    /// `rdma_establish`: an application that moves its own QP says it is RTS (an id with a QP
    /// of its own is established by the CM when the reply arrives).
    pub fn establish_own_qp(&self, qp: Option<&dyn IdQp>) -> Result<(), CmError> {
        if qp.is_some() {
            return Err(CmError::Invalid(
                "the CM establishes an id with a QP itself",
            ));
        }
        self.establish()
    }

    /// The active side is ready (its QP is RTS): sends RTU.
    pub fn establish(&self) -> Result<(), CmError> {
        let mut s = self.state();
        if s.phase != Phase::ReplyReceived {
            return Err(CmError::Invalid("no connection reply to establish"));
        }
        s.phase = Phase::Connected;
        if let Some(link) = &s.link {
            let _ = send_message(link, &Message::Rtu);
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

    /// `rdma_notify`: the application saw traffic on a QP it moves itself. ugdr's CM has no
    /// timer waiting for it; the id must be connected or about to be.
    pub fn notify(&self) -> Result<(), CmError> {
        match self.phase() {
            Phase::ReplySent | Phase::ReplyReceived | Phase::Connected => Ok(()),
            _ => Err(CmError::Invalid("not connected")),
        }
    }

    /// `rdma_disconnect` as the application calls it: the id's QP goes to ERR first (its
    /// work requests flush), then DREQ. Returns whether a DISCONNECTED event will follow
    /// (see [`CmId::disconnect`]).
    pub fn disconnect_with(self: &Arc<Self>, qp: Option<&dyn IdQp>) -> Result<bool, CmError> {
        if let Some(qp) = qp {
            move_to_error(qp);
        }
        self.disconnect()
    }

    /// Sends DREQ; DISCONNECTED follows when the peer answers (or goes). Returns whether a
    /// DISCONNECTED event will follow. As with the kernel CM, any id that started a
    /// connection exchange may disconnect: twice, after the peer did, after a reject or
    /// failure, or before the exchange finished (then nothing is sent, since the IB CM sends
    /// DREQ only when established, and no event follows; a REP arriving later finds the QP in
    /// ERR and ends in CONNECT_ERROR).
    pub fn disconnect(self: &Arc<Self>) -> Result<bool, CmError> {
        if self.is_ud() {
            return Err(CmError::Invalid("a UD id has no connection"));
        }
        let mut s = self.state();
        match s.phase {
            Phase::Connected | Phase::ReplyReceived | Phase::ReplySent => {}
            Phase::Disconnecting | Phase::Disconnected => return Ok(true),
            Phase::Connecting | Phase::RequestReceived | Phase::Rejected | Phase::Failed => {
                return Ok(false);
            }
            _ => return Err(CmError::Invalid("not connected")),
        }
        s.phase = Phase::Disconnecting;
        let link = s.link.clone();
        drop(s);
        let sent = link
            .as_ref()
            .is_some_and(|l| send_message(l, &Message::Dreq).is_ok());
        if !sent {
            self.finish_disconnect();
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::event::{CmEvent, EventChannel};
    use std::time::Duration;

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
