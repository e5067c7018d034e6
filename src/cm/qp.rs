//! An id's QP as the CM drives it (the kernel's `rdma_init_qp_attr`, librdmacm's
//! `ucma_modify_qp_*`): the attributes each state gets from the connection, the states a QP
//! passes through when it is created, when the passive side accepts and when the active side
//! reads the reply, and ERR when the connection fails. The QP itself belongs to the C layer,
//! which moves it with `ibv_modify_qp` (as librdmacm does) behind [`IdQp`].

use super::CmError;
use super::id::{CmId, HOP_LIMIT, PATH_MTU_4096, PortSpace};
use super::sidr::UDP_QKEY;
use super::wire::Endpoint;
use crate::fake_verbs::mr::{ACCESS_REMOTE_ATOMIC, ACCESS_REMOTE_READ, ACCESS_REMOTE_WRITE};
use crate::fake_verbs::qp::{ModifyRequest, QpAttributes};
use crate::fake_verbs::qp_state::{AttrMask, QpState, QpType};

/// The local ACK timeout of a connected QP unless the application sets one
/// (`RDMA_OPTION_ID_ACK_TIMEOUT`): 4.096 µs · 2^18, about 1.07 s, what the kernel's CM computes
/// for a RoCE path (packet lifetime 16) to a HCA with an ACK delay of 16, as ConnectX reports.
/// ugdr's acknowledgements come from the peer's CPU, so a shorter one would fail connections
/// whose peer is merely descheduled for a few hundred milliseconds on a loaded host.
pub(super) const ACK_TIMEOUT: u8 = 18;
/// The RNR NAK timer a connected QP's responder asks for (IB code 12: 0.64 ms).
const MIN_RNR_TIMER: u8 = 12;
/// The states a connected QP passes through to carry traffic.
pub(super) const CONNECT_STATES: [QpState; 3] = [QpState::Init, QpState::Rtr, QpState::Rts];

/// The QP the application gave an id (`rdma_create_qp`), as the CM needs it.
pub trait IdQp {
    fn qp_num(&self) -> u32;
    /// Whether its receives come from a shared receive queue.
    fn has_srq(&self) -> bool;
    /// Applies one modify (with `ibv_modify_qp`).
    fn modify(&self, req: &ModifyRequest) -> Result<(), CmError>;
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
    /// The local ACK timeout code the QP gets in RTS.
    pub ack_timeout: u8,
}

/// How a QP addresses `peer`: by GID (the engine finds it on this or another host).
pub(super) fn address_peer(attrs: &mut QpAttributes, peer: &Endpoint) {
    attrs.ah.grh.dgid = peer.gid;
    attrs.ah.grh.hop_limit = HOP_LIMIT;
    attrs.ah.dlid = peer.lid;
    attrs.ah.is_global = true;
    attrs.ah.port_num = 1;
}

/// The modify that moves a QP to ERR (flushing its work requests).
pub(super) fn to_error() -> ModifyRequest {
    ModifyRequest {
        mask: AttrMask::STATE,
        state: Some(QpState::Err),
        claimed_cur: None,
        attrs: QpAttributes::default(),
    }
}

/// Moves `qp` to ERR; a QP that cannot move stays where it is.
pub(super) fn move_to_error(qp: &dyn IdQp) {
    let _ = qp.modify(&to_error());
}

impl QpParams {
    /// The attributes and mask that move a CM id's QP into `state` (`rdma_init_qp_attr`):
    /// INIT, RTR and RTS only, and the last two only once the peer is known (UD needs none).
    pub fn modify_request(&self, state: QpState) -> Result<ModifyRequest, CmError> {
        let mut a = QpAttributes::default();
        let ud = self.qp_type == QpType::Ud.to_raw();
        let mask = match state {
            QpState::Init => {
                a.pkey_index = 0;
                a.port_num = 1;
                if ud {
                    a.qkey = UDP_QKEY;
                    AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::QKEY
                } else {
                    // Before a connection exists the kernel grants nothing; once it does,
                    // remote writes, and reads and atomics when this side serves any.
                    a.access_flags = match &self.peer {
                        None => 0,
                        Some(_) if self.responder_resources > 0 => {
                            ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ | ACCESS_REMOTE_ATOMIC
                        }
                        Some(_) => ACCESS_REMOTE_WRITE,
                    };
                    AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::ACCESS_FLAGS
                }
            }
            QpState::Rtr if ud => AttrMask::STATE,
            QpState::Rtr => {
                let peer = self
                    .peer
                    .as_ref()
                    .ok_or(CmError::Invalid("no peer to connect the QP to"))?;
                address_peer(&mut a, peer);
                a.path_mtu = PATH_MTU_4096;
                a.dest_qp_num = peer.qpn;
                a.rq_psn = peer.psn;
                let connect = AttrMask::STATE
                    | AttrMask::AV
                    | AttrMask::PATH_MTU
                    | AttrMask::DEST_QPN
                    | AttrMask::RQ_PSN;
                if self.qp_type == QpType::XrcSend.to_raw() {
                    connect // an XRC initiator has no responder side (the kernel CM's masks)
                } else {
                    a.max_dest_rd_atomic = self.responder_resources;
                    a.min_rnr_timer = MIN_RNR_TIMER;
                    connect | AttrMask::MAX_DEST_RD_ATOMIC | AttrMask::MIN_RNR_TIMER
                }
            }
            QpState::Rts if ud => {
                a.sq_psn = 0;
                AttrMask::STATE | AttrMask::SQ_PSN
            }
            QpState::Rts => {
                if self.peer.is_none() {
                    return Err(CmError::Invalid("no peer to connect the QP to"));
                }
                a.timeout = self.ack_timeout;
                a.sq_psn = self.local_psn;
                if self.qp_type == QpType::XrcRecv.to_raw() {
                    // An XRC target sends nothing of its own (the kernel CM's masks).
                    return Ok(ModifyRequest {
                        mask: AttrMask::STATE | AttrMask::TIMEOUT | AttrMask::SQ_PSN,
                        state: Some(state),
                        claimed_cur: None,
                        attrs: a,
                    });
                }
                a.retry_cnt = self.retry_count.min(7);
                a.rnr_retry = self.rnr_retry_count.min(7);
                a.sq_psn = self.local_psn;
                a.max_rd_atomic = self.initiator_depth;
                AttrMask::STATE
                    | AttrMask::TIMEOUT
                    | AttrMask::RETRY_CNT
                    | AttrMask::RNR_RETRY
                    | AttrMask::SQ_PSN
                    | AttrMask::MAX_QP_RD_ATOMIC
            }
            _ => {
                return Err(CmError::Invalid(
                    "the CM moves a QP to INIT, RTR or RTS only",
                ));
            }
        };
        Ok(ModifyRequest {
            mask,
            state: Some(state),
            claimed_cur: None,
            attrs: a,
        })
    }

    /// Moves `qp` through `states` with these attributes (librdmacm's ucma_modify_qp_*).
    pub(super) fn drive(&self, qp: &dyn IdQp, states: &[QpState]) -> Result<(), CmError> {
        for &state in states {
            qp.modify(&self.modify_request(state)?)?;
        }
        Ok(())
    }
}

impl CmId {
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
            ack_timeout: s.ack_timeout.unwrap_or(ACK_TIMEOUT),
        }
    }

    /// `RDMA_OPTION_ID_ACK_TIMEOUT`: the local ACK timeout code (4.096 µs · 2^code) the id's
    /// QP gets when it moves to RTS from now on; connected (RC) ids only, as the kernel's.
    pub fn set_ack_timeout(&self, code: u8) -> Result<(), CmError> {
        if self.qp_type == QpType::Ud.to_raw() {
            return Err(CmError::Invalid("ACK timeout of a datagram id"));
        }
        self.state().ack_timeout = Some(code.min(31));
        Ok(())
    }

    /// `rdma_init_qp_attr`: the modify that moves this id's QP to `state` (None: a value
    /// `enum ibv_qp_state` does not have).
    pub fn init_qp_attr(&self, state: Option<QpState>) -> Result<ModifyRequest, CmError> {
        let state = state.ok_or(CmError::Invalid("qp_state"))?;
        self.qp_params().modify_request(state)
    }

    /// `rdma_create_qp`: a new QP goes to INIT, and a UD QP on to RTS (it needs no peer).
    pub fn ready_new_qp(&self, qp: &dyn IdQp) -> Result<(), CmError> {
        let states: &[QpState] = if self.is_ud() {
            &CONNECT_STATES
        } else {
            &CONNECT_STATES[..1]
        };
        self.qp_params().drive(qp, states)
    }
}
