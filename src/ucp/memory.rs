//! Application memory, as ugdr may touch it.
//!
//! An [`AppRegion`] is memory the application registered (`ibv_reg_mr`): the application
//! promises it stays valid for reads and writes until it deregisters it, exactly the promise a
//! real HCA relies on for DMA. Everything below is safe on that promise; the promise itself
//! enters through the one `unsafe` constructor, [`AppRegion::new`].
//!
//! An on-demand-paging region ([`AppRegion::on_demand`], `IBV_ACCESS_ON_DEMAND`) carries no
//! such promise: the application may map and unmap inside it at will, as the kernel lets it
//! with ODP hardware. Its spans are cut only after the process's mappings show the range
//! mapped with the permissions the access needs ([`super::mappings`]), so an unmapped address
//! is refused (an access error) instead of faulting. The remaining promise is the one a
//! pinned region makes for its whole life, held only while an operation on the span is in
//! flight: memory is not unmapped under an access that is already copying it.

/// Memory the application registered: `len` bytes at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppRegion {
    addr: u64,
    len: u64,
    /// On-demand paging: check the mappings before cutting each span.
    on_demand: bool,
}

/// A checked piece of an [`AppRegion`] (or of ugdr's own staging memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppSpan {
    addr: u64,
    len: usize,
}

impl AppRegion {
    /// # Safety
    /// `[addr, addr + len)` must stay valid for reads and writes by any thread for as long as
    /// any [`AppSpan`] cut from this region is used (the `ibv_reg_mr` contract: until the MR is
    /// deregistered and no operation on it is outstanding).
    pub unsafe fn new(addr: u64, len: u64) -> AppRegion {
        AppRegion {
            addr,
            len,
            on_demand: false,
        }
    }

    /// An on-demand-paging region: nothing is promised about the range (it may be unmapped,
    /// or the whole address space: `addr` 0, `len` `u64::MAX`); every span is checked against
    /// the process's mappings when it is cut.
    pub fn on_demand(addr: u64, len: u64) -> AppRegion {
        AppRegion {
            addr,
            len,
            on_demand: true,
        }
    }

    pub fn is_on_demand(&self) -> bool {
        self.on_demand
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The part `[addr, addr + len)` of this region (same promise, same kind), if inside it.
    pub fn sub(&self, addr: u64, len: u64) -> Option<AppRegion> {
        let end = addr.checked_add(len)?;
        if addr < self.addr || end > self.addr.checked_add(self.len)? {
            return None;
        }
        Some(AppRegion {
            addr,
            len,
            on_demand: self.on_demand,
        })
    }

    /// The span `[addr, addr + len)` if it lies inside this region (overflow-safe), for reads
    /// and writes.
    pub fn span(&self, addr: u64, len: u64) -> Option<AppSpan> {
        self.span_for(addr, len, true)
    }

    /// The span `[addr, addr + len)` if it lies inside this region (overflow-safe) and, for an
    /// on-demand region, is mapped now, readable, and writable when `write`.
    pub fn span_for(&self, addr: u64, len: u64, write: bool) -> Option<AppSpan> {
        let end = addr.checked_add(len)?;
        let region_end = self.addr.checked_add(self.len)?;
        if addr < self.addr || end > region_end {
            return None;
        }
        let len = usize::try_from(len).ok()?;
        if self.on_demand && len > 0 {
            if let Err(e) = super::mappings::check(addr, len as u64, write) {
                tracing::debug!("on-demand access to {addr:#x}+{len}: {e}");
                return None;
            }
        }
        Some(AppSpan { addr, len })
    }
}

/// Memory ugdr owns for the application (device memory, `ibv_alloc_dm`): a private anonymous
/// mapping, page-aligned and zeroed, unmapped on drop. Its owner keeps it alive while any
/// region or span cut from it is in use (a DM lives until its last MR is gone).
#[derive(Debug)]
pub struct HostBuffer {
    /// The mapping (pinned: valid while the buffer lives).
    region: AppRegion,
}

impl HostBuffer {
    /// `len` bytes (> 0) of fresh zeroed memory.
    pub fn new(len: u64) -> std::io::Result<HostBuffer> {
        let size = usize::try_from(len)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| std::io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: a new anonymous mapping at an address the kernel picks; no existing memory
        // is affected.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(HostBuffer {
            region: AppRegion {
                addr: p as u64,
                len,
                on_demand: false,
            },
        })
    }

    /// The whole buffer as registrable memory (valid while `self` lives; see the type).
    pub fn region(&self) -> AppRegion {
        self.region
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no span of it is in use any more
        // (the owner's contract).
        unsafe {
            libc::munmap(
                self.region.addr as usize as *mut libc::c_void,
                self.region.len as usize,
            )
        };
    }
}

impl AppSpan {
    /// A span over ugdr-owned bytes (inline data, staging buffers). The span must not outlive
    /// `bytes`; callers keep the owner alive alongside the span (see `SendPayload`).
    pub fn of_owned(bytes: &[u8]) -> AppSpan {
        AppSpan {
            addr: bytes.as_ptr() as u64,
            len: bytes.len(),
        }
    }

    pub fn addr(&self) -> u64 {
        self.addr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first `n` bytes (at most all of them) and the rest.
    pub fn split_at(&self, n: usize) -> (AppSpan, AppSpan) {
        let n = n.min(self.len);
        (
            AppSpan {
                addr: self.addr,
                len: n,
            },
            AppSpan {
                addr: self.addr + n as u64,
                len: self.len - n,
            },
        )
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.addr as usize as *mut u8
    }
}

impl AppSpan {
    fn as_atomic(&self) -> Option<&std::sync::atomic::AtomicU64> {
        if self.len != 8 || self.addr % 8 != 0 {
            return None;
        }
        // SAFETY: 8 registered bytes (AppRegion's contract), 8-byte aligned (checked), so a
        // valid AtomicU64 location; other writers may race, which is what atomics are for.
        Some(unsafe { &*(self.as_ptr() as *const std::sync::atomic::AtomicU64) })
    }

    /// Atomically adds `add` to the 8 bytes (host byte order, as verbs atomics); the old value.
    /// None unless the span is 8 aligned bytes.
    pub fn fetch_add(&self, add: u64) -> Option<u64> {
        Some(
            self.as_atomic()?
                .fetch_add(add, std::sync::atomic::Ordering::SeqCst),
        )
    }

    /// Atomically replaces the 8 bytes by `swap` if they equal `compare`; the old value.
    pub fn compare_swap(&self, compare: u64, swap: u64) -> Option<u64> {
        let a = self.as_atomic()?;
        Some(
            match a.compare_exchange(
                compare,
                swap,
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
            ) {
                Ok(v) | Err(v) => v,
            },
        )
    }
}

/// Copies `src` into `spans`, in order; returns the bytes written (≤ the spans' total).
pub fn scatter(spans: &[AppSpan], src: &[u8]) -> usize {
    let mut off = 0;
    for s in spans {
        if off == src.len() {
            break;
        }
        let n = s.len.min(src.len() - off);
        // SAFETY: `s` lies in a registered region (AppRegion::new's contract) or in memory
        // its creator keeps alive; `src` is a Rust slice; the two cannot overlap because UCX's
        // receive buffers and ugdr's own buffers are never registered by the application.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(off), s.as_ptr(), n) };
        off += n;
    }
    off
}

/// Copies the bytes of `spans`, in order, into a new vector (inline sends, staging).
pub fn gather(spans: &[AppSpan]) -> Vec<u8> {
    let total = spans.iter().map(|s| s.len).sum();
    let mut out = Vec::with_capacity(total);
    for s in spans {
        // SAFETY: as in `scatter`; the span is readable for `len` bytes.
        let bytes = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, s.len) };
        out.extend_from_slice(bytes);
    }
    out
}
