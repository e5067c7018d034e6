//! The verbs beneath one connected stream rsocket: an RC queue pair on a CQ of its own (with a
//! completion channel, whose fd is what a blocked call or `rpoll` waits on), and one buffer
//! of ugdr's memory holding the receive ring, the send ring and the credit word.
//!
//! The protocol (both sides are ugdr, so it is ugdr's own; rsocket(7) for the semantics):
//! * every message is a SEND_WITH_IMM of at most [`SEG`] bytes from a send slot into one of the
//!   peer's posted receives; the immediate names its kind ([`MSG_DATA`], [`MSG_FIN`] for
//!   `rshutdown(SHUT_WR)`, [`MSG_IOMAP`]/[`MSG_IOUNMAP`] for the peer's `riomap` table);
//! * flow control by credits, so a message never finds the peer's receive queue empty (real
//!   RC would answer RNR): the receiver counts the receives it posted again after the
//!   application consumed them and RDMA-WRITEs that count into the sender's credit word (an
//!   inline 8-byte write, which consumes no receive); the sender may have at most the peer's
//!   ring size of messages not yet counted;
//! * `riowrite` is an RDMA WRITE from a send slot into a buffer the peer mapped with `riomap`.

use super::RsError;
use crate::cm::{CmError, CmId, IdQp};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::context::DeviceContext;
use crate::fake_verbs::cq::{CompletionChannel, CompletionQueue};
use crate::fake_verbs::mr::{ACCESS_LOCAL_WRITE, ACCESS_REMOTE_WRITE, MemoryRegion};
use crate::fake_verbs::pd::ProtectionDomain;
use crate::fake_verbs::qp::{ModifyRequest, QpCaps, QueuePair};
use crate::fake_verbs::qp_state::QpType;
use crate::fake_verbs::work::{
    RecvRequest, SendOpcode, SendRequest, Sge, WC_WITH_IMM, WcOpcode, WcStatus, WorkCompletion,
};
use crate::ucp::{AppRegion, HostBuffer, gather, gather_into, scatter};
use smallvec::smallvec;
use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::{Arc, OnceLock};

/// The size of every message buffer (receive and send slots).
pub const SEG: u32 = 64 * 1024;
/// Message kinds, in the immediate of each SEND.
pub const MSG_DATA: u32 = 0;
pub const MSG_FIN: u32 = 1;
pub const MSG_IOMAP: u32 = 2;
pub const MSG_IOUNMAP: u32 = 3;
/// "UGRS": the first word of the connection parameters in REQ and REP private data.
const MAGIC: u32 = 0x5547_5253;
/// Send work-request ids: a slot number, or a credit write (which has none).
const WR_CREDIT: u64 = u64::MAX;
/// The credit word's registered area: whole pages (of any page size up to 64 KiB), so that
/// registering it moves it onto shared memory and the peer's credit writes take the same-host
/// direct path (`shared_memory::backing` shares whole pages only; an 8-byte region stayed
/// private, ERANGE, and every credit write went as a message). The word is its first 8 bytes.
const CREDIT_AREA: u64 = SEG as u64;
/// Work requests kept free in the send queue for credit writes.
const SQ_SPARE: u32 = 4;

/// The verbs device every rsocket of the process uses (one context and PD, never closed).
struct Device {
    context: Arc<DeviceContext>,
    pd: Arc<ProtectionDomain>,
}

fn device() -> Result<&'static Device, RsError> {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    if let Some(d) = DEVICE.get() {
        return Ok(d);
    }
    Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
    let context = Arc::new(DeviceContext::new()?);
    let pd = ProtectionDomain::new(Arc::clone(&context));
    Ok(DEVICE.get_or_init(|| Device { context, pd }))
}

/// The device context and protection domain of every rsocket (datagram ones too).
pub(super) fn context_and_pd() -> Result<(Arc<DeviceContext>, Arc<ProtectionDomain>), RsError> {
    let d = device()?;
    Ok((Arc::clone(&d.context), Arc::clone(&d.pd)))
}

/// The protection domain rsockets register memory in (`riomap`).
pub fn pd() -> Result<Arc<ProtectionDomain>, RsError> {
    Ok(Arc::clone(&device()?.pd))
}

/// What each side tells the other in REQ/REP private data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub rq: u32,
    pub seg: u32,
    pub credit_addr: u64,
    pub credit_rkey: u32,
}

impl Hello {
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(24);
        v.extend_from_slice(&MAGIC.to_le_bytes());
        v.extend_from_slice(&self.rq.to_le_bytes());
        v.extend_from_slice(&self.seg.to_le_bytes());
        v.extend_from_slice(&self.credit_rkey.to_le_bytes());
        v.extend_from_slice(&self.credit_addr.to_le_bytes());
        v
    }

    /// The peer's parameters; None unless it is a ugdr rsocket with our segment size.
    pub fn decode(b: &[u8]) -> Option<Hello> {
        let word = |i: usize| Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?));
        if word(0)? != MAGIC {
            return None;
        }
        let h = Hello {
            rq: word(4)?,
            seg: word(8)?,
            credit_rkey: word(12)?,
            credit_addr: u64::from_le_bytes(b.get(16..24)?.try_into().ok()?),
        };
        (h.seg == SEG && h.rq > 0).then_some(h)
    }
}

/// A buffer the peer mapped for `riowrite` (rsocket offset → its address and key).
#[derive(Debug, Clone, Copy)]
pub struct RemoteMap {
    pub offset: u64,
    pub addr: u64,
    pub len: u64,
    pub rkey: u32,
}

impl RemoteMap {
    fn encode(&self) -> [u8; 28] {
        let mut b = [0u8; 28];
        b[..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..].copy_from_slice(&self.rkey.to_le_bytes());
        b
    }

    /// A notice from the peer: refused unless its range is non-empty and ends within u64, in
    /// rsocket offsets and in the peer's addresses (`riowrite` adds to both).
    fn decode(b: &[u8]) -> Option<RemoteMap> {
        let u64_at = |i: usize| Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?));
        let map = RemoteMap {
            offset: u64_at(0)?,
            addr: u64_at(8)?,
            len: u64_at(16)?,
            rkey: u32::from_le_bytes(b.get(24..28)?.try_into().ok()?),
        };
        let ends = |start: u64| start.checked_add(map.len).is_some();
        (map.len > 0 && ends(map.offset) && ends(map.addr)).then_some(map)
    }
}

/// The most `riomap`ped ranges of the peer kept (its notices beyond are ignored: a peer must
/// not grow this process's memory without bound).
const MAX_REMOTE_MAPS: usize = 1024;

/// One received message not yet fully read.
struct Arrival {
    slot: u32,
    len: u32,
    read: u32,
}

/// The QP as the connection manager drives it.
pub struct QpRef<'a>(pub &'a Arc<QueuePair>);

impl IdQp for QpRef<'_> {
    fn qp_num(&self) -> u32 {
        self.0.qp_num
    }

    fn has_srq(&self) -> bool {
        false
    }

    fn modify(&self, req: &ModifyRequest) -> Result<(), CmError> {
        self.0
            .modify_resolving(req)
            .map(drop)
            .map_err(CmError::from)
    }
}

/// The verbs of one connection and the protocol state on them.
pub struct Conn {
    pub qp: Arc<QueuePair>,
    cq: Arc<CompletionQueue>,
    comp: Arc<CompletionChannel>,
    mem: HostBuffer,
    ring_mr: Arc<MemoryRegion>,
    credit_mr: Arc<MemoryRegion>,
    rq: u32,
    sq: u32,
    send_off: u64,
    credit_off: u64,
    base: u64,
    /// Received data in arrival order.
    ready: VecDeque<Arrival>,
    /// Receives posted again (the count the peer's credit word gets), and the last written.
    reposted: u64,
    written: u64,
    pub peer: Option<Hello>,
    /// Messages sent (each took one of the peer's receives).
    sent: u64,
    free_slots: Vec<u32>,
    /// Send work requests posted and not completed.
    in_sq: u32,
    /// The peer sent FIN (`rshutdown(SHUT_WR)`): end of stream after `ready`.
    pub fin: bool,
    /// The connection failed (a completion error): the errno of later calls.
    pub error: Option<i32>,
    pub remote_maps: Vec<RemoteMap>,
}

/// What [`own_qp`] makes: the completion channel, the CQ and the QP.
pub(super) type OwnQp = (Arc<CompletionChannel>, Arc<CompletionQueue>, Arc<QueuePair>);

/// A QP of ugdr's own for an rsocket (`qp_type`, `sq` sends with up to `inline` bytes inline,
/// `rq` receives, one SGE each) on a CQ of its own with a completion channel, registered with
/// the engine so that its messages reach it.
pub(super) fn own_qp(
    context: &Arc<DeviceContext>,
    pd: &Arc<ProtectionDomain>,
    qp_type: QpType,
    sq: u32,
    rq: u32,
    inline: u32,
) -> Result<OwnQp, RsError> {
    let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
    let comp = CompletionChannel::new(Arc::clone(context))?;
    let cq = CompletionQueue::new(
        Arc::clone(context),
        (rq + sq) as usize * 2,
        Some(Arc::clone(&comp)),
    );
    let caps = QpCaps::grant(QpCaps {
        max_send_wr: sq,
        max_recv_wr: rq,
        max_send_sge: 1,
        max_recv_sge: 1,
        max_inline_data: inline,
    })?;
    let qp = QueuePair::new(
        engine.allocate_qpn(),
        qp_type,
        Arc::clone(pd),
        Arc::clone(&cq),
        Arc::clone(&cq),
        None,
        false,
        caps,
        engine.lid,
    )?;
    engine.register_qp(qp.qp_num, Arc::clone(&qp) as _);
    Ok((comp, cq, qp))
}

impl Conn {
    /// A QP with `rq` receives of [`SEG`] bytes and `sq` send slots, in INIT on `id` with
    /// every receive posted.
    pub fn new(id: &Arc<CmId>, rq: u32, sq: u32) -> Result<Conn, RsError> {
        let dev = device()?;
        let (comp, cq, qp) = own_qp(&dev.context, &dev.pd, QpType::Rc, sq + SQ_SPARE, rq, 64)?;
        let send_off = u64::from(rq) * u64::from(SEG);
        let credit_off = send_off + u64::from(sq) * u64::from(SEG);
        let mem = HostBuffer::new(credit_off + CREDIT_AREA)?;
        let region = |off: u64, len: u64| {
            mem.region(off, len)
                .ok_or(RsError::Os(libc::EINVAL))
                .map(|r: AppRegion| (r.addr(), r))
        };
        let (base, ring) = region(0, credit_off)?;
        let ring_mr = MemoryRegion::register(&dev.pd, ring, base, ACCESS_LOCAL_WRITE)?;
        let (credit_addr, credit) = region(credit_off, CREDIT_AREA)?;
        let credit_mr = MemoryRegion::register(
            &dev.pd,
            credit,
            credit_addr,
            ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE,
        )?;
        let mut conn = Conn {
            qp,
            cq,
            comp,
            mem,
            ring_mr,
            credit_mr,
            rq,
            sq,
            send_off,
            credit_off,
            base,
            ready: VecDeque::new(),
            reposted: 0,
            written: 0,
            peer: None,
            sent: 0,
            free_slots: (0..sq).rev().collect(),
            in_sq: 0,
            fin: false,
            error: None,
            remote_maps: Vec::new(),
        };
        id.ready_new_qp(&QpRef(&conn.qp))?;
        for slot in 0..rq {
            conn.post_recv(slot)?;
        }
        // Counted from zero: the receives posted now are the peer's initial credits.
        conn.reposted = 0;
        Ok(conn)
    }

    /// Our parameters for the peer.
    pub fn hello(&self) -> Hello {
        Hello {
            rq: self.rq,
            seg: SEG,
            credit_addr: self.base + self.credit_off,
            credit_rkey: self.credit_mr.rkey(),
        }
    }

    /// The fd that becomes readable when a completion arrives on an armed CQ.
    pub fn wait_fd(&self) -> RawFd {
        self.comp.events.fd()
    }

    fn post_recv(&mut self, slot: u32) -> Result<(), RsError> {
        let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
        let locked = engine.worker.lock();
        self.qp.post_recv(
            &locked,
            RecvRequest {
                wr_id: u64::from(slot),
                sges: smallvec![Sge {
                    addr: self.base + u64::from(slot) * u64::from(SEG),
                    length: SEG,
                    lkey: self.ring_mr.lkey(),
                }],
            },
        )?;
        self.reposted += 1;
        Ok(())
    }

    fn post_send(&mut self, req: SendRequest) -> Result<(), RsError> {
        let engine = Engine::get().map_err(|e| RsError::from(VerbsError::from(e)))?;
        let locked = engine.worker.lock();
        self.qp.post_send(&locked, req)?;
        self.in_sq += 1;
        Ok(())
    }

    /// Takes what arrived: completions (data, control messages, freed send slots, errors).
    /// When nothing has, the engine's worker is progressed from this thread (if no other
    /// thread is at it) and the CQ looked at again, as `ibv_poll_cq` on an empty CQ does: an
    /// application that spins on a non-blocking socket (rstream's default) then moves its
    /// own messages instead of waiting for the progress thread to get a core beside it (on 2
    /// cores busy with other work that took rstream's default set past 2 minutes). Only such
    /// a `spinning` caller counts as polling (the progress thread steps aside while polls
    /// come fast); one that goes on to block needs the progress thread to serve it.
    pub fn progress(&mut self, spinning: bool) {
        while let Ok(Some(_)) = self.comp.events.try_wait() {}
        if self.take_completions() == 0
            && let Some(engine) = Engine::running()
        {
            if spinning {
                engine.progress_from_app();
            } else {
                engine.progress_beside_app();
            }
            self.take_completions();
        }
        // A credit write skipped for a full send queue goes now.
        if self.reposted - self.written >= u64::from((self.rq / 4).max(1)) {
            self.write_credits();
        }
    }

    /// Handles the completions the CQ holds; how many there were.
    fn take_completions(&mut self) -> usize {
        let mut taken = 0;
        loop {
            let mut batch: Vec<WorkCompletion> = Vec::new();
            let n = self.cq.poll(64, |wc| batch.push(*wc));
            for wc in &batch {
                self.complete(wc);
            }
            taken += batch.len();
            if n < 64 {
                return taken;
            }
        }
    }

    fn complete(&mut self, wc: &WorkCompletion) {
        if wc.status != WcStatus::Success && wc.opcode == WcOpcode::Recv {
            // As librdmacm's rsockets: a receive that did not complete (flushed when the
            // connection went) is no failure of the connection; its slot is gone with it.
            return;
        }
        if wc.status != WcStatus::Success {
            if self.error.is_none() {
                tracing::debug!("rsocket qp {:#x}: {:?}", self.qp.qp_num, wc.status);
                self.error = Some(if wc.status == WcStatus::WrFlushErr {
                    libc::EPIPE
                } else {
                    libc::ECONNRESET
                });
            }
            self.send_done(wc.wr_id);
            return;
        }
        if wc.opcode != WcOpcode::Recv {
            self.send_done(wc.wr_id);
            return;
        }
        let slot = wc.wr_id as u32;
        let kind = if wc.wc_flags & WC_WITH_IMM != 0 {
            wc.imm_data
        } else {
            MSG_DATA
        };
        match kind {
            MSG_DATA if wc.byte_len > 0 => self.ready.push_back(Arrival {
                slot,
                len: wc.byte_len,
                read: 0,
            }),
            MSG_FIN => {
                self.fin = true;
                self.repost(slot);
            }
            MSG_IOMAP | MSG_IOUNMAP => {
                let bytes = self.slot_bytes(u64::from(slot) * u64::from(SEG), wc.byte_len);
                if let Some(map) = RemoteMap::decode(&bytes) {
                    self.remote_maps.retain(|m| m.offset != map.offset);
                    if kind == MSG_IOMAP && self.remote_maps.len() < MAX_REMOTE_MAPS {
                        self.remote_maps.push(map);
                    }
                }
                self.repost(slot);
            }
            _ => self.repost(slot),
        }
    }

    fn send_done(&mut self, wr_id: u64) {
        self.in_sq = self.in_sq.saturating_sub(1);
        if wr_id != WR_CREDIT && (wr_id as u32) < self.sq {
            self.free_slots.push(wr_id as u32);
        }
    }

    fn slot_bytes(&self, off: u64, len: u32) -> Vec<u8> {
        match self.mem.span(off, u64::from(len)) {
            Some(span) => gather(&[span]),
            None => Vec::new(),
        }
    }

    fn repost(&mut self, slot: u32) {
        if let Err(e) = self.post_recv(slot) {
            tracing::debug!("rsocket: cannot post a receive again: {e:?}");
            self.error.get_or_insert(libc::ECONNRESET);
            return;
        }
        // Tell the sender once a quarter of the ring is free again.
        if self.reposted - self.written >= u64::from((self.rq / 4).max(1)) {
            self.write_credits();
        }
    }

    fn write_credits(&mut self) {
        let Some(peer) = self.peer else { return };
        if self.error.is_some() || self.in_sq >= self.sq + SQ_SPARE {
            return;
        }
        let req = SendRequest {
            signaled: true,
            inline_data: Some(self.reposted.to_le_bytes().as_slice().into()),
            remote_addr: peer.credit_addr,
            rkey: peer.credit_rkey,
            ..SendRequest::new(WR_CREDIT, SendOpcode::RdmaWrite)
        };
        if self.post_send(req).is_ok() {
            self.written = self.reposted;
        }
    }

    /// Receives the peer has posted again since the start (its credit word).
    fn peer_reposted(&self) -> u64 {
        self.mem
            .span(self.credit_off, 8)
            .and_then(|s| s.fetch_add(0))
            .map(u64::from_le)
            .unwrap_or(0)
            .min(self.sent)
    }

    /// Whether a message may go now: a send slot, room in the send queue, and a receive
    /// the peer posted that no message has taken yet.
    pub fn can_send(&self) -> bool {
        let Some(peer) = self.peer else { return false };
        !self.free_slots.is_empty()
            && self.in_sq < self.sq
            && self.sent - self.peer_reposted() < u64::from(peer.rq)
    }

    /// Sends one message of `kind` with (up to [`SEG`] bytes of) `data`; the bytes taken.
    /// Call after [`Conn::can_send`].
    pub fn send(&mut self, kind: u32, data: &[u8]) -> Result<usize, RsError> {
        let n = data.len().min(SEG as usize);
        let slot = self.take_slot(&data[..n])?;
        let req = self.request(slot, n, SendOpcode::SendWithImm, kind, 0, 0);
        self.post_or_release(slot, req)?;
        self.sent += 1;
        Ok(n)
    }

    /// RDMA WRITE of (up to [`SEG`] bytes of) `data` to `addr`/`rkey`; the bytes taken. Needs
    /// a send slot and room in the send queue, not the peer's credits.
    pub fn write(&mut self, data: &[u8], addr: u64, rkey: u32) -> Result<usize, RsError> {
        if self.free_slots.is_empty() || self.in_sq >= self.sq {
            return Err(RsError::Again);
        }
        let n = data.len().min(SEG as usize);
        let slot = self.take_slot(&data[..n])?;
        let req = self.request(slot, n, SendOpcode::RdmaWrite, 0, addr, rkey);
        self.post_or_release(slot, req)?;
        Ok(n)
    }

    /// Tells the peer about a mapping (or its end).
    pub fn send_map(&mut self, kind: u32, map: &RemoteMap) -> Result<(), RsError> {
        self.send(kind, &map.encode()).map(drop)
    }

    pub fn has_free_slot(&self) -> bool {
        !self.free_slots.is_empty() && self.in_sq < self.sq
    }

    fn take_slot(&mut self, data: &[u8]) -> Result<u32, RsError> {
        let slot = self.free_slots.pop().ok_or(RsError::Again)?;
        let off = self.send_off + u64::from(slot) * u64::from(SEG);
        if let Some(span) = self.mem.span(off, data.len() as u64) {
            scatter(&[span], data);
        }
        Ok(slot)
    }

    fn request(
        &self,
        slot: u32,
        len: usize,
        opcode: SendOpcode,
        imm: u32,
        remote_addr: u64,
        rkey: u32,
    ) -> SendRequest {
        SendRequest {
            sges: smallvec![Sge {
                addr: self.base + self.send_off + u64::from(slot) * u64::from(SEG),
                length: len as u32,
                lkey: self.ring_mr.lkey(),
            }],
            imm_data: imm,
            signaled: true,
            remote_addr,
            rkey,
            ..SendRequest::new(u64::from(slot), opcode)
        }
    }

    fn post_or_release(&mut self, slot: u32, req: SendRequest) -> Result<(), RsError> {
        self.post_send(req)
            .inspect_err(|_| self.free_slots.push(slot))
    }

    /// Whether received data waits to be read.
    pub fn readable(&self) -> bool {
        !self.ready.is_empty()
    }

    /// Copies received data into `buf` (leaving it queued with `peek`); the bytes copied.
    pub fn read(&mut self, buf: &mut [u8], peek: bool) -> usize {
        let mut done = 0;
        let mut i = 0;
        while done < buf.len() && i < self.ready.len() {
            let a = &self.ready[i];
            let n = ((a.len - a.read) as usize).min(buf.len() - done);
            let off = u64::from(a.slot) * u64::from(SEG) + u64::from(a.read);
            // One copy, from the receive ring straight into the caller's buffer.
            done += match self.mem.span(off, n as u64) {
                Some(span) => gather_into(&[span], &mut buf[done..done + n]),
                None => 0,
            };
            if peek {
                i += 1;
                continue;
            }
            let a = &mut self.ready[i];
            a.read += n as u32;
            if a.read == a.len {
                let slot = a.slot;
                self.ready.pop_front();
                self.repost(slot);
            }
        }
        // Reposts below the write threshold (`repost`) stay unwritten: the sender still
        // has more credits than that, so it never waits for them.
        done
    }

    /// Arms the CQ for the next completion; true if completions arrived meanwhile (so the
    /// caller should progress instead of waiting).
    pub fn arm(&self) -> bool {
        let _ = self.cq.arm(false);
        !self.cq.is_empty()
    }

    /// Whether sends are still in flight.
    pub fn sending(&self) -> bool {
        self.in_sq > 0
    }

    /// Tears the verbs down (the id disconnected or destroyed first).
    pub fn destroy(&self) {
        if let Ok(engine) = Engine::get() {
            let locked = engine.worker.lock();
            self.qp.flush_ack(&locked);
            engine.unregister_qp(self.qp.qp_num);
            self.qp.destroy(&locked);
        }
        // Only ugdr holds these keys: no memory window can be bound to the region.
        let _ = self.ring_mr.deregister();
        // Only ugdr holds these keys: no memory window can be bound to the region.
        let _ = self.credit_mr.deregister();
        self.cq.destroy();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_notices_whose_ranges_overflow_are_refused() {
        let map = |offset, addr, len| RemoteMap {
            offset,
            addr,
            len,
            rkey: 7,
        };
        let ok = map(4096, 0x7f00_0000_0000, 4096);
        let back = RemoteMap::decode(&ok.encode()).expect("a sound notice");
        assert_eq!(
            (back.offset, back.addr, back.len, back.rkey),
            (4096, 0x7f00_0000_0000, 4096, 7)
        );
        for bad in [
            map(0, 0x1000, 0),
            map(u64::MAX - 10, 0x1000, 100),
            map(0, u64::MAX - 10, 100),
        ] {
            assert!(RemoteMap::decode(&bad.encode()).is_none(), "{bad:?}");
        }
        assert!(RemoteMap::decode(&ok.encode()[..27]).is_none(), "short");
    }
}
