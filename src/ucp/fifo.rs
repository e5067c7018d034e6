//! UCX's shared-memory receive FIFOs, and the slot a sender that died while writing left
//! behind.
//!
//! Every UCX worker receives shared-memory messages (the `posix` and `sysv` transports) in
//! one FIFO per transport, in memory that every sender maps. A sender takes a slot by moving
//! the FIFO's head on (an atomic compare-and-swap), writes the message into it, and then flips
//! the slot's owner bit; the receiver reads slots strictly in order, each once its owner bit
//! says it is written. A sender killed between the two (SIGKILL while it sends) leaves a slot
//! that is never written, and the receiver waits for it forever: every later message, from
//! every process, sits behind it. UCX has no recovery for this (1.13 to 1.18 alike). It is
//! what stopped SPDK's target under ugdr from answering any initiator after one was killed
//! mid-I/O (`scripts/spdk cycles`: after ~6 kills, in 2 of 5 runs of 20).
//!
//! This module finds the worker's own FIFOs (the mappings its creation added: a `posix` or
//! `sysv` segment of a FIFO's size whose control block names this process), tells how long the
//! oldest slot taken but not written has been so, and completes such a slot with a message
//! that the receiver drops: a UCP active message for ugdr's id with no header and no payload
//! (ugdr's gate drops what carries no token, and counts it). The receiver then goes on with
//! the next slot. Whether a slot is abandoned, and not just being written by a sender that
//! was descheduled, is the caller's judgment (the engine waits for a local peer's exit, or
//! long enough that no live sender could still be writing).
//!
//! The layout is UCX's (`uct_mm_fifo_ctl_t`, `uct_mm_fifo_element_t`, `ucp_am_hdr_t`, UCP's
//! active-message id 23): read from the sources of 1.13 to 1.18, which agree; other versions
//! are not touched. Element and FIFO sizes are the ones ugdr sets or UCX's defaults; where the
//! user sized them, nothing is touched either.

use std::io::{BufRead, BufReader};
use std::ptr::NonNull;
use std::sync::atomic::{Ordering, fence};
use std::time::Instant;

/// `uct_mm_fifo_ctl_t`: the head (with the "event armed" bit 63) in the first cache line,
/// the tail and the owner's pid in the second; 192 bytes with its alignment.
const CTL_TAIL: usize = 128;
const CTL_PID: usize = 136;
const CTL_SIZE: usize = 192;
const HEAD_EVENT_ARMED: u64 = 1 << 63;
/// `uct_mm_fifo_element_t`: flags (bit 0 the owner bit, bit 1 inline), the UCT active-message
/// id, the length (u16), the receive descriptor (16 bytes) and its pointer; 28 bytes, packed.
const ELEM_FLAGS: usize = 0;
const ELEM_AM_ID: usize = 1;
const ELEM_LENGTH: usize = 2;
const ELEM_HEADER: usize = 28;
const FLAG_OWNER: u8 = 1;
const FLAG_INLINE: u8 = 2;
/// `UCP_AM_ID_AM_SINGLE`: a one-fragment UCP active message, whose payload starts with
/// `ucp_am_hdr_t` (the user's id u16, flags u16, user header length u32).
const UCT_AM_ID_UCP_AM_SINGLE: u8 = 23;
const UCP_AM_HEADER_LEN: usize = 8;

/// The FIFO shape this process's UCX uses: slots and bytes per slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub slots: u64,
    pub slot_size: usize,
}

impl Geometry {
    /// The size of a FIFO's mapping: control block, slots, the alignment UCX allows for,
    /// in whole pages.
    fn mapping_len(self, page: usize) -> usize {
        let raw = CTL_SIZE + self.slots as usize * self.slot_size + 63;
        raw.div_ceil(page) * page
    }
}

/// One shared mapping of this process (`/proc/self/maps`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: usize,
    pub end: usize,
    pub shared_writable: bool,
    pub name: String,
}

/// The mappings of this process now.
pub fn mappings() -> Vec<Mapping> {
    let Ok(f) = std::fs::File::open("/proc/self/maps") else {
        return Vec::new();
    };
    BufReader::new(f)
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| parse_mapping(&l))
        .collect()
}

/// One line of `/proc/PID/maps`: `start-end perms offset dev inode [name]`.
pub fn parse_mapping(line: &str) -> Option<Mapping> {
    let mut fields = line.split_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?;
    let name = fields.nth(3).map(|_| {
        // The name is everything after the inode, spaces and " (deleted)" included.
        let mut rest = line;
        for _ in 0..5 {
            rest = rest.trim_start();
            rest = rest.split_once(char::is_whitespace).map_or("", |(_, r)| r);
        }
        rest.trim().to_string()
    });
    Some(Mapping {
        start: usize::from_str_radix(start, 16).ok()?,
        end: usize::from_str_radix(end, 16).ok()?,
        shared_writable: perms.starts_with("rw") && perms.ends_with('s'),
        name: name.unwrap_or_default(),
    })
}

/// Whether a mapping could be a FIFO of UCX's `posix` or `sysv` transport.
fn named_like_a_fifo(name: &str) -> bool {
    name.contains("/ucx_shm_posix_") || name.starts_with("/SYSV")
}

/// A slot taken and not yet written, and since when it has been seen so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Unwritten {
    index: u64,
    since: Instant,
}

struct Fifo {
    base: NonNull<u8>,
    unwritten: Option<Unwritten>,
}

/// The oldest slot of a FIFO taken and still unwritten, and for how long it has been seen so.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stalled {
    fifo: usize,
    pub index: u64,
    pub since: Instant,
}

/// The receive FIFOs of one worker.
pub struct ReceiveFifos {
    fifos: Vec<Fifo>,
    geometry: Geometry,
}

// SAFETY: the mappings belong to the worker that owns this value and live as long as it;
// every access goes through that worker's lock (LockedWorker).
unsafe impl Send for ReceiveFifos {}

impl ReceiveFifos {
    /// The FIFOs among the mappings `after` a worker's creation that were not there `before`.
    /// Empty where the layout is not known to be UCX's (`version`) or the user sized them.
    pub fn created_between(
        before: &[Mapping],
        after: &[Mapping],
        version: &str,
        geometry: Option<Geometry>,
    ) -> ReceiveFifos {
        let (Some(geometry), true) = (geometry, layout_known(version)) else {
            return ReceiveFifos::unwatched();
        };
        // SAFETY: sysconf has no preconditions.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = geometry.mapping_len(page);
        let pid = std::process::id() as i32;
        let fifos = after
            .iter()
            .filter(|m| m.shared_writable && named_like_a_fifo(&m.name))
            .filter(|m| m.end.checked_sub(m.start) == Some(len))
            .filter(|m| !before.iter().any(|b| b.start == m.start && b.end == m.end))
            .filter_map(|m| NonNull::new(m.start as *mut u8))
            .filter(|base| {
                // SAFETY: a live mapping of `len` bytes (just listed, made by the worker being
                // created, which nothing can destroy meanwhile); CTL_PID + 4 < len.
                let owner = unsafe { base.as_ptr().add(CTL_PID).cast::<i32>().read_volatile() };
                owner == pid
            })
            .map(|base| Fifo {
                base,
                unwritten: None,
            })
            .collect();
        ReceiveFifos { fifos, geometry }
    }

    /// No FIFO watched (shared memory not used, or sized by the user).
    pub fn unwatched() -> ReceiveFifos {
        ReceiveFifos {
            fifos: Vec::new(),
            geometry: Geometry {
                slots: 0,
                slot_size: 0,
            },
        }
    }

    /// How many FIFOs are watched.
    pub fn len(&self) -> usize {
        self.fifos.len()
    }

    pub fn is_empty(&self) -> bool {
        self.fifos.is_empty()
    }

    fn read_u64(&self, f: &Fifo, offset: usize) -> u64 {
        // SAFETY: `offset` lies in the control block of a live FIFO mapping (see Send);
        // 8-byte aligned; senders in other processes write it, hence volatile.
        unsafe { f.base.as_ptr().add(offset).cast::<u64>().read_volatile() }
    }

    fn slot(&self, f: &Fifo, index: u64) -> *mut u8 {
        let i = (index & (self.geometry.slots - 1)) as usize;
        // SAFETY: i < slots, so the slot lies inside the mapping.
        unsafe { f.base.as_ptr().add(CTL_SIZE + i * self.geometry.slot_size) }
    }

    /// The owner bit a slot's writer sets for `index`: it flips at every wrap-around.
    fn written_owner_bit(&self, index: u64) -> u8 {
        ((index / self.geometry.slots) & 1) as u8
    }

    /// Looks at every FIFO: the oldest slot taken and not written, and since when it has been
    /// seen unwritten (now, for one not seen before), if any.
    pub fn stalled(&mut self, now: Instant) -> Option<Stalled> {
        let mut oldest: Option<Stalled> = None;
        for i in 0..self.fifos.len() {
            let f = &self.fifos[i];
            let head = self.read_u64(f, 0) & !HEAD_EVENT_ARMED;
            let tail = self.read_u64(f, CTL_TAIL);
            let first = head.saturating_sub(self.geometry.slots).max(tail.min(head));
            let unwritten = (first..head).find(|&k| {
                // SAFETY: a slot of a live mapping; senders write its flags byte.
                let flags = unsafe { self.slot(f, k).add(ELEM_FLAGS).read_volatile() };
                flags & FLAG_OWNER != self.written_owner_bit(k)
            });
            let f = &mut self.fifos[i];
            f.unwritten = match (unwritten, f.unwritten) {
                (None, _) => None,
                (Some(k), Some(u)) if u.index == k => Some(u),
                (Some(k), _) => Some(Unwritten {
                    index: k,
                    since: now,
                }),
            };
            if let Some(u) = f.unwritten
                && oldest.is_none_or(|o| u.since < o.since)
            {
                oldest = Some(Stalled {
                    fifo: i,
                    index: u.index,
                    since: u.since,
                });
            }
        }
        oldest
    }

    /// Completes a slot that `stalled` reported, if it is still unwritten: as a UCP active
    /// message for `am_id` without header or payload. Returns whether it did.
    pub fn complete_abandoned(&mut self, stalled: Stalled, am_id: u16) -> bool {
        let Some(f) = self.fifos.get(stalled.fifo) else {
            return false;
        };
        let slot = self.slot(f, stalled.index);
        let owner = self.written_owner_bit(stalled.index);
        // SAFETY: a slot of a live mapping. The sender that took it is gone (the caller's
        // judgment), so only this process's receiver, which reads a slot only once its
        // owner bit is set, looks at it: the body first, then (after the fence) the flags.
        unsafe {
            if slot.add(ELEM_FLAGS).read_volatile() & FLAG_OWNER == owner {
                return false;
            }
            let mut body = [0u8; UCP_AM_HEADER_LEN];
            body[..2].copy_from_slice(&am_id.to_le_bytes());
            for (i, b) in body.iter().enumerate() {
                slot.add(ELEM_HEADER + i).write_volatile(*b);
            }
            slot.add(ELEM_LENGTH)
                .cast::<[u8; 2]>()
                .write_unaligned((UCP_AM_HEADER_LEN as u16).to_le_bytes());
            slot.add(ELEM_AM_ID).write_volatile(UCT_AM_ID_UCP_AM_SINGLE);
            fence(Ordering::Release);
            slot.add(ELEM_FLAGS).write_volatile(owner | FLAG_INLINE);
        }
        if let Some(f) = self.fifos.get_mut(stalled.fifo) {
            f.unwritten = None;
        }
        true
    }
}

/// UCX versions whose FIFO and active-message layout this module knows (1.13 to 1.18).
fn layout_known(version: &str) -> bool {
    let mut parts = version.split('.').map(|p| p.parse::<u32>().ok());
    matches!(
        (parts.next(), parts.next()),
        (Some(Some(1)), Some(Some(13..=18)))
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn maps_lines_parse_with_names_that_hold_spaces() {
        let m = parse_mapping(
            "7f18f4020000-7f18f4025000 rw-s 00000000 00:1b 22392                      \
             /dev/shm/ucx_shm_posix_5c9f6bbb (deleted)",
        )
        .unwrap();
        assert_eq!((m.start, m.end), (0x7f18f4020000, 0x7f18f4025000));
        assert!(m.shared_writable);
        assert_eq!(m.name, "/dev/shm/ucx_shm_posix_5c9f6bbb (deleted)");
        let anon = parse_mapping("7ffd1000-7ffd2000 r-xp 00000000 00:00 0").unwrap();
        assert!(!anon.shared_writable);
        assert_eq!(anon.name, "");
        assert!(named_like_a_fifo("/SYSV00000000 (deleted)"));
        assert!(!named_like_a_fifo("/memfd:ugdr-table (deleted)"));
    }

    #[test]
    fn only_known_layouts_are_touched() {
        for v in ["1.13.1", "1.13.0", "1.16.0", "1.18.1"] {
            assert!(layout_known(v), "{v}");
        }
        for v in ["1.12.1", "1.19.0", "2.0.0", "", "x"] {
            assert!(!layout_known(v), "{v}");
        }
        assert_eq!(
            Geometry {
                slots: 64,
                slot_size: 256
            }
            .mapping_len(4096),
            0x5000,
            "as UCX 1.13 maps a FIFO of 64 slots of 256 bytes"
        );
    }

    /// A FIFO in this process's own memory, shaped as UCX's, walked through a sender that
    /// took a slot and died, the watcher's report, and the completion.
    #[test]
    fn an_abandoned_slot_is_reported_then_completed_as_an_empty_message() {
        let geometry = Geometry {
            slots: 4,
            slot_size: 64,
        };
        let mut memory = vec![0u64; (CTL_SIZE + 4 * 64) / 8];
        let base = NonNull::new(memory.as_mut_ptr().cast::<u8>()).unwrap();
        let mut fifos = ReceiveFifos {
            fifos: vec![Fifo {
                base,
                unwritten: None,
            }],
            geometry,
        };
        let set_head = |fifos: &ReceiveFifos, head: u64| {
            // SAFETY: the test's own buffer.
            unsafe { fifos.fifos[0].base.as_ptr().cast::<u64>().write(head) }
        };
        let write = |fifos: &ReceiveFifos, index: u64| {
            let owner = fifos.written_owner_bit(index);
            // SAFETY: a slot of the test's own buffer.
            unsafe {
                fifos
                    .slot(&fifos.fifos[0], index)
                    .write(owner | FLAG_INLINE)
            }
        };
        // Round 0 writes owner bit 0, which fresh (zeroed) memory already shows: mark every
        // slot as written in a previous round (bit 1) first, as after a wrap-around.
        for k in 4..8 {
            write(&fifos, k);
        }
        let t0 = Instant::now();
        set_head(&fifos, 8 | HEAD_EVENT_ARMED);
        assert_eq!(fifos.stalled(t0), None, "every slot taken is written");
        // Slots 8 and 9 taken; 9 written, 8 not (its sender died between the two steps).
        set_head(&fifos, 10);
        write(&fifos, 9);
        let s = fifos.stalled(t0).expect("slot 8 is unwritten");
        assert_eq!((s.index, s.since), (8, t0));
        let later = t0 + Duration::from_millis(300);
        assert_eq!(
            fifos.stalled(later).map(|s| s.since),
            Some(t0),
            "seen since t0"
        );
        assert!(fifos.complete_abandoned(s, 0x4755));
        let slot = fifos.slot(&fifos.fifos[0], 8);
        // SAFETY: the test's own buffer.
        let bytes = unsafe { std::slice::from_raw_parts(slot, ELEM_HEADER + 8) };
        assert_eq!(
            bytes[ELEM_FLAGS], FLAG_INLINE,
            "round 2: owner bit 0, inline"
        );
        assert_eq!(bytes[ELEM_AM_ID], UCT_AM_ID_UCP_AM_SINGLE);
        assert_eq!(&bytes[ELEM_LENGTH..ELEM_LENGTH + 2], &8u16.to_le_bytes());
        assert_eq!(&bytes[ELEM_HEADER..], &[0x55, 0x47, 0, 0, 0, 0, 0, 0]);
        assert_eq!(fifos.stalled(later), None);
        assert!(
            !fifos.complete_abandoned(s, 0x4755),
            "written now: left alone"
        );
        drop(memory);
    }
}
