//! A UD QP's part in multicast (IBA 10.5.2.2, `ibv_attach_mcast(3)`): attaching to and
//! detaching from groups, a SEND through an address handle to a group, and a group's
//! datagram arriving. The engine keeps the membership and carries the datagrams
//! (`engine::multicast`).
//!
//! * Only UD QPs attach, to a multicast GID (first byte 0xFF) with a multicast LID
//!   (0xC000–0xFFFE), else EINVAL; attaching twice is one attachment (one copy per datagram);
//!   detaching a group the QP is not attached to is EINVAL; a process's QPs attach to at most
//!   `max_mcast_grp` groups, at most `max_mcast_qp_attach` QPs to one group (ENOMEM beyond).
//! * The QP's state does not matter to attaching; a datagram is taken only in RTR or later,
//!   with the QP's Q_Key, into a posted receive, as any datagram. Its completion has the
//!   sender's QPN and LID and `IBV_WC_GRH`, with a GRH whose destination is the MGID.

use super::QueuePair;
use super::queues::DataMessage;
use crate::engine::Engine;
use crate::engine::multicast::{AttachError, is_multicast_gid, is_multicast_lid};
use crate::engine::wire::Header;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::qp_state::{QpState, QpType};
use crate::ucp::{AmPayload, LockedWorker};
use std::sync::Arc;

impl QueuePair {
    /// `ibv_attach_mcast`.
    pub fn attach_multicast(&self, gid: &[u8; 16], lid: u16) -> Result<(), VerbsError> {
        self.check_group(gid, lid)?;
        let engine = Engine::get()?;
        engine
            .multicast_attach(gid, self.qp_num)
            .map_err(|e| match e {
                AttachError::TooManyGroups => VerbsError::NoResources("max_mcast_grp reached"),
                AttachError::TooManyQps => VerbsError::NoResources("max_mcast_qp_attach reached"),
            })
    }

    /// `ibv_detach_mcast`.
    pub fn detach_multicast(&self, gid: &[u8; 16], lid: u16) -> Result<(), VerbsError> {
        self.check_group(gid, lid)?;
        if Engine::get()?.multicast_detach(gid, self.qp_num) {
            Ok(())
        } else {
            Err(VerbsError::Invalid("the QP is not attached to this group"))
        }
    }

    /// Whether the QP is attached to some group (it cannot be destroyed then).
    pub fn in_multicast_groups(&self) -> bool {
        self.qp_type == QpType::Ud
            && Engine::running().is_some_and(|e| e.multicast_groups_of(self.qp_num) > 0)
    }

    fn check_group(&self, gid: &[u8; 16], lid: u16) -> Result<(), VerbsError> {
        if self.qp_type != QpType::Ud {
            return Err(VerbsError::Invalid(
                "only UD QPs attach to multicast groups",
            ));
        }
        if !is_multicast_gid(gid) {
            return Err(VerbsError::Invalid("not a multicast GID"));
        }
        if !is_multicast_lid(lid) {
            return Err(VerbsError::Invalid("not a multicast LID (0xC000-0xFFFE)"));
        }
        Ok(())
    }

    /// A SEND the requester built for an address handle to group `mgid`: the engine
    /// replicates it to the group's members; like any UD send, it completes once it left.
    pub(super) fn send_to_group(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        mgid: &[u8; 16],
        message: DataMessage,
    ) {
        let mut data = crate::ucp::OwnedBytes::new();
        message.payload.append_to(&mut data);
        if let Some(engine) = Engine::running() {
            engine.multicast_send(locked, mgid, &message.header, &data);
        }
        self.sent(locked, message.seq, false);
    }

    /// A datagram to group `mgid`, which this QP is attached to.
    pub(super) fn on_group_datagram(
        self: &Arc<Self>,
        locked: &LockedWorker<'_>,
        h: Header,
        mgid: &[u8; 16],
        payload: AmPayload<'_>,
    ) -> bool {
        self.locked_then_send(locked, |q| {
            if matches!(
                q.state,
                QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
            ) {
                self.on_datagram(q, h, payload, Some(mgid));
            }
        });
        false
    }
}
