//! UD ids (`RDMA_PS_UDP`, `RDMA_PS_IPOIB`): their REQ/REP exchange is IB's service ID
//! resolution (SIDR) — one request, one reply, no connection kept and nothing to disconnect —
//! and the reply tells the requester the peer's address vector, QPN and Q_Key.

use super::event::{ConnParam, EventKind};
use super::id::{CmId, Phase};
use super::qp::address_peer;
use super::wire::Endpoint;
use crate::fake_verbs::qp::QpAttributes;
use crate::fake_verbs::qp_state::QpType;
use std::net::Shutdown;
use std::sync::Arc;

/// `RDMA_UDP_QKEY`: the Q_Key of every UD id.
pub const UDP_QKEY: u32 = 0x0123_4567;
/// Private data a SIDR REQ and a SIDR REP carry.
pub(super) const PRIVATE_DATA_SIDR_REQ: usize = 180;
const PRIVATE_DATA_SIDR_REP: usize = 136;

impl CmId {
    /// UD ids connect by service ID resolution (SIDR): one request, one reply, no
    /// connection to keep.
    pub fn is_ud(&self) -> bool {
        self.qp_type == QpType::Ud.to_raw()
    }

    /// Whether `rdma_accept` raises an event: a SIDR reply ends the exchange at once.
    pub fn accept_raises_event(&self) -> bool {
        !self.is_ud()
    }

    /// What a UD id's events report of the peer (`rdma_ud_param`): its address vector (zero
    /// while it is unknown) and the Q_Key.
    pub fn ud_peer_attributes(&self) -> QpAttributes {
        let mut attrs = QpAttributes {
            qkey: UDP_QKEY,
            ..QpAttributes::default()
        };
        if let Some(peer) = self.peer() {
            address_peer(&mut attrs, &peer);
        }
        attrs
    }

    /// A SIDR REP: the requester's id is usable at once, and the exchange's connection ends.
    pub(super) fn on_sidr_reply(self: &Arc<Self>, endpoint: Endpoint, private_data: &[u8]) {
        let param = ConnParam::from_peer(&endpoint, private_data, PRIVATE_DATA_SIDR_REP);
        let mut s = self.state();
        s.peer = Some(endpoint);
        s.phase = Phase::Connected;
        if let Some(link) = s.link.take() {
            let _ = link.shutdown(Shutdown::Both);
        }
        drop(s);
        self.emit(EventKind::Established, 0, param);
    }
}
