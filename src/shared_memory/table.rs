//! A process's table of published memory regions and queue pairs: a memfd of fixed layout
//! that the owner writes and its same-host peers map and read. Every field is an atomic, so
//! reading a slot another process is changing is defined (the engine's protocol decides
//! whether what was read may be used).

use super::{Mapping, file_identity, memfd, open_peer_fd};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicI32, AtomicU32, AtomicU64};

/// "ugdrMEM3" (version 3 of this layout: queue pairs publish their receive ring).
const MAGIC: u64 = 0x3349_4d45_4d52_4447;
/// The memfd name peers look for in `/proc/<pid>/fd`.
const NAME: &str = "ugdr-table";

pub const MR_SLOTS: usize = 4096;
pub const QP_SLOTS: usize = 4096;

#[repr(C, align(64))]
struct Header {
    magic: AtomicU64,
    pid: AtomicU32,
    /// The owner's LID: a pid seen from another pid namespace names another process.
    lid: AtomicU32,
}

/// A published memory region (the owner writes it; peers read it).
#[repr(C, align(64))]
pub struct MrSlot {
    /// Even: valid; odd: being changed or withdrawn. Bumped on every change.
    pub seq: AtomicU64,
    pub rkey: AtomicU32,
    pub pd: AtomicU32,
    pub access: AtomicU32,
    /// The owner's descriptor of the memfd holding the whole pages of the region (-1: none).
    pub backing_fd: AtomicI32,
    pub backing_ino: AtomicU64,
    /// The part of the region on those pages, in the peer's (iova) space: first address and
    /// length (0 with no backing).
    pub pages_iova: AtomicU64,
    pub pages_len: AtomicU64,
    /// Offset of `pages_iova` in the backing file.
    pub backing_offset: AtomicU64,
    /// The whole region in the peer's (iova) space, and the owner's address of its first
    /// byte (reached with `process_vm_writev`/`readv` where no backing holds it).
    pub region_iova: AtomicU64,
    pub region_len: AtomicU64,
    pub region_addr: AtomicU64,
}

/// A published queue pair: who may access memory through it.
#[repr(C, align(64))]
pub struct QpSlot {
    /// Even: accepting one-sided requests from its peer; odd: not.
    pub seq: AtomicU64,
    /// The pid of a peer in the middle of a direct access through this QP (0: none).
    pub lock: AtomicU32,
    pub qpn: AtomicU32,
    pub pd: AtomicU32,
    pub access: AtomicU32,
    pub peer_lid: AtomicU32,
    pub peer_qpn: AtomicU32,
    /// The owner's descriptor of the QP's receive ring (-1 or 0 with inode 0: none), and the
    /// ring file's inode.
    pub ring_fd: AtomicI32,
    pub ring_ino: AtomicU64,
}

const MR_OFFSET: usize = std::mem::size_of::<Header>();
const QP_OFFSET: usize = MR_OFFSET + MR_SLOTS * std::mem::size_of::<MrSlot>();
const SIZE: usize = QP_OFFSET + QP_SLOTS * std::mem::size_of::<QpSlot>();

/// Slots viewed through a mapping of the table file.
struct Slots {
    mapping: Mapping,
}

impl Slots {
    fn header(&self) -> &Header {
        // SAFETY: the mapping is SIZE bytes, page-aligned, and starts with a Header; Header is
        // all atomics, valid for any bit pattern (a fresh memfd is zeros); the reference lives
        // no longer than `self`, which owns the mapping.
        unsafe { &*self.mapping.base().cast::<Header>() }
    }

    fn mr(&self, i: usize) -> &MrSlot {
        assert!(i < MR_SLOTS);
        // SAFETY: in bounds (checked), 64-byte aligned (page-aligned base, 64-byte slots), all
        // atomics; borrowed for no longer than the mapping lives.
        unsafe { &*self.mapping.base().add(MR_OFFSET).cast::<MrSlot>().add(i) }
    }

    fn qp(&self, i: usize) -> &QpSlot {
        assert!(i < QP_SLOTS);
        // SAFETY: as for `mr`.
        unsafe { &*self.mapping.base().add(QP_OFFSET).cast::<QpSlot>().add(i) }
    }
}

/// This process's own table.
pub struct Table {
    fd: OwnedFd,
    slots: Slots,
}

impl Table {
    pub fn create() -> io::Result<Table> {
        let name = std::ffi::CString::new(NAME).expect("no NUL");
        let fd = memfd(&name, SIZE as u64)?;
        let mapping = Mapping::of_file(&fd, SIZE)?;
        let slots = Slots { mapping };
        let h = slots.header();
        h.pid
            .store(std::process::id(), std::sync::atomic::Ordering::Relaxed);
        h.magic.store(MAGIC, std::sync::atomic::Ordering::Release);
        Ok(Table { fd, slots })
    }

    pub fn set_lid(&self, lid: u16) {
        self.slots
            .header()
            .lid
            .store(u32::from(lid), std::sync::atomic::Ordering::Release);
    }

    /// The descriptor peers open through `/proc/<pid>/fd/<n>`.
    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub fn mr(&self, i: usize) -> &MrSlot {
        self.slots.mr(i)
    }

    pub fn qp(&self, i: usize) -> &QpSlot {
        self.slots.qp(i)
    }
}

/// A peer process's table, mapped here.
pub struct PeerTable {
    pub pid: i32,
    slots: Slots,
}

impl PeerTable {
    /// Finds and maps the table of process `pid` (its memfd among its descriptors).
    pub fn open(pid: i32) -> io::Result<PeerTable> {
        let wanted = format!("/memfd:{NAME} (deleted)");
        let mut found = None;
        for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
            let entry = entry?;
            if std::fs::read_link(entry.path()).is_ok_and(|t| t.as_os_str() == wanted.as_str()) {
                found = entry
                    .file_name()
                    .to_str()
                    .and_then(|n| n.parse::<i32>().ok());
                break;
            }
        }
        let n = found.ok_or_else(|| io::Error::from_raw_os_error(libc::ENOENT))?;
        let fd = open_peer_fd(pid, n)?;
        let (size, _) = file_identity(&fd)?;
        if size != SIZE as u64 {
            return Err(io::Error::from_raw_os_error(libc::EPROTO));
        }
        let slots = Slots {
            mapping: Mapping::of_file(&fd, SIZE)?,
        };
        let h = slots.header();
        if h.magic.load(std::sync::atomic::Ordering::Acquire) != MAGIC
            || h.pid.load(std::sync::atomic::Ordering::Relaxed) != pid as u32
        {
            return Err(io::Error::from_raw_os_error(libc::EPROTO));
        }
        Ok(PeerTable { pid, slots })
    }

    /// The LID its owner published (0 until the owner claimed one).
    pub fn lid(&self) -> u16 {
        self.slots
            .header()
            .lid
            .load(std::sync::atomic::Ordering::Acquire) as u16
    }

    pub fn mr(&self, i: usize) -> &MrSlot {
        self.slots.mr(i)
    }

    pub fn qp(&self, i: usize) -> &QpSlot {
        self.slots.qp(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::Ordering;

    #[test]
    fn slots_are_cache_lines_and_the_table_is_page_sized_pieces() {
        assert_eq!(std::mem::size_of::<MrSlot>(), 128);
        assert_eq!(std::mem::size_of::<QpSlot>(), 64);
        assert_eq!(SIZE, 64 + 128 * MR_SLOTS + 64 * QP_SLOTS);
    }

    #[test]
    fn a_peer_sees_what_the_owner_publishes() {
        let own = Table::create().unwrap();
        own.mr(7).rkey.store(0xabc, Ordering::Release);
        own.qp(4095).qpn.store(0x1234, Ordering::Release);
        let peer = PeerTable::open(std::process::id() as i32).unwrap();
        assert_eq!(peer.mr(7).rkey.load(Ordering::Acquire), 0xabc);
        assert_eq!(peer.qp(4095).qpn.load(Ordering::Acquire), 0x1234);
        peer.qp(3).lock.store(99, Ordering::Release);
        assert_eq!(own.qp(3).lock.load(Ordering::Acquire), 99);
    }

    #[test]
    fn a_process_without_a_table_has_none_to_open() {
        // pid 1 (init or the container's first process) runs no ugdr, or cannot be opened.
        assert!(PeerTable::open(1).is_err() || std::process::id() == 1);
    }
}
