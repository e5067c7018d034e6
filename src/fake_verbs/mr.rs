//! Memory regions: keys, access flags, and the checks a HCA makes on every SGE.
//!
//! A region's keys name a [`Registration`]: host memory (pinned, or on-demand paging, which
//! may be the whole address space), or device memory. `ibv_rereg_mr` replaces the
//! registration behind the same [`MemoryRegion`], withdrawing the old one from same-host
//! peers (the direct path) before publishing the new one.
//!
//! A pinned registration whose memory was unmapped or replaced after registration (see
//! `ucp::memory`) is refused by every check from then on, as a HCA refuses an invalidated MR:
//! a remote access is a remote access error, a local SGE a local protection error. The check
//! is one atomic load of the region's liveness. Each registration has a region (and so a
//! liveness cell) of its own: a re-registration makes a new one, and the old one retires
//! when the last operation holding the old registration ends. An on-demand registration is
//! never invalidated by unmapping; its accesses check the mappings instead.

use super::VerbsError;
use super::dm::DeviceMemory;
use super::pd::ProtectionDomain;
use super::work::Sge;
use crate::engine::Engine;
use crate::engine::direct::{InPlace, PublishedRegion, RegionView, SEND_MAX};
use crate::ucp::{AppRegion, AppSpan, RegionExtent, SpanList};
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

/// `enum ibv_access_flags` bits.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 1 << 1;
pub const ACCESS_REMOTE_READ: u32 = 1 << 2;
pub const ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;
/// Every access a peer may be granted (through a region or a memory window).
pub const ACCESS_REMOTE: u32 = ACCESS_REMOTE_READ | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC;
pub const ACCESS_MW_BIND: u32 = 1 << 4;
pub const ACCESS_ZERO_BASED: u32 = 1 << 5;
pub const ACCESS_ON_DEMAND: u32 = 1 << 6;
pub const ACCESS_HUGETLB: u32 = 1 << 7;
/// IBV_ACCESS_OPTIONAL_RANGE: bits 20..29, hints a device may ignore (relaxed ordering, …).
pub const ACCESS_OPTIONAL_RANGE: u32 = 0x3ff0_0000;
const ACCESS_SUPPORTED: u32 = ACCESS_LOCAL_WRITE
    | ACCESS_REMOTE_WRITE
    | ACCESS_REMOTE_READ
    | ACCESS_REMOTE_ATOMIC
    | ACCESS_MW_BIND
    | ACCESS_ON_DEMAND
    | ACCESS_HUGETLB
    | ACCESS_OPTIONAL_RANGE;

/// `IBV_ADVISE_MR_ADVICE_*` and `IBV_ADVISE_MR_FLAG_FLUSH`.
pub const ADVICE_PREFETCH: u32 = 0;
pub const ADVICE_PREFETCH_WRITE: u32 = 1;
pub const ADVICE_PREFETCH_NO_FAULT: u32 = 2;
pub const ADVISE_FLAG_FLUSH: u32 = 1;

/// The access flags a device-memory MR may have (`IBV_ACCESS_ZERO_BASED` required).
const DM_ACCESS: u32 = ACCESS_LOCAL_WRITE
    | ACCESS_REMOTE_WRITE
    | ACCESS_REMOTE_READ
    | ACCESS_REMOTE_ATOMIC
    | ACCESS_ZERO_BASED;

/// A memory region: the application's handle, whose registration `ibv_rereg_mr` replaces.
pub struct MemoryRegion {
    /// The registration in force; its lock also orders re-registration and deregistration.
    current: Mutex<Arc<Registration>>,
    /// Memory windows bound to the region: a busy region cannot be re-registered.
    windows: AtomicUsize,
}

/// One registration of a memory region: what the keys name, immutable while it is in force.
pub struct Registration {
    pub pd: Arc<ProtectionDomain>,
    pub region: AppRegion,
    /// The address the peer uses for this region (iova; equals the address for ibv_reg_mr,
    /// 0 for device memory, which is zero-based).
    pub iova: u64,
    pub access: u32,
    pub lkey: u32,
    pub rkey: u32,
    /// The device memory it maps (`ibv_reg_dm_mr`), kept alive with it.
    pub dm: Option<Arc<DeviceMemory>>,
    /// Where same-host peers see it (the direct path), while registered.
    published: Mutex<Option<PublishedRegion>>,
    /// The slot of the direct-access table its rkey names (held until deregistration).
    slot: Option<u16>,
}

/// Every live registration of the process, by lkey (local SGEs) and by rkey (remote requests).
static BY_LKEY: LazyLock<DashMap<u32, Arc<Registration>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);
static BY_RKEY: LazyLock<DashMap<u32, Arc<Registration>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);

/// Random bits from the kernel (keys nobody can predict, as a HCA's key generator).
fn random_u32() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        // No entropy source: still unique, just predictable.
        static FALLBACK: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(1);
        return FALLBACK
            .fetch_add(0x9e37_79b1, std::sync::atomic::Ordering::Relaxed)
            .rotate_left(7);
    }
    u32::from_ne_bytes(b)
}

/// A key not in use in `map`, never 0. With a direct-access `slot`, its low bits name the
/// slot (so a peer finds the published region from the rkey alone) and the rest is random.
fn unused_key(map: &DashMap<u32, Arc<Registration>, FxBuildHasher>, slot: Option<u16>) -> u32 {
    loop {
        let r = random_u32();
        let key = match slot {
            Some(s) => (r << 12) | u32::from(s),
            None => r,
        };
        // Never a key whose upper 24 bits name a memory window (whose low 8 bits vary).
        if key != 0 && !map.contains_key(&key) && !super::mw::reserves(key) {
            return key;
        }
    }
}

/// Whether registering with `access` needs writable memory: the kernel's `ib_access_writable`
/// (local or remote write, remote atomics, and memory-window binding, which may grant them).
pub fn needs_writable(access: u32) -> bool {
    access & (ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC | ACCESS_MW_BIND) != 0
}

/// Checks `access` as rdma-core and the kernel do: remote write or atomic needs local write.
pub fn check_access(access: u32) -> Result<(), VerbsError> {
    if access & !ACCESS_SUPPORTED != 0 {
        return Err(VerbsError::Invalid("unknown or unsupported access flags"));
    }
    if access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0
        && access & ACCESS_LOCAL_WRITE == 0
    {
        return Err(VerbsError::Invalid(
            "remote write/atomic access requires local write",
        ));
    }
    Ok(())
}

/// Whether `[addr, addr + len)` is the whole address space: an implicit on-demand MR.
pub fn is_whole_address_space(addr: u64, len: u64) -> bool {
    addr == 0 && len == u64::MAX
}

/// Checks a host-memory registration's arguments (`ibv_reg_mr`, `ibv_rereg_mr`).
fn check_host_registration(region: &AppRegion, iova: u64, access: u32) -> Result<(), VerbsError> {
    check_access(access)?;
    if region.is_empty() {
        return Err(VerbsError::Invalid("zero-length memory region"));
    }
    if region.is_on_demand() != (access & ACCESS_ON_DEMAND != 0) {
        return Err(VerbsError::Invalid(
            "on-demand paging and the region's kind disagree",
        ));
    }
    if is_whole_address_space(region.addr(), region.len()) {
        // Implicit ODP: the whole address space, at its own addresses.
        if !region.is_on_demand() || iova != 0 {
            return Err(VerbsError::Invalid(
                "the whole address space is registered only as implicit ODP (iova 0)",
            ));
        }
        return Ok(());
    }
    if region.addr().checked_add(region.len()).is_none() || iova.checked_add(region.len()).is_none()
    {
        return Err(VerbsError::Invalid("memory region wraps the address space"));
    }
    Ok(())
}

/// A direct-access slot for a registration that grants remote access or local writing to
/// pinned memory (on-demand memory stays on the message path, where the responder checks each
/// access against the mappings), and the rkey naming it; None when the path is off or full,
/// or the region is empty (a zero-length device-memory MR has nothing to publish). Regions of
/// local writing only (receive buffers, for SENDs written in place) leave the last quarter of
/// the slots to regions of remote access, whose WRITEs, READs and atomics need theirs more.
fn direct_slot(access: u32, region: &AppRegion) -> Option<(u16, u32)> {
    if !direct_publishable(access, region) || region.is_empty() {
        return None;
    }
    let reserve = if access & ACCESS_REMOTE == 0 {
        crate::engine::direct::MR_SLOTS / 4
    } else {
        0
    };
    let slot = Engine::local_memory()?.allocate_region_slot_leaving(reserve)?;
    Some((slot, unused_key(&BY_RKEY, Some(slot))))
}

/// Whether a registration with `access` over `region` is for the direct path's peers: it
/// grants remote access (direct WRITE/READ/atomics) or local writing (SENDs written in place
/// into receive WRs), to pinned memory.
fn direct_publishable(access: u32, region: &AppRegion) -> bool {
    access & (ACCESS_REMOTE | ACCESS_LOCAL_WRITE) != 0 && !region.is_on_demand()
}

impl Registration {
    /// The rkey under which same-host peers find this registration in the direct path's
    /// table, if it is published there.
    fn published_as(&self) -> Option<u32> {
        let published = self.published.lock().unwrap_or_else(|p| p.into_inner());
        published.is_some().then_some(self.rkey)
    }

    /// A registration with the given keys, published for the direct path when it grants
    /// remote access to pinned memory (on-demand memory stays on the message path, where the
    /// responder checks each access against the mappings).
    fn new(
        pd: &Arc<ProtectionDomain>,
        region: AppRegion,
        iova: u64,
        access: u32,
        dm: Option<Arc<DeviceMemory>>,
        (lkey, rkey, slot): (u32, u32, Option<u16>),
    ) -> Arc<Registration> {
        let published = match (Engine::local_memory(), slot) {
            (Some(m), Some(s)) if direct_publishable(access, &region) => m.publish_region(
                s,
                &RegionView {
                    rkey,
                    pd: pd.id,
                    access,
                    iova,
                    addr: region.addr(),
                    len: region.len(),
                },
            ),
            _ => None,
        };
        Arc::new(Registration {
            pd: Arc::clone(pd),
            region,
            iova,
            access,
            lkey,
            rkey,
            dm,
            published: Mutex::new(published),
            slot,
        })
    }

    /// Stops same-host peers reaching it: once this returns, nothing more lands.
    fn withdraw(&self) {
        let published = self
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let (Some(m), Some(p)) = (Engine::local_memory(), published) {
            m.withdraw_region(p);
        }
    }

    /// Whether it is an on-demand-paging registration (explicit or implicit).
    pub fn is_on_demand(&self) -> bool {
        self.region.is_on_demand()
    }

    /// The span of `[addr, addr + len)` (in the iova space), if the registration is live and
    /// the range inside it (and, on demand, mapped now; `write`: writable).
    pub fn span_at(&self, addr: u64, len: u64, write: bool) -> Option<AppSpan> {
        if !self.region.is_live() {
            return None;
        }
        let offset = addr.checked_sub(self.iova)?;
        let start = self.region.addr().checked_add(offset)?;
        self.region.span_for(start, len, write)
    }
}

/// Whether an rkey of a registration starts with `prefix` (its upper 24 bits): such a prefix
/// cannot name a memory window.
pub fn rkey_prefix_in_use(prefix: u32) -> bool {
    (0..=0xffu32).any(|low| BY_RKEY.contains_key(&(prefix << 8 | low)))
}

impl MemoryRegion {
    /// The argument checks of a pinned registration (EINVAL), made before the memory is
    /// looked at.
    pub fn validate(addr: u64, len: u64, iova: u64, access: u32) -> Result<(), VerbsError> {
        check_access(access)?;
        if len == 0 {
            return Err(VerbsError::Invalid("zero-length memory region"));
        }
        if addr.checked_add(len).is_none() || iova.checked_add(len).is_none() {
            return Err(VerbsError::Invalid("memory region wraps the address space"));
        }
        Ok(())
    }

    fn adopt(reg: Arc<Registration>) -> Arc<MemoryRegion> {
        reg.pd.adopt_child();
        if let Some(dm) = &reg.dm {
            dm.adopt_user();
        }
        BY_LKEY.insert(reg.lkey, Arc::clone(&reg));
        BY_RKEY.insert(reg.rkey, Arc::clone(&reg));
        lkeys_changed();
        Arc::new(MemoryRegion {
            current: Mutex::new(reg),
            windows: AtomicUsize::new(0),
        })
    }

    /// `ibv_reg_mr` of host memory (`region` is on-demand exactly when `access` has
    /// `IBV_ACCESS_ON_DEMAND`; addr 0 and length `u64::MAX` is implicit ODP).
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        region: AppRegion,
        iova: u64,
        access: u32,
    ) -> Result<Arc<MemoryRegion>, VerbsError> {
        check_host_registration(&region, iova, access)?;
        let lkey = unused_key(&BY_LKEY, None);
        let keys = match direct_slot(access, &region) {
            Some((slot, rkey)) => (lkey, rkey, Some(slot)),
            None => (lkey, unused_key(&BY_RKEY, None), None),
        };
        Ok(Self::adopt(Registration::new(
            pd, region, iova, access, None, keys,
        )))
    }

    /// `ibv_reg_dm_mr`: `[offset, offset + length)` of device memory, zero-based (the MR's
    /// address 0 is the DM's byte `offset`).
    pub fn register_device_memory(
        pd: &Arc<ProtectionDomain>,
        dm: &Arc<DeviceMemory>,
        offset: u64,
        length: u64,
        access: u32,
    ) -> Result<Arc<MemoryRegion>, VerbsError> {
        if access & ACCESS_ZERO_BASED == 0 || access & !DM_ACCESS != 0 {
            return Err(VerbsError::Invalid(
                "device memory MRs are zero-based (IBV_ACCESS_ZERO_BASED) without other flags",
            ));
        }
        check_access(access & !ACCESS_ZERO_BASED)?;
        if !Arc::ptr_eq(&dm.context, &pd.context) {
            return Err(VerbsError::Invalid("device memory of another context"));
        }
        // Length 0 is a valid MR covering nothing, as the kernel and mlx5 register it (only
        // zero-length SGEs reach it).
        let region = dm.region(offset, length)?;
        let lkey = unused_key(&BY_LKEY, None);
        let keys = match direct_slot(access, &region) {
            Some((slot, rkey)) => (lkey, rkey, Some(slot)),
            None => (lkey, unused_key(&BY_RKEY, None), None),
        };
        Ok(Self::adopt(Registration::new(
            pd,
            region,
            0,
            access,
            Some(Arc::clone(dm)),
            keys,
        )))
    }

    fn current(&self) -> std::sync::MutexGuard<'_, Arc<Registration>> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The registration in force.
    pub fn registration(&self) -> Arc<Registration> {
        Arc::clone(&self.current())
    }

    pub fn lkey(&self) -> u32 {
        self.current().lkey
    }

    pub fn rkey(&self) -> u32 {
        self.current().rkey
    }

    /// A memory window is bound to this region (type 1 bind, or a type 2 bind WR): the
    /// registration it reaches, which stays in force while the window is bound (no
    /// re-registration or deregistration until then). EINVAL once deregistered.
    pub fn adopt_window(&self) -> Result<Arc<Registration>, VerbsError> {
        let current = self.current();
        let live = BY_LKEY
            .get(&current.lkey)
            .is_some_and(|r| Arc::ptr_eq(r.value(), &current));
        if !live {
            return Err(VerbsError::Invalid("memory region deregistered"));
        }
        self.windows.fetch_add(1, Ordering::AcqRel);
        Ok(Arc::clone(&current))
    }

    /// A memory window bound to this region was unbound, invalidated or deallocated.
    pub fn release_window(&self) {
        self.windows.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_rereg_mr`: replaces the registration by one of `pd`, `region` at `iova` and
    /// `access` (the caller passes the old values for what does not change). Conceptually a
    /// deregistration then a registration: operations already holding the old one finish,
    /// same-host peers are fenced off the old memory before this returns and see the new one
    /// afterwards. Both keys stay, as rxe's and mlx5's do (rdma-core's own tests go on using
    /// the rkey they exchanged before): the new registration takes the old one's direct-path
    /// slot, which the rkey names, and is published there once the old one is withdrawn; a
    /// region that had no slot (no remote access before) stays on the message path. On
    /// failure nothing changed.
    pub fn reregister(
        &self,
        pd: &Arc<ProtectionDomain>,
        region: AppRegion,
        iova: u64,
        access: u32,
    ) -> Result<(), VerbsError> {
        let mut current = self.current();
        if self.windows.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("memory windows are bound to the region"));
        }
        if current.dm.is_some() {
            return Err(VerbsError::Invalid(
                "device memory MRs cannot be re-registered",
            ));
        }
        if !Arc::ptr_eq(&pd.context, &current.pd.context) {
            return Err(VerbsError::Invalid("protection domain of another context"));
        }
        check_host_registration(&region, iova, access)?;
        let old = Arc::clone(&current);
        // Same-host peers fenced off the old one before the new one takes its slot; until
        // the keys name the new one below, an access goes by message to the old one.
        super::qp::fence_placed_receives(old.lkey);
        old.withdraw();
        let new = Registration::new(
            pd,
            region,
            iova,
            access,
            None,
            (old.lkey, old.rkey, old.slot),
        );
        if !Arc::ptr_eq(&new.pd, &old.pd) {
            new.pd.adopt_child();
            old.pd.release_child();
        }
        BY_LKEY.insert(new.lkey, Arc::clone(&new));
        BY_RKEY.insert(new.rkey, Arc::clone(&new));
        lkeys_changed();
        *current = new;
        drop(current);
        // What was admitted under the old registration (a rendezvous WRITE landing, a READ's
        // answer leaving) ends before this returns.
        old.region.end_and_drain();
        Ok(())
    }

    /// Revokes the keys at once; operations already holding the MR finish before this returns
    /// (no UCX transfer and no same-host peer reads or writes it afterwards). Must not be
    /// called with the worker lock held. A region with memory windows bound
    /// to it is EINVAL, as rxe's (the man page: "fails if any memory window is still bound").
    pub fn deregister(&self) -> Result<(), VerbsError> {
        let current = self.current();
        if self.windows.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Invalid(
                "memory windows are bound to the region",
            ));
        }
        let reg = Arc::clone(&current);
        drop(current);
        super::qp::fence_placed_receives(reg.lkey);
        BY_LKEY.remove(&reg.lkey);
        BY_RKEY.remove(&reg.rkey);
        lkeys_changed();
        reg.withdraw();
        // Transfers admitted before (a rendezvous WRITE landing, a READ's answer leaving, a
        // send of its bytes) end before this returns: the application may free the memory.
        reg.region.end_and_drain();
        if let (Some(m), Some(s)) = (Engine::local_memory(), reg.slot) {
            m.free_region_slot(s);
        }
        if let Some(dm) = &reg.dm {
            dm.release_user();
        }
        reg.pd.release_child();
        Ok(())
    }
}

/// `ibv_advise_mr`: checks the advice as a device with on-demand paging does. Nothing needs
/// prefetching (software reaches pages when it copies), so a valid advice is done at once.
/// Unknown advice: EOPNOTSUPP; unknown flags or no SGEs: EINVAL; an lkey that is not an
/// on-demand MR of `pd` (or not writable for PREFETCH_WRITE): ENOENT; a range outside its MR,
/// or (for the faulting advices) not mapped: EFAULT.
pub fn advise(
    pd: &Arc<ProtectionDomain>,
    advice: u32,
    flags: u32,
    sges: &[Sge],
) -> Result<(), VerbsError> {
    if advice > ADVICE_PREFETCH_NO_FAULT {
        return Err(VerbsError::Unsupported("advice"));
    }
    if flags & !ADVISE_FLAG_FLUSH != 0 {
        return Err(VerbsError::Invalid("advise flags"));
    }
    if sges.is_empty() {
        return Err(VerbsError::Invalid("no scatter/gather elements"));
    }
    let write = advice == ADVICE_PREFETCH_WRITE;
    for sge in sges {
        let reg = BY_LKEY
            .get(&sge.lkey)
            .map(|r| Arc::clone(r.value()))
            .filter(|r| Arc::ptr_eq(&r.pd, pd) && r.is_on_demand())
            .filter(|r| !write || r.access & ACCESS_LOCAL_WRITE != 0)
            .ok_or(VerbsError::NotFound(
                "lkey is not a (writable) on-demand MR of this PD",
            ))?;
        let outside = VerbsError::BadAddress("range outside the MR");
        let offset = sge.addr.checked_sub(reg.iova).ok_or(outside.clone())?;
        let start = reg
            .region
            .addr()
            .checked_add(offset)
            .ok_or(outside.clone())?;
        let len = u64::from(sge.length);
        if !reg.region.contains(start, len) {
            return Err(outside);
        }
        if advice != ADVICE_PREFETCH_NO_FAULT && reg.region.span_for(start, len, write).is_none() {
            return Err(VerbsError::BadAddress("range not mapped"));
        }
    }
    Ok(())
}

/// Checks a remote access as the responder's HCA does: the rkey names a live MR of the QP's
/// PD that grants `access`, and `[addr, addr + len)` (in the MR's iova space) lies inside it
/// (and, in an on-demand MR, is mapped now: an unmapped page is a remote access error).
pub fn remote_span(
    pd: &Arc<ProtectionDomain>,
    rkey: u32,
    addr: u64,
    len: u64,
    access: u32,
) -> Option<AppSpan> {
    let mr = BY_RKEY.get(&rkey).map(|r| Arc::clone(r.value()))?;
    if !Arc::ptr_eq(&mr.pd, pd) || mr.access & access != access {
        return None;
    }
    mr.span_at(
        addr,
        len,
        access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0,
    )
}

/// Checks `sges` against the local MRs of `pd` (lkey, PD, bounds, local write for receive
/// buffers, and for on-demand MRs that the range is mapped now) and returns the spans; `None`
/// is a local protection error.
pub fn local_spans(pd: &Arc<ProtectionDomain>, sges: &[Sge], need_write: bool) -> Option<SpanList> {
    local_spans_cached(pd, sges, need_write, &mut KeyCache::default())
}

/// Counts changes of [`BY_LKEY`] (a registration, re-registration or deregistration): a
/// [`KeyCache`] filled before the latest change looks its lkey up again.
static LKEY_CHANGES: AtomicU64 = AtomicU64::new(0);

/// Records a change of [`BY_LKEY`], after it is made.
fn lkeys_changed() {
    LKEY_CHANGES.fetch_add(1, Ordering::SeqCst);
}

/// The MR an lkey named last. A queue pair keeps one for its send WRs and one for its receive
/// WRs: their SGEs mostly name the same MR, so it is looked up once, not once per SGE. It is
/// good only while no MR was registered, re-registered or deregistered since (one atomic load
/// tells): a deregistration racing with a use is the same race as with a fresh lookup, and the
/// span's hold settles it. It keeps no registration alive: it holds a copy of what the checks
/// read (the PD's address, access, iova, and the region's range and liveness cell, not the
/// region), so a registration's region still dies when `ibv_dereg_mr` lets go of it and spans
/// cut from it before (a send's copy kept for retransmission) are dead from then on. The PD's
/// address is only compared: an MR keeps its PD allocated (`ibv_dealloc_pd` is EBUSY), and its
/// deregistration changes the count before the PD can go, so no cache compares against a PD
/// that reuses the address.
#[derive(Default)]
pub struct KeyCache {
    last: Option<CachedKey>,
    changes: u64,
}

/// What a [`KeyCache`] remembers of one registration.
#[derive(Clone, Copy)]
struct CachedKey {
    lkey: u32,
    pd: usize,
    access: u32,
    iova: u64,
    region: RegionExtent,
    /// The rkey under which the region is published for same-host peers, if it is.
    published_as: Option<u32>,
}

impl KeyCache {
    /// What the checks read of the MR `lkey` names, without a copy when it is the cached one.
    #[inline]
    fn by_lkey(&mut self, lkey: u32) -> Option<&CachedKey> {
        let changes = LKEY_CHANGES.load(Ordering::SeqCst);
        if changes != self.changes || self.last.as_ref().is_none_or(|k| k.lkey != lkey) {
            self.look_up(lkey, changes);
        }
        self.last.as_ref()
    }

    #[cold]
    fn look_up(&mut self, lkey: u32, changes: u64) {
        self.changes = changes;
        self.last = BY_LKEY.get(&lkey).map(|r| {
            let mr = r.value();
            CachedKey {
                lkey,
                pd: Arc::as_ptr(&mr.pd) as usize,
                access: mr.access,
                iova: mr.iova,
                region: mr.region.extent(),
                published_as: mr.published_as(),
            }
        });
    }
}

/// The checks of one SGE against the local MRs of `pd` (lkey, PD, liveness, local write when
/// `need_write`): the region it lies in and its address in this process (the SGE's address is
/// in the MR's iova space). Its range is checked by what uses the region.
#[inline]
fn checked_sge(
    pd: &Arc<ProtectionDomain>,
    sge: &Sge,
    need_write: bool,
    cache: &mut KeyCache,
) -> Option<(RegionExtent, u64)> {
    let mr = cache.by_lkey(sge.lkey)?;
    if mr.pd != Arc::as_ptr(pd) as usize || !mr.region.is_live() {
        return None;
    }
    if need_write && mr.access & ACCESS_LOCAL_WRITE == 0 {
        return None;
    }
    let offset = sge.addr.checked_sub(mr.iova)?;
    Some((mr.region, mr.region.addr().checked_add(offset)?))
}

/// Whether `sges` name live, pinned (not on-demand) memory of `pd` with local write access
/// (what [`local_spans_cached`] would cut for a receive), without cutting spans.
pub fn receive_sges_pinned(pd: &Arc<ProtectionDomain>, sges: &[Sge], cache: &mut KeyCache) -> bool {
    let pinned = |sge: &Sge, cache: &mut KeyCache| {
        sge.length == 0 || pinned_receive_sge(pd, sge, cache).is_some()
    };
    match sges {
        // Most receive WRs (one per SEND placed): no iterator to set up.
        [one] => pinned(one, cache),
        _ => sges.iter().all(|sge| pinned(sge, cache)),
    }
}

/// One receive SGE checked for local writing whose whole range lies in live, pinned (not
/// on-demand) memory: its region and address in this process.
#[inline]
fn pinned_receive_sge(
    pd: &Arc<ProtectionDomain>,
    sge: &Sge,
    cache: &mut KeyCache,
) -> Option<(RegionExtent, u64)> {
    checked_sge(pd, sge, true, cache)
        .filter(|(region, addr)| region.holds_pinned(*addr, u64::from(sge.length)))
}

/// Where a same-host peer may write a SEND larger than a receive ring entry into a receive WR
/// (`engine/direct.rs`): its one SGE, when that names live pinned memory of `pd` granting
/// local writing in a region published for the direct path (the peer checks the published
/// region again before it writes). None: such SENDs go through UCX.
pub fn in_place_target(
    pd: &Arc<ProtectionDomain>,
    sges: &[Sge],
    cache: &mut KeyCache,
) -> Option<InPlace> {
    let [sge] = sges else {
        return None;
    };
    if (sge.length as usize) <= SEND_MAX {
        return None;
    }
    pinned_receive_sge(pd, sge, cache)?;
    let rkey = cache.by_lkey(sge.lkey)?.published_as?;
    Some(InPlace {
        rkey,
        len: sge.length,
        addr: sge.addr,
    })
}

/// Lands `bytes` in a receive WR's single SGE, checked as [`local_spans_cached`] checks it for
/// local writing, when it lies in a pinned region: true once written. False when the WR has
/// more SGEs, or the SGE needs more than these checks (an on-demand region) or fails them:
/// the caller then cuts spans, which tells which.
pub fn land_in_one_pinned_sge(
    pd: &Arc<ProtectionDomain>,
    sges: &[Sge],
    bytes: &[u8],
    cache: &mut KeyCache,
) -> bool {
    let [sge] = sges else {
        return false;
    };
    if bytes.len() as u64 > u64::from(sge.length) {
        return false;
    }
    // The whole SGE must lie in the region, as a cut span would (a receive WR with a bad SGE
    // fails whatever the message's length); write_pinned checks only the bytes it writes.
    pinned_receive_sge(pd, sge, cache)
        .is_some_and(|(region, addr)| region.write_pinned(addr, bytes))
}

/// [`local_spans`], looking lkeys up through `cache`.
pub fn local_spans_cached(
    pd: &Arc<ProtectionDomain>,
    sges: &[Sge],
    need_write: bool,
    cache: &mut KeyCache,
) -> Option<SpanList> {
    let span = |sge: &Sge, cache: &mut KeyCache| {
        let (region, addr) = checked_sge(pd, sge, need_write, cache)?;
        region.span_for(addr, u64::from(sge.length), need_write)
    };
    match sges {
        // Most WRs: one SGE, its span built in place.
        [sge] if sge.length > 0 => Some(SmallVec::from_buf([span(sge, cache)?])),
        _ => {
            let mut spans = SmallVec::new();
            for sge in sges.iter().filter(|s| s.length > 0) {
                spans.push(span(sge, cache)?);
            }
            Some(spans)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_verbs::context::DeviceContext;

    fn pd() -> Arc<ProtectionDomain> {
        ProtectionDomain::new(Arc::new(DeviceContext::new().expect("context")))
    }

    const ODP_RW: u32 = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_ON_DEMAND;

    #[test]
    fn a_region_with_bound_windows_is_busy_for_reregistration() {
        let pd = pd();
        let buf = vec![0u8; 8192];
        let a = buf.as_ptr() as u64;
        let mr = MemoryRegion::register(&pd, AppRegion::on_demand(a, 8192), a, ODP_RW).unwrap();
        let lkey = mr.lkey();
        mr.adopt_window().unwrap();
        let busy = mr.reregister(&pd, AppRegion::on_demand(a, 4096), a, ODP_RW);
        assert!(matches!(busy, Err(VerbsError::Busy(_))), "{busy:?}");
        assert_eq!(busy.unwrap_err().errno(), libc::EBUSY);
        assert_eq!(mr.registration().region.len(), 8192, "unchanged");
        mr.release_window();
        mr.reregister(&pd, AppRegion::on_demand(a, 4096), a, ODP_RW)
            .unwrap();
        assert_eq!(mr.registration().region.len(), 4096);
        assert_eq!(mr.lkey(), lkey, "the lkey stays");
        assert!(remote_span(&pd, mr.rkey(), a + 4000, 96, ACCESS_REMOTE_WRITE).is_some());
        assert!(
            remote_span(&pd, mr.rkey(), a + 4000, 97, ACCESS_REMOTE_WRITE).is_none(),
            "the old length is gone"
        );
        mr.deregister().unwrap();
        assert_eq!(pd.check_deallocatable(), Ok(()));
    }

    #[test]
    fn a_placed_send_lands_in_one_pinned_sge_only_under_every_check_of_a_cut_span() {
        let other_pd = pd();
        let pd = pd();
        // Device memory: pinned memory ugdr owns, registered as host memory at its address.
        let dm = crate::fake_verbs::dm::DeviceMemory::allocate(&pd.context, 4096, 0).unwrap();
        let region = || dm.region(0, 4096).unwrap();
        let a = region().addr();
        let bytes_at = |offset: u64, len: u64| crate::ucp::gather(&[dm.span(offset, len).unwrap()]);
        let rw = ACCESS_LOCAL_WRITE;
        let mr = MemoryRegion::register(&pd, region(), a, rw).unwrap();
        let sge = |addr: u64, length: u32| Sge {
            addr,
            length,
            lkey: mr.lkey(),
        };
        let mut cache = KeyCache::default();
        let bytes = [7u8; 8];
        assert!(land_in_one_pinned_sge(
            &pd,
            &[sge(a + 100, 16)],
            &bytes,
            &mut cache
        ));
        assert_eq!(bytes_at(100, 8), bytes, "landed where the SGE points");
        assert_eq!(bytes_at(108, 1), [0], "no byte past the message");
        let mut refused = |sges: &[Sge], pd: &Arc<ProtectionDomain>| {
            !land_in_one_pinned_sge(pd, sges, &bytes, &mut cache)
        };
        assert!(
            refused(&[sge(a + 4080, 32)], &pd),
            "SGE past the end (the message fits)"
        );
        assert!(refused(&[sge(a + 200, 4)], &pd), "message above the SGE");
        assert!(refused(&[sge(a, 8), sge(a + 8, 8)], &pd), "two SGEs");
        assert!(refused(&[sge(a, 16)], &other_pd), "another PD");
        let unknown = Sge {
            lkey: mr.lkey() ^ 0x100,
            ..sge(a, 16)
        };
        assert!(refused(&[unknown], &pd), "unknown lkey");
        mr.reregister(&pd, region(), a, 0).unwrap();
        assert!(refused(&[sge(a + 300, 16)], &pd), "no local write");
        mr.reregister(&pd, AppRegion::on_demand(a, 4096), a, rw | ACCESS_ON_DEMAND)
            .unwrap();
        assert!(
            refused(&[sge(a + 300, 16)], &pd),
            "on-demand: left to the span path, which checks the mappings"
        );
        mr.reregister(&pd, region(), a, rw).unwrap();
        let stale = sge(a + 400, 16);
        mr.deregister().unwrap();
        assert!(refused(&[stale], &pd), "deregistered");
        assert!(
            bytes_at(200, 3896).iter().all(|&b| b == 0),
            "nothing landed when refused"
        );
    }

    #[test]
    fn receive_sges_are_pinned_only_when_every_sge_with_bytes_passes_the_checks() {
        let pd = pd();
        let dm = crate::fake_verbs::dm::DeviceMemory::allocate(&pd.context, 4096, 0).unwrap();
        let a = dm.region(0, 4096).unwrap().addr();
        let mr = MemoryRegion::register(&pd, dm.region(0, 4096).unwrap(), a, ACCESS_LOCAL_WRITE)
            .unwrap();
        let sge = |addr: u64, length: u32, lkey: u32| Sge { addr, length, lkey };
        let good = sge(a, 64, mr.lkey());
        let bad = sge(a, 64, mr.lkey() ^ 0x100);
        let past_end = sge(a + 4090, 64, mr.lkey());
        let empty_bad = sge(0, 0, mr.lkey() ^ 0x100);
        let mut cache = KeyCache::default();
        let mut pinned = |sges: &[Sge]| receive_sges_pinned(&pd, sges, &mut cache);
        assert!(pinned(&[good]));
        assert!(!pinned(&[bad]), "unknown lkey");
        assert!(!pinned(&[past_end]), "range past the region");
        assert!(pinned(&[empty_bad]), "an empty SGE holds nothing to check");
        assert!(pinned(&[]), "no SGE");
        assert!(pinned(&[good, empty_bad, good]));
        assert!(!pinned(&[good, bad]), "the second SGE counts too");
        assert!(!pinned(&[good, good, past_end]), "and the last");
        mr.reregister(&pd, dm.region(0, 4096).unwrap(), a, 0)
            .unwrap();
        assert!(!pinned(&[good]), "no local write");
    }

    #[test]
    fn a_kept_key_cache_sees_every_reregistration_and_deregistration() {
        let pd = pd();
        let buf = vec![0u8; 8192];
        let a = buf.as_ptr() as u64;
        let mr = MemoryRegion::register(&pd, AppRegion::on_demand(a, 8192), a, ODP_RW).unwrap();
        let sge = Sge {
            addr: a + 4096,
            length: 64,
            lkey: mr.lkey(),
        };
        let mut cache = KeyCache::default();
        assert!(local_spans_cached(&pd, &[sge], true, &mut cache).is_some());
        // Same lkey, now read-only and half as long: the cached registration is stale.
        let read_only = ACCESS_ON_DEMAND;
        mr.reregister(&pd, AppRegion::on_demand(a, 8192), a, read_only)
            .unwrap();
        assert_eq!(mr.lkey(), sge.lkey);
        assert!(
            local_spans_cached(&pd, &[sge], true, &mut cache).is_none(),
            "written through a registration without LOCAL_WRITE"
        );
        assert!(local_spans_cached(&pd, &[sge], false, &mut cache).is_some());
        mr.reregister(&pd, AppRegion::on_demand(a, 4096), a, ODP_RW)
            .unwrap();
        assert!(
            local_spans_cached(&pd, &[sge], true, &mut cache).is_none(),
            "past the new end"
        );
        let inside = Sge { addr: a, ..sge };
        let spans = local_spans_cached(&pd, &[inside], true, &mut cache).unwrap();
        mr.deregister().unwrap();
        drop(mr);
        // The cache keeps nothing alive: a span cut before the deregistration is dead.
        assert!(
            spans[0].hold().is_none(),
            "the region outlived ibv_dereg_mr"
        );
        assert!(
            local_spans_cached(&pd, &[inside], true, &mut cache).is_none(),
            "deregistered"
        );
    }

    #[test]
    fn on_demand_spans_are_cut_only_from_mapped_memory() {
        let pd = pd();
        let whole = || AppRegion::on_demand(0, u64::MAX);
        let mr = MemoryRegion::register(&pd, whole(), 0, ODP_RW).unwrap();
        let local = [7u64; 4];
        let a = local.as_ptr() as u64;
        assert!(remote_span(&pd, mr.rkey(), a, 32, ACCESS_REMOTE_WRITE).is_some());
        assert!(
            remote_span(&pd, mr.rkey(), 8, 8, ACCESS_REMOTE_WRITE).is_none(),
            "page 0"
        );
        let text = on_demand_spans_are_cut_only_from_mapped_memory as *const () as u64;
        assert!(
            remote_span(&pd, mr.rkey(), text, 8, ACCESS_REMOTE_WRITE).is_none(),
            "code is not writable"
        );
        let sge = |addr| Sge {
            addr,
            length: 8,
            lkey: mr.lkey(),
        };
        assert!(
            local_spans(&pd, &[sge(text)], false).is_some(),
            "code is readable"
        );
        assert!(local_spans(&pd, &[sge(text)], true).is_none());
        assert!(local_spans(&pd, &[sge(16)], false).is_none());
        // Implicit ODP needs the on-demand flag and iova 0.
        assert!(MemoryRegion::register(&pd, whole(), 4096, ODP_RW).is_err());
        assert!(MemoryRegion::register(&pd, whole(), 0, ACCESS_LOCAL_WRITE).is_err());
        mr.deregister().unwrap();
    }

    #[test]
    fn device_memory_regions_are_zero_based_and_keep_their_memory_busy() {
        let pd = pd();
        let dm = DeviceMemory::allocate(&pd.context, 8192, 0).unwrap();
        let rw = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE;
        assert!(MemoryRegion::register_device_memory(&pd, &dm, 0, 4096, rw).is_err());
        assert!(
            MemoryRegion::register_device_memory(&pd, &dm, 4096, 4097, rw | ACCESS_ZERO_BASED)
                .is_err()
        );
        let mr = MemoryRegion::register_device_memory(&pd, &dm, 4096, 4096, rw | ACCESS_ZERO_BASED)
            .unwrap();
        let span = remote_span(&pd, mr.rkey(), 100, 8, ACCESS_REMOTE_WRITE).unwrap();
        assert_eq!(span.addr(), dm.span(4096 + 100, 8).unwrap().addr());
        assert!(remote_span(&pd, mr.rkey(), 4090, 8, ACCESS_REMOTE_WRITE).is_none());
        assert!(matches!(dm.check_freeable(), Err(VerbsError::Busy(_))));
        let moved = mr.reregister(&pd, AppRegion::on_demand(0, u64::MAX), 0, ODP_RW);
        assert!(matches!(moved, Err(VerbsError::Invalid(_))), "{moved:?}");
        mr.deregister().unwrap();
        assert_eq!(dm.check_freeable(), Ok(()));
        assert!(matches!(dm.span(8000, 193), Err(VerbsError::Invalid(_))));
    }
}
