//! Memory regions: keys, access flags, and the checks a HCA makes on every SGE.

use super::VerbsError;
use super::pd::ProtectionDomain;
use super::work::Sge;
use crate::engine::Engine;
use crate::engine::direct::{PublishedRegion, RegionView};
use crate::ucp::{AppRegion, AppSpan};
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use smallvec::SmallVec;
use std::sync::{Arc, LazyLock, Mutex};

/// `enum ibv_access_flags` bits.
pub const ACCESS_LOCAL_WRITE: u32 = 1;
pub const ACCESS_REMOTE_WRITE: u32 = 1 << 1;
pub const ACCESS_REMOTE_READ: u32 = 1 << 2;
pub const ACCESS_REMOTE_ATOMIC: u32 = 1 << 3;
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
    | ACCESS_HUGETLB
    | ACCESS_OPTIONAL_RANGE;

pub struct MemoryRegion {
    pub pd: Arc<ProtectionDomain>,
    pub region: AppRegion,
    /// The address the peer uses for this region (iova; equals the address for ibv_reg_mr).
    pub iova: u64,
    pub access: u32,
    pub lkey: u32,
    pub rkey: u32,
    /// Where same-host peers see it (the direct path), while registered.
    published: Mutex<Option<PublishedRegion>>,
    /// The slot of the direct-access table its rkey names (held until deregistration).
    slot: Option<u16>,
}

/// Every live MR of the process, by lkey (local SGEs) and by rkey (remote requests).
static BY_LKEY: LazyLock<DashMap<u32, Arc<MemoryRegion>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);
static BY_RKEY: LazyLock<DashMap<u32, Arc<MemoryRegion>, FxBuildHasher>> =
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
fn unused_key(map: &DashMap<u32, Arc<MemoryRegion>, FxBuildHasher>, slot: Option<u16>) -> u32 {
    loop {
        let r = random_u32();
        let key = match slot {
            Some(s) => (r << 12) | u32::from(s),
            None => r,
        };
        if key != 0 && !map.contains_key(&key) {
            return key;
        }
    }
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

impl MemoryRegion {
    pub fn register(
        pd: &Arc<ProtectionDomain>,
        region: AppRegion,
        iova: u64,
        access: u32,
    ) -> Result<Arc<MemoryRegion>, VerbsError> {
        check_access(access)?;
        if region.is_empty() {
            return Err(VerbsError::Invalid("zero-length memory region"));
        }
        if region.addr().checked_add(region.len()).is_none()
            || iova.checked_add(region.len()).is_none()
        {
            return Err(VerbsError::Invalid("memory region wraps the address space"));
        }
        let remote = access & (ACCESS_REMOTE_READ | ACCESS_REMOTE_WRITE) != 0;
        let memory = Engine::local_memory().filter(|_| remote);
        let slot = memory.and_then(|m| m.allocate_region_slot());
        let lkey = unused_key(&BY_LKEY, None);
        let rkey = unused_key(&BY_RKEY, slot);
        let published = match (memory, slot) {
            (Some(m), Some(s)) => m.publish_region(
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
        let mr = Arc::new(MemoryRegion {
            pd: Arc::clone(pd),
            region,
            iova,
            access,
            lkey,
            rkey,
            published: Mutex::new(published),
            slot,
        });
        pd.adopt_child();
        BY_LKEY.insert(lkey, Arc::clone(&mr));
        BY_RKEY.insert(rkey, Arc::clone(&mr));
        Ok(mr)
    }

    /// Revokes the keys at once; operations already holding the MR finish, and no same-host
    /// peer reads or writes it directly once this returns.
    pub fn deregister(&self) {
        BY_LKEY.remove(&self.lkey);
        BY_RKEY.remove(&self.rkey);
        let published = self
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(m) = Engine::local_memory() {
            if let Some(p) = published {
                m.withdraw_region(p);
            }
            if let Some(s) = self.slot {
                m.free_region_slot(s);
            }
        }
        self.pd.release_child();
    }
}

/// Checks a remote access as the responder's HCA does: the rkey names a live MR of the QP's
/// PD that grants `access`, and `[addr, addr + len)` (in the MR's iova space) lies inside it.
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
    let offset = addr.checked_sub(mr.iova)?;
    let start = mr.region.addr().checked_add(offset)?;
    mr.region.span(start, len)
}

/// Checks `sges` against the local MRs of `pd` (lkey, PD, bounds, and local write for
/// receive buffers) and returns the spans; `None` is a local protection error.
pub fn local_spans(
    pd: &Arc<ProtectionDomain>,
    sges: &[Sge],
    need_write: bool,
) -> Option<SmallVec<[AppSpan; 4]>> {
    local_spans_cached(pd, sges, need_write, &mut KeyCache::default())
}

/// The MR an lkey named last, while one WR list is posted: the SGEs of a list mostly name
/// the same MR, so it is looked up once per list instead of once per SGE.
#[derive(Default)]
pub struct KeyCache {
    last: Option<Arc<MemoryRegion>>,
}

impl KeyCache {
    fn by_lkey(&mut self, lkey: u32) -> Option<&Arc<MemoryRegion>> {
        if self.last.as_ref().is_none_or(|mr| mr.lkey != lkey) {
            self.last = Some(BY_LKEY.get(&lkey).map(|r| Arc::clone(r.value()))?);
        }
        self.last.as_ref()
    }
}

/// [`local_spans`], looking lkeys up through `cache`.
pub fn local_spans_cached(
    pd: &Arc<ProtectionDomain>,
    sges: &[Sge],
    need_write: bool,
    cache: &mut KeyCache,
) -> Option<SmallVec<[AppSpan; 4]>> {
    let mut spans = SmallVec::new();
    for sge in sges {
        if sge.length == 0 {
            continue;
        }
        let mr = cache.by_lkey(sge.lkey)?;
        if !Arc::ptr_eq(&mr.pd, pd) {
            return None;
        }
        if need_write && mr.access & ACCESS_LOCAL_WRITE == 0 {
            return None;
        }
        // The SGE address is in the MR's iova space; translate to the process address.
        let offset = sge.addr.checked_sub(mr.iova)?;
        let addr = mr.region.addr().checked_add(offset)?;
        spans.push(mr.region.span(addr, u64::from(sge.length))?);
    }
    Some(spans)
}
