//! Memory that ugdr processes on one host share, so that an RDMA WRITE or READ between them
//! is a `memcpy` by the requester and needs nothing of the target's CPU (docs/design.md,
//! "Same-host one-sided path").
//!
//! * [`Table`]: each process's table of published memory regions and queue pairs, in a memfd
//!   its peers map. The slot layout is the protocol between processes; the rules for using it
//!   (who writes what, in which order) live in the engine (`engine/direct.rs`).
//! * [`Backing`]: registered application memory moved, in place and with its content, onto a
//!   memfd (the pages stay at the same addresses with the same protection, now as a shared
//!   mapping), so that a peer can map the same pages.
//! * [`PeerTable`], [`PeerBacking`]: a peer's table and backings, mapped into this process
//!   through `/proc/<pid>/fd/<n>` (which the kernel allows exactly when this process may
//!   ptrace-read the peer: same user, peer dumpable, or CAP_SYS_PTRACE).
//! * [`ReceiveRing`]: a queue pair's posted receive WRs as its same-host peer sees them, and
//!   the SENDs that peer places in them (a memfd per queue pair, mapped by the peer as the
//!   table is).
//! * [`write_process`], [`read_process`]: cross-memory attach (`process_vm_writev`/`readv`)
//!   into a peer's own address space, for registered memory no backing holds (part of a page,
//!   a private file mapping); the kernel allows it when this process may ptrace-attach the
//!   peer (as above, and Yama's `ptrace_scope` may forbid it).
//!
//! This is one of the FFI edges: `unsafe` here is limited to mapping, unmapping and copying,
//! each with its `SAFETY:` line; everything above it is safe Rust.

mod backing;
mod ring;
mod table;

pub use backing::{AtomicOp, Backing, PeerBacking};
pub use ring::{ENTRY_DATA, InPlace, MAX_ENTRIES, Placed, PlacedBody, PostedAhead, ReceiveRing};
pub use table::{MR_SLOTS, MrSlot, PeerTable, QP_SLOTS, QpSlot, Table};

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;

/// A shared mapping of a whole file, unmapped on drop.
struct Mapping {
    addr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics (the table) or
// through copies whose races are the RDMA semantics the verbs contract allows (a WRITE racing
// the target's own stores), never through Rust references to non-atomic data.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd` from offset 0, shared, readable and writable.
    fn of_file(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: a fresh mapping chosen by the kernel (no MAP_FIXED): it replaces nothing.
        let addr = unsafe {
            raw_mmap(
                0,
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let addr = NonNull::new(addr.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Mapping { addr, len })
    }

    fn base(&self) -> *mut u8 {
        self.addr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping this value created; nothing borrows it any more
        // (borrows of the table's slots are tied to the owning value's lifetime).
        unsafe { libc::syscall(libc::SYS_munmap, self.addr.as_ptr(), self.len) };
    }
}

/// `mmap` as the system call, past the libc wrappers that ugdr (capi/libc_hooks.rs) and UCX
/// interpose: ugdr's own mappings are not the application's memory changing under an MR.
///
/// # Safety
/// As `mmap(2)`; with `MAP_FIXED`, the caller owns the pages it replaces.
unsafe fn raw_mmap(
    addr: u64,
    len: usize,
    prot: libc::c_int,
    flags: libc::c_int,
    fd: libc::c_int,
) -> *mut libc::c_void {
    // SAFETY: the caller's contract; the system call takes plain integers.
    let r = unsafe { libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, 0i64) };
    if r < 0 {
        libc::MAP_FAILED
    } else {
        r as *mut libc::c_void
    }
}

/// Size of `fd`'s file and its inode number.
fn file_identity(fd: &OwnedFd) -> io::Result<(u64, u64)> {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).map_err(io::Error::from)?;
    Ok((st.st_size as u64, st.st_ino))
}

/// A new memfd named `name` of `len` bytes (close-on-exec).
fn memfd(name: &std::ffi::CStr, len: u64) -> io::Result<OwnedFd> {
    let fd = nix::sys::memfd::memfd_create(name, nix::sys::memfd::MemFdCreateFlag::MFD_CLOEXEC)
        .map_err(io::Error::from)?;
    nix::unistd::ftruncate(&fd, len as libc::off_t).map_err(io::Error::from)?;
    Ok(fd)
}

/// Opens the file behind another process's descriptor (`/proc/<pid>/fd/<fd>`), read-write.
fn open_peer_fd(pid: i32, fd: i32) -> io::Result<OwnedFd> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/{pid}/fd/{fd}"))?;
    Ok(OwnedFd::from(file))
}

/// Copies the bytes of `spans`, in order, to `addr` in process `pid`'s address space
/// (`process_vm_writev`): all of them, or an error (EFAULT when part of the range is not
/// mapped writable there; EPERM when this process may not attach to `pid`).
pub fn write_process(pid: i32, addr: u64, spans: &[crate::ucp::AppSpan]) -> io::Result<()> {
    cross_memory(pid, addr, spans, true)
}

/// Copies bytes at `addr` in process `pid`'s address space into `spans`, in order
/// (`process_vm_readv`): all of them, or an error, as [`write_process`].
pub fn read_process(pid: i32, addr: u64, spans: &[crate::ucp::AppSpan]) -> io::Result<()> {
    cross_memory(pid, addr, spans, false)
}

fn cross_memory(pid: i32, addr: u64, spans: &[crate::ucp::AppSpan], write: bool) -> io::Result<()> {
    let total: usize = spans.iter().map(crate::ucp::AppSpan::len).sum();
    if total == 0 {
        return Ok(());
    }
    if spans.len() > 1024 || addr.checked_add(total as u64).is_none() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let local: Vec<libc::iovec> = spans
        .iter()
        .map(|s| libc::iovec {
            iov_base: s.addr() as *mut libc::c_void,
            iov_len: s.len(),
        })
        .collect();
    let remote = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: total,
    };
    // SAFETY: `local` describes checked spans of registered (or ugdr-owned) memory, valid for
    // reads, and for writes when this reads the peer (AppSpan's contract: a READ's spans have
    // local write access); `remote` lies in the other process, which the kernel checks (it
    // writes nothing there that is not mapped writable, and copies nothing into this process
    // beyond `local`).
    let n = unsafe {
        if write {
            libc::process_vm_writev(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                &remote,
                1,
                0,
            )
        } else {
            libc::process_vm_readv(
                pid,
                local.as_ptr(),
                local.len() as libc::c_ulong,
                &remote,
                1,
                0,
            )
        }
    };
    match n {
        n if n < 0 => Err(io::Error::last_os_error()),
        n if n as usize == total => Ok(()),
        // Part of the range is not mapped there (any more).
        _ => Err(io::Error::from_raw_os_error(libc::EFAULT)),
    }
}

/// The page size of this host.
fn page_size() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: sysconf reads a constant of the system; no pointers involved.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 { p as u64 } else { 4096 }
    })
}
