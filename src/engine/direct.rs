//! The same-host one-sided path: an RDMA WRITE or READ to a peer process on this host is a
//! `memcpy` by the requester into (or out of) the peer's registered pages, mapped here (or,
//! for registered memory on pages shared with other data, a copy by the kernel straight into
//! the peer's address space, `process_vm_writev`/`readv`), and a fetch-and-add or
//! compare-and-swap one CPU atomic on the mapped pages, with no message and nothing asked of
//! the peer's CPU (docs/design.md).
//!
//! Each process publishes, in its [`Table`], the memory regions peers may reach (rkey, PD,
//! access, range, the memfd holding the pages) and the queue pairs they may reach them through
//! (state, PD, access flags, the one peer LID/QPN connected to it). A requester checks both
//! before touching memory, exactly the checks the responder makes on the message path; any
//! doubt (not published, stale, busy, refused) falls back to the message path, which then
//! gives the authoritative outcome (the NAK, the event, the state change).
//!
//! Fencing (`ibv_dereg_mr`, QP state changes, `ibv_destroy_qp`): a requester holds its target
//! QP slot's lock (its pid) while it checks and copies. The owner first makes the slot invalid
//! (odd `seq`), then waits until no lock that could have seen the old value is held. Both
//! sides use sequentially consistent operations in opposite order (lock then read `seq`;
//! write `seq` then read locks), so either the requester sees the withdrawal or the owner sees
//! the lock: once a withdrawal returns, nothing more lands.

use super::Engine;
pub use crate::shared_memory::{
    AtomicOp, InPlace, MR_SLOTS, Placed, PlacedBody, PostedAhead, ReceiveRing,
};
use crate::shared_memory::{
    Backing, ENTRY_DATA, MAX_ENTRIES, PeerBacking, PeerTable, QP_SLOTS, QpSlot, Table,
    read_process, write_process,
};
use crate::ucp::{AppSpan, total_len};
use rustc_hash::FxBuildHasher;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// `IBV_ACCESS_REMOTE_WRITE` / `_READ` as published in the slots.
pub const REMOTE_WRITE: u32 = 1 << 1;
pub const REMOTE_READ: u32 = 1 << 2;
/// `IBV_ACCESS_REMOTE_ATOMIC`.
pub const REMOTE_ATOMIC: u32 = 1 << 3;
/// `IBV_ACCESS_LOCAL_WRITE`: what a region must grant for a SEND written in place into a
/// receive WR's buffer.
pub const LOCAL_WRITE: u32 = 1;

/// Whether the direct path is on (`UGDR_DIRECT=off` turns it off).
pub fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| !matches!(std::env::var("UGDR_DIRECT").as_deref(), Ok("off" | "0")))
}

/// Whether this process may map a peer's published memory the way the direct path does: it
/// maps its own table through `/proc/self/fd` (the same kernel checks, against itself; a
/// sandbox that forbids `/proc/<pid>/fd` fails here).
pub fn self_check() -> std::io::Result<()> {
    let lid = Engine::running()
        .map(|e| e.lid)
        .ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENODEV))?;
    PeerTable::open(std::process::id() as i32).and_then(|t| {
        if t.lid() == lid {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(libc::ESRCH))
        }
    })
}

/// How registered memory that shares a page with other data is reached (`ugdr info`): by
/// cross-memory attach, which Yama's `ptrace_scope` may restrict beyond the checks that
/// mapping a peer's pages passes.
pub fn part_pages_note() -> String {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    match scope {
        None | Some(0) => "memory sharing a page with other data is copied by the kernel \
                           (process_vm_writev/readv)"
            .to_string(),
        Some(n) => format!(
            "memory sharing a page with other data goes through messages unless the \
             requester has CAP_SYS_PTRACE (kernel.yama.ptrace_scope = {n} forbids \
             process_vm_writev/readv to peers)"
        ),
    }
}

/// How often the direct path was taken, and how often it fell back to messages.
#[derive(Default)]
pub struct DirectCounters {
    /// SENDs placed in a peer's receive ring (of them, those written in place into the
    /// receive WR's buffer), and those that went as messages instead.
    pub sends: AtomicU64,
    pub sends_in_place: AtomicU64,
    pub sends_as_messages: AtomicU64,
    /// RDMA WRITEs done directly (of them, those with immediate data, placed in the ring).
    pub writes: AtomicU64,
    pub writes_with_imm: AtomicU64,
    pub reads: AtomicU64,
    pub atomics: AtomicU64,
    pub fallbacks: AtomicU64,
}

pub static COUNTERS: DirectCounters = DirectCounters {
    sends: AtomicU64::new(0),
    sends_in_place: AtomicU64::new(0),
    sends_as_messages: AtomicU64::new(0),
    writes: AtomicU64::new(0),
    writes_with_imm: AtomicU64::new(0),
    reads: AtomicU64::new(0),
    atomics: AtomicU64::new(0),
    fallbacks: AtomicU64::new(0),
};

/// What a requester does in a peer's memory on the direct path, with its local spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DirectAccess {
    /// An RDMA WRITE of the spans' bytes.
    Write,
    /// An RDMA READ into the spans.
    Read,
    /// An atomic on the 8 bytes at the remote address; the value they held before lands in
    /// the spans (8 bytes, as the responder's answer carries it).
    Atomic(AtomicOp),
}

impl DirectAccess {
    /// The access the target QP and region must grant.
    fn needs(self) -> u32 {
        match self {
            DirectAccess::Write => REMOTE_WRITE,
            DirectAccess::Read => REMOTE_READ,
            DirectAccess::Atomic(_) => REMOTE_ATOMIC,
        }
    }

    /// The bytes it touches in the target's memory.
    fn remote_len(self, spans: &[AppSpan]) -> u64 {
        match self {
            DirectAccess::Write | DirectAccess::Read => spans.iter().map(|s| s.len() as u64).sum(),
            DirectAccess::Atomic(_) => 8,
        }
    }
}

/// This process's published memory (owner side).
pub struct LocalMemory {
    table: Table,
    /// Backings of registered memory, by first address; dropped when no MR uses them and the
    /// application no longer maps them.
    backings: Mutex<Vec<Arc<Backing>>>,
    mr_slots: Mutex<SlotAllocator>,
    /// The pages each published region slot reaches: `[start, end)`.
    published: Mutex<HashMap<usize, (u64, u64)>>,
}

struct SlotAllocator {
    free: Vec<u16>,
}

/// A memory region as published: the slot it holds, and the pages it keeps shared (none
/// where peers reach it through this process's address space).
pub struct PublishedRegion {
    slot: usize,
    _backing: Option<Arc<Backing>>,
}

/// What a region publishes.
pub struct RegionView {
    pub rkey: u32,
    pub pd: u32,
    pub access: u32,
    /// The region's first byte in the peer's address space, and where it lives here.
    pub iova: u64,
    pub addr: u64,
    pub len: u64,
}

impl LocalMemory {
    pub fn new(lid: u16) -> std::io::Result<LocalMemory> {
        let table = Table::create()?;
        table.set_lid(lid);
        Ok(LocalMemory {
            table,
            backings: Mutex::new(Vec::new()),
            mr_slots: Mutex::new(SlotAllocator {
                free: (0..MR_SLOTS as u16).rev().collect(),
            }),
            published: Mutex::new(HashMap::new()),
        })
    }

    /// A free MR slot: its index becomes the low bits of the region's rkey.
    pub fn allocate_region_slot(&self) -> Option<u16> {
        self.allocate_region_slot_leaving(0)
    }

    /// A free MR slot, if more than `reserve` are free (what regions of lesser use must leave
    /// to the others).
    pub fn allocate_region_slot_leaving(&self, reserve: usize) -> Option<u16> {
        let mut slots = self.mr_slots.lock().unwrap_or_else(|p| p.into_inner());
        if slots.free.len() <= reserve {
            return None;
        }
        slots.free.pop()
    }

    pub fn free_region_slot(&self, slot: u16) {
        self.mr_slots
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .free
            .push(slot);
    }

    /// The backing holding the whole pages of `[addr, addr + len)`: an existing one, or a new
    /// one (the pages move onto a memfd). None when the memory cannot be shared.
    fn backing_for(&self, addr: u64, len: u64) -> Option<Arc<Backing>> {
        let mut backings = self.backings.lock().unwrap_or_else(|p| p.into_inner());
        // Keep a backing while an MR uses it or the application still maps it (so memory
        // registered again after a deregistration finds it); forget it once unmapped. A few
        // unused ones are looked up one by one; many, in one read of all the mappings.
        let unused = backings
            .iter()
            .filter(|b| Arc::strong_count(b) == 1)
            .count();
        let listed = if unused > 16 {
            crate::ucp::mappings::all_vmas().ok()
        } else {
            None
        };
        backings.retain(|b| {
            Arc::strong_count(b) > 1
                || listed
                    .as_deref()
                    .map_or_else(|| b.still_mapped(), |all| b.still_mapped_in(all))
        });
        let end = addr.checked_add(len)?;
        if let Some(b) = backings.iter().find(|b| b.covers_pages_of(addr, end)) {
            return Some(Arc::clone(b));
        }
        if backings.iter().any(|b| b.overlaps(addr, end)) {
            return None; // partly shared already: this region keeps to the message path
        }
        let shared = Backing::share(addr, len).or_else(|e| match e.raw_os_error() {
            // Not private anonymous memory: a shared mapping of a file is as good.
            Some(libc::EOPNOTSUPP) => Backing::adopt_shared(addr, len),
            _ => Err(e),
        });
        match shared {
            Ok(b) => {
                let b = Arc::new(b);
                backings.push(Arc::clone(&b));
                Some(b)
            }
            Err(e) => {
                tracing::debug!("memory at {addr:#x}+{len} stays private: {e}");
                None
            }
        }
    }

    /// Publishes a region in `slot` (from [`allocate_region_slot`]). Its whole pages are moved
    /// onto a backing peers map where the memory allows; peers reach the rest (or all of it)
    /// through this process's address space (cross-memory attach).
    pub fn publish_region(&self, slot: u16, view: &RegionView) -> Option<PublishedRegion> {
        view.addr.checked_add(view.len)?;
        view.iova.checked_add(view.len)?;
        let backing = self.backing_for(view.addr, view.len);
        let pages = backing
            .as_ref()
            .and_then(|b| Some((b, b.pages_of(view.addr, view.len)?)));
        let s = self.table.mr(usize::from(slot));
        let seq = s.seq.load(Ordering::Relaxed);
        let seq = if seq.is_multiple_of(2) { seq + 1 } else { seq };
        s.seq.store(seq, Ordering::SeqCst);
        s.rkey.store(view.rkey, Ordering::Relaxed);
        s.pd.store(view.pd, Ordering::Relaxed);
        s.access.store(view.access, Ordering::Relaxed);
        match pages {
            Some((backing, (start, len))) => {
                s.backing_fd.store(backing.fd(), Ordering::Relaxed);
                s.backing_ino.store(backing.ino(), Ordering::Relaxed);
                s.pages_iova
                    .store(view.iova + (start - view.addr), Ordering::Relaxed);
                s.pages_len.store(len, Ordering::Relaxed);
                s.backing_offset
                    .store(backing.offset_of(start), Ordering::Relaxed);
            }
            None => {
                s.backing_fd.store(-1, Ordering::Relaxed);
                s.backing_ino.store(0, Ordering::Relaxed);
                s.pages_iova.store(0, Ordering::Relaxed);
                s.pages_len.store(0, Ordering::Relaxed);
                s.backing_offset.store(0, Ordering::Relaxed);
            }
        }
        s.region_iova.store(view.iova, Ordering::Relaxed);
        s.region_len.store(view.len, Ordering::Relaxed);
        s.region_addr.store(view.addr, Ordering::Relaxed);
        s.seq.store(seq + 1, Ordering::Release);
        self.published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(usize::from(slot), (view.addr, view.addr + view.len));
        Some(PublishedRegion {
            slot: usize::from(slot),
            _backing: pages.map(|(b, _)| Arc::clone(b)),
        })
    }

    /// Withdraws a region: once this returns, no peer reads or writes it any more.
    pub fn withdraw_region(&self, region: PublishedRegion) {
        self.published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&region.slot);
        self.invalidate_slot(region.slot);
        self.wait_all_unlocked();
    }

    /// The application unmaps, remaps or protects `[start, start + len)`: every region whose
    /// pages overlap it is withdrawn (its MR is dead from now on; the message path refuses it
    /// too). Once this returns, no peer reads or writes those pages any more.
    pub fn withdraw_overlapping(&self, start: u64, len: u64) {
        let end = start.saturating_add(len);
        let hit: Vec<usize> = self
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|(_, (s, e))| *s < end && *e > start)
            .map(|(slot, _)| *slot)
            .collect();
        if hit.is_empty() {
            return;
        }
        for slot in hit {
            self.invalidate_slot(slot);
        }
        self.wait_all_unlocked();
    }

    fn invalidate_slot(&self, slot: usize) {
        let s = self.table.mr(slot);
        let seq = s.seq.load(Ordering::Relaxed);
        if seq.is_multiple_of(2) {
            s.seq.store(seq + 1, Ordering::SeqCst);
        }
    }

    fn wait_all_unlocked(&self) {
        for i in 0..QP_SLOTS {
            self.wait_unlocked(i);
        }
    }

    /// Publishes QP `qpn` as reachable by its peer (`peer_lid`, `peer_qpn`) with `access`,
    /// and its receive ring if it has one.
    pub fn publish_qp(
        &self,
        qpn: u32,
        pd: u32,
        access: u32,
        peer: (u16, u32),
        ring: Option<&OwnReceiveRing>,
    ) {
        let (peer_lid, peer_qpn) = peer;
        let s = self.table.qp(qp_slot(qpn));
        let seq = s.seq.load(Ordering::Relaxed);
        if seq.is_multiple_of(2) {
            s.seq.store(seq + 1, Ordering::SeqCst);
            self.wait_unlocked(qp_slot(qpn));
        }
        let seq = s.seq.load(Ordering::Relaxed);
        s.qpn.store(qpn, Ordering::Relaxed);
        s.pd.store(pd, Ordering::Relaxed);
        s.access.store(access, Ordering::Relaxed);
        s.peer_lid.store(u32::from(peer_lid), Ordering::Relaxed);
        s.peer_qpn.store(peer_qpn, Ordering::Relaxed);
        s.ring_fd
            .store(ring.map_or(-1, |r| r.ring.fd()), Ordering::Relaxed);
        s.ring_ino
            .store(ring.map_or(0, |r| r.ring.ino()), Ordering::Relaxed);
        s.seq.store(seq + 1, Ordering::Release);
    }

    /// QP `qpn` takes no direct access any more; once this returns, none is in progress.
    pub fn withdraw_qp(&self, qpn: u32) {
        let i = qp_slot(qpn);
        let s = self.table.qp(i);
        if s.qpn.load(Ordering::Relaxed) != qpn {
            return;
        }
        let seq = s.seq.load(Ordering::Relaxed);
        if seq.is_multiple_of(2) {
            s.seq.store(seq + 1, Ordering::SeqCst);
        }
        self.wait_unlocked(i);
    }

    /// Whether QP slot `qpn` maps to is free (no live QP of this process publishes there).
    pub fn qp_slot_free(&self, qpn: u32) -> bool {
        self.table.qp(qp_slot(qpn)).qpn.load(Ordering::Relaxed) == 0
    }

    /// Claims QP `qpn`'s slot (not yet published: odd seq).
    pub fn claim_qp_slot(&self, qpn: u32) {
        let s = self.table.qp(qp_slot(qpn));
        let seq = s.seq.load(Ordering::Relaxed);
        if seq.is_multiple_of(2) {
            s.seq.store(seq + 1, Ordering::SeqCst);
        }
        s.qpn.store(qpn, Ordering::Release);
    }

    /// Releases QP `qpn`'s slot (after [`withdraw_qp`]).
    pub fn release_qp_slot(&self, qpn: u32) {
        let s = self.table.qp(qp_slot(qpn));
        if s.qpn.load(Ordering::Relaxed) == qpn {
            s.qpn.store(0, Ordering::Release);
        }
    }

    /// Waits until no requester holds QP slot `i`'s lock; a holder that died is cleared.
    fn wait_unlocked(&self, i: usize) {
        let lock = &self.table.qp(i).lock;
        let mut spins = 0u32;
        loop {
            let holder = lock.load(Ordering::SeqCst);
            if holder == 0 {
                return;
            }
            spins += 1;
            if spins.is_multiple_of(1024) && !super::address::pid_alive(holder as i32) {
                let _ = lock.compare_exchange(holder, 0, Ordering::SeqCst, Ordering::SeqCst);
            }
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// Adds one to a statistic for the log and returns it: a load and a store, not an atomic
/// read-modify-write (~20 cycles on every direct access); two threads counting at once may
/// lose one.
#[inline]
fn note(counter: &AtomicU64) -> u64 {
    let n = counter.load(Ordering::Relaxed) + 1;
    counter.store(n, Ordering::Relaxed);
    n
}

fn qp_slot(qpn: u32) -> usize {
    qpn as usize % QP_SLOTS
}

/// Why a direct access did not happen (the message path then carries the request).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refused {
    /// Another requester holds the target QP's slot.
    Busy,
    /// The target QP or region is not published for this access (or changed meanwhile).
    NotPublished,
    /// The peer's memory could not be mapped or copied.
    Unreachable,
    /// A SEND found no receive WR it may take (none posted, or the next one takes messages
    /// only: its buffers are not all valid, or too small).
    NoReceive,
}

/// Where a checked range of a peer's published region lies ([`PeerMemory::region_target`]).
enum RegionTarget {
    /// In a backing mapped here, at this offset.
    Mapped(Arc<PeerBacking>, u64),
    /// Only in the peer's address space, at this address (cross-memory attach).
    Process(u64),
}

/// The largest SEND the same-host SEND path carries in a receive ring entry; larger ones are
/// written in place into the receive WR's buffer, when it allows.
pub const SEND_MAX: usize = ENTRY_DATA;

/// A SEND to place in a peer's receive ring ([`PeerMemory::send`]).
pub struct SendToRing<'a> {
    /// Its bytes.
    pub spans: &'a [AppSpan],
    pub imm_data: Option<u32>,
    pub psn: u32,
    /// The ACK the sending QP owes the peer's, carried as a message would carry it.
    pub ack: Option<u32>,
    /// The sending QP: this process's port LID and the QP's number.
    pub from: (u16, u32),
    /// The peer's QP.
    pub dst_qpn: u32,
    /// An RDMA WRITE with immediate data instead of a SEND: its rkey and remote address (its
    /// bytes go there, checked as a direct WRITE; the receive WR takes its completion).
    pub rdma_write: Option<(u32, u64)>,
}

/// Receive rings in this process, and the most it makes.
static RECEIVE_RINGS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
pub const MAX_RECEIVE_RINGS: usize = 256;

/// A requester QP's view of its same-host peer's receive ring (the SEND path's cache): the
/// ring mapped here, and the receive WRs last seen posted in it.
#[derive(Default)]
pub struct PeerRing {
    ring: Option<Arc<ReceiveRing>>,
    posted: PostedAhead,
}

/// A queue pair's receive ring, owner side: the same-host SEND path (docs/design.md). The
/// owner posts each receive WR into it, in order; its connected peer takes the next one
/// (holding the QP's slot lock, as for a direct WRITE) and places a small SEND in it; the
/// owner completes placed WRs in order when its receive CQ is polled, and takes the next WR
/// itself (through the same cursor) for each message that arrives through UCX.
pub struct OwnReceiveRing {
    ring: ReceiveRing,
    /// The receive WRs posted so far (the ring's own count is for the peer, which may write
    /// it too: the owner never reads it back).
    posted: AtomicU64,
    /// The receive WRs completed so far (or taken by messages): the next one to complete.
    /// Changed under the QP's lock; read without it to tell whether a poll has work.
    collected: AtomicU64,
}

impl OwnReceiveRing {
    /// A ring for a receive queue of `max_recv_wr` WRs. Each ring holds a descriptor (peers
    /// open it through `/proc`): beyond [`MAX_RECEIVE_RINGS`] in the process, queue pairs
    /// go without (EMFILE), so that ugdr never takes many of the application's descriptors.
    pub fn create(max_recv_wr: u32) -> std::io::Result<OwnReceiveRing> {
        if RECEIVE_RINGS.fetch_add(1, Ordering::Relaxed) >= MAX_RECEIVE_RINGS {
            RECEIVE_RINGS.fetch_sub(1, Ordering::Relaxed);
            return Err(std::io::Error::from_raw_os_error(libc::EMFILE));
        }
        let ring = Self::create_counted(max_recv_wr);
        if ring.is_err() {
            RECEIVE_RINGS.fetch_sub(1, Ordering::Relaxed);
        }
        ring
    }

    fn create_counted(max_recv_wr: u32) -> std::io::Result<OwnReceiveRing> {
        let capacity = max_recv_wr.max(1).checked_next_power_of_two();
        let capacity = capacity
            .filter(|c| *c <= MAX_ENTRIES)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok(OwnReceiveRing {
            ring: ReceiveRing::create(capacity)?,
            posted: AtomicU64::new(0),
            collected: AtomicU64::new(0),
        })
    }

    /// Posts the next receive WR (`posted()`-th): `room` bytes of buffers; `direct`: a
    /// placed SEND may land in them (else the peer leaves it to messages); `in_place`: where
    /// the peer may write a SEND larger than an entry (the WR's one SGE in a published
    /// region). The ring holds at least as many entries as the queue WRs: the caller never
    /// posts more than that beyond `collected()`.
    pub fn post(&self, room: u64, direct: bool, in_place: Option<InPlace>) {
        let index = self.posted.load(Ordering::Relaxed);
        self.posted.store(index + 1, Ordering::Relaxed);
        self.ring
            .post(index, room.min(ENTRY_DATA as u64) as u32, direct, in_place);
    }

    /// The PSN the next placed SEND must carry: the one after the last request the QP
    /// delivered (set when the QP enters RTR, and once a message took effect; placed SENDs
    /// advance it themselves).
    pub fn set_expected_psn(&self, psn: u32) {
        self.ring.set_expected_psn(psn);
    }

    pub fn collected(&self) -> u64 {
        self.collected.load(Ordering::Relaxed)
    }

    /// Whether the next receive WR to complete holds a placed message (no lock needed).
    pub fn arrived(&self) -> bool {
        let i = self.collected.load(Ordering::Relaxed);
        i < self.posted.load(Ordering::Relaxed) && self.ring.is_filled(i)
    }

    /// The message placed in the next receive WR to complete, if any; its bytes read into
    /// `out` (at most `out.len()` of them). The length is the peer's word: the caller checks
    /// it against the WR (and against `out`) before using the bytes.
    pub fn take_placed(&self, out: &mut [u8]) -> Option<Placed> {
        let i = self.collected.load(Ordering::Relaxed);
        if i >= self.posted.load(Ordering::Relaxed) {
            return None;
        }
        let placed = self.ring.read_filled(i, out)?;
        self.collected.store(i + 1, Ordering::Relaxed);
        Some(Placed {
            psn: placed.psn & super::wire::PSN_MASK,
            ack: placed.ack.map(|a| a & super::wire::PSN_MASK),
            ..placed
        })
    }

    /// Takes the next receive WR for a message that arrived through UCX: false when the peer
    /// took it (its SEND is being placed, or was: complete it first).
    pub fn take_for_message(&self) -> bool {
        let i = self.collected.load(Ordering::Relaxed);
        if i >= self.posted.load(Ordering::Relaxed) {
            return false;
        }
        if self.ring.take(i) {
            self.collected.store(i + 1, Ordering::Relaxed);
            true
        } else {
            false
        }
    }

    /// The `index`-th receive WR (posted, not yet taken) takes no placed SEND any more.
    pub fn refuse(&self, index: u64) {
        if index < self.posted.load(Ordering::Relaxed) {
            self.ring.refuse(index);
        }
    }

    /// Skips the next receive WR (flushed): it takes nothing more.
    pub fn skip(&self) {
        let i = self.collected.load(Ordering::Relaxed);
        if i < self.posted.load(Ordering::Relaxed) {
            let _ = self.ring.take(i);
            self.collected.store(i + 1, Ordering::Relaxed);
        }
    }

    /// Empties the ring (the QP was reset or destroyed): only once the QP is withdrawn, so
    /// that no peer uses it.
    pub fn reset(&self) {
        self.ring.reset();
        self.posted.store(0, Ordering::Relaxed);
        self.collected.store(0, Ordering::Relaxed);
    }
}

impl Drop for OwnReceiveRing {
    fn drop(&mut self) {
        RECEIVE_RINGS.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A peer process on this host whose published memory this process maps (requester side).
pub struct PeerMemory {
    pid: i32,
    /// This process's pid, written into the peer's QP slot lock while an access runs (read
    /// once: `getpid` is a system call, and this is on every direct access).
    me: u32,
    table: PeerTable,
    backings: Mutex<HashMap<(i32, u64), Arc<PeerBacking>, FxBuildHasher>>,
    failed_once: AtomicBool,
    /// The kernel refused cross-memory attach to this peer.
    attach_denied: AtomicBool,
    /// A receive ring of this peer could not be mapped: SENDs to it go as messages without
    /// trying again (each try is three system calls).
    rings_unreachable: AtomicBool,
}

impl PeerMemory {
    /// Maps the table of the process `pid` that owns port `lid`. Fails when the direct path is
    /// off, or the kernel does not let this process open the peer's descriptors (another
    /// user, a non-dumpable peer, a sandbox).
    pub fn open(pid: i32, lid: u16) -> std::io::Result<PeerMemory> {
        if !enabled() {
            return Err(std::io::Error::from_raw_os_error(libc::EPERM));
        }
        let table = PeerTable::open(pid)?;
        if table.lid() != lid {
            return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
        }
        Ok(PeerMemory {
            pid,
            me: std::process::id(),
            table,
            backings: Mutex::new(HashMap::default()),
            failed_once: AtomicBool::new(false),
            attach_denied: AtomicBool::new(false),
            rings_unreachable: AtomicBool::new(false),
        })
    }

    /// `op` with the local `spans` at `remote_addr` under `rkey`, through the peer's QP
    /// `dst_qpn`, from this process's QP `my_qpn` on port `my_lid`.
    #[allow(clippy::too_many_arguments)]
    pub fn access(
        &self,
        op: DirectAccess,
        spans: &[AppSpan],
        my_lid: u16,
        my_qpn: u32,
        dst_qpn: u32,
        rkey: u32,
        remote_addr: u64,
    ) -> Result<(), Refused> {
        let result = self.holding_slot(dst_qpn, || {
            self.access_locked(op, spans, my_lid, my_qpn, dst_qpn, rkey, remote_addr)
        });
        self.count(match (&result, op) {
            (Ok(()), DirectAccess::Write) => &COUNTERS.writes,
            (Ok(()), DirectAccess::Read) => &COUNTERS.reads,
            (Ok(()), DirectAccess::Atomic(_)) => &COUNTERS.atomics,
            (Err(_), _) => &COUNTERS.fallbacks,
        });
        result
    }

    /// Runs `f` holding the peer's QP slot `dst_qpn`'s lock (the fence's other side: the
    /// owner withdraws a slot, then waits until no lock is held); Busy if another holds it.
    fn holding_slot(
        &self,
        dst_qpn: u32,
        f: impl FnOnce() -> Result<(), Refused>,
    ) -> Result<(), Refused> {
        let qp = self.table.qp(qp_slot(dst_qpn));
        if qp
            .lock
            .compare_exchange(0, self.me, Ordering::SeqCst, Ordering::SeqCst)
            .is_err()
        {
            return Err(Refused::Busy);
        }
        let result = f();
        qp.lock.store(0, Ordering::Release);
        result
    }

    /// Counts one outcome; the counts are logged at each power of two.
    #[inline]
    fn count(&self, counter: &AtomicU64) {
        if note(counter).is_power_of_two() {
            self.log_counts();
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn access_locked(
        &self,
        op: DirectAccess,
        spans: &[AppSpan],
        my_lid: u16,
        my_qpn: u32,
        dst_qpn: u32,
        rkey: u32,
        remote_addr: u64,
    ) -> Result<(), Refused> {
        let needed = op.needs();
        let (qp, _) = self.connected_slot(dst_qpn, (my_lid, my_qpn))?;
        let pd = qp.pd.load(Ordering::Relaxed);
        if qp.access.load(Ordering::Relaxed) & needed != needed {
            return Err(Refused::NotPublished);
        }
        let len = op.remote_len(spans);
        let done = match self.region_target(pd, rkey, remote_addr, len, needed)? {
            RegionTarget::Mapped(backing, offset) => match op {
                DirectAccess::Write => backing.write(offset, spans),
                DirectAccess::Read => backing.read(offset, spans),
                DirectAccess::Atomic(atomic) => backing.atomic(offset, atomic).map(|old| {
                    crate::ucp::scatter(spans, &old.to_le_bytes());
                }),
            },
            RegionTarget::Process(addr) => return self.access_process(op, spans, addr),
        };
        done.map_err(|e| {
            tracing::debug!("direct access to pid {}: {e}", self.pid);
            Refused::Unreachable
        })
    }

    /// Where `len` bytes at `addr` of the peer's published region `rkey` lie, if that region
    /// belongs to PD `pd`, grants `needed` and holds them: in a backing mapped here (with the
    /// offset in it), or only in the peer's address space (the address there).
    fn region_target(
        &self,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        needed: u32,
    ) -> Result<RegionTarget, Refused> {
        let mr = self.table.mr(rkey as usize % MR_SLOTS);
        let mr_seq = mr.seq.load(Ordering::SeqCst);
        let end = addr.checked_add(len).ok_or(Refused::NotPublished)?;
        let within = |first: u64, n: u64| addr >= first && end <= first.saturating_add(n);
        let region_iova = mr.region_iova.load(Ordering::Relaxed);
        if mr_seq % 2 == 1
            || mr.rkey.load(Ordering::Relaxed) != rkey
            || mr.pd.load(Ordering::Relaxed) != pd
            || mr.access.load(Ordering::Relaxed) & needed != needed
            || !within(region_iova, mr.region_len.load(Ordering::Relaxed))
        {
            return Err(Refused::NotPublished);
        }
        let pages_iova = mr.pages_iova.load(Ordering::Relaxed);
        let fd = mr.backing_fd.load(Ordering::Relaxed);
        if fd < 0 || !within(pages_iova, mr.pages_len.load(Ordering::Relaxed)) {
            // The peer's table is the peer's word: an address past u64 is refused.
            return mr
                .region_addr
                .load(Ordering::Relaxed)
                .checked_add(addr - region_iova)
                .map(RegionTarget::Process)
                .ok_or(Refused::NotPublished);
        }
        let ino = mr.backing_ino.load(Ordering::Relaxed);
        let offset = mr
            .backing_offset
            .load(Ordering::Relaxed)
            .checked_add(addr - pages_iova)
            .ok_or(Refused::NotPublished)?;
        Ok(RegionTarget::Mapped(self.backing(fd, ino)?, offset))
    }

    /// A WRITE or READ at `addr` of the peer's address space, in a region no backing holds
    /// there: copied straight between the two address spaces by the kernel (cross-memory
    /// attach). Atomics cannot be (a copy is not indivisible): they take the message path.
    fn access_process(
        &self,
        op: DirectAccess,
        spans: &[AppSpan],
        addr: u64,
    ) -> Result<(), Refused> {
        if self.attach_denied.load(Ordering::Relaxed) {
            return Err(Refused::Unreachable);
        }
        let done = match op {
            DirectAccess::Write => write_process(self.pid, addr, spans),
            DirectAccess::Read => read_process(self.pid, addr, spans),
            DirectAccess::Atomic(_) => return Err(Refused::NotPublished),
        };
        done.map_err(|e| {
            if e.raw_os_error() == Some(libc::EPERM) {
                // Not allowed to attach (Yama's ptrace_scope, say): it stays so.
                self.attach_denied.store(true, Ordering::Relaxed);
                tracing::debug!("cannot attach to pid {}: {e}", self.pid);
            } else {
                tracing::debug!("direct access to pid {}: {e}", self.pid);
            }
            Refused::Unreachable
        })
    }

    /// Whether the peer's QP `dst_qpn` publishes a receive ring (it takes placed SENDs).
    pub fn takes_placed_sends(&self, dst_qpn: u32) -> bool {
        let qp = self.table.qp(qp_slot(dst_qpn));
        !self.is_this_process()
            && qp.qpn.load(Ordering::Relaxed) == dst_qpn
            && qp.ring_fd.load(Ordering::Relaxed) >= 0
            && qp.ring_ino.load(Ordering::Relaxed) != 0
    }

    /// Whether the peer is this process (whose QPs' completions may share CQs, where a
    /// receive is expected before the send it answers completes: such SENDs go as messages).
    pub fn is_this_process(&self) -> bool {
        self.pid as u32 == self.me
    }

    /// The same-host SEND path: places a SEND of the local `spans` (at most [`SEND_MAX`]
    /// bytes, with `imm_data`, numbered `psn`) in the next receive WR of the peer's QP
    /// `dst_qpn`, from this process's QP `my_qpn` on port `my_lid`, under the same QP checks
    /// as a direct WRITE, and only if `psn` follows the last request the peer's QP delivered
    /// (nothing before it is still on its way; a requester whose numbering the responder does
    /// not share delivers nothing, as on the message path). `ring`: what the requester QP
    /// keeps of the peer's ring (mapped here, and the WRs it saw posted there).
    pub fn send(&self, ring: &mut PeerRing, send: &SendToRing<'_>) -> Result<(), Refused> {
        let result = self.holding_slot(send.dst_qpn, || self.send_locked(ring, send));
        self.count(match (&result, send.rdma_write) {
            (Ok(()), Some(_)) => &COUNTERS.writes,
            (Err(_), Some(_)) => &COUNTERS.fallbacks,
            (Ok(()), None) => &COUNTERS.sends,
            (Err(_), None) => &COUNTERS.sends_as_messages,
        });
        result
    }

    #[inline]
    fn send_locked(
        &self,
        cache: &mut PeerRing,
        &SendToRing {
            spans,
            imm_data,
            psn,
            ack,
            from: (my_lid, my_qpn),
            dst_qpn,
            rdma_write,
        }: &SendToRing<'_>,
    ) -> Result<(), Refused> {
        let publication = self.connected_ring(cache, dst_qpn, (my_lid, my_qpn))?;
        let ring = cache.ring.as_deref().ok_or(Refused::Unreachable)?;
        if ring.expected_psn() != psn {
            return Err(Refused::NotPublished);
        }
        let len = total_len(spans);
        // The WR's posted slot says whether it is posted (no count of posted WRs is read:
        // that line would move between the two processes' caches on every post and SEND),
        // and what was read of it stays known until the owner withdraws its QP.
        let index = ring.taken();
        let byte_len = u32::try_from(len).map_err(|_| Refused::NoReceive)?;
        let message = |body| Placed {
            byte_len,
            imm_data,
            psn,
            ack,
            body,
        };
        if let Some(to) = rdma_write {
            // A receive WR must be posted: it takes the completion (not the bytes).
            ring.posted_room_ahead(index, publication, &mut cache.posted)
                .ok_or(Refused::NoReceive)?;
            let placed = message(PlacedBody::RdmaWrite);
            return self.write_with_imm(ring, index, dst_qpn, spans, to, placed);
        }
        if len > SEND_MAX {
            // The peer QP's PD, from the slot `connected_ring` found published.
            let pd = self.table.qp(qp_slot(dst_qpn)).pd.load(Ordering::Relaxed);
            let placed = message(PlacedBody::InPlace);
            return self.send_in_place(ring, index, pd, spans, placed);
        }
        let room = ring
            .posted_room_ahead(index, publication, &mut cache.posted)
            .ok_or(Refused::NoReceive)?;
        if len > room as usize {
            return Err(Refused::NoReceive);
        }
        if !ring.take(index) {
            return Err(Refused::Busy);
        }
        // Taken: it is placed now (the length was checked, so the copy cannot fail). Only
        // this QP places in the ring, so the next PSN may follow the fill.
        ring.fill(index, spans, &message(PlacedBody::Entry))
            .map_err(|_| Refused::NotPublished)?;
        ring.set_expected_psn(super::wire::psn_add(psn, 1));
        Ok(())
    }

    /// A SEND larger than a ring entry, into the `index`-th receive WR of `ring` (whose QP
    /// belongs to PD `pd`): written straight into the WR's buffer where the owner said it
    /// lies, after the same checks as a direct WRITE into it (the owner's region there is
    /// published, of the QP's PD, grants local writing and holds the bytes), then the entry
    /// says it is in place.
    fn send_in_place(
        &self,
        ring: &ReceiveRing,
        index: u64,
        pd: u32,
        spans: &[AppSpan],
        message: Placed,
    ) -> Result<(), Refused> {
        let len = message.byte_len;
        let at = ring.in_place(index).ok_or(Refused::NoReceive)?;
        if len > at.len {
            return Err(Refused::NoReceive);
        }
        let target = self.region_target(pd, at.rkey, at.addr, u64::from(len), LOCAL_WRITE)?;
        self.write_then_fill(ring, index, target, spans, &message)?;
        note(&COUNTERS.sends_in_place);
        Ok(())
    }

    /// An RDMA WRITE with immediate data into the peer's QP `dst_qpn`, whose `index`-th receive
    /// WR of `ring` takes its completion: checked as a direct WRITE (the QP grants remote
    /// writing; the region `rkey` is published, of the QP's PD, grants it and holds the bytes
    /// at `addr`), the bytes written there, then the entry filled.
    fn write_with_imm(
        &self,
        ring: &ReceiveRing,
        index: u64,
        dst_qpn: u32,
        spans: &[AppSpan],
        (rkey, addr): (u32, u64),
        message: Placed,
    ) -> Result<(), Refused> {
        let qp = self.table.qp(qp_slot(dst_qpn));
        if qp.access.load(Ordering::Relaxed) & REMOTE_WRITE == 0 {
            return Err(Refused::NotPublished);
        }
        let pd = qp.pd.load(Ordering::Relaxed);
        let target =
            self.region_target(pd, rkey, addr, u64::from(message.byte_len), REMOTE_WRITE)?;
        self.write_then_fill(ring, index, target, spans, &message)?;
        note(&COUNTERS.writes_with_imm);
        Ok(())
    }

    /// Writes `spans` to `target` (checked by the caller), then takes the `index`-th receive WR
    /// of `ring` and fills its entry with `message`. The bytes go first, before the WR is
    /// taken: a copy by the kernel may fail halfway (the peer unmapped the memory), and then
    /// the WR is still there for the message path, whose responder gives the outcome (an
    /// error leaves the target's bytes undefined, as a HCA's). Nobody else takes that WR
    /// meanwhile: the PSN check said every request before this one was delivered, and only
    /// this QP places in the ring; should the take fail all the same, the message path writes
    /// the same bytes again.
    fn write_then_fill(
        &self,
        ring: &ReceiveRing,
        index: u64,
        target: RegionTarget,
        spans: &[AppSpan],
        message: &Placed,
    ) -> Result<(), Refused> {
        match target {
            RegionTarget::Mapped(backing, offset) => {
                backing.write(offset, spans).map_err(|e| {
                    tracing::debug!("direct access to pid {}: {e}", self.pid);
                    Refused::Unreachable
                })?;
            }
            RegionTarget::Process(addr) => {
                self.access_process(DirectAccess::Write, spans, addr)?;
            }
        }
        if !ring.take(index) {
            return Err(Refused::Busy);
        }
        ring.fill(index, spans, message)
            .map_err(|_| Refused::NotPublished)?;
        ring.set_expected_psn(super::wire::psn_add(message.psn, 1));
        Ok(())
    }

    /// Maps into `cache` (once; the caller borrows it from there, not a clone: two atomic
    /// read-modify-writes fewer per SEND) the receive ring of the peer's QP `dst_qpn`, if that
    /// QP is connected to this process's QP `me` (see [`Self::connected_slot`]) and publishes
    /// one; the QP's publication (its slot's sequence number, which changes whenever the
    /// owner withdraws the QP).
    #[inline]
    fn connected_ring(
        &self,
        cache: &mut PeerRing,
        dst_qpn: u32,
        me: (u16, u32),
    ) -> Result<u64, Refused> {
        let (qp, publication) = self.connected_slot(dst_qpn, me)?;
        let fd = qp.ring_fd.load(Ordering::Relaxed);
        let ino = qp.ring_ino.load(Ordering::Relaxed);
        if fd < 0 || ino == 0 {
            return Err(Refused::NotPublished);
        }
        if cache.ring.as_ref().is_none_or(|r| r.ino() != ino) {
            if self.rings_unreachable.load(Ordering::Relaxed) {
                return Err(Refused::Unreachable);
            }
            let r = ReceiveRing::open_peer(self.pid, fd, ino).map_err(|e| {
                tracing::debug!("cannot map a receive ring of pid {}: {e}", self.pid);
                self.rings_unreachable.store(true, Ordering::Relaxed);
                Refused::Unreachable
            })?;
            // Another ring (the QP was connected anew, maybe to another process, whose
            // publications are numbered on their own): nothing seen posted in the last one
            // holds for it.
            *cache = PeerRing {
                ring: Some(Arc::new(r)),
                posted: PostedAhead::default(),
            };
        }
        Ok(publication)
    }

    /// Whether the responder of the peer's QP `dst_qpn` (connected to this process's QP `me`,
    /// with a receive ring) delivered every request before `psn`: they all took effect there,
    /// as an ACK of `psn`'s predecessor would say. False when it cannot tell (no ring).
    pub fn delivered_before(
        &self,
        cache: &mut PeerRing,
        dst_qpn: u32,
        me: (u16, u32),
        psn: u32,
    ) -> bool {
        self.connected_ring(cache, dst_qpn, me).is_ok()
            && cache
                .ring
                .as_deref()
                .is_some_and(|ring| ring.expected_psn() == psn)
    }

    /// The peer's slot for its QP `dst_qpn`, if it is published (not being changed) and
    /// connected to this process's QP `me` (port LID, QP number): what every direct access
    /// checks first. With the slot's sequence number (even: the publication).
    #[inline]
    fn connected_slot(
        &self,
        dst_qpn: u32,
        (my_lid, my_qpn): (u16, u32),
    ) -> Result<(&QpSlot, u64), Refused> {
        let qp = self.table.qp(qp_slot(dst_qpn));
        let seq = qp.seq.load(Ordering::SeqCst);
        if seq % 2 == 1
            || qp.qpn.load(Ordering::Relaxed) != dst_qpn
            || qp.peer_lid.load(Ordering::Relaxed) != u32::from(my_lid)
            || qp.peer_qpn.load(Ordering::Relaxed) != my_qpn
        {
            return Err(Refused::NotPublished);
        }
        Ok((qp, seq))
    }

    fn log_counts(&self) {
        // Observable with UGDR_LOG=debug, at a logarithmic cost.
        tracing::debug!(
            "direct path to pid {}: {} sends placed, {} of them written in place, {} sent as \
             messages, {} writes, {} of them with immediate data, {} reads, {} atomics, {} fell \
             back to messages",
            self.pid,
            COUNTERS.sends.load(Ordering::Relaxed),
            COUNTERS.sends_in_place.load(Ordering::Relaxed),
            COUNTERS.sends_as_messages.load(Ordering::Relaxed),
            COUNTERS.writes.load(Ordering::Relaxed),
            COUNTERS.writes_with_imm.load(Ordering::Relaxed),
            COUNTERS.reads.load(Ordering::Relaxed),
            COUNTERS.atomics.load(Ordering::Relaxed),
            COUNTERS.fallbacks.load(Ordering::Relaxed)
        );
    }

    fn backing(&self, fd: i32, ino: u64) -> Result<Arc<PeerBacking>, Refused> {
        let mut map = self.backings.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = map.get(&(fd, ino)) {
            return Ok(Arc::clone(b));
        }
        match PeerBacking::open(self.pid, fd, ino) {
            Ok(b) => {
                let b = Arc::new(b);
                // A peer's fd numbers are reused for new backings: forget older ones on it.
                map.retain(|(f, _), _| *f != fd);
                map.insert((fd, ino), Arc::clone(&b));
                Ok(b)
            }
            Err(e) => {
                if !self.failed_once.swap(true, Ordering::Relaxed) {
                    tracing::debug!("cannot map memory of pid {}: {e}", self.pid);
                }
                Err(Refused::Unreachable)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The owner's ring and a peer's view of it (this process mapping its own memfd, as a
    /// peer on this host does).
    fn ring_and_peer(max_recv_wr: u32) -> (OwnReceiveRing, ReceiveRing) {
        let own = OwnReceiveRing::create(max_recv_wr).unwrap();
        let peer = ReceiveRing::open_peer(std::process::id() as i32, own.ring.fd(), own.ring.ino())
            .unwrap();
        (own, peer)
    }

    /// What `PeerMemory::send_locked` does once its checks passed.
    fn place(peer: &ReceiveRing, bytes: &[u8], psn: u32) -> u64 {
        let index = peer.taken();
        assert!(peer.take(index));
        let message = Placed {
            byte_len: bytes.len() as u32,
            imm_data: None,
            psn,
            ack: None,
            body: PlacedBody::Entry,
        };
        peer.fill(index, &[AppSpan::of_owned(bytes)], &message)
            .unwrap();
        index
    }

    /// Regions published and withdrawn leave their backings behind while the memory stays
    /// mapped (a new registration of it reuses one); once more than 16 such wait, they are
    /// checked from one read of all the mappings: the reused and the forgotten are the same.
    #[test]
    fn backings_of_withdrawn_regions_are_reused_while_mapped_and_forgotten_once_unmapped() {
        const N: usize = 20;
        let memory = LocalMemory::new(1).unwrap();
        let page = 4096usize;
        // Each region's memory: two pages of their own, unmapped when dropped.
        let mut pages: Vec<Option<crate::ucp::HostBuffer>> = (0..N)
            .map(|_| Some(crate::ucp::HostBuffer::new(2 * page as u64).unwrap()))
            .collect();
        let addrs: Vec<u64> = pages
            .iter()
            .map(|p| p.as_ref().unwrap().span(0, page as u64).unwrap().addr())
            .collect();
        let addr = |i: usize| addrs[i];
        let publish = |i: usize| {
            let slot = memory.allocate_region_slot().unwrap();
            let view = RegionView {
                rkey: u32::from(slot),
                pd: 1,
                access: LOCAL_WRITE,
                iova: addr(i),
                addr: addr(i),
                len: page as u64,
            };
            (slot, memory.publish_region(slot, &view).unwrap())
        };
        let mut inodes = Vec::new();
        for i in 0..N {
            let (slot, region) = publish(i);
            let s = memory.table.mr(usize::from(slot));
            assert!(
                s.backing_fd.load(Ordering::Relaxed) >= 0,
                "region {i} on a backing"
            );
            inodes.push(s.backing_ino.load(Ordering::Relaxed));
            memory.withdraw_region(region);
            memory.free_region_slot(slot);
        }
        // More than 16 unused backings: one read of the mappings; region 3's is reused.
        let (slot, region) = publish(3);
        let s = memory.table.mr(usize::from(slot));
        assert_eq!(s.backing_ino.load(Ordering::Relaxed), inodes[3]);
        memory.withdraw_region(region);
        memory.free_region_slot(slot);
        // The application unmaps all but region 5: the other backings go at the next
        // registration, region 5's stays for it.
        for (i, p) in pages.iter_mut().enumerate() {
            if i != 5 {
                *p = None;
            }
        }
        let (slot, region) = publish(5);
        let s = memory.table.mr(usize::from(slot));
        assert_eq!(s.backing_ino.load(Ordering::Relaxed), inodes[5]);
        assert_eq!(
            memory
                .backings
                .lock()
                .unwrap()
                .iter()
                .map(|b| b.ino())
                .collect::<Vec<_>>(),
            vec![inodes[5]],
            "the unmapped ones were forgotten"
        );
        memory.withdraw_region(region);
        memory.free_region_slot(slot);
    }

    #[test]
    fn region_slots_can_be_taken_leaving_some_to_others() {
        let memory = LocalMemory::new(1).unwrap();
        let reserve = MR_SLOTS / 4;
        let taken: Vec<u16> =
            std::iter::from_fn(|| memory.allocate_region_slot_leaving(reserve)).collect();
        assert_eq!(taken.len(), MR_SLOTS - reserve);
        let rest: Vec<u16> = std::iter::from_fn(|| memory.allocate_region_slot()).collect();
        assert_eq!(
            rest.len(),
            reserve,
            "the reserved ones go to who may take them"
        );
        memory.free_region_slot(taken[0]);
        assert_eq!(memory.allocate_region_slot_leaving(reserve), None);
        assert_eq!(memory.allocate_region_slot(), Some(taken[0]));
    }

    #[test]
    fn placed_sends_and_messages_take_receive_wrs_in_order_through_one_cursor() {
        let (own, peer) = ring_and_peer(3); // 4 entries
        own.set_expected_psn(0x10);
        own.post(64, true, None);
        own.post(64, false, None); // takes messages only
        own.post(8, true, None);
        assert_eq!(peer.posted_room(0), Some(64));
        assert_eq!(peer.posted_room(3), None);
        assert_eq!(peer.expected_psn(), 0x10);
        assert_eq!(peer.posted_room(1), None);
        assert_eq!(peer.posted_room(2), Some(8));
        assert!(!own.arrived());
        place(&peer, b"first", 0x10);
        assert!(own.arrived());
        let mut out = [0u8; SEND_MAX];
        let p = own.take_placed(&mut out).unwrap();
        assert_eq!((p.byte_len, p.imm_data, p.psn), (5, None, 0x10));
        assert_eq!(&out[..5], b"first");
        // The next WR goes to a message the owner delivers.
        assert!(own.take_for_message());
        assert_eq!(peer.taken(), 2);
        // A WR the peer took but has not filled yet is neither placed nor the message's.
        assert!(peer.take(2));
        assert!(own.take_placed(&mut out).is_none());
        assert!(!own.take_for_message());
        // Refused and skipped WRs.
        own.post(64, true, None);
        own.refuse(3);
        assert_eq!(peer.posted_room(3), None);
        own.skip(); // the taken-unfilled one (its peer died): flushed
        assert_eq!(own.collected(), 3);
        own.reset();
        assert_eq!((peer.taken(), own.collected()), (0, 0));
        // Nothing posted before the reset reads as posted after it.
        assert_eq!(peer.posted_room(0), None);
    }

    #[test]
    fn a_length_the_peer_wrote_beyond_any_entry_reads_no_more_than_the_buffer() {
        let (own, peer) = ring_and_peer(1);
        own.post(64, true, None);
        // A peer that places one byte and says it placed u32::MAX.
        let index = peer.taken();
        assert!(peer.take(index));
        let lying = Placed {
            byte_len: u32::MAX,
            imm_data: None,
            psn: 0,
            ack: None,
            body: PlacedBody::Entry,
        };
        peer.fill(index, &[AppSpan::of_owned(b"x")], &lying)
            .unwrap();
        let mut out = [0u8; SEND_MAX];
        let p = own.take_placed(&mut out).unwrap();
        // Reported as written, for the caller to refuse; nothing read past `out`.
        assert_eq!(p.byte_len, u32::MAX);
        assert_eq!(out[0], b'x');
    }
}
