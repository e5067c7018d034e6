//! Multicast on UD ids (`rdma_join_multicast`, `rdma_join_multicast_ex`,
//! `rdma_leave_multicast`; the kernel's cma.c join and librdmacm's `ucma_process_join`).
//!
//! * An id joins a group named by an IP address once its address is bound or resolved, and
//!   only a UD id does (else EINVAL). The MGID is the one the kernel's CM makes for an IB
//!   port: an IPv4 group `a.b.c.d` becomes `ff12:401b:<P_Key>::<a&0x0f>.b.c.d` and an IPv6
//!   one `ff12:601b:<P_Key>:` + its last ten bytes, with 0x4001/0x6001 for RDMA_PS_UDP
//!   ids (rdma_cm's signature). The MLID is ugdr's choice, derived from the MGID
//!   (`engine::multicast::mlid_of`), the same on every host: what a subnet manager assigns.
//! * There is no subnet administrator to ask: the join asks who on other hosts is in the
//!   group (the engine's discovery) and then raises RDMA_CM_EVENT_MULTICAST_JOIN, whose UD
//!   parameters carry the group's address vector (MLID, GRH with the MGID), QPN 0xFFFFFF,
//!   the id's Q_Key, and the context given to the join as `private_data`.
//! * As librdmacm, the id's QP is attached when the application reads the event (not for a
//!   send-only full member); a failed attach turns the event into MULTICAST_ERROR with its
//!   errno. Leaving detaches it (EADDRNOTAVAIL for an address never joined); destroying the
//!   id leaves every group it joined.

use super::CmError;
use super::event::{ConnParam, EventKind};
use super::id::{CmId, HOP_LIMIT, Phase, PortSpace};
use super::sidr::UDP_QKEY;
use crate::engine::Engine;
use crate::engine::multicast::{MULTICAST_QPN, mlid_of};
use crate::fake_verbs::qp::QpAttributes;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// `RDMA_MC_JOIN_FLAG_FULLMEMBER`: sends and receives.
pub const JOIN_FULL_MEMBER: u32 = 0;
/// `RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER`: sends only (the QP is not attached).
pub const JOIN_SEND_ONLY_FULL_MEMBER: u32 = 1;

/// A group an id joined.
#[derive(Debug, Clone)]
pub(super) struct Join {
    addr: SocketAddr,
    group: Group,
    flags: u32,
    /// The id's QP is attached to the group.
    attached: bool,
}

/// What a MULTICAST_JOIN or MULTICAST_ERROR event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub mgid: [u8; 16],
    pub mlid: u16,
    /// The context the application gave the join (librdmacm hands it back as `private_data`).
    pub context: usize,
}

/// The MGID the kernel's CM makes for `addr` on an InfiniBand port with the default P_Key.
pub fn mgid_of(addr: &IpAddr, port_space: PortSpace) -> [u8; 16] {
    let (pkey_hi, pkey_lo) = (0xff, 0xff);
    let udp = port_space == PortSpace::Udp;
    let mut mgid = [0u8; 16];
    match addr {
        IpAddr::V4(v4) => {
            mgid[..6].copy_from_slice(&[0xff, 0x12, 0x40, 0x1b, pkey_hi, pkey_lo]);
            let o = v4.octets();
            mgid[12..].copy_from_slice(&[o[0] & 0x0f, o[1], o[2], o[3]]);
        }
        IpAddr::V6(v6) => {
            mgid[..6].copy_from_slice(&[0xff, 0x12, 0x60, 0x1b, pkey_hi, pkey_lo]);
            mgid[6..].copy_from_slice(&v6.octets()[6..]);
        }
    }
    if udp {
        mgid[3] = 0x01;
    }
    mgid
}

impl CmId {
    /// `rdma_join_multicast_ex`: raises MULTICAST_JOIN once the group's members on other
    /// hosts had a moment to answer.
    pub fn join_multicast(
        self: &Arc<Self>,
        addr: SocketAddr,
        flags: u32,
        context: usize,
    ) -> Result<(), CmError> {
        if flags > JOIN_SEND_ONLY_FULL_MEMBER {
            return Err(CmError::Invalid("join flags"));
        }
        if !self.is_ud() {
            return Err(CmError::Invalid("only UD ids join multicast groups"));
        }
        let mgid = mgid_of(&addr.ip(), self.port_space);
        let group = Group {
            mgid,
            mlid: mlid_of(&mgid),
            context,
        };
        {
            let mut s = self.state();
            if !matches!(s.phase, Phase::Bound | Phase::AddrResolved) {
                return Err(CmError::Invalid(
                    "the id's address is not bound or resolved",
                ));
            }
            s.joins.push(Join {
                addr,
                group,
                flags,
                attached: false,
            });
        }
        let engine = Engine::get().map_err(|_| CmError::NoDevice)?;
        let id = Arc::clone(self);
        super::spawn_cm_thread("ugdr-cm-join", move || {
            engine.multicast_interest(&mgid);
            id.emit(
                EventKind::MulticastJoin,
                0,
                ConnParam {
                    qp_num: MULTICAST_QPN,
                    group: Some(group),
                    ..ConnParam::default()
                },
            );
        })
    }

    /// What librdmacm does as the application reads a multicast event: attach the id's QP
    /// to the group (not for a send-only member); a failure makes it MULTICAST_ERROR.
    pub fn on_multicast_delivery(
        &self,
        kind: EventKind,
        status: i32,
        group: &Group,
    ) -> (EventKind, i32) {
        if kind != EventKind::MulticastJoin {
            return (kind, status);
        }
        let mut s = self.state();
        let qp = s.qp.clone();
        let Some(join) = s
            .joins
            .iter_mut()
            .find(|j| j.group == *group && !j.attached)
        else {
            return (kind, status); // left before the event was read
        };
        let Some(qp) = qp.filter(|_| join.flags != JOIN_SEND_ONLY_FULL_MEMBER) else {
            return (kind, status);
        };
        match qp.attach_multicast(&group.mgid, group.mlid) {
            Ok(()) => {
                join.attached = true;
                (kind, status)
            }
            Err(e) => (EventKind::MulticastError, -e.errno()),
        }
    }

    /// `rdma_leave_multicast`: the group joined with `addr`; its QP is detached.
    pub fn leave_multicast(&self, addr: SocketAddr) -> Result<(), CmError> {
        let (join, qp) = {
            let mut s = self.state();
            let i = s
                .joins
                .iter()
                .position(|j| j.addr == addr)
                .ok_or(CmError::Os(libc::EADDRNOTAVAIL))?;
            (s.joins.remove(i), s.qp.clone())
        };
        if join.attached
            && let Some(qp) = qp
        {
            let _ = qp.detach_multicast(&join.group.mgid, join.group.mlid);
        }
        Ok(())
    }

    /// Leaves every group (the id is being destroyed).
    pub(super) fn leave_all_groups(&self) {
        let addrs: Vec<SocketAddr> = self.state().joins.iter().map(|j| j.addr).collect();
        for addr in addrs {
            let _ = self.leave_multicast(addr);
        }
    }

    /// The UD parameters of a multicast event: the group's address vector and the Q_Key.
    pub fn group_attributes(&self, group: &Group) -> QpAttributes {
        let mut attrs = QpAttributes {
            qkey: UDP_QKEY,
            ..QpAttributes::default()
        };
        attrs.ah.grh.dgid = group.mgid;
        attrs.ah.grh.hop_limit = HOP_LIMIT;
        attrs.ah.dlid = group.mlid;
        attrs.ah.is_global = true;
        attrs.ah.port_num = 1;
        attrs
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mgids_are_the_kernel_cms() {
        let v4: IpAddr = "239.1.1.1".parse().unwrap();
        let m = mgid_of(&v4, PortSpace::Udp);
        assert_eq!(
            m,
            [
                0xff, 0x12, 0x40, 0x01, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0x0f, 1, 1, 1
            ]
        );
        assert_eq!(mgid_of(&v4, PortSpace::Ipoib)[3], 0x1b);
        let v6: IpAddr = "ff0e::1234:5678".parse().unwrap();
        let m = mgid_of(&v6, PortSpace::Udp);
        assert_eq!(&m[..4], &[0xff, 0x12, 0x60, 0x01]);
        assert_eq!(&m[12..], &[0x12, 0x34, 0x56, 0x78]);
        assert!((0xc000..=0xfffe).contains(&mlid_of(&m)));
    }
}
