//! A queue pair's receive ring: the receive WRs its owner posted, as its same-host peer sees
//! them, and the small SENDs that peer places in them (the same-host SEND path,
//! `engine/direct.rs`). A memfd of fixed layout: a header, the peer's cursor, one posted slot
//! per receive WR (written by the owner), then one entry per receive WR (written by the
//! peer) of [`ENTRY_DATA`] message bytes. Every field but the message bytes is an atomic, so
//! reading what the other side is changing is defined; what was read is checked before use
//! (the other process is not trusted with this process's memory safety).
//!
//! The two sides write apart: the owner's posts touch only the posted slots (four to a cache
//! line), the peer's SENDs only the entries, and a message of up to [`HEAD_DATA`] bytes lies
//! in its entry's first cache line with what describes it. So a placed SEND moves the
//! entry's line(s) to the owner, and a post one slot line in four to the peer.
//!
//! A SEND larger than an entry is written by the peer straight into the receive WR's buffer,
//! when the owner said where that lies: an *in-place slot* per receive WR (written by the
//! owner with the post, read by the peer only for such SENDs) names the WR's one SGE as the
//! owner's published memory region sees it; the entry then says only that the bytes are in
//! place. An RDMA WRITE with immediate data takes a receive WR too: its bytes go to the
//! address it names, and its entry says so ([`PlacedBody`]).

use super::{Mapping, file_identity, memfd, open_peer_fd};
use crate::ucp::{AppSpan, total_len};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// "ugdrRNG3" (RNG1 kept a count of posted WRs and each WR's room in the peer's entry, lines
/// the owner wrote on every post and the peer read on every SEND; RNG2 had no in-place
/// slots).
const MAGIC: u64 = 0x3347_4e52_5244_4755;
const NAME: &str = "ugdr-receive-ring";

/// The largest message an entry holds: a SEND up to this size takes the ring.
pub const ENTRY_DATA: usize = 256;
/// The most entries a ring has (beyond any `max_recv_wr` ugdr grants).
pub const MAX_ENTRIES: u32 = 1 << 16;

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    capacity: AtomicU32,
}

/// Advanced by whoever takes the next receive WR: the peer placing a SEND, or the owner
/// delivering a message that arrived through UCX.
#[repr(C, align(64))]
struct Taken {
    count: AtomicU64,
    /// The PSN the next SEND placed must carry: the one after the last request the owner's QP
    /// delivered (the peer advances it with each placed SEND; the owner sets it when it
    /// starts, and when a message took effect). A requester reads it as the ACK of all
    /// before it.
    expected_psn: AtomicU32,
}

/// One receive WR as the owner posted it. Slot `i % capacity` stands for the `i`-th receive
/// WR posted since the ring was (re)set. Written by the owner only.
#[repr(C)]
struct PostedSlot {
    /// `i + 1` once the owner posted the `i`-th receive WR and it may take a placed message
    /// (0 or another value: it may not; the message goes through UCX). Stored with Release
    /// after `room`.
    posted_as: AtomicU64,
    /// The receive WR's room (its SGEs' lengths added up, at most [`ENTRY_DATA`] counted).
    room: AtomicU32,
    _pad: u32,
}

/// Where the peer may write a SEND larger than an entry into the `i`-th receive WR (slot
/// `i % capacity`): its one SGE, by the key and address of the owner's published region.
/// Written by the owner before the WR's `posted_as`; `len` 0: nowhere (such SENDs go through
/// UCX).
#[repr(C)]
struct InPlaceSlot {
    rkey: AtomicU32,
    len: AtomicU32,
    addr: AtomicU64,
}

/// A receive WR's one SGE as a peer may write it ([`ReceiveRing::in_place`]): `len` bytes at
/// `addr` of the owner's region `rkey` (checked again against the owner's published region
/// before any byte is written).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InPlace {
    pub rkey: u32,
    pub len: u32,
    pub addr: u64,
}

/// The message placed for one receive WR: entry `i % capacity` holds the `i`-th. Written by
/// the peer only; its message bytes follow it.
#[repr(C)]
struct EntryHead {
    /// `i + 1` once the peer placed the `i`-th message here (byte length, immediate data and
    /// flags written before).
    filled_as: AtomicU64,
    byte_len: AtomicU32,
    imm_data: AtomicU32,
    /// [`FILLED_WITH_IMM`], [`FILLED_WITH_ACK`].
    flags: AtomicU32,
    /// The placed SEND's PSN.
    psn: AtomicU32,
    /// With [`FILLED_WITH_ACK`]: the newest PSN of the owner's own requests the peer
    /// acknowledges with this SEND (as a message's piggybacked ACK).
    ack_psn: AtomicU32,
    _pad: u32,
}

/// Posted slots in one cache line.
const SLOTS_PER_LINE: usize = 64 / std::mem::size_of::<PostedSlot>();

/// Receive WRs a peer saw posted in an owner's ring, kept by the peer
/// ([`ReceiveRing::posted_room_ahead`]): from the `first`-th, `count` of them, with their
/// rooms. A WR once posted stays posted (with its room) until it is taken, unless the owner
/// withdraws it (refuses it, or resets the ring), and the owner does that only with its QP
/// withdrawn from direct access, which changes the `publication` they were read under.
#[derive(Debug, Default, Clone, Copy)]
pub struct PostedAhead {
    publication: u64,
    first: u64,
    rooms: [u32; SLOTS_PER_LINE],
    count: usize,
}

impl PostedAhead {
    fn room(&self, publication: u64, index: u64) -> Option<u32> {
        let k = usize::try_from(index.checked_sub(self.first)?).ok()?;
        (publication == self.publication && k < self.count).then(|| self.rooms[k])
    }
}

/// The placed message carries immediate data.
const FILLED_WITH_IMM: u32 = 1;
/// The placed message acknowledges the owner's requests up to `ack_psn`.
const FILLED_WITH_ACK: u32 = 2;
/// The placed message's bytes are in the receive WR's buffer (its in-place slot), not here.
const FILLED_IN_PLACE: u32 = 4;
/// The placed message is an RDMA WRITE with immediate data: its bytes went to the address it
/// named, and the receive WR takes only its completion.
const FILLED_RDMA_WRITE: u32 = 8;

/// Where a placed message's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacedBody {
    /// In the ring entry (a SEND of up to [`ENTRY_DATA`] bytes).
    Entry,
    /// In the receive WR's buffer, written there by the peer ([`InPlace`]).
    InPlace,
    /// At the address an RDMA WRITE with immediate data named, written there by the peer:
    /// the receive WR takes only the completion.
    RdmaWrite,
}

/// A message placed in a receive WR's entry: its length, immediate data, PSN, and the ACK
/// it carries of the owner's own requests (as a message's piggybacked ACK).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placed {
    pub byte_len: u32,
    pub imm_data: Option<u32>,
    pub psn: u32,
    pub ack: Option<u32>,
    pub body: PlacedBody,
}

const HEADER_SIZE: usize = 2 * 64;
const HEAD_SIZE: usize = std::mem::size_of::<EntryHead>();
/// The message bytes that share the entry's first cache line with its head.
const HEAD_DATA: usize = 64 - HEAD_SIZE;
const _: () = assert!(
    HEAD_DATA >= 8,
    "an 8-byte message fits its entry's first line"
);
/// An entry: its head and data, rounded up to whole cache lines.
const ENTRY_SIZE: usize = (HEAD_SIZE + ENTRY_DATA).next_multiple_of(64);

fn posted_size(capacity: u32) -> usize {
    (capacity as usize * std::mem::size_of::<PostedSlot>()).next_multiple_of(64)
}

fn in_place_size(capacity: u32) -> usize {
    (capacity as usize * std::mem::size_of::<InPlaceSlot>()).next_multiple_of(64)
}

fn size_for(capacity: u32) -> usize {
    HEADER_SIZE + posted_size(capacity) + capacity as usize * ENTRY_SIZE + in_place_size(capacity)
}

/// A receive ring mapped in this process: the owner's (made with [`ReceiveRing::create`]) or
/// a peer's (mapped with [`ReceiveRing::open_peer`]).
pub struct ReceiveRing {
    mapping: Mapping,
    capacity: u32,
    /// Where the entries start (after the header and the posted slots).
    entries_at: usize,
    /// The owner's descriptor (None for a peer's ring).
    fd: Option<OwnedFd>,
    ino: u64,
}

impl ReceiveRing {
    /// A new ring of `capacity` entries (a power of two, at most [`MAX_ENTRIES`]).
    pub fn create(capacity: u32) -> io::Result<ReceiveRing> {
        if !capacity.is_power_of_two() || capacity > MAX_ENTRIES {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        let name = std::ffi::CString::new(NAME).expect("no NUL");
        let size = size_for(capacity);
        let fd = memfd(&name, size as u64)?;
        let (_, ino) = file_identity(&fd)?;
        let mapping = Mapping::of_file(&fd, size)?;
        let ring = ReceiveRing {
            mapping,
            capacity,
            entries_at: HEADER_SIZE + posted_size(capacity),
            fd: Some(fd),
            ino,
        };
        ring.header().capacity.store(capacity, Ordering::Relaxed);
        ring.header().magic.store(MAGIC, Ordering::Release);
        Ok(ring)
    }

    /// Maps the ring behind descriptor `fd` of process `pid`, if it is still inode `ino` and
    /// has a ring's layout.
    pub fn open_peer(pid: i32, fd: i32, ino: u64) -> io::Result<ReceiveRing> {
        let file = open_peer_fd(pid, fd)?;
        let (size, actual) = file_identity(&file)?;
        if actual != ino || size < HEADER_SIZE as u64 || size > size_for(MAX_ENTRIES) as u64 {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        let mapping = Mapping::of_file(&file, size as usize)?;
        let mut ring = ReceiveRing {
            mapping,
            capacity: 0,
            entries_at: 0,
            fd: None,
            ino,
        };
        let capacity = ring.header().capacity.load(Ordering::Relaxed);
        if ring.header().magic.load(Ordering::Acquire) != MAGIC
            || !capacity.is_power_of_two()
            || size_for(capacity) as u64 != size
        {
            return Err(io::Error::from_raw_os_error(libc::EPROTO));
        }
        ring.capacity = capacity;
        ring.entries_at = HEADER_SIZE + posted_size(capacity);
        Ok(ring)
    }

    /// The owner's descriptor, which peers open through `/proc/<pid>/fd/<n>` (-1 for a
    /// peer's ring).
    pub fn fd(&self) -> i32 {
        self.fd.as_ref().map_or(-1, |f| f.as_raw_fd())
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    fn header(&self) -> &Header {
        // SAFETY: the mapping holds at least HEADER_SIZE bytes (checked at create/open), is
        // page-aligned and starts with a Header of atomics (valid for any bits); the borrow
        // lives no longer than `self`, which owns the mapping.
        unsafe { &*self.mapping.base().cast::<Header>() }
    }

    fn taken_line(&self) -> &Taken {
        // SAFETY: as `header`; the second 64-byte line.
        unsafe { &*self.mapping.base().add(64).cast::<Taken>() }
    }

    fn taken_cell(&self) -> &AtomicU64 {
        &self.taken_line().count
    }

    pub fn expected_psn(&self) -> u32 {
        self.taken_line().expected_psn.load(Ordering::Acquire)
    }

    /// Release, not SeqCst (an `xchg` on every placed SEND): whoever reads the PSN then sees
    /// the WRs taken before it was stored; nothing reads back after storing it.
    pub fn set_expected_psn(&self, psn: u32) {
        self.taken_line().expected_psn.store(psn, Ordering::Release);
    }

    /// The slot of the `index`-th receive WR: `capacity` is a power of two (checked at
    /// create/open), so a mask, not a division (a 64-bit `div` costs tens of cycles, several
    /// times per SEND).
    fn slot(&self, index: u64) -> usize {
        (index & u64::from(self.capacity - 1)) as usize
    }

    fn posted_slot(&self, index: u64) -> &PostedSlot {
        // SAFETY: `slot < capacity`, and the posted slots follow the header inside the
        // mapping (`size_for(capacity)` bytes, checked at create/open); 16-byte slots from a
        // 64-byte boundary are aligned; all atomics; borrowed no longer than the mapping.
        unsafe {
            &*self
                .mapping
                .base()
                .add(HEADER_SIZE + self.slot(index) * std::mem::size_of::<PostedSlot>())
                .cast::<PostedSlot>()
        }
    }

    fn in_place_slot(&self, index: u64) -> &InPlaceSlot {
        let at = self.entries_at
            + self.capacity as usize * ENTRY_SIZE
            + self.slot(index) * std::mem::size_of::<InPlaceSlot>();
        // SAFETY: `slot < capacity`, and the in-place slots follow the entries inside the
        // mapping (`size_for(capacity)` bytes, checked at create/open); 16-byte slots from a
        // 64-byte boundary are aligned; all atomics; borrowed no longer than the mapping.
        unsafe { &*self.mapping.base().add(at).cast::<InPlaceSlot>() }
    }

    fn entry_base(&self, index: u64) -> *mut u8 {
        let at = self.entries_at + self.slot(index) * ENTRY_SIZE;
        // SAFETY: `slot < capacity`, and the mapping is `size_for(capacity)` bytes (checked at
        // create/open): the entry lies inside it.
        unsafe { self.mapping.base().add(at) }
    }

    /// The head of the entry that stands for the `index`-th receive WR (read and written
    /// only through `fill`, `read_filled` and `is_filled`: the entry's protocol stays here).
    fn entry(&self, index: u64) -> &EntryHead {
        // SAFETY: inside the mapping (entry_base), 64-byte aligned (page-aligned base,
        // header, posted slots and entries whole cache lines), all atomics; borrowed for no
        // longer than the mapping lives.
        unsafe { &*self.entry_base(index).cast::<EntryHead>() }
    }

    /// The owner posts its `index`-th receive WR: `room` bytes, and whether a placed message
    /// may land in it (`direct`; else the peer leaves it to messages), and where a SEND
    /// larger than an entry may be written in place (`in_place`; None: such SENDs go as
    /// messages).
    pub fn post(&self, index: u64, room: u32, direct: bool, in_place: Option<InPlace>) {
        let target = self.in_place_slot(index);
        match in_place.filter(|_| direct) {
            Some(at) => {
                target.rkey.store(at.rkey, Ordering::Relaxed);
                target.len.store(at.len, Ordering::Relaxed);
                target.addr.store(at.addr, Ordering::Relaxed);
            }
            // Length 0 says nowhere; the rest is not read then.
            None => target.len.store(0, Ordering::Relaxed),
        }
        let slot = self.posted_slot(index);
        slot.room.store(room, Ordering::Relaxed);
        slot.posted_as
            .store(if direct { index + 1 } else { 0 }, Ordering::Release);
    }

    /// The `index`-th receive WR takes no placed message any more.
    pub fn refuse(&self, index: u64) {
        self.posted_slot(index).posted_as.store(0, Ordering::SeqCst);
    }

    /// The room of the `index`-th receive WR, if it is posted and may take a placed message.
    pub fn posted_room(&self, index: u64) -> Option<u32> {
        let slot = self.posted_slot(index);
        (slot.posted_as.load(Ordering::Acquire) == index + 1)
            .then(|| slot.room.load(Ordering::Relaxed))
    }

    /// Where a SEND larger than an entry may be written into the `index`-th receive WR, if it
    /// is posted, may take a placed message, and its owner said where (the owner's word: the
    /// peer checks it against the owner's published regions before writing).
    pub fn in_place(&self, index: u64) -> Option<InPlace> {
        if self.posted_slot(index).posted_as.load(Ordering::Acquire) != index + 1 {
            return None;
        }
        let slot = self.in_place_slot(index);
        let at = InPlace {
            rkey: slot.rkey.load(Ordering::Relaxed),
            len: slot.len.load(Ordering::Relaxed),
            addr: slot.addr.load(Ordering::Relaxed),
        };
        (at.len > 0).then_some(at)
    }

    /// The room of the `index`-th receive WR, as [`ReceiveRing::posted_room`], for a peer
    /// that keeps `ahead`: what it read of this ring under the same `publication` of the
    /// owner's QP (a number that changes whenever the owner may have withdrawn WRs: refused
    /// or reset). When `ahead` does not know the WR, it is read with the WRs after it in its
    /// slot's cache line. So a peer reads that line once per four SENDs, not on each, and the
    /// owner's posts find it in their own cache three times in four (each read moved it to
    /// the peer and back: two transfers between cores on the way of every SEND).
    #[inline]
    pub fn posted_room_ahead(
        &self,
        index: u64,
        publication: u64,
        ahead: &mut PostedAhead,
    ) -> Option<u32> {
        if let Some(room) = ahead.room(publication, index) {
            return Some(room);
        }
        let room = self.posted_room(index)?;
        // The slots after it in its line, while posted (a ring of fewer slots than a line
        // holds wraps into slots of other WRs: no further than its capacity).
        let in_line = SLOTS_PER_LINE - self.slot(index) % SLOTS_PER_LINE;
        let most = in_line.min(self.capacity as usize);
        *ahead = PostedAhead {
            publication,
            first: index,
            rooms: [room; SLOTS_PER_LINE],
            count: 1,
        };
        for k in 1..most {
            match self.posted_room(index + k as u64) {
                Some(r) => {
                    ahead.rooms[k] = r;
                    ahead.count = k + 1;
                }
                None => break,
            }
        }
        Some(room)
    }

    pub fn taken(&self) -> u64 {
        self.taken_cell().load(Ordering::SeqCst)
    }

    /// Takes the `index`-th receive WR if nobody took it yet.
    pub fn take(&self, index: u64) -> bool {
        self.taken_cell()
            .compare_exchange(index, index + 1, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
    }

    /// Starts the ring over (no WR posted or taken): only while no peer may use it. Every
    /// entry is cleared, so that none posted before reads as posted again.
    pub fn reset(&self) {
        for index in 0..u64::from(self.capacity) {
            self.posted_slot(index)
                .posted_as
                .store(0, Ordering::Relaxed);
            self.entry(index).filled_as.store(0, Ordering::Relaxed);
        }
        self.taken_cell().store(0, Ordering::SeqCst);
    }

    /// Whether the `index`-th entry holds the message placed for it.
    pub fn is_filled(&self, index: u64) -> bool {
        self.entry(index).filled_as.load(Ordering::Acquire) == index + 1
    }

    /// Places a message in the `index`-th entry, which the caller took ([`ReceiveRing::take`]):
    /// the bytes of `spans` (at most [`ENTRY_DATA`], else EMSGSIZE and nothing is placed;
    /// none for a message whose bytes are elsewhere, where the caller already wrote `spans`),
    /// then what describes them, then the mark that it is filled.
    #[inline]
    pub fn fill(&self, index: u64, spans: &[AppSpan], message: &Placed) -> io::Result<()> {
        if message.body == PlacedBody::Entry {
            self.write_data(index, spans)?;
        }
        let entry = self.entry(index);
        entry.byte_len.store(message.byte_len, Ordering::Relaxed);
        entry
            .imm_data
            .store(message.imm_data.unwrap_or(0), Ordering::Relaxed);
        entry
            .ack_psn
            .store(message.ack.unwrap_or(0), Ordering::Relaxed);
        let with_imm = if message.imm_data.is_some() {
            FILLED_WITH_IMM
        } else {
            0
        };
        let with_ack = if message.ack.is_some() {
            FILLED_WITH_ACK
        } else {
            0
        };
        let body = match message.body {
            PlacedBody::Entry => 0,
            PlacedBody::InPlace => FILLED_IN_PLACE,
            PlacedBody::RdmaWrite => FILLED_RDMA_WRITE,
        };
        entry
            .flags
            .store(with_imm | with_ack | body, Ordering::Relaxed);
        entry.psn.store(message.psn, Ordering::Relaxed);
        entry.filled_as.store(index + 1, Ordering::Release);
        Ok(())
    }

    /// The message placed in the `index`-th entry, if it is filled, its bytes read into `out`
    /// (at most `out.len()` of them; none when they are elsewhere). Every field is
    /// the peer's word: the caller checks the length against the receive WR before using the
    /// bytes.
    pub fn read_filled(&self, index: u64, out: &mut [u8]) -> Option<Placed> {
        if !self.is_filled(index) {
            return None;
        }
        let entry = self.entry(index);
        let byte_len = entry.byte_len.load(Ordering::Relaxed);
        let flags = entry.flags.load(Ordering::Relaxed);
        let placed = Placed {
            byte_len,
            imm_data: (flags & FILLED_WITH_IMM != 0)
                .then(|| entry.imm_data.load(Ordering::Relaxed)),
            psn: entry.psn.load(Ordering::Relaxed),
            ack: (flags & FILLED_WITH_ACK != 0).then(|| entry.ack_psn.load(Ordering::Relaxed)),
            body: if flags & FILLED_RDMA_WRITE != 0 {
                PlacedBody::RdmaWrite
            } else if flags & FILLED_IN_PLACE != 0 {
                PlacedBody::InPlace
            } else {
                PlacedBody::Entry
            },
        };
        if placed.body == PlacedBody::Entry {
            let n = (byte_len as usize).min(out.len());
            self.read_data(index, &mut out[..n]);
        }
        Some(placed)
    }

    /// Copies the bytes of `spans`, in order, into the `index`-th entry (at most
    /// [`ENTRY_DATA`] in all).
    #[inline]
    fn write_data(&self, index: u64, spans: &[AppSpan]) -> io::Result<()> {
        let total = total_len(spans);
        if total > ENTRY_DATA {
            return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
        }
        // SAFETY: the entry's data area follows its head inside the mapping (entry_base).
        let mut at = unsafe { self.entry_base(index).add(HEAD_SIZE) };
        for s in spans {
            // SAFETY: `s` is a checked span of registered (or ugdr-owned) memory, valid for
            // reads (AppSpan's contract); the destination lies inside the entry's data area
            // (`total <= ENTRY_DATA`), another mapping than any Rust object.
            unsafe {
                std::ptr::copy_nonoverlapping(s.addr() as *const u8, at, s.len());
                at = at.add(s.len());
            }
        }
        Ok(())
    }

    /// Copies the first `out.len()` (at most [`ENTRY_DATA`]) message bytes of the `index`-th
    /// entry into `out`.
    fn read_data(&self, index: u64, out: &mut [u8]) {
        let n = out.len().min(ENTRY_DATA);
        // SAFETY: the source lies inside the entry's data area (n <= ENTRY_DATA); `out` is a
        // Rust slice of this process, never inside the shared mapping. The peer may be
        // writing these bytes (a misbehaving one): plain bytes, any value is valid.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.entry_base(index).add(HEAD_SIZE),
                out.as_mut_ptr(),
                n,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_are_whole_cache_lines_and_a_small_message_shares_its_heads_line() {
        assert_eq!(std::mem::size_of::<EntryHead>(), 32);
        assert_eq!(HEAD_DATA, 32);
        assert_eq!(ENTRY_SIZE, 320);
        assert_eq!(std::mem::size_of::<PostedSlot>(), 16);
        assert_eq!(posted_size(1), 64);
        assert_eq!(posted_size(8), 128);
        assert_eq!(std::mem::size_of::<Header>(), 64);
        assert_eq!(std::mem::size_of::<Taken>(), 64);
    }

    #[test]
    fn a_peer_sees_posted_entries_and_the_owner_the_placed_bytes() {
        let own = ReceiveRing::create(4).unwrap();
        assert!(ReceiveRing::create(3).is_err());
        let peer = ReceiveRing::open_peer(std::process::id() as i32, own.fd(), own.ino()).unwrap();
        assert_eq!(peer.capacity(), 4);
        own.post(5, 64, true, None);
        assert_eq!(peer.posted_room(5), Some(64));
        // Slot 5 is slot 1 of four, and stands for the 5th WR only.
        assert_eq!(peer.posted_room(1), None);
        assert_eq!(peer.posted_room(9), None);
        own.post(6, 64, false, None);
        assert_eq!(peer.posted_room(6), None, "a WR for messages only");
        own.refuse(5);
        assert_eq!(peer.posted_room(5), None);
        own.post(7, 8, true, None);
        own.reset();
        assert_eq!(peer.posted_room(7), None, "nothing posted before a reset");
        let bytes = *b"hello ring";
        peer.write_data(5, &[AppSpan::of_owned(&bytes)]).unwrap();
        let mut out = [0u8; 10];
        own.read_data(5, &mut out);
        assert_eq!(&out, b"hello ring");
        assert!(peer.take(0));
        assert!(!peer.take(0));
        assert_eq!(own.taken(), 1);
        let big = [0u8; ENTRY_DATA + 1];
        assert!(peer.write_data(0, &[AppSpan::of_owned(&big)]).is_err());
    }

    #[test]
    fn a_peer_reads_posted_slots_a_line_at_a_time_and_keeps_them_for_one_publication() {
        let own = ReceiveRing::create(8).unwrap();
        let peer = ReceiveRing::open_peer(std::process::id() as i32, own.fd(), own.ino()).unwrap();
        for (index, room) in [(0, 10), (1, 11), (2, 12), (4, 14)] {
            own.post(index, room, true, None);
        }
        own.post(3, 13, false, None);
        let mut ahead = PostedAhead::default();
        assert_eq!(peer.posted_room_ahead(0, 2, &mut ahead), Some(10));
        // WRs 1 and 2 were read with WR 0; WR 3 takes messages only, so the look stopped.
        assert_eq!((ahead.first, ahead.count), (0, 3));
        own.refuse(1);
        own.refuse(2);
        assert_eq!(
            peer.posted_room_ahead(1, 2, &mut ahead),
            Some(11),
            "kept while the publication is the same (the owner withdraws its QP to refuse)"
        );
        assert_eq!(peer.posted_room_ahead(2, 4, &mut ahead), None, "read again");
        assert_eq!(peer.posted_room_ahead(3, 4, &mut ahead), None);
        // WR 4 starts the second line of slots: the look ends with it (WR 5 is not posted).
        assert_eq!(peer.posted_room_ahead(4, 4, &mut ahead), Some(14));
        assert_eq!((ahead.first, ahead.count), (4, 1));
        own.post(5, 15, true, None);
        own.post(6, 16, true, None);
        own.post(7, 17, true, None);
        own.post(8, 18, true, None); // slot 0 again, the next line
        assert_eq!(peer.posted_room_ahead(5, 4, &mut ahead), Some(15));
        assert_eq!(
            (ahead.first, ahead.count),
            (5, 3),
            "no further than the line"
        );
        assert_eq!(peer.posted_room_ahead(7, 4, &mut ahead), Some(17));
        assert_eq!(peer.posted_room_ahead(8, 4, &mut ahead), Some(18));
        // A ring of two slots: no look beyond them (slot 0 again stands for another WR).
        let small = ReceiveRing::create(2).unwrap();
        small.post(0, 20, true, None);
        small.post(1, 21, true, None);
        let mut ahead = PostedAhead::default();
        assert_eq!(small.posted_room_ahead(0, 0, &mut ahead), Some(20));
        assert_eq!((ahead.first, ahead.count), (0, 2));
        assert_eq!(small.posted_room_ahead(2, 0, &mut ahead), None);
    }

    #[test]
    fn a_peer_sees_where_to_write_in_place_only_for_wrs_posted_so() {
        let own = ReceiveRing::create(2).unwrap();
        let peer = ReceiveRing::open_peer(std::process::id() as i32, own.fd(), own.ino()).unwrap();
        let at = InPlace {
            rkey: 0x1234,
            len: 4096,
            addr: 0x7000_0000,
        };
        assert_eq!(peer.in_place(0), None, "not posted");
        own.post(0, 256, true, Some(at));
        assert_eq!(peer.in_place(0), Some(at));
        assert_eq!(peer.in_place(2), None, "the same slot stands for WR 0 only");
        own.post(1, 256, false, Some(at));
        assert_eq!(peer.in_place(1), None, "a WR for messages only");
        // Slot 0 again, for WR 2: posted without a place, the last one's is gone.
        own.post(2, 64, true, None);
        assert_eq!(peer.in_place(2), None);
        own.post(3, 256, true, Some(at));
        own.refuse(3);
        assert_eq!(peer.in_place(3), None, "refused");
        // A message written in place: the entry says so and holds no bytes to read.
        assert!(peer.take(0));
        let message = Placed {
            byte_len: 3000,
            imm_data: Some(7),
            psn: 9,
            ack: None,
            body: PlacedBody::InPlace,
        };
        peer.fill(0, &[], &message).unwrap();
        let mut out = [0xaau8; 8];
        assert_eq!(own.read_filled(0, &mut out), Some(message));
        assert_eq!(out, [0xaa; 8], "nothing copied out of the entry");
        // A WRITE with immediate data: the entry says so, and holds no bytes either.
        own.post(4, 0, true, None);
        assert!(peer.take(1) && peer.take(2) && peer.take(3) && peer.take(4));
        let write = Placed {
            body: PlacedBody::RdmaWrite,
            ..message
        };
        peer.fill(4, &[], &write).unwrap();
        assert_eq!(own.read_filled(4, &mut out), Some(write));
        assert_eq!(out, [0xaa; 8]);
    }

    #[test]
    fn a_file_that_is_not_a_ring_is_refused() {
        let own = ReceiveRing::create(2).unwrap();
        assert!(
            ReceiveRing::open_peer(std::process::id() as i32, own.fd(), own.ino() + 1).is_err()
        );
    }
}
