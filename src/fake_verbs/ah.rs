//! Address handles (`ibv_ah`): where a UD send goes. The destination port is resolved once,
//! when the handle is created (as a HCA builds its address vector); the UCX endpoint to it is
//! taken from the engine's per-process cache when a send needs it.

use super::VerbsError;
use super::device;
use super::pd::ProtectionDomain;
use super::qp::AddressVector;
use crate::engine::Engine;
use crate::engine::address::Resolved;
use crate::engine::multicast::is_multicast_gid;
use crate::ucp::{Endpoint, LockedWorker};
use std::sync::Arc;

pub struct AddressHandle {
    pub pd: Arc<ProtectionDomain>,
    pub av: AddressVector,
    /// The process behind `av`, or None when no port answers to it: sends through the
    /// handle then complete and go nowhere, as datagrams to an absent LID do. For a
    /// multicast group, this process (the engine replicates the datagram from here).
    target: Option<Resolved>,
    /// The MGID when `av` names a multicast group (its GRH's destination is one).
    group: Option<[u8; 16]>,
}

impl AddressHandle {
    /// Checks the address vector as `ibv_create_ah` does, then resolves it. Blocking (it may
    /// ask another host): call without the worker lock.
    pub fn new(
        engine: &Engine,
        pd: Arc<ProtectionDomain>,
        av: AddressVector,
    ) -> Result<Arc<AddressHandle>, VerbsError> {
        check(&av)?;
        let group = (av.is_global && is_multicast_gid(&av.grh.dgid)).then_some(av.grh.dgid);
        if let Some(mgid) = &group {
            // Members on other hosts are asked for now, not at the first send.
            engine.multicast_interest(mgid);
        }
        let (dlid, dgid) = match &group {
            Some(_) => (engine.lid, None),
            None => (av.dlid, av.is_global.then_some(&av.grh.dgid)),
        };
        let target = match engine.resolve(dlid, dgid) {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::debug!(
                    "ah to lid {:#06x}: {e}; its datagrams will be lost",
                    av.dlid
                );
                None
            }
        };
        pd.adopt_child();
        Ok(Arc::new(AddressHandle {
            pd,
            av,
            target,
            group,
        }))
    }

    /// The multicast group the handle names, if it names one.
    pub fn group(&self) -> Option<&[u8; 16]> {
        self.group.as_ref()
    }

    /// The endpoint to the destination's process (None: unreachable, the datagram is lost).
    pub fn endpoint(&self, locked: &LockedWorker<'_>) -> Option<Arc<Endpoint>> {
        let target = self.target.as_ref()?;
        let engine = Engine::running()?;
        match engine.connect(locked, target, 0) {
            Ok(peer) => Some(peer.endpoint),
            Err(e) => {
                tracing::debug!("ah to lid {:#06x}: cannot connect: {e}", self.av.dlid);
                None
            }
        }
    }

    /// `ibv_destroy_ah`.
    pub fn destroy(&self) {
        self.pd.release_child();
    }
}

/// `ibv_create_ah`'s checks: the port exists, a GRH names a GID this port has, and without a
/// GRH the LID is a unicast LID.
pub fn check(av: &AddressVector) -> Result<(), VerbsError> {
    if av.port_num != device::PORT_NUM {
        return Err(VerbsError::Invalid("ah_attr.port_num"));
    }
    if av.is_global && i32::from(av.grh.sgid_index) >= device::GID_TABLE_LEN {
        return Err(VerbsError::Invalid("ah_attr.grh.sgid_index"));
    }
    if !av.is_global && (av.dlid == 0 || av.dlid >= 0xc000) {
        return Err(VerbsError::Invalid(
            "ah_attr.dlid must be a unicast LID without a GRH",
        ));
    }
    if av.sl > 15 {
        return Err(VerbsError::Invalid("ah_attr.sl"));
    }
    Ok(())
}
