//! The receive side of UC and UD queue pairs: nothing is acknowledged, nothing waits.
//!
//! * UC (IBA 9.7.7, 10.2.5): SEND(+imm) and RDMA WRITE(+imm) from the connected QP (its LID
//!   and QP number), in PSN order from `rq_psn`: a PSN behind the expected one is dropped, one
//!   ahead is taken and the sequence resumes after it (what was skipped is lost, as UC loses
//!   it). A message that finds no receive WR, or a WRITE its rkey does not allow, is dropped
//!   silently; the sender has already completed.
//! * UD (IBA 10.2.4, 11.4.1.1): datagrams from any QP, matched by destination QP number; a
//!   Q_Key other than the QP's is dropped silently, so is a datagram that finds no receive WR
//!   (UD has no RNR). Every receive starts with the 40-byte GRH area, counted in `byte_len`;
//!   when the sender's address handle had a GRH it is written there and the completion has
//!   IBV_WC_GRH.

use super::QueuePair;
use super::completer::from_peer;
use super::queues::{Body, Queues};
use crate::engine::wire::{self, Header, Op};
use crate::fake_verbs::device::GRH_LEN;
use crate::fake_verbs::mr;
use crate::fake_verbs::qp_state::{QpState, QpType};
use crate::fake_verbs::work::{UdDestination, WC_GRH};
use crate::ucp::{AmPayload, AppSpan, SpanList};
use smallvec::SmallVec;
use std::net::Ipv4Addr;
use std::sync::Arc;

/// A WR's `remote_qkey` with the high bit set means the sending QP's own Q_Key (IBA 10.2.4).
const QKEY_USE_QP_OWN: u32 = 0x8000_0000;

/// The header of a UD send (see `wire` for where the datagram fields ride).
pub(super) fn datagram_header(
    ud: &UdDestination,
    own_qkey: u32,
    qp_num: u32,
    local_lid: u16,
    seq: u32,
) -> Header {
    let mut h = Header::new(Op::Send, ud.remote_qpn, qp_num, local_lid, seq);
    h.flags |= wire::FLAG_DATAGRAM;
    h.rkey = if ud.remote_qkey & QKEY_USE_QP_OWN != 0 {
        own_qkey
    } else {
        ud.remote_qkey
    };
    let av = &ud.ah.av;
    h.sl = av.sl;
    if av.is_global {
        h.flags |= wire::FLAG_GRH;
        let ipv4 = u32::from(crate::engine::host_network().ipv4);
        h.remote_addr = u64::from(ipv4)
            | (u64::from(av.grh.flow_label & 0xf_ffff) << 32)
            | (u64::from(av.grh.traffic_class) << 56);
        h.status = av.grh.hop_limit;
    }
    h
}

/// The 40 bytes a GRH occupies (IBA 8.3), from a datagram's header: IP version 6, traffic
/// class, flow label, payload length (BTH + DETH + payload [+ immediate] + ICRC), next header
/// 0x1B (BTH), hop limit, source GID (the sender's port), destination GID (this port).
pub fn grh_bytes(h: &Header, payload_len: usize, dgid: &[u8; 16]) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    let flow_label = ((h.remote_addr >> 32) & 0xf_ffff) as u32;
    let traffic_class = (h.remote_addr >> 56) as u32;
    g[0..4].copy_from_slice(&((6u32 << 28) | (traffic_class << 20) | flow_label).to_be_bytes());
    let imm = if h.flags & wire::FLAG_IMM != 0 { 4 } else { 0 };
    let paylen = (12 + 8 + payload_len + imm + 4).min(usize::from(u16::MAX)) as u16;
    g[4..6].copy_from_slice(&paylen.to_be_bytes());
    g[6] = 0x1b;
    g[7] = h.status;
    let sender_ipv4 = Ipv4Addr::from(h.remote_addr as u32);
    g[8..24].copy_from_slice(&crate::engine::address::port_gid(sender_ipv4, h.src_lid));
    g[24..40].copy_from_slice(dgid);
    g
}

/// `spans` without their first `n` bytes, and those bytes.
fn split_front(spans: &[AppSpan], n: usize) -> (SpanList, SpanList) {
    let mut front = SmallVec::new();
    let mut rest = SmallVec::new();
    let mut left = n;
    for s in spans {
        if left == 0 {
            rest.push(*s);
            continue;
        }
        let (a, b) = s.split_at(left);
        left -= a.len();
        front.push(a);
        if !b.is_empty() {
            rest.push(b);
        }
    }
    (front, rest)
}

impl QueuePair {
    /// A message for a UC or UD QP.
    pub(super) fn on_unreliable_locked(
        self: &Arc<Self>,
        q: &mut Queues,
        h: Header,
        payload: AmPayload<'_>,
    ) {
        if !matches!(
            q.state,
            QpState::Rtr | QpState::Rts | QpState::Sqd | QpState::Sqe
        ) {
            tracing::trace!(
                "qp {:#x}: dropping {:?} in {:?}",
                self.qp_num,
                h.op,
                q.state
            );
            return;
        }
        match self.qp_type {
            QpType::Ud => self.on_datagram(q, h, payload, None),
            _ => self.on_uc_message(q, h, payload),
        }
    }

    fn next_receive_key(q: &mut Queues) -> u32 {
        let key = q.next_receive;
        q.next_receive = key.wrapping_add(1);
        key
    }

    /// A datagram for this QP, or (`group`) for a multicast group it is attached to: the GRH
    /// then names the group's MGID as its destination.
    pub(super) fn on_datagram(
        self: &Arc<Self>,
        q: &mut Queues,
        h: Header,
        payload: AmPayload<'_>,
        group: Option<&[u8; 16]>,
    ) {
        if h.op != Op::Send || h.flags & wire::FLAG_DATAGRAM == 0 {
            tracing::debug!("qp {:#x}: dropping a non-datagram {:?}", self.qp_num, h.op);
            return;
        }
        if h.rkey != q.attrs.qkey {
            tracing::debug!(
                "qp {:#x}: dropping a datagram from qp {:#x}: q_key {:#x}, expected {:#x}",
                self.qp_num,
                h.src_qpn,
                h.rkey,
                q.attrs.qkey
            );
            return;
        }
        let Some(wr) = self.take_receive(q) else {
            tracing::debug!(
                "qp {:#x}: dropping a datagram from qp {:#x}: no receive posted",
                self.qp_num,
                h.src_qpn
            );
            return;
        };
        let body = Body::Current(payload);
        let len = body.len();
        let Some(spans) = self.check_receive(q, &wr, &h, len, GRH_LEN) else {
            return;
        };
        let (grh_area, data) = split_front(&spans, GRH_LEN);
        let mut wc = self.recv_completion(&wr, &h, len);
        wc.byte_len = (len + GRH_LEN) as u32;
        wc.sl = h.sl;
        if h.flags & wire::FLAG_GRH != 0 {
            let dgid = group.copied().unwrap_or_else(|| {
                crate::engine::address::port_gid(crate::engine::host_network().ipv4, self.local_lid)
            });
            crate::ucp::scatter(&grh_area, &grh_bytes(&h, len, &dgid));
            wc.wc_flags |= WC_GRH;
        }
        let key = Self::next_receive_key(q);
        let solicited = h.flags & wire::FLAG_SOLICITED != 0;
        self.place(q, key, data, body, Some(wc), solicited);
    }

    fn on_uc_message(self: &Arc<Self>, q: &mut Queues, h: Header, payload: AmPayload<'_>) {
        if !from_peer(q, &h) || h.flags & wire::FLAG_UNRELIABLE == 0 {
            self.drop_request(q, &h, "not from the connected UC peer");
            return;
        }
        if wire::psn_before(h.seq, q.expected_seq) {
            self.drop_request(q, &h, "behind the expected PSN");
            return;
        }
        q.expected_seq = wire::psn_add(h.seq, 1);
        self.established(q);
        let body = Body::Current(payload);
        let len = body.len();
        let solicited = h.flags & wire::FLAG_SOLICITED != 0;
        let (spans, wc) = match h.op {
            Op::Send => {
                let Some(wr) = self.take_receive(q) else {
                    tracing::debug!("qp {:#x}: dropping a SEND: no receive posted", self.qp_num);
                    return;
                };
                let Some(spans) = self
                    .check_receive(q, &wr, &h, len, 0)
                    .filter(|_| self.invalidate_for_send(q, &wr, &h))
                else {
                    return;
                };
                (spans, Some(self.recv_completion(&wr, &h, len)))
            }
            Op::Write => {
                let Some(target) = self.check_remote(q, &h, len as u64, mr::ACCESS_REMOTE_WRITE)
                else {
                    return; // a UC responder drops what it may not write (no NAK exists)
                };
                let wc = if h.flags & wire::FLAG_IMM != 0 {
                    let Some(wr) = self.take_receive(q) else {
                        tracing::debug!(
                            "qp {:#x}: dropping a WRITE_WITH_IMM: no receive posted",
                            self.qp_num
                        );
                        return;
                    };
                    Some(self.recv_completion(&wr, &h, len))
                } else {
                    None
                };
                (target.into_iter().collect(), wc)
            }
            _ => {
                tracing::debug!("qp {:#x}: UC drops {:?}", self.qp_num, h.op);
                return;
            }
        };
        let key = Self::next_receive_key(q);
        self.place(q, key, spans, body, wc, solicited);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grh_carries_class_flow_hop_limit_and_both_gids() {
        let mut h = Header::new(Op::Send, 5, 6, 0x0102, 0);
        h.flags |= wire::FLAG_DATAGRAM | wire::FLAG_GRH;
        h.remote_addr =
            u64::from(u32::from(Ipv4Addr::new(10, 0, 0, 7))) | (0x12345 << 32) | (0xab << 56);
        h.status = 64;
        let dgid = [9u8; 16];
        let g = grh_bytes(&h, 100, &dgid);
        assert_eq!(u32::from_be_bytes(g[0..4].try_into().unwrap()), 0x6ab1_2345);
        assert_eq!(u16::from_be_bytes([g[4], g[5]]), 100 + 24);
        assert_eq!((g[6], g[7]), (0x1b, 64));
        assert_eq!(
            &g[8..24],
            &crate::engine::address::port_gid(Ipv4Addr::new(10, 0, 0, 7), 0x0102)
        );
        assert_eq!(&g[24..40], &dgid);
    }

    #[test]
    fn split_front_cuts_across_spans() {
        let buf = [0u8; 64];
        let a = AppSpan::of_owned(&buf[..30]);
        let b = AppSpan::of_owned(&buf[30..]);
        let (front, rest) = split_front(&[a, b], 40);
        assert_eq!(front.iter().map(|s| s.len()).collect::<Vec<_>>(), [30, 10]);
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].len(), 24);
        assert_eq!(rest[0].addr(), buf.as_ptr() as u64 + 40);
    }
}
