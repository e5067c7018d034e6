//! The libc calls ugdr must see, interposed (libugdr.so is preloaded, so these definitions
//! come before libc's), each chaining to the next definition of its symbol.
//!
//! `pthread_cancel` notes that the process cancels threads (`boundary::CANCEL_USED`: from
//! then on every export disables cancellation while it runs) before it acts.
//!
//! The calls that take memory away from a process: `munmap`, `mremap`, `mmap`/`mmap64` with
//! `MAP_FIXED`, `madvise` with `MADV_DONTNEED`/`MADV_DONTNEED_LOCKED`/`MADV_FREE`/`MADV_REMOVE`,
//! and `shmdt`. Each first invalidates the registered memory regions overlapping what goes away
//! (`ucp::invalidate_range`: they are refused from then on, and accesses in progress on them
//! end first), then calls the next definition of the same symbol, found with
//! `dlsym(RTLD_NEXT)` — libc's, or another interposer's — so hooks further down the chain (UCX's
//! ucm, when an application's own UCX installs them) still see every call. Calls that take
//! nothing registered away cost one atomic load more than libc's.
//!
//! Limits: only calls through these dynamic symbols are seen. Memory released inside libc
//! (`free()` of a large `malloc` block, which unmaps it with libc's internal `__munmap`, heap
//! trimming) and raw `syscall(SYS_munmap, …)` are not: registered memory released that way
//! still breaks the registration promise, as before.
//!
//! `mprotect` takes access away: regions registered for writing die when their memory stops
//! being writable, all of them when it stops being readable (a HCA would go on, but ugdr's
//! copies would fault).
//!
//! `mremap` is variadic in C (the new address comes only with `MREMAP_FIXED`); it is defined
//! here with five fixed arguments, which on x86-64 and AArch64 Linux arrive in the same
//! registers as the variadic one (other targets do not interpose it).

use super::boundary::{CANCEL_USED, ffi_boundary};
use crate::ucp::{Invalidation, Loss, anything_registered, invalidate_range};
use crate::ugdr::host_memory;
use std::ffi::CStr;
use std::os::raw::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

thread_local! {
    /// Set while this thread looks a real function up: `dlsym` may map memory itself.
    static RESOLVING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The next definition of `name` after libugdr.so (0 while this thread is resolving one, or
/// if there is none: the caller then makes the system call itself).
fn next_symbol(name: &CStr, slot: &AtomicUsize) -> usize {
    let cached = slot.load(Ordering::Acquire);
    if cached != 0 || RESOLVING.get() {
        return cached;
    }
    RESOLVING.set(true);
    // SAFETY: `name` is NUL-terminated; dlsym only reads it.
    let addr = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    RESOLVING.set(false);
    slot.store(addr, Ordering::Release);
    addr
}

/// Looks the next `$name` up once, as a function pointer of type `$ty`.
macro_rules! next_fn {
    ($name:literal, $ty:ty) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        match next_symbol($name, &SLOT) {
            0 => None,
            // SAFETY: the next definition of this libc symbol has this C signature.
            addr => Some(unsafe { std::mem::transmute::<usize, $ty>(addr) }),
        }
    }};
}

fn page_size() -> u64 {
    static PAGE: AtomicUsize = AtomicUsize::new(0);
    match PAGE.load(Ordering::Relaxed) {
        0 => {
            // SAFETY: sysconf has no preconditions.
            let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
            PAGE.store(p, Ordering::Relaxed);
            p as u64
        }
        p => p as u64,
    }
}

/// Invalidates the registered memory in `[addr, addr + len)` that `loss` affects, rounded to
/// whole pages as the kernel rounds it; nothing for an unaligned address (the kernel refuses
/// the call). Keep what it returns until the real call returned: on-demand regions there
/// hold their accesses until then (`ucp::memory`).
fn lose(addr: *const c_void, len: usize, loss: Loss) -> Option<Invalidation> {
    let page = page_size();
    let start = addr as u64;
    if !start.is_multiple_of(page) || len == 0 {
        return None;
    }
    let len = (len as u64).saturating_add(page - 1) & !(page - 1);
    let changing = invalidate_range(start, len, loss);
    withdraw_direct(start, len);
    Some(changing)
}

/// Same-host peers stop reaching `[start, start + len)` directly (engine/direct.rs).
fn withdraw_direct(start: u64, len: u64) {
    if let Some(memory) = crate::engine::Engine::local_memory() {
        memory.withdraw_overlapping(start, len);
    }
}

type MunmapFn = unsafe extern "C" fn(*mut c_void, usize) -> c_int;
type MremapFn = unsafe extern "C" fn(*mut c_void, usize, usize, c_int, ...) -> *mut c_void;
type MmapFn = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, c_int, i64) -> *mut c_void;
type MadviseFn = unsafe extern "C" fn(*mut c_void, usize, c_int) -> c_int;
type ShmdtFn = unsafe extern "C" fn(*const c_void) -> c_int;

/// # Safety
/// As libc's `munmap`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn munmap(addr: *mut c_void, len: usize) -> c_int {
    ffi_boundary!("munmap", quiet, on_panic = -1, {
        let _changing = lose(addr, len, Loss::Pages);
        match next_fn!(c"munmap", MunmapFn) {
            // SAFETY: the caller's arguments, passed on.
            Some(real) => unsafe { real(addr, len) },
            // SAFETY: as above.
            None => unsafe { libc::syscall(libc::SYS_munmap, addr, len) as c_int },
        }
    })
}

/// # Safety
/// As libc's `mremap`; `new_addr` is read only with `MREMAP_FIXED` (see the module comment).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mremap(
    old: *mut c_void,
    old_size: usize,
    new_size: usize,
    flags: c_int,
    new_addr: *mut c_void,
) -> *mut c_void {
    ffi_boundary!("mremap", quiet, on_panic = libc::MAP_FAILED, {
        let _moved = if flags & (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) != 0 {
            // The pages may move: what is registered at the old address goes.
            lose(old, old_size, Loss::Pages)
        } else if new_size < old_size {
            // Shrinking in place: the tail goes.
            lose(
                old.wrapping_byte_add(new_size),
                old_size - new_size,
                Loss::Pages,
            )
        } else {
            None
        };
        // Whatever was mapped at the new address is replaced.
        let _replaced = (flags & libc::MREMAP_FIXED != 0)
            .then(|| lose(new_addr, new_size, Loss::Pages))
            .flatten();
        match next_fn!(c"mremap", MremapFn) {
            // SAFETY: the caller's arguments, passed on (the fifth as the variadic one).
            Some(real) => unsafe { real(old, old_size, new_size, flags, new_addr) },
            // SAFETY: as above.
            None => unsafe {
                libc::syscall(libc::SYS_mremap, old, old_size, new_size, flags, new_addr)
                    as *mut c_void
            },
        }
    })
}

/// `mmap` and `mmap64` (the same function on LP64), under each name.
macro_rules! export_map {
    ($name:ident) => {
        /// # Safety
        /// As libc's `mmap`.
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            addr: *mut c_void,
            len: usize,
            prot: c_int,
            flags: c_int,
            fd: c_int,
            offset: i64,
        ) -> *mut c_void {
            ffi_boundary!(stringify!($name), quiet, on_panic = libc::MAP_FAILED, {
                // MAP_FIXED replaces what is there; MAP_FIXED_NOREPLACE fails instead.
                let _changing = (flags & libc::MAP_FIXED != 0)
                    .then(|| lose(addr, len, Loss::Pages))
                    .flatten();
                match next_fn!(c"mmap", MmapFn) {
                    // SAFETY: the caller's arguments, passed on.
                    Some(real) => unsafe { real(addr, len, prot, flags, fd, offset) },
                    // SAFETY: as above.
                    None => unsafe {
                        libc::syscall(libc::SYS_mmap, addr, len, prot, flags, fd, offset)
                            as *mut c_void
                    },
                }
            })
        }
    };
}
export_map!(mmap);
export_map!(mmap64);

type MprotectFn = unsafe extern "C" fn(*mut c_void, usize, c_int) -> c_int;

/// # Safety
/// As libc's `mprotect`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn mprotect(addr: *mut c_void, len: usize, prot: c_int) -> c_int {
    ffi_boundary!("mprotect", quiet, on_panic = -1, {
        let _changing = if prot & libc::PROT_READ == 0 {
            lose(addr, len, Loss::Pages)
        } else if prot & libc::PROT_WRITE == 0 {
            lose(addr, len, Loss::Write)
        } else {
            None
        };
        match next_fn!(c"mprotect", MprotectFn) {
            // SAFETY: the caller's arguments, passed on.
            Some(real) => unsafe { real(addr, len, prot) },
            // SAFETY: as above.
            None => unsafe { libc::syscall(libc::SYS_mprotect, addr, len, prot) as c_int },
        }
    })
}

/// `MADV_DONTNEED_LOCKED` (Linux 5.18), which the libc crate does not name.
const MADV_DONTNEED_LOCKED: c_int = 24;

/// # Safety
/// As libc's `madvise`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn madvise(addr: *mut c_void, len: usize, advice: c_int) -> c_int {
    ffi_boundary!("madvise", quiet, on_panic = -1, {
        // These drop the pages (the next touch maps fresh ones): a HCA would keep DMA-ing to
        // the old pages, which the process no longer sees.
        let dropped = matches!(
            advice,
            libc::MADV_DONTNEED | libc::MADV_FREE | libc::MADV_REMOVE | MADV_DONTNEED_LOCKED
        );
        let _changing = dropped.then(|| lose(addr, len, Loss::Pages)).flatten();
        match next_fn!(c"madvise", MadviseFn) {
            // SAFETY: the caller's arguments, passed on.
            Some(real) => unsafe { real(addr, len, advice) },
            // SAFETY: as above.
            None => unsafe { libc::syscall(libc::SYS_madvise, addr, len, advice) as c_int },
        }
    })
}

/// # Safety
/// As libc's `shmdt`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn shmdt(addr: *const c_void) -> c_int {
    ffi_boundary!("shmdt", quiet, on_panic = -1, {
        // The segment's size is not an argument: the mapping that starts at `addr` tells it
        // (read only when something is registered).
        let mut _changing = None;
        if anything_registered()
            && let Some(len) = host_memory::attached_extent(addr as u64)
        {
            _changing = Some(invalidate_range(addr as u64, len, Loss::Pages));
            withdraw_direct(addr as u64, len);
        }
        match next_fn!(c"shmdt", ShmdtFn) {
            // SAFETY: the caller's argument, passed on.
            Some(real) => unsafe { real(addr) },
            // SAFETY: as above.
            None => unsafe { libc::syscall(libc::SYS_shmdt, addr) as c_int },
        }
    })
}

type PthreadCancelFn = unsafe extern "C" fn(libc::pthread_t) -> c_int;

/// # Safety
/// As libc's `pthread_cancel`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pthread_cancel(thread: libc::pthread_t) -> c_int {
    ffi_boundary!("pthread_cancel", quiet, on_panic = libc::ESRCH, {
        CANCEL_USED.store(true, Ordering::SeqCst);
        match next_fn!(c"pthread_cancel", PthreadCancelFn) {
            // SAFETY: the caller's argument, passed on.
            Some(real) => unsafe { real(thread) },
            None => libc::ENOSYS,
        }
    })
}
