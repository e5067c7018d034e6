//! The verbs beneath one datagram rsocket: a UD queue pair on a CQ of its own (with a
//! completion channel, whose fd a blocked call or `rpoll` waits on) and one buffer of ugdr's
//! memory holding the receive ring (each receive: the 40-byte GRH area, then one UD MTU) and
//! the send slots (one UD MTU each). Every datagram is one UD SEND of at most the port's MTU
//! (4096 bytes): ugdr's [`HDR_LEN`]-byte header, then the application's bytes.

use super::RsError;
use crate::engine::Engine;
use crate::engine::address::port_gid;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::ah::AddressHandle;
use crate::fake_verbs::cq::{CompletionChannel, CompletionQueue};
use crate::fake_verbs::device::{ACTIVE_MTU_BYTES, GRH_LEN};
use crate::fake_verbs::mr::{ACCESS_LOCAL_WRITE, MemoryRegion};
use crate::fake_verbs::pd::ProtectionDomain;
use crate::fake_verbs::qp::{AddressVector, GlobalRoute, ModifyRequest, QpAttributes, QueuePair};
use crate::fake_verbs::qp_state::{AttrMask, QpState, QpType};
use crate::fake_verbs::work::{
    RecvRequest, SendOpcode, SendRequest, Sge, UdDestination, WorkCompletion,
};
use crate::ucp::{HostBuffer, gather_into, scatter};
use smallvec::smallvec;
use std::os::fd::RawFd;
use std::sync::Arc;

/// The largest UD message: the port's active MTU.
pub const MTU: usize = ACTIVE_MTU_BYTES as usize;
/// ugdr's header in front of every datagram's bytes (`datagram.rs`).
pub const HDR_LEN: usize = 16;
/// The largest datagram an application may send: one UD message less the header.
pub const MAX_PAYLOAD: usize = MTU - HDR_LEN;
/// Bytes of one receive: the GRH area, then a whole UD message.
const RECV_SLOT: u64 = (GRH_LEN + MTU) as u64;
const SEND_SLOT: u64 = MTU as u64;
/// `RDMA_UDP_QKEY`, the Q_Key of every datagram rsocket's QP.
const QKEY: u32 = 0x0123_4567;
/// The most receives or send slots a socket has.
const MAX_RING: u32 = 1024;

/// Receives for a receive buffer of `rcvbuf` bytes, send slots for `sndbuf`.
pub fn ring_sizes(rcvbuf: u32, sndbuf: u32) -> (u32, u32) {
    let fit = |bytes: u32, slot: u64| ((u64::from(bytes) / slot) as u32).clamp(2, MAX_RING);
    (fit(rcvbuf, RECV_SLOT), fit(sndbuf, SEND_SLOT))
}

/// Where datagrams to one peer go: an address handle to its port and its QP number.
pub struct Route {
    dest: UdDestination,
    pub lid: u16,
}

impl Route {
    /// A route to QP `qpn` of the port with GID `gid` (a ugdr GID names its LID and host).
    /// Blocking (it may ask the peer's host): call without the worker lock.
    pub fn new(pd: &Arc<ProtectionDomain>, gid: [u8; 16], qpn: u32) -> Result<Route, RsError> {
        let (_, lid) = crate::engine::address::parse_gid(&gid).ok_or(RsError::Os(libc::EINVAL))?;
        let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
        let av = AddressVector {
            dlid: lid,
            is_global: true,
            port_num: 1,
            grh: GlobalRoute {
                dgid: gid,
                hop_limit: 64,
                ..GlobalRoute::default()
            },
            ..AddressVector::default()
        };
        let ah = AddressHandle::new(engine, Arc::clone(pd), av)?;
        Ok(Route {
            dest: UdDestination {
                ah,
                remote_qpn: qpn,
                remote_qkey: QKEY,
            },
            lid,
        })
    }

    pub fn qpn(&self) -> u32 {
        self.dest.remote_qpn
    }
}

impl Drop for Route {
    fn drop(&mut self) {
        self.dest.ah.destroy();
    }
}

pub struct UdPort {
    pub qp: Arc<QueuePair>,
    pd: Arc<ProtectionDomain>,
    cq: Arc<CompletionQueue>,
    comp: Arc<CompletionChannel>,
    mem: HostBuffer,
    mr: Arc<MemoryRegion>,
    base: u64,
    pub rq: u32,
    sq: u32,
    send_off: u64,
    free_slots: Vec<u32>,
    in_sq: u32,
}

impl UdPort {
    /// A UD QP in RTS with `rq` receives posted and `sq` send slots.
    pub fn new(rq: u32, sq: u32) -> Result<UdPort, RsError> {
        let (context, pd) = super::transport::context_and_pd()?;
        let (comp, cq, qp) = super::transport::own_qp(&context, &pd, QpType::Ud, sq, rq, 0)?;
        let send_off = u64::from(rq) * RECV_SLOT;
        let len = send_off + u64::from(sq) * SEND_SLOT;
        let mem = HostBuffer::new(len)?;
        let region = mem.region(0, len).ok_or(RsError::Os(libc::EINVAL))?;
        let base = region.addr();
        let mr = MemoryRegion::register(&pd, region, base, ACCESS_LOCAL_WRITE)?;
        let port = UdPort {
            qp,
            pd,
            cq,
            comp,
            mem,
            mr,
            base,
            rq,
            sq,
            send_off,
            free_slots: (0..sq).rev().collect(),
            in_sq: 0,
        };
        let init = QpAttributes {
            qkey: QKEY,
            port_num: 1,
            ..QpAttributes::default()
        };
        for (state, mask, attrs) in [
            (
                QpState::Init,
                AttrMask::STATE | AttrMask::PKEY_INDEX | AttrMask::PORT | AttrMask::QKEY,
                init,
            ),
            (QpState::Rtr, AttrMask::STATE, QpAttributes::default()),
            (
                QpState::Rts,
                AttrMask::STATE | AttrMask::SQ_PSN,
                QpAttributes::default(),
            ),
        ] {
            let req = ModifyRequest {
                mask,
                state: Some(state),
                claimed_cur: None,
                attrs,
            };
            if let Err(e) = port.qp.modify_resolving(&req) {
                port.destroy();
                return Err(e.into());
            }
        }
        for slot in 0..rq {
            if let Err(e) = port.post_recv(slot) {
                port.destroy();
                return Err(e);
            }
        }
        Ok(port)
    }

    pub fn pd(&self) -> &Arc<ProtectionDomain> {
        &self.pd
    }

    /// This port's GID (it names the host and the LID).
    pub fn gid(&self) -> [u8; 16] {
        let lid = Engine::running()
            .map(|e| e.lid)
            .unwrap_or(self.qp.local_lid);
        port_gid(crate::engine::host_network().ipv4, lid)
    }

    /// The fd that becomes readable when a completion arrives on an armed CQ.
    pub fn wait_fd(&self) -> RawFd {
        self.comp.events.fd()
    }

    /// Posts receive `slot` (again).
    pub fn post_recv(&self, slot: u32) -> Result<(), RsError> {
        let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
        let locked = engine.worker.lock();
        self.qp.post_recv(
            &locked,
            RecvRequest {
                wr_id: u64::from(slot),
                sges: smallvec![Sge {
                    addr: self.base + u64::from(slot) * RECV_SLOT,
                    length: RECV_SLOT as u32,
                    lkey: self.mr.lkey(),
                }],
            },
        )?;
        Ok(())
    }

    /// The completions that arrived, to `sink` (send completions free their slot first).
    pub fn poll(&mut self, mut sink: impl FnMut(&mut UdPort, &WorkCompletion)) {
        while let Ok(Some(_)) = self.comp.events.try_wait() {}
        loop {
            let mut batch: Vec<WorkCompletion> = Vec::new();
            let n = self.cq.poll(64, |wc| batch.push(*wc));
            for wc in &batch {
                if self.is_send(wc) {
                    self.in_sq = self.in_sq.saturating_sub(1);
                    self.release_slot(wc.wr_id as u32);
                } else {
                    sink(self, wc);
                }
            }
            if n < 64 {
                break;
            }
        }
    }

    fn is_send(&self, wc: &WorkCompletion) -> bool {
        wc.opcode != crate::fake_verbs::work::WcOpcode::Recv
    }

    /// Copies `len` bytes at `off` of receive `slot` into `dst` (one copy); the bytes copied.
    pub fn read_recv(&self, slot: u32, off: usize, dst: &mut [u8]) -> usize {
        if slot >= self.rq || off + dst.len() > RECV_SLOT as usize {
            return 0;
        }
        let at = u64::from(slot) * RECV_SLOT + off as u64;
        match self.mem.span(at, dst.len() as u64) {
            Some(span) => gather_into(&[span], dst),
            None => 0,
        }
    }

    /// A free send slot, if any (and room in the send queue).
    pub fn take_slot(&mut self) -> Option<u32> {
        self.free_slots.pop()
    }

    pub fn has_free_slot(&self) -> bool {
        !self.free_slots.is_empty()
    }

    pub fn release_slot(&mut self, slot: u32) {
        if slot < self.sq && !self.free_slots.contains(&slot) {
            self.free_slots.push(slot);
        }
    }

    /// Writes `bytes` at `off` of send `slot`.
    pub fn fill_slot(&self, slot: u32, off: usize, bytes: &[u8]) {
        let at = self.send_off + u64::from(slot) * SEND_SLOT + off as u64;
        if off + bytes.len() <= MTU
            && let Some(span) = self.mem.span(at, bytes.len() as u64)
        {
            scatter(&[span], bytes);
        }
    }

    /// Sends the first `len` bytes of `slot` along `route`; the slot is free again when the
    /// send completes (or now, if it cannot be posted).
    pub fn send(&mut self, slot: u32, len: usize, route: &Route) -> Result<(), RsError> {
        let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
        let req = SendRequest {
            sges: smallvec![Sge {
                addr: self.base + self.send_off + u64::from(slot) * SEND_SLOT,
                length: len.min(MTU) as u32,
                lkey: self.mr.lkey(),
            }],
            signaled: true,
            ud: Some(route.dest.clone()),
            ..SendRequest::new(u64::from(slot), SendOpcode::Send)
        };
        let posted = {
            let locked = engine.worker.lock();
            self.qp.post_send(&locked, req)
        };
        match posted {
            Ok(()) => {
                self.in_sq += 1;
                Ok(())
            }
            Err(e) => {
                self.release_slot(slot);
                Err(e.into())
            }
        }
    }

    /// Whether sends are still in flight.
    pub fn sending(&self) -> bool {
        self.in_sq > 0
    }

    /// Arms the CQ for the next completion; true if completions arrived meanwhile.
    pub fn arm(&self) -> bool {
        let _ = self.cq.arm(false);
        !self.cq.is_empty()
    }

    /// Tears the verbs down.
    pub fn destroy(&self) {
        if let Ok(engine) = Engine::get() {
            let locked = engine.worker.lock();
            engine.unregister_qp(self.qp.qp_num);
            self.qp.destroy(&locked);
        }
        // Only ugdr holds this key: no memory window can be bound to the region.
        let _ = self.mr.deregister();
        self.cq.destroy();
    }
}
