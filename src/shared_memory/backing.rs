//! Registered memory on a memfd, so that same-host peers can map the very pages.
//!
//! [`Backing::share`] moves the whole pages inside a registered range of private anonymous
//! memory (heap, `malloc`, `mmap(MAP_ANONYMOUS | MAP_PRIVATE)`) onto a new memfd: it copies
//! the pages that hold data (never-touched pages stay unallocated) and maps the memfd over
//! them with `MAP_FIXED`, read-write as before. The application sees the same bytes at the
//! same addresses. Only pages entirely inside the registered range move, so no other
//! allocation sharing a page with it (malloc's own bookkeeping included) is ever touched.
//! What changes, and is documented in docs/design.md: those pages are now a shared mapping (a
//! `fork()`ed child shares them instead of copying them on write), and a store the application
//! makes to the registered buffer itself while `ibv_reg_mr` runs may be lost. Ranges that are
//! file-backed, shared already, the main thread's stack (which grows), or not readable and
//! writable are left alone (`share` fails).
//!
//! [`Backing::adopt_shared`] takes memory that is a shared, read-write mapping of a file the
//! process still has open already (DPDK's and so SPDK's `--no-huge` memory is a memfd mapped
//! `MAP_SHARED`; so is memory other programs share on purpose): nothing moves, ugdr opens the
//! file again through that descriptor and publishes where the range lies in it. Anything else
//! (a private file mapping, a file no descriptor holds any more) keeps to the message path.

use super::{Mapping, file_identity, memfd, open_peer_fd, page_size};
use crate::ucp::mappings::{Vma, vmas_overlapping};
use crate::ucp::{AppSpan, total_len};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

/// Application memory moved onto a memfd (owner side). The memfd stays open while the
/// backing lives, so that peers can open it; the application's mapping keeps the pages.
pub struct Backing {
    fd: OwnedFd,
    ino: u64,
    /// Page-aligned start and length of the range.
    base: u64,
    len: u64,
    /// Where `base` lies in the file (0 for memory ugdr moved onto its own memfd).
    file_offset: u64,
}

impl Backing {
    /// Moves the whole pages inside `[addr, addr + len)` onto a memfd (see the module
    /// comment); fails when there are none.
    pub fn share(addr: u64, len: u64) -> io::Result<Backing> {
        let page = page_size();
        let (base, end) = addr
            .checked_add(len)
            .and_then(|end| whole_pages(addr, end))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ERANGE))?;
        let size = end - base;
        check_private_anonymous(base, end)?;
        let fd = memfd(c"ugdr-mr", size)?;
        let (_, ino) = file_identity(&fd)?;
        let staging = Mapping::of_file(&fd, size as usize)?;
        let resident = resident_pages(base, size / page);
        for (i, present) in resident.iter().enumerate() {
            if !present {
                continue; // never touched: reads as zeros, as the fresh memfd does
            }
            let off = i as u64 * page;
            // SAFETY: the source page lies in a private anonymous, readable and writable
            // mapping of this process (checked above), the destination inside the staging
            // mapping of `size` bytes; the two never overlap (the staging mapping is new).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    (base + off) as *const u8,
                    staging.base().add(off as usize),
                    page as usize,
                );
            }
        }
        // SAFETY: replaces exactly the pages of `[base, end)`, which were checked to be a
        // private anonymous read-write mapping of this process, by a shared mapping of the
        // memfd that now holds their content: the same bytes at the same addresses.
        let mapped = unsafe {
            super::raw_mmap(
                base,
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_FIXED,
                fd.as_raw_fd(),
            )
        };
        if mapped == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Backing {
            fd,
            ino,
            base,
            len: size,
            file_offset: 0,
        })
    }

    /// Adopts the whole pages inside `[addr, addr + len)` when they are one shared read-write
    /// mapping of a file this process holds a descriptor of (see the module comment).
    pub fn adopt_shared(addr: u64, len: u64) -> io::Result<Backing> {
        let (base, end) = addr
            .checked_add(len)
            .and_then(|end| whole_pages(addr, end))
            .ok_or_else(|| io::Error::from_raw_os_error(libc::ERANGE))?;
        let file = shared_file_of(&vmas_overlapping(base, end)?, base, end)?;
        let fd = open_by_identity(file.dev, file.ino)?;
        let (size, ino) = file_identity(&fd)?;
        if ino != file.ino || file.offset.saturating_add(end - base) > size {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        Ok(Backing {
            fd,
            ino,
            base,
            len: end - base,
            file_offset: file.offset,
        })
    }

    pub fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    /// The moved range: its first address and length.
    pub fn range(&self) -> (u64, u64) {
        (self.base, self.len)
    }

    /// The whole pages inside `[addr, addr + len)` that lie in this backing, as (first
    /// address, length); None when there are none.
    pub fn pages_of(&self, addr: u64, len: u64) -> Option<(u64, u64)> {
        let (start, end) = whole_pages(addr, addr.checked_add(len)?)?;
        let start = start.max(self.base);
        let end = end.min(self.base + self.len);
        (end > start).then_some((start, end - start))
    }

    /// Whether this backing holds every whole page inside `[addr, end)`.
    pub fn covers_pages_of(&self, addr: u64, end: u64) -> bool {
        whole_pages(addr, end).is_some_and(|(s, e)| s >= self.base && e <= self.base + self.len)
    }

    /// Where address `addr` (inside the backing) lies in the file.
    pub fn offset_of(&self, addr: u64) -> u64 {
        self.file_offset + (addr - self.base)
    }

    /// Whether the application still maps this backing's pages from its memfd: then a new
    /// registration of the same memory can reuse it.
    pub fn still_mapped(&self) -> bool {
        vmas_overlapping(self.base, self.base + self.len)
            .is_ok_and(|vmas| self.still_mapped_in(&vmas))
    }

    /// [`Backing::still_mapped`], from `vmas` (mappings that include those over the backing).
    pub fn still_mapped_in(&self, vmas: &[Vma]) -> bool {
        let end = self.base + self.len;
        let mut covered = self.base;
        for m in vmas {
            if m.inode == self.ino && m.start <= covered && m.end > covered {
                covered = m.end;
                if covered >= end {
                    return true;
                }
            }
        }
        false
    }

    /// Whether the whole pages inside `[addr, end)` overlap this backing.
    pub fn overlaps(&self, addr: u64, end: u64) -> bool {
        whole_pages(addr, end).is_some_and(|(s, e)| s < self.base + self.len && e > self.base)
    }
}

/// The whole pages inside `[addr, end)`: (first page, end of the last page), if any.
fn whole_pages(addr: u64, end: u64) -> Option<(u64, u64)> {
    let page = page_size();
    let start = addr.checked_add(page - 1)? & !(page - 1);
    let end = end & !(page - 1);
    (end > start).then_some((start, end))
}

/// Checks, from this process's mappings, that `[start, end)` is covered by private anonymous
/// mappings that are readable and writable and not the stack.
fn check_private_anonymous(start: u64, end: u64) -> io::Result<()> {
    let mut covered = start;
    for m in vmas_overlapping(start, end)? {
        let anonymous =
            m.inode == 0 && (m.anonymous_name.is_empty() || m.anonymous_name == "[heap]");
        if m.start > covered || !anonymous || !m.read || !m.write || m.shared {
            return Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP));
        }
        covered = m.end;
        if covered >= end {
            return Ok(());
        }
    }
    Err(io::Error::from_raw_os_error(libc::EFAULT))
}

/// The file a range of shared memory maps, and where the range starts in it.
#[derive(Debug)]
struct SharedFile {
    dev: u64,
    ino: u64,
    offset: u64,
}

/// Checks, from the mappings over `[start, end)`, that the range is one read-write shared
/// mapping of one file, contiguous in it, and says which file and where.
fn shared_file_of(vmas: &[Vma], start: u64, end: u64) -> io::Result<SharedFile> {
    let unsupported = || io::Error::from_raw_os_error(libc::EOPNOTSUPP);
    let mut covered = start;
    let mut found: Option<SharedFile> = None;
    for m in vmas {
        if m.end <= covered || m.start >= end {
            continue;
        }
        if m.start > covered || m.inode == 0 || !m.read || !m.write || !m.shared {
            return Err(unsupported());
        }
        // Where `covered` lies in this mapping's file.
        let at = m.offset + (covered - m.start);
        match &found {
            None => {
                found = Some(SharedFile {
                    dev: m.dev,
                    ino: m.inode,
                    offset: at,
                })
            }
            Some(f) if f.dev == m.dev && f.ino == m.inode && f.offset + (covered - start) == at => {
            }
            Some(_) => return Err(unsupported()),
        }
        covered = m.end;
        if covered >= end {
            return found.ok_or_else(unsupported);
        }
    }
    Err(io::Error::from_raw_os_error(libc::EFAULT))
}

/// Opens again, read-write, the file one of this process's descriptors holds with device
/// `dev` and inode `ino` (through `/proc/self/fd`, which reopens memfds too).
fn open_by_identity(dev: u64, ino: u64) -> io::Result<OwnedFd> {
    for entry in std::fs::read_dir("/proc/self/fd")?.flatten() {
        let path = entry.path();
        let Ok(meta) = std::fs::metadata(&path) else {
            continue;
        };
        use std::os::unix::fs::MetadataExt;
        if meta.dev() != dev || meta.ino() != ino || !meta.file_type().is_file() {
            continue;
        }
        if let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
        {
            return Ok(OwnedFd::from(file));
        }
    }
    Err(io::Error::from_raw_os_error(libc::EOPNOTSUPP))
}

/// For each page of `[base, base + pages * page)`: whether it holds data (present or swapped,
/// from `/proc/self/pagemap`). Unknown (no pagemap): every page counts as holding data.
fn resident_pages(base: u64, pages: u64) -> Vec<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let all = vec![true; pages as usize];
    let Ok(mut f) = std::fs::File::open("/proc/self/pagemap") else {
        return all;
    };
    let mut raw = vec![0u8; pages as usize * 8];
    if f.seek(SeekFrom::Start(base / page_size() * 8)).is_err() || f.read_exact(&mut raw).is_err() {
        return all;
    }
    raw.chunks_exact(8)
        .map(|e| {
            let v = u64::from_le_bytes(e.try_into().expect("8 bytes"));
            v & (3 << 62) != 0 // bit 63: present, bit 62: swapped
        })
        .collect()
}

/// An RDMA atomic on 8 bytes of a peer's memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    FetchAdd(u64),
    CompareSwap { compare: u64, swap: u64 },
}

/// A peer's backing, mapped here (requester side).
pub struct PeerBacking {
    mapping: Mapping,
    ino: u64,
}

impl PeerBacking {
    /// Maps the memfd behind descriptor `fd` of process `pid`, if it is still inode `ino`.
    pub fn open(pid: i32, fd: i32, ino: u64) -> io::Result<PeerBacking> {
        let file = open_peer_fd(pid, fd)?;
        let (size, actual) = file_identity(&file)?;
        if actual != ino || size == 0 {
            return Err(io::Error::from_raw_os_error(libc::ESTALE));
        }
        let mapping = Mapping::of_file(&file, size as usize)?;
        Ok(PeerBacking { mapping, ino })
    }

    pub fn ino(&self) -> u64 {
        self.ino
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        let off =
            usize::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EFAULT))?;
        match off.checked_add(len) {
            Some(end) if end <= self.mapping.len => Ok(off),
            _ => Err(io::Error::from_raw_os_error(libc::EFAULT)),
        }
    }

    /// Copies the bytes of `spans`, in order, to `offset` in the peer's memory.
    pub fn write(&self, offset: u64, spans: &[AppSpan]) -> io::Result<()> {
        let total = total_len(spans);
        let mut at = self.check(offset, total)?;
        for s in spans {
            // SAFETY: `s` is a checked span of registered (or ugdr-owned) memory, valid for
            // reads (AppSpan's contract); the destination range was bounds-checked against the
            // mapping; the peer's pages are another mapping, never the same Rust object.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    s.addr() as *const u8,
                    self.mapping.base().add(at),
                    s.len(),
                );
            }
            at += s.len();
        }
        Ok(())
    }

    /// Applies `op` to the 8 bytes at `offset` in the peer's memory as one atomic
    /// read-modify-write (host byte order, as the peer's responder executes atomics that
    /// arrive as messages, so both stay atomic with each other); the value they held before.
    /// EINVAL when those bytes are not 8-byte aligned.
    pub fn atomic(&self, offset: u64, op: AtomicOp) -> io::Result<u64> {
        let at = self.check(offset, 8)?;
        // SAFETY: `at + 8` lies inside the mapping (checked above).
        let p = unsafe { self.mapping.base().add(at) };
        if !(p as usize).is_multiple_of(8) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: 8 aligned bytes inside a live shared mapping of plain memory; the peer and
        // other requesters only ever change them with atomics of the same width (or racing
        // stores the verbs contract leaves undefined), never through Rust references.
        let cell = unsafe { std::sync::atomic::AtomicU64::from_ptr(p.cast::<u64>()) };
        let order = std::sync::atomic::Ordering::SeqCst;
        Ok(match op {
            AtomicOp::FetchAdd(add) => cell.fetch_add(add, order),
            AtomicOp::CompareSwap { compare, swap } => {
                match cell.compare_exchange(compare, swap, order, order) {
                    Ok(v) | Err(v) => v,
                }
            }
        })
    }

    /// Copies bytes at `offset` in the peer's memory into `spans`, in order.
    pub fn read(&self, offset: u64, spans: &[AppSpan]) -> io::Result<()> {
        let total = total_len(spans);
        let mut at = self.check(offset, total)?;
        for s in spans {
            // SAFETY: `s` is a checked span of registered memory with local write access,
            // valid for writes (AppSpan's contract); the source range was bounds-checked.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    self.mapping.base().add(at),
                    s.addr() as *mut u8,
                    s.len(),
                );
            }
            at += s.len();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ucp::mappings::{all_vmas, vmas_of_text};
    use crate::ucp::{AppRegion, HostBuffer};

    #[test]
    fn a_shared_file_range_is_found_in_the_maps_and_anything_else_refused() {
        let maps = "\
1000-3000 rw-s 00002000 00:01 77 /memfd:nohuge (deleted)
3000-5000 rw-s 00004000 00:01 77 /memfd:nohuge (deleted)
5000-6000 rw-s 00000000 00:01 78 /memfd:other (deleted)
6000-7000 rw-p 00000000 00:00 0
7000-8000 r--s 00000000 00:01 79 /memfd:ro (deleted)
";
        let maps = &vmas_of_text(maps, 0, u64::MAX);
        let f = shared_file_of(maps, 0x2000, 0x5000).unwrap();
        assert_eq!((f.dev, f.ino, f.offset), (libc::makedev(0, 1), 77, 0x3000));
        let refused = |lo, hi| shared_file_of(maps, lo, hi).unwrap_err().raw_os_error();
        assert_eq!(refused(0x4000, 0x6000), Some(libc::EOPNOTSUPP), "two files");
        assert_eq!(refused(0x6000, 0x7000), Some(libc::EOPNOTSUPP), "private");
        assert_eq!(refused(0x7000, 0x8000), Some(libc::EOPNOTSUPP), "read-only");
        assert_eq!(refused(0x8000, 0x9000), Some(libc::EFAULT), "not mapped");
        // Two lines of one file that are not contiguous in it.
        let gap = "1000-2000 rw-s 00000000 00:01 77 /f\n2000-3000 rw-s 00005000 00:01 77 /f\n";
        let gap = &vmas_of_text(gap, 0, u64::MAX);
        assert_eq!(
            shared_file_of(gap, 0x1000, 0x3000)
                .unwrap_err()
                .raw_os_error(),
            Some(libc::EOPNOTSUPP)
        );
    }

    /// A private anonymous mapping of `pages` pages, filled with a pattern.
    fn anonymous(pages: usize) -> &'static mut [u8] {
        let len = pages * page_size() as usize;
        // Leaked: unmapped only when the test process ends.
        let mapped = std::mem::ManuallyDrop::new(HostBuffer::new(len as u64).unwrap());
        let addr = mapped.span(0, len as u64).unwrap().addr();
        // SAFETY: the fresh mapping above, `len` bytes, owned by the test from now on.
        let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, len) };
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        buf
    }

    fn span(addr: u64, len: u64) -> AppSpan {
        // SAFETY: test memory that stays mapped (leaked) for the test's duration.
        unsafe { AppRegion::new(addr, len, true) }
            .span(addr, len)
            .unwrap()
    }

    #[test]
    fn cross_memory_attach_copies_whole_spans_and_refuses_unmapped_ranges() {
        use crate::shared_memory::{read_process, write_process};
        let me = std::process::id() as i32;
        let target = anonymous(2);
        let source = anonymous(1);
        source[..10].copy_from_slice(b"0123456789");
        let at = target.as_ptr() as u64 + 100;
        // Two spans land back to back, in order.
        let src = source.as_ptr() as u64;
        write_process(me, at, &[span(src + 5, 5), span(src, 5)]).unwrap();
        assert_eq!(&target[100..110], b"5678901234");
        assert_eq!(target[99], 99, "nothing before");
        assert_eq!(target[110], 110, "nothing after");
        let back = anonymous(1);
        read_process(me, at, &[span(back.as_ptr() as u64, 10)]).unwrap();
        assert_eq!(&back[..10], b"5678901234");
        // A range running into an unmapped page is refused, not partly reported as done.
        let page = page_size();
        let second = target[page as usize..].as_mut_ptr().cast();
        // SAFETY: the second page of the test's own mapping, which nothing else uses.
        let unmapped = unsafe { libc::munmap(second, page as usize) };
        assert_eq!(unmapped, 0);
        let last = target.as_ptr() as u64 + page - 4;
        let err = write_process(me, last, &[span(src, 8)]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
        let err = read_process(me, last, &[span(back.as_ptr() as u64, 8)]).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EFAULT));
    }

    #[test]
    fn sharing_keeps_the_bytes_and_a_peer_mapping_sees_and_changes_them() {
        let buf = anonymous(4);
        let start = buf.as_ptr() as u64;
        // Registered from the middle of page 0 to the middle of page 3: pages 1 and 2 move.
        let backing = Backing::share(start + 100, 3 * 4096).unwrap();
        assert_eq!(backing.range(), (start + 4096, 2 * 4096));
        assert_eq!(
            backing.pages_of(start, 3 * 4096),
            Some((start + 4096, 2 * 4096))
        );
        assert!(backing.covers_pages_of(start + 4096, start + 3 * 4096 + 7));
        assert!(!backing.covers_pages_of(start, start + 4 * 4096));
        assert!(backing.still_mapped(), "the application maps the memfd now");
        assert!(backing.still_mapped_in(&all_vmas().unwrap()));
        assert!(buf.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        let peer =
            PeerBacking::open(std::process::id() as i32, backing.fd(), backing.ino()).unwrap();
        let src = [7u8; 10];
        peer.write(
            backing.offset_of(start + 4096 + 5),
            &[AppSpan::of_owned(&src)],
        )
        .unwrap();
        assert_eq!(&buf[4096 + 5..4096 + 15], &[7u8; 10]);
        assert_eq!(buf[4096 + 4], ((4096 + 4) % 251) as u8);
        let out = anonymous(1);
        peer.read(
            backing.offset_of(start + 4096),
            &[span(out.as_ptr() as u64, 4)],
        )
        .unwrap();
        assert_eq!(&out[..4], &buf[4096..4100]);
        assert!(
            peer.write(2 * 4096 - 5, &[AppSpan::of_owned(&src)])
                .is_err()
        );
        // The application maps other memory over one of the pages: the backing is no longer
        // what it maps there, by either way of reading the mappings.
        // SAFETY: page 2 of the test's own mapping, which nothing uses from here on.
        let over = unsafe {
            libc::mmap(
                (start + 2 * 4096) as *mut libc::c_void,
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        assert_ne!(over, libc::MAP_FAILED);
        assert!(!backing.still_mapped());
        assert!(!backing.still_mapped_in(&all_vmas().unwrap()));
    }

    #[test]
    fn file_backed_and_sub_page_memory_are_left_alone() {
        let text =
            sharing_keeps_the_bytes_and_a_peer_mapping_sees_and_changes_them as *const () as usize;
        assert!(Backing::share(text as u64, 8192).is_err());
        let buf = anonymous(2);
        assert!(Backing::share(buf.as_ptr() as u64 + 1, 4096).is_err());
    }
}
