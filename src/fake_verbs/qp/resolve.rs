//! `ibv_modify_qp` as a whole: a move from INIT to RTR with an address vector first finds the
//! peer's worker (which may ask another host, so before the worker lock is taken) and its
//! endpoint, then the QP's state machine applies the modify. Shared by the C ABI's
//! `ibv_modify_qp` and by ugdr's own users of QPs (rsockets).

use super::super::VerbsError;
use super::super::qp_state::QpState;
use super::{ModifyRequest, QueuePair};
use crate::engine::Engine;
use std::sync::Arc;

impl QueuePair {
    /// Applies `req`, resolving the peer it names on the way to RTR. A peer that cannot be
    /// resolved leaves the QP without one (its sends then fail as to a vanished peer).
    pub fn modify_resolving(self: &Arc<Self>, req: &ModifyRequest) -> Result<QpState, VerbsError> {
        let engine = Engine::get()?;
        let to_rtr = req.state == Some(QpState::Rtr)
            && self.state() == QpState::Init
            && req.mask.contains(super::super::qp_state::AttrMask::AV);
        let remote = if to_rtr {
            let av = &req.attrs.ah;
            match engine.resolve(av.dlid, av.is_global.then_some(&av.grh.dgid)) {
                Ok(addr) => Some(addr),
                Err(e) => {
                    tracing::warn!(
                        "qp {:#x}: lid {:#06x} qpn {:#x}: {e}",
                        self.qp_num,
                        av.dlid,
                        req.attrs.dest_qp_num
                    );
                    None
                }
            }
        } else {
            None
        };
        let locked = engine.worker.lock();
        let peer = match remote {
            Some(target) => Some(engine.connect(&locked, &target, req.attrs.dest_qp_num)?),
            None => None,
        };
        self.modify(&locked, req, peer)
    }
}
