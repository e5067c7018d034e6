//! Application memory, as ugdr may touch it.
//!
//! An [`AppRegion`] is memory the application registered (`ibv_reg_mr`): the application
//! promises it stays valid for reads and writes until it deregisters it, exactly the promise a
//! real HCA relies on for DMA. Everything below is safe on that promise; the promise itself
//! enters through the one `unsafe` constructor, [`AppRegion::new`].
//!
//! **Invalidation.** A HCA pins the pages it registers, so an application that unmaps (or
//! remaps) a registered range never sees DMA meant for the old pages land in whatever is
//! mapped there next, and DMA ignores page protections. ugdr has no pins; instead the libc
//! calls that take pages away (`munmap`, `mremap`, `mmap(MAP_FIXED)`,
//! `madvise(MADV_DONTNEED|FREE|REMOVE)`, `shmdt`) or access (`mprotect`: write, for regions
//! registered for writing; read, for all), interposed in `capi::libc_hooks`, call
//! [`invalidate_range`] first, which marks every such registered region overlapping the
//! range dead for good and waits for the accesses in progress on them to end, before the
//! real call runs. (Dead for good: a HCA would go on working through the old pages, but
//! ugdr's copies would then fault or reach the new memory, so a refusal is the safe answer.) Every region has a [`Liveness`] cell
//! (pooled, generation-tagged, so spans cut from an older region never see a newer one as
//! theirs) that its spans carry:
//! * the MR checks (`fake_verbs::mr`) refuse a dead region: a remote access is
//!   REM_ACCESS_ERR, a local one LOC_PROT_ERR — one atomic load on the hot path;
//! * every access through a span — a copy here, an atomic, and a UCX transfer for as long as
//!   UCX holds the buffer (`Endpoint::am_send`, `LockedWorker::receive_rendezvous`) — first
//!   *holds* the cell (a counter the invalidation waits for; a Dekker pair of SeqCst
//!   operations with the dead mark) and then rechecks that it lives. A span whose region died
//!   between the MR check and the access behaves as the old pinned pages would for the
//!   application, which can no longer see them: what is written there is dropped, and what is
//!   read there reads as zeros (an atomic returns 0 and changes nothing).
//!
//! Deregistration ends the region and waits for the transfers in progress on it
//! ([`AppRegion::end_and_drain`]), as a HCA fences DMA before deregistration returns.
//! Dropping the region retires the cell; while something still holds spans of it (a wait
//! that gave up), it stays in the registry, dead, so that unmapping its range still waits.
//!
//! **On-demand paging.** An on-demand-paging region ([`AppRegion::on_demand`],
//! `IBV_ACCESS_ON_DEMAND`) carries no pinning promise: the application may map and unmap
//! inside it at will, as it may with ODP hardware. Its spans are cut only after the process's
//! mappings show the range mapped with the permissions the access needs ([`super::mappings`]),
//! so an unmapped address is refused (an access error) instead of faulting. Invalidation
//! therefore never kills such a region (the MR stays usable; accesses to pages unmapped since
//! fail their mapping check, a remote one with REM_ACCESS_ERR). It does what a HCA's MMU
//! notifier does instead: between [`invalidate_range`] and the drop of the [`Invalidation`] it
//! returns (the libc hooks keep it across the real call) the cell counts a change in progress;
//! an access waits for it to end (its hold), and the first access to a span cut before the
//! change rechecks the span's mapping, while holding, so no copy reaches pages that went away.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// Whether one registered region is still there, shared by every span cut from it.
pub struct Liveness {
    /// `generation * 2 + 1` while the region of this generation lives, `generation * 2` once
    /// it died (the next region using this cell gets the next generation).
    state: AtomicU64,
    /// Accesses in progress on the region (held copies, and UCX transfers in flight).
    busy: AtomicUsize,
    /// On-demand regions: mapping changes in progress over the region (see the module comment).
    changing: AtomicUsize,
    /// On-demand regions: mapping changes over the region that ended (a span cut at an older
    /// count rechecks its mapping when it is held).
    changes: AtomicU64,
}

/// A span's (or region's) reference to its cell, at the generation it was cut in.
#[derive(Clone, Copy)]
struct Pin {
    cell: &'static Liveness,
    live: u64,
}

/// What an on-demand span was checked for: the cell's change count when it was cut, and
/// whether it needed writable memory.
#[derive(Debug, Clone, Copy)]
struct Checked {
    changes: u64,
    write: bool,
}

/// An access in progress on a live region (or on ugdr's own memory, which needs none); the
/// region's invalidation waits for it to drop.
pub struct Hold(Option<&'static Liveness>);

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(cell) = self.0 {
            cell.busy.fetch_sub(1, Ordering::Release);
        }
    }
}

impl Pin {
    #[inline]
    fn is_live(&self) -> bool {
        self.cell.state.load(Ordering::Acquire) == self.live
    }

    /// Counts an access in, then checks the region still lives (see the module comment).
    fn hold(&self) -> Option<Hold> {
        self.cell.busy.fetch_add(1, Ordering::SeqCst);
        let hold = Hold(Some(self.cell));
        (self.cell.state.load(Ordering::SeqCst) == self.live).then_some(hold)
    }

    /// Marks the region dead (no effect on a later generation); whether it lived until now.
    fn kill(&self) -> bool {
        self.cell
            .state
            .compare_exchange(
                self.live,
                self.live & !1,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
    }
}

/// One registered region, as [`invalidate_range`] finds it.
struct Registered {
    start: u64,
    end: u64,
    pin: Pin,
    /// Registered for writing (local or remote): losing write permission kills it too.
    writable: bool,
    /// On-demand paging: invalidation marks a change in progress instead of killing it.
    on_demand: bool,
    /// Its region was dropped (the MR deregistered) while transfers on it were in flight: it
    /// stays here, dead, so that unmapping the range still waits for them, until they end.
    retired: bool,
}

/// Every registered region (and the retired ones still busy), and the cells of the others
/// that were dropped, for reuse.
struct Registry {
    regions: Vec<Registered>,
    spare: Vec<&'static Liveness>,
}

impl Registry {
    /// Gives the cells of retired regions whose transfers ended back to the pool.
    fn sweep(&mut self) {
        let mut i = 0;
        while i < self.regions.len() {
            let r = &self.regions[i];
            let idle = r.pin.cell.busy.load(Ordering::SeqCst) == 0
                && r.pin.cell.changing.load(Ordering::SeqCst) == 0;
            if r.retired && idle {
                let cell = self.regions.swap_remove(i).pin.cell;
                self.spare.push(cell);
            } else {
                i += 1;
            }
        }
        REGISTERED_COUNT.store(self.regions.len(), Ordering::Release);
    }
}

/// [`REGISTERED_COUNT`] lets the interposed libc calls skip the lock while the registry is
/// empty.
static REGISTRY: Mutex<Registry> = Mutex::new(Registry {
    regions: Vec::new(),
    spare: Vec::new(),
});
static REGISTERED_COUNT: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    /// Set while this thread holds [`REGISTRY`]: an allocator (or the logger) that unmaps
    /// through the interposed libc calls meanwhile must not wait for the lock this thread
    /// holds (nothing it unmaps then is registered).
    static UPDATING: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `f` on the registry, marked as an update of this thread.
fn updating<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    UPDATING.set(true);
    let r = f(&mut REGISTRY.lock().unwrap_or_else(|p| p.into_inner()));
    UPDATING.set(false);
    r
}

/// Whether any region is registered now (one atomic load).
pub fn anything_registered() -> bool {
    REGISTERED_COUNT.load(Ordering::Acquire) != 0
}

/// How long an invalidation waits for transfers in flight (UCX completes or fails them; a
/// stuck peer must not hang the application's `munmap` for ever).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// What happens to a range of memory that invalidates the regions registered in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Loss {
    /// Its pages go away or are replaced: every region there dies.
    Pages,
    /// It stops being writable (`mprotect`): the regions registered for writing die.
    Write,
}

/// A mapping change over on-demand regions in progress (see the module comment): dropping it,
/// once the change is made, ends it.
#[must_use = "the change ends when this is dropped, after the memory changed"]
pub struct Invalidation {
    cells: smallvec::SmallVec<[&'static Liveness; 4]>,
}

impl Drop for Invalidation {
    fn drop(&mut self) {
        for cell in &self.cells {
            cell.changes.fetch_add(1, Ordering::SeqCst);
            cell.changing.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// Marks the registered regions overlapping `[start, start + len)` that `loss` affects dead
/// (on-demand ones: changing, until the returned [`Invalidation`] drops), then waits until no
/// access is in progress on any of them (at most [`DRAIN_LIMIT`]). Called before the memory
/// goes (see the module comment); cheap when nothing is registered.
pub fn invalidate_range(start: u64, len: u64, loss: Loss) -> Invalidation {
    let mut changed = Invalidation {
        cells: smallvec::SmallVec::new(),
    };
    if len == 0 || !anything_registered() || UPDATING.get() {
        return changed;
    }
    let end = start.saturating_add(len);
    let deadline = Instant::now() + DRAIN_LIMIT;
    let mut first = true;
    loop {
        // Kill every overlapping region, and note (without allocating) up to 16 with accesses
        // in progress; wait for those, and look again until none is left.
        let mut busy: [Option<&'static Liveness>; 16] = [None; 16];
        updating(|registry| {
            let mut n = 0;
            for r in registry
                .regions
                .iter()
                .filter(|r| r.start < end && start < r.end)
                .filter(|r| loss == Loss::Pages || r.writable)
            {
                if r.on_demand {
                    if first && !r.retired {
                        r.pin.cell.changing.fetch_add(1, Ordering::SeqCst);
                        changed.cells.push(r.pin.cell);
                    }
                } else if r.pin.kill() {
                    tracing::debug!(
                        "registered memory {:#x}+{:#x} invalidated: unmapped or replaced",
                        r.start,
                        r.end - r.start
                    );
                }
                if r.pin.cell.busy.load(Ordering::SeqCst) != 0 && n < busy.len() {
                    busy[n] = Some(r.pin.cell);
                    n += 1;
                }
            }
            registry.sweep();
        });
        first = false;
        if busy[0].is_none() {
            return changed;
        }
        for cell in busy.iter().flatten() {
            if !drain(cell, deadline, "unmapped") {
                return changed;
            }
        }
    }
}

/// Waits until no access is in progress on `cell`; false once `deadline` passed (`what`
/// happens to the memory then, for the log).
fn drain(cell: &Liveness, deadline: Instant, what: &str) -> bool {
    while cell.busy.load(Ordering::SeqCst) != 0 {
        if Instant::now() >= deadline {
            tracing::warn!("registered memory is {what} while a transfer on it is in flight");
            return false;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
    true
}

/// Memory the application registered: its extent (range, liveness cell, on-demand), which
/// this owner retires when dropped.
#[derive(Debug)]
pub struct AppRegion {
    extent: RegionExtent,
}

impl std::fmt::Debug for Pin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", if self.is_live() { "live" } else { "dead" })
    }
}

/// The spans of one work request's gather or scatter list, kept inline for the common
/// case of one SGE (each move of a send or receive copies it).
pub type SpanList = smallvec::SmallVec<[AppSpan; 1]>;

/// The bytes `spans` cover in all. Most lists hold one span: read without a loop (a summing
/// loop's setup, unrolled by four, cost more than the one addition on every small SEND).
#[inline]
pub fn total_len(spans: &[AppSpan]) -> usize {
    match spans {
        [one] => one.len(),
        _ => spans.iter().map(AppSpan::len).sum(),
    }
}

/// A checked piece of an [`AppRegion`] (or of ugdr's own staging memory).
#[derive(Debug, Clone, Copy)]
pub struct AppSpan {
    addr: u64,
    len: usize,
    /// The region's cell; `None` for ugdr's own memory, which never goes away under it.
    pin: Option<Pin>,
    /// On-demand spans: what their mapping was checked for (see the module comment).
    checked: Option<Checked>,
}

impl AppRegion {
    /// # Safety
    /// `[addr, addr + len)` must stay valid for reads and writes by any thread for as long as
    /// any [`AppSpan`] cut from this region is used (the `ibv_reg_mr` contract: until the MR is
    /// deregistered and no operation on it is outstanding), or until [`invalidate_range`]
    /// covering it returns, which the libc calls that take memory away call first.
    pub unsafe fn new(addr: u64, len: u64, writable: bool) -> AppRegion {
        Self::registered(addr, len, writable, false)
    }

    /// An on-demand-paging region: nothing is promised about the range (it may be unmapped,
    /// or the whole address space: `addr` 0, `len` `u64::MAX`); every span is checked against
    /// the process's mappings when it is cut (and again after a mapping change over it).
    pub fn on_demand(addr: u64, len: u64) -> AppRegion {
        Self::registered(addr, len, true, true)
    }

    /// A region with a live cell, in the registry that [`invalidate_range`] searches.
    fn registered(addr: u64, len: u64, writable: bool, on_demand: bool) -> AppRegion {
        let pin = updating(|registry| {
            let pin = match registry.spare.pop() {
                Some(cell) => Pin {
                    cell,
                    live: cell.state.fetch_add(1, Ordering::SeqCst) + 1,
                },
                None => Pin {
                    cell: Box::leak(Box::new(Liveness {
                        state: AtomicU64::new(1),
                        busy: AtomicUsize::new(0),
                        changing: AtomicUsize::new(0),
                        changes: AtomicU64::new(0),
                    })),
                    live: 1,
                },
            };
            registry.regions.push(Registered {
                start: addr,
                end: addr.saturating_add(len),
                pin,
                writable,
                on_demand,
                retired: false,
            });
            registry.sweep();
            pin
        });
        AppRegion {
            extent: RegionExtent {
                addr,
                len,
                pin,
                on_demand,
            },
        }
    }

    pub fn is_on_demand(&self) -> bool {
        self.extent.on_demand
    }

    pub fn addr(&self) -> u64 {
        self.extent.addr
    }

    pub fn len(&self) -> u64 {
        self.extent.len
    }

    pub fn is_empty(&self) -> bool {
        self.extent.len == 0
    }

    /// False once the memory was unmapped or replaced (or the region dropped); an on-demand
    /// region lives until it is dropped.
    pub fn is_live(&self) -> bool {
        self.extent.is_live()
    }

    /// Whether `[addr, addr + len)` lies inside this region (overflow-safe).
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let e = &self.extent;
        match (addr.checked_add(len), e.addr.checked_add(e.len)) {
            (Some(end), Some(region_end)) => addr >= e.addr && end <= region_end,
            _ => false,
        }
    }

    /// The span `[addr, addr + len)` if it lies inside this region (overflow-safe), for reads
    /// and writes.
    pub fn span(&self, addr: u64, len: u64) -> Option<AppSpan> {
        self.span_for(addr, len, true)
    }

    /// The span `[addr, addr + len)` if it lies inside this region (overflow-safe) and, for an
    /// on-demand region, is mapped now, readable, and writable when `write`.
    pub fn span_for(&self, addr: u64, len: u64, write: bool) -> Option<AppSpan> {
        self.extent.span_for(addr, len, write)
    }

    /// A copy of what cutting spans needs, owning nothing: spans cut through it die with this
    /// region as any others do (a cache of a key's region can keep one).
    pub fn extent(&self) -> RegionExtent {
        self.extent
    }
}

/// A registered region's range and liveness cell (an [`AppRegion`] owns one; a copy keeps
/// nothing alive, and every span it cuts is checked against the region's generation).
#[derive(Debug, Clone, Copy)]
pub struct RegionExtent {
    addr: u64,
    len: u64,
    pin: Pin,
    /// On-demand paging: check the mappings before cutting each span.
    on_demand: bool,
}

impl RegionExtent {
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// False once the region's memory was unmapped or replaced, or the region dropped.
    #[inline]
    pub fn is_live(&self) -> bool {
        self.pin.is_live()
    }

    /// Whether `[addr, addr + len)` lies inside this region (overflow-safe) and the region
    /// is pinned (not on-demand: whether its pages are mapped is known only at each access).
    pub fn holds_pinned(&self, addr: u64, len: u64) -> bool {
        let (Some(end), Some(region_end)) =
            (addr.checked_add(len), self.addr.checked_add(self.len))
        else {
            return false;
        };
        !self.on_demand && addr >= self.addr && end <= region_end
    }

    /// Copies `src` to `[addr, addr + src.len())` if that lies inside this region, which is
    /// pinned and lives (held for the copy): what cutting a span and scattering into it does,
    /// for one span, without building it. False: nothing was written (out of range,
    /// on-demand, or dead).
    #[inline]
    pub fn write_pinned(&self, addr: u64, src: &[u8]) -> bool {
        if !self.holds_pinned(addr, src.len() as u64) {
            return false;
        }
        let Some(_held) = self.pin.hold() else {
            return false;
        };
        // SAFETY: the range lies in a registered, pinned region (AppRegion::new's contract),
        // held alive for the copy; `src` is a Rust slice, which the callers take from ugdr's
        // own buffers, never registered by the application: the two cannot overlap (the
        // contract `scatter` relies on too).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), addr as usize as *mut u8, src.len()) };
        true
    }

    /// As [`AppRegion::span_for`]. Inlined: cutting a span of a pinned region takes a few
    /// compares, and every post cuts some (the mappings of an on-demand region are checked out
    /// of line).
    #[inline]
    pub fn span_for(&self, addr: u64, len: u64, write: bool) -> Option<AppSpan> {
        let end = addr.checked_add(len)?;
        let region_end = self.addr.checked_add(self.len)?;
        if addr < self.addr || end > region_end {
            return None;
        }
        let len = usize::try_from(len).ok()?;
        let checked = if self.on_demand && len > 0 {
            Some(self.check_mapped(addr, len, write)?)
        } else {
            None
        };
        Some(AppSpan {
            addr,
            len,
            pin: Some(self.pin),
            checked,
        })
    }

    /// An on-demand span's pages are mapped now (and writable when `write`): what it was
    /// checked for.
    #[cold]
    fn check_mapped(&self, addr: u64, len: usize, write: bool) -> Option<Checked> {
        // The change count first: a change that ends after the check makes the first hold
        // check again.
        let changes = self.pin.cell.changes.load(Ordering::SeqCst);
        if let Err(e) = super::mappings::check(addr, len as u64, write) {
            tracing::debug!("on-demand access to {addr:#x}+{len}: {e}");
            return None;
        }
        Some(Checked { changes, write })
    }
}

/// Memory ugdr owns for the application (device memory, `ibv_alloc_dm`): a private anonymous
/// mapping, page-aligned and zeroed, unmapped on drop. Its owner keeps it alive while any
/// region or span cut from it is in use (a DM lives until its last MR is gone).
#[derive(Debug)]
pub struct HostBuffer {
    addr: u64,
    len: u64,
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
            addr: p as u64,
            len,
        })
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The process address of byte `offset` and whether `[offset, offset + len)` is inside.
    fn inside(&self, offset: u64, len: u64) -> Option<u64> {
        let end = offset.checked_add(len)?;
        (end <= self.len).then_some(self.addr + offset)
    }

    /// `[offset, offset + len)` as registrable memory (`ibv_reg_dm_mr`): a region of its own
    /// (with its own cell), valid while `self` lives (see the type).
    pub fn region(&self, offset: u64, len: u64) -> Option<AppRegion> {
        let addr = self.inside(offset, len)?;
        // SAFETY: the buffer's own mapping, kept by its owner while the region is in use.
        Some(unsafe { AppRegion::new(addr, len, true) })
    }

    /// `[offset, offset + len)` for a copy by ugdr itself (`ibv_memcpy_to/from_dm`); valid
    /// while `self` lives.
    pub fn span(&self, offset: u64, len: u64) -> Option<AppSpan> {
        let addr = self.inside(offset, len)?;
        Some(AppSpan {
            addr,
            len: usize::try_from(len).ok()?,
            pin: None,
            checked: None,
        })
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; no span of it is in use any more
        // (the owner's contract).
        unsafe { libc::munmap(self.addr as usize as *mut libc::c_void, self.len as usize) };
    }
}

impl AppRegion {
    /// Ends the region now (its spans see it dead) and waits until no access through it is in
    /// progress — UCX transfers included, which end in the worker's progress, so the caller
    /// must not hold the worker lock — at most [`DRAIN_LIMIT`]: what `ibv_dereg_mr` promises
    /// (a HCA fences its DMA before deregistration returns). False when the wait gave up.
    pub fn end_and_drain(&self) -> bool {
        let pin = self.extent.pin;
        pin.kill();
        drain(pin.cell, Instant::now() + DRAIN_LIMIT, "deregistered")
    }
}

impl Drop for AppRegion {
    fn drop(&mut self) {
        // Retire this generation: spans still around see it dead from now on.
        let pin = self.extent.pin;
        pin.cell.state.store((pin.live | 1) + 1, Ordering::SeqCst);
        let cell = pin.cell;
        updating(|registry| {
            if let Some(r) = registry
                .regions
                .iter_mut()
                .find(|r| std::ptr::eq(r.pin.cell, cell))
            {
                r.retired = true;
            }
            registry.sweep();
        });
    }
}

impl AppSpan {
    /// A span over ugdr-owned bytes (inline data, staging buffers). The span must not outlive
    /// `bytes`; callers keep the owner alive alongside the span (see `SendPayload`).
    pub fn of_owned(bytes: &[u8]) -> AppSpan {
        AppSpan {
            addr: bytes.as_ptr() as u64,
            len: bytes.len(),
            pin: None,
            checked: None,
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
                pin: self.pin,
                checked: self.checked,
            },
            AppSpan {
                addr: self.addr + n as u64,
                len: self.len - n,
                pin: self.pin,
                checked: self.checked,
            },
        )
    }

    pub(crate) fn as_ptr(&self) -> *mut u8 {
        self.addr as usize as *mut u8
    }
}

impl AppSpan {
    /// Holds the span's region for an access; `None` once the region died (see the module
    /// comment). Keep the hold until the access (or UCX's use of the buffer) is over.
    pub fn hold(&self) -> Option<Hold> {
        let Some(pin) = &self.pin else {
            return Some(Hold(None));
        };
        let Some(checked) = self.checked else {
            return pin.hold();
        };
        // On-demand: wait out a mapping change in progress over the region (each ends within
        // its libc call); after one that ended since the span was cut, check again, held (so
        // no change starts meanwhile).
        let cell = pin.cell;
        loop {
            let hold = pin.hold()?;
            if cell.changing.load(Ordering::SeqCst) == 0 {
                if cell.changes.load(Ordering::SeqCst) == checked.changes {
                    return Some(hold);
                }
                return super::mappings::check(self.addr, self.len as u64, checked.write)
                    .is_ok()
                    .then_some(hold);
            }
            drop(hold);
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// # Safety
    /// Only while a [`Hold`] of this span is alive.
    unsafe fn as_atomic(&self) -> Option<&std::sync::atomic::AtomicU64> {
        if self.len != 8 || !self.addr.is_multiple_of(8) {
            return None;
        }
        // SAFETY: 8 registered bytes (AppRegion's contract), held, 8-byte aligned (checked),
        // so a valid AtomicU64 location; other writers may race, which is what atomics are for.
        Some(unsafe { &*(self.as_ptr() as *const std::sync::atomic::AtomicU64) })
    }

    /// Atomically adds `add` to the 8 bytes (host byte order, as verbs atomics); the old value.
    /// None unless the span is 8 aligned bytes; 0 (and nothing changed) if its region died.
    pub fn fetch_add(&self, add: u64) -> Option<u64> {
        self.atomically(|a| a.fetch_add(add, Ordering::SeqCst))
    }

    /// Atomically replaces the 8 bytes by `swap` if they equal `compare`; the old value
    /// (0, and nothing changed, if its region died).
    pub fn compare_swap(&self, compare: u64, swap: u64) -> Option<u64> {
        self.atomically(|a| {
            match a.compare_exchange(compare, swap, Ordering::SeqCst, Ordering::SeqCst) {
                Ok(v) | Err(v) => v,
            }
        })
    }

    /// Stores `value` in the 8 bytes in one indivisible write (an ATOMIC WRITE); false unless
    /// the span is 8 aligned bytes. Nothing changes if its region died.
    pub fn atomic_store(&self, value: u64) -> bool {
        self.atomically(|a| {
            a.store(value, Ordering::SeqCst);
            0
        })
        .is_some()
    }

    fn atomically(&self, op: impl FnOnce(&std::sync::atomic::AtomicU64) -> u64) -> Option<u64> {
        if self.len != 8 || !self.addr.is_multiple_of(8) {
            return None;
        }
        let Some(_held) = self.hold() else {
            return Some(0);
        };
        // SAFETY: held just above.
        Some(op(unsafe { self.as_atomic() }?))
    }
}

/// Copies the bytes of `spans`, in order, into `dst` (as many as fit); the bytes copied. A
/// span whose region died reads as zeros. One copy, where [`gather`] would make a vector first.
pub fn gather_into(spans: &[AppSpan], dst: &mut [u8]) -> usize {
    let mut off = 0;
    for s in spans {
        if off == dst.len() {
            break;
        }
        let n = s.len.min(dst.len() - off);
        match s.hold() {
            // SAFETY: as in `scatter`; the span is readable for `len` >= `n` bytes, and `dst`
            // is a Rust slice of at least `off + n` bytes that cannot overlap ugdr's buffers.
            Some(_held) => unsafe {
                std::ptr::copy_nonoverlapping(s.as_ptr() as *const u8, dst.as_mut_ptr().add(off), n)
            },
            None => dst[off..off + n].fill(0),
        }
        off += n;
    }
    off
}

/// Holds every span (see [`AppSpan::hold`]); `None` if any of their regions died.
pub fn hold_all<'a>(
    spans: impl IntoIterator<Item = &'a AppSpan>,
) -> Option<smallvec::SmallVec<[Hold; 4]>> {
    spans.into_iter().map(AppSpan::hold).collect()
}

/// Copies `src` into `spans`, in order; returns the bytes written (≤ the spans' total). The
/// bytes meant for a span whose region died are dropped.
pub fn scatter(spans: &[AppSpan], src: &[u8]) -> usize {
    let mut off = 0;
    for s in spans {
        if off == src.len() {
            break;
        }
        let n = s.len.min(src.len() - off);
        if let Some(_held) = s.hold() {
            // SAFETY: `s` lies in a registered region (AppRegion::new's contract), held alive
            // for the copy, or in memory its creator keeps alive; `src` is a Rust slice; the
            // two cannot overlap because UCX's receive buffers and ugdr's own buffers are never
            // registered by the application.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr().add(off), s.as_ptr(), n) };
        }
        off += n;
    }
    off
}

/// Copies the bytes of `spans`, in order, into a new vector (inline sends, staging); a span
/// whose region died reads as zeros.
pub fn gather(spans: &[AppSpan]) -> Vec<u8> {
    let mut out = Vec::with_capacity(spans.iter().map(|s| s.len).sum());
    for_each_gathered(spans, |bytes, len| match bytes {
        Some(b) => out.extend_from_slice(b),
        None => out.resize(out.len() + len, 0),
    });
    out
}

/// As [`gather`], appending to `out` (a bundle's body).
pub fn gather_append(spans: &[AppSpan], out: &mut smallvec::SmallVec<[u8; 64]>) {
    for_each_gathered(spans, |bytes, len| match bytes {
        Some(b) => out.extend_from_slice(b),
        None => out.resize(out.len() + len, 0),
    });
}

/// Hands each span's bytes to `f` while its region is held (None, with the length, for a
/// span whose region died).
fn for_each_gathered(spans: &[AppSpan], mut f: impl FnMut(Option<&[u8]>, usize)) {
    for s in spans {
        match s.hold() {
            Some(_held) => {
                // SAFETY: as in `scatter`; the span is readable for `len` bytes.
                let bytes = unsafe { std::slice::from_raw_parts(s.as_ptr() as *const u8, s.len) };
                f(Some(bytes), s.len);
            }
            None => f(None, s.len),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_list_is_as_long_as_its_spans_added_up() {
        let bytes = [0u8; 100];
        let span = |n: usize| AppSpan::of_owned(&bytes[..n]);
        assert_eq!(total_len(&[]), 0);
        assert_eq!(total_len(&[span(7)]), 7);
        assert_eq!(total_len(&[span(7), span(0), span(90)]), 97);
        assert_eq!(
            total_len(&[span(1), span(2), span(3), span(4), span(5)]),
            15
        );
    }

    #[test]
    fn invalidation_kills_overlapping_regions_only_and_dead_spans_drop_writes_and_read_zeros() {
        let mut a = vec![7u8; 64];
        let mut b = vec![7u8; 64];
        // SAFETY: both vectors outlive their regions (dropped at the end of the test).
        let (ra, rb) = unsafe {
            (
                AppRegion::new(a.as_mut_ptr() as u64, 64, true),
                AppRegion::new(b.as_mut_ptr() as u64, 64, false),
            )
        };
        let sa = ra.span(ra.addr() + 8, 8).unwrap();
        let sb = rb.span(rb.addr(), 8).unwrap();
        drop(invalidate_range(ra.addr() + 60, 100, Loss::Pages)); // overlaps a's last 4 bytes only
        assert!(!ra.is_live() && rb.is_live());
        assert_eq!(scatter(&[sa, sb], &[1u8; 16]), 16);
        assert_eq!(gather(&[sa, sb]), [[0u8; 8], [1u8; 8]].concat());
        assert_eq!(
            sa.fetch_add(5),
            Some(0),
            "a dead span's atomic changes nothing"
        );
        drop((ra, rb));
        assert_eq!(a, vec![7u8; 64], "nothing was written into the dead region");
        assert_eq!(&b[..8], &[1u8; 8]);
    }

    #[test]
    fn unmapping_waits_for_a_transfer_in_flight_even_after_the_region_was_dropped() {
        let mut buf = vec![0u8; 4096];
        let addr = buf.as_mut_ptr() as u64;
        // SAFETY: `buf` outlives the region.
        let region = unsafe { AppRegion::new(addr, 4096, true) };
        let held = region.span(addr, 64).unwrap().hold().expect("live");
        drop(region); // deregistered while "UCX" still holds the span
        let release = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            drop(held);
        });
        let t = Instant::now();
        drop(invalidate_range(addr, 4096, Loss::Pages));
        assert!(
            t.elapsed() >= Duration::from_millis(150),
            "returned after {:?}, before the transfer ended",
            t.elapsed()
        );
        release.join().unwrap();
        drop(buf);
    }

    #[test]
    fn unmapping_inside_an_on_demand_region_keeps_it_and_fails_only_the_unmapped_spans() {
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of two pages.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let addr = p as u64;
        let region = AppRegion::on_demand(addr, 2 * page as u64);
        let first = region.span_for(addr, 8, true).expect("mapped");
        let second = region
            .span_for(addr + page as u64, 8, true)
            .expect("mapped");
        let changing = invalidate_range(addr, page as u64, Loss::Pages);
        assert!(
            region.is_live(),
            "an on-demand region survives invalidation"
        );
        // An access during the change waits for it to end, then finds the page gone.
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            (first.hold().is_some(), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(150));
        // SAFETY: the first page of the mapping made above, unmapped by the raw system call.
        assert_eq!(unsafe { libc::syscall(libc::SYS_munmap, p, page) }, 0);
        drop(changing);
        let (held, waited) = waiter.join().unwrap();
        assert!(
            !held,
            "a span cut before the unmap reached the unmapped page"
        );
        assert!(
            waited >= Duration::from_millis(100),
            "did not wait: {waited:?}"
        );
        assert!(region.span_for(addr, 8, false).is_none(), "unmapped now");
        assert_eq!(scatter(&[second], &[5u8; 8]), 8);
        assert_eq!(
            gather(&[second]),
            vec![5u8; 8],
            "the other page still works"
        );
        drop(region);
        // SAFETY: the second page, still mapped.
        unsafe { libc::syscall(libc::SYS_munmap, addr + page as u64, page) };
    }

    #[test]
    fn a_reused_cell_never_revives_the_spans_of_its_earlier_region() {
        let mut buf = vec![0u8; 16];
        // SAFETY: `buf` outlives both regions.
        let first = unsafe { AppRegion::new(buf.as_mut_ptr() as u64, 16, true) };
        let stale = first.span(first.addr(), 8).unwrap();
        drop(first);
        assert!(
            stale.hold().is_none(),
            "dropping the region retires its spans"
        );
        // Later registrations may take the same cell (the pool is shared with other tests,
        // so register a few): none of them makes the stale span live again.
        // SAFETY: as above.
        let later: Vec<AppRegion> = (0..4)
            .map(|_| unsafe { AppRegion::new(buf.as_mut_ptr() as u64, 16, true) })
            .collect();
        assert!(later.iter().all(AppRegion::is_live));
        assert!(stale.hold().is_none());
        assert_eq!(scatter(&[stale], &[9u8; 8]), 8);
        drop(later);
        assert_eq!(buf, vec![0u8; 16]);
    }

    #[test]
    fn gather_into_copies_in_order_up_to_the_destination_and_reads_dead_spans_as_zeros() {
        let a = [1u8, 2, 3];
        let b = [4u8, 5];
        let spans = [AppSpan::of_owned(&a), AppSpan::of_owned(&b)];
        let mut out = [0xEEu8; 4];
        assert_eq!(gather_into(&spans, &mut out), 4);
        assert_eq!(out, [1, 2, 3, 4]);
        let mut all = [0xEEu8; 8];
        assert_eq!(gather_into(&spans, &mut all), 5);
        assert_eq!(all, [1, 2, 3, 4, 5, 0xEE, 0xEE, 0xEE]);
        let buf = HostBuffer::new(16).unwrap();
        let region = buf.region(0, 16).unwrap();
        let span = region.span(region.addr(), 16).unwrap();
        scatter(&[span], &[7u8; 16]);
        let mut live = [0u8; 16];
        assert_eq!(gather_into(&[span], &mut live), 16);
        assert_eq!(live, [7u8; 16]);
        drop(region);
        let mut dead = [0xEEu8; 16];
        assert_eq!(gather_into(&[span], &mut dead), 16);
        assert_eq!(dead, [0u8; 16]);
    }
}
