//! Application memory, as ugdr may touch it.
//!
//! An [`AppRegion`] is memory the application registered (`ibv_reg_mr`): the application
//! promises it stays valid for reads and writes until it deregisters it, exactly the promise a
//! real HCA relies on for DMA. Everything below is safe on that promise; the promise itself
//! enters through the one `unsafe` constructor, [`AppRegion::new`].

/// Memory the application registered: `len` bytes at `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AppRegion {
    addr: u64,
    len: u64,
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
        AppRegion { addr, len }
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

    /// The span `[addr, addr + len)` if it lies inside this region (overflow-safe).
    pub fn span(&self, addr: u64, len: u64) -> Option<AppSpan> {
        let end = addr.checked_add(len)?;
        let region_end = self.addr.checked_add(self.len)?;
        if addr < self.addr || end > region_end {
            return None;
        }
        Some(AppSpan {
            addr,
            len: usize::try_from(len).ok()?,
        })
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
        if self.len != 8 || !self.addr.is_multiple_of(8) {
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
