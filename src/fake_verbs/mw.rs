//! Memory windows (`ibv_alloc_mw`, IBA 10.6.7): a remote key for a sub-range of a memory
//! region, with access rights of its own, bound and invalidated through the send queue.
//!
//! The rules are rxe's (`rxe_mw.c`), which follow IBA's compliance statements:
//! * A window's rkey is `index << 8 | key`: the index (24 random bits, never the upper bits of
//!   a region's rkey) names the window for its life, the low 8 bits are the consumer's key,
//!   chosen at each bind (`ibv_inc_rkey`). A window starts unbound.
//! * Binding (a BIND_MW work request; `ibv_bind_mw` posts one for type 1) needs: for type 1,
//!   `mw->rkey` being the window's current key (`ibv_bind_mw` keeps it so); a region of the window's PD that is
//!   not zero-based and has `IBV_ACCESS_MW_BIND` (C10-73); local write on the region when the
//!   window grants remote write or atomics (C10-74); the range inside the region (C10-75); no
//!   access but remote read/write/atomic (local write, meaningless for a window, is accepted
//!   and ignored as rxe and mlx5 do; zero-based windows are not offered). A type 1 window
//!   may be bound again (replacing the binding) or unbound with length 0; a type 2 window only
//!   when unbound (o10-37.2.30), through a QP of its PD (C10-72), with a region and a length
//!   (o10-37.2.40). Anything else completes the WR with `IBV_WC_MW_BIND_ERR`.
//! * A type 2 window (2B) is reached only through the QP that bound it; a type 1 window
//!   through any QP of its PD. Either grants exactly its access over exactly its range.
//! * Only a bound type 2 window can be invalidated (o10-37.2.26), locally (LOCAL_INV: else
//!   `IBV_WC_LOC_QP_OP_ERR`) or by the peer (SEND_WITH_INV: else `IBV_WC_REM_INV_REQ_ERR`);
//!   a region's key cannot be (ugdr has no fast-registration MRs).
//! * A bound window keeps its region busy: `ibv_rereg_mr` is EBUSY, `ibv_dereg_mr` EINVAL.
//!   Deallocating a window unbinds it.
//!
//! Windows are never published for the same-host direct path (their rkeys name no slot, so a
//! direct access through one falls back to the message path); accesses are checked by the
//! responder under the window's lock, so once an unbind, rebind, invalidation or deallocation
//! returns, no new access through the old key is admitted (one already admitted, e.g. a
//! rendezvous WRITE still landing, finishes, as with `ibv_dereg_mr` on the message path).

use super::VerbsError;
use super::mr::{
    ACCESS_LOCAL_WRITE, ACCESS_MW_BIND, ACCESS_REMOTE, ACCESS_REMOTE_ATOMIC, ACCESS_REMOTE_WRITE,
    ACCESS_ZERO_BASED, MemoryRegion, Registration, rkey_prefix_in_use,
};
use super::pd::ProtectionDomain;
use crate::ucp::AppSpan;
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};

/// `enum ibv_mw_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowType {
    One = 1,
    Two = 2,
}

impl WindowType {
    pub fn from_raw(v: u32) -> Option<WindowType> {
        match v {
            1 => Some(WindowType::One),
            2 => Some(WindowType::Two),
            _ => None,
        }
    }
}

/// The access flags a window may grant.
const WINDOW_ACCESS: u32 = ACCESS_REMOTE;

/// Most windows a process holds (`max_mw`).
pub const MAX_WINDOWS: i32 = 1 << 16;

pub struct MemoryWindow {
    pub pd: Arc<ProtectionDomain>,
    pub kind: WindowType,
    /// The upper 24 bits of every rkey the window has.
    index: u32,
    binding: Mutex<Binding>,
}

struct Binding {
    rkey: u32,
    bound: Option<Bound>,
}

impl Binding {
    /// Unbinds: the region it was bound to is free of it. Whether it was bound.
    fn unbind(&mut self) -> bool {
        let Some(old) = self.bound.take() else {
            return false;
        };
        old.region.release_window();
        true
    }
}

struct Bound {
    region: Arc<MemoryRegion>,
    registration: Arc<Registration>,
    addr: u64,
    len: u64,
    access: u32,
    /// Type 2: the QP that bound it, the only one it is reached through.
    qpn: u32,
}

/// A BIND_MW work request, as posted.
#[derive(Clone)]
pub struct BindRequest {
    pub window: Arc<MemoryWindow>,
    /// The window's rkey as the application named it (`mw->rkey` at post time).
    pub window_rkey: u32,
    /// The new rkey: its low 8 bits become the window's key.
    pub new_rkey: u32,
    /// The region (NULL in C: None; only a type 1 unbind may omit it).
    pub region: Option<Arc<MemoryRegion>>,
    pub addr: u64,
    pub length: u64,
    pub access: u32,
}

impl std::fmt::Debug for BindRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BindRequest")
            .field("window_rkey", &self.window_rkey)
            .field("new_rkey", &self.new_rkey)
            .field("addr", &self.addr)
            .field("length", &self.length)
            .field("access", &self.access)
            .finish()
    }
}

/// Every window of the process, by index (`rkey >> 8`).
static WINDOWS: LazyLock<DashMap<u32, Arc<MemoryWindow>, FxBuildHasher>> =
    LazyLock::new(DashMap::default);

/// Whether `key`'s upper 24 bits name a window (so no region may take it as its rkey).
pub fn reserves(key: u32) -> bool {
    WINDOWS.contains_key(&(key >> 8))
}

fn random_bytes() -> [u8; 4] {
    let mut b = [0u8; 4];
    if getrandom::fill(&mut b).is_err() {
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0x51_7c00);
        b = NEXT
            .fetch_add(0x1_0b00, std::sync::atomic::Ordering::Relaxed)
            .to_ne_bytes();
    }
    b
}

impl MemoryWindow {
    /// `ibv_alloc_mw`: an unbound window of `pd`; it counts in the PD until deallocated.
    pub fn allocate(
        pd: &Arc<ProtectionDomain>,
        kind: WindowType,
    ) -> Result<Arc<MemoryWindow>, VerbsError> {
        if WINDOWS.len() >= MAX_WINDOWS as usize {
            return Err(VerbsError::NoResources("memory windows"));
        }
        loop {
            let b = random_bytes();
            let index = u32::from_le_bytes([b[0], b[1], b[2], 0]);
            if index == 0 || rkey_prefix_in_use(index) {
                continue;
            }
            let window = Arc::new(MemoryWindow {
                pd: Arc::clone(pd),
                kind,
                index,
                binding: Mutex::new(Binding {
                    rkey: index << 8 | u32::from(b[3]),
                    bound: None,
                }),
            });
            let dashmap::Entry::Vacant(slot) = WINDOWS.entry(index) else {
                continue;
            };
            slot.insert(Arc::clone(&window));
            // A region registered meanwhile may have taken this prefix: draw again.
            if rkey_prefix_in_use(index) {
                WINDOWS.remove(&index);
                continue;
            }
            pd.adopt_child();
            return Ok(window);
        }
    }

    fn binding(&self) -> MutexGuard<'_, Binding> {
        self.binding.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The window's current rkey.
    pub fn rkey(&self) -> u32 {
        self.binding().rkey
    }

    /// `ibv_dealloc_mw`: unbinds it (its region is free again) and retires its keys.
    pub fn deallocate(&self) {
        let mut b = self.binding();
        b.unbind();
        drop(b);
        WINDOWS.remove(&self.index);
        self.pd.release_child();
    }

    /// Executes a BIND_MW WR posted on QP `qpn` of `qp_pd`. An error is the WR's
    /// `IBV_WC_MW_BIND_ERR` (nothing changed).
    pub fn bind(
        &self,
        qp_pd: &Arc<ProtectionDomain>,
        qpn: u32,
        req: &BindRequest,
    ) -> Result<(), VerbsError> {
        let mut b = self.binding();
        // Type 1: `ibv_bind_mw` keeps `mw->rkey` current, so a stale one is an error. A type 2
        // bind names its window by pointer (`mw->rkey` is not updated by a BIND_MW WR).
        if self.kind == WindowType::One && req.window_rkey != b.rkey {
            return Err(VerbsError::Invalid(
                "the rkey is not the window's current one",
            ));
        }
        // Local write is a region's right, meaningless for a window: accepted and ignored, as
        // rxe and mlx5 do (rdma-core's own tests bind with it).
        if req.access & !(WINDOW_ACCESS | ACCESS_ZERO_BASED | ACCESS_LOCAL_WRITE) != 0 {
            return Err(VerbsError::Invalid("access flags a window cannot grant"));
        }
        if req.access & ACCESS_ZERO_BASED != 0 {
            return Err(VerbsError::Invalid("zero-based windows are not offered"));
        }
        if self.kind == WindowType::Two {
            if b.bound.is_some() {
                return Err(VerbsError::Invalid("type 2 window already bound"));
            }
            if !Arc::ptr_eq(qp_pd, &self.pd) {
                return Err(VerbsError::Invalid(
                    "type 2 window of another PD than the QP's",
                ));
            }
            if req.region.is_none() || req.length == 0 {
                return Err(VerbsError::Invalid(
                    "type 2 bind without a region or length",
                ));
            }
        }
        let new_rkey = (b.rkey & !0xff) | (req.new_rkey & 0xff);
        let Some(region) = req.region.as_ref().filter(|_| req.length != 0) else {
            // Type 1, length 0: unbound, under a new key.
            b.unbind();
            b.rkey = new_rkey;
            return Ok(());
        };
        let reg = region.registration();
        if !Arc::ptr_eq(&reg.pd, &self.pd) {
            return Err(VerbsError::Invalid(
                "region of another PD than the window's",
            ));
        }
        if reg.access & ACCESS_ZERO_BASED != 0 {
            return Err(VerbsError::Invalid("zero-based region"));
        }
        if reg.access & ACCESS_MW_BIND == 0 {
            return Err(VerbsError::Invalid("region without IBV_ACCESS_MW_BIND"));
        }
        if req.access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0
            && reg.access & ACCESS_LOCAL_WRITE == 0
        {
            return Err(VerbsError::Invalid(
                "writable window on a region without local write",
            ));
        }
        let inside = req.addr >= reg.iova
            && req
                .addr
                .checked_add(req.length)
                .is_some_and(|end| end <= reg.iova.saturating_add(reg.region.len()));
        if !inside {
            return Err(VerbsError::Invalid("window outside its region"));
        }
        let registration = region.adopt_window()?;
        b.unbind();
        b.bound = Some(Bound {
            region: Arc::clone(region),
            registration,
            addr: req.addr,
            len: req.length,
            access: req.access & WINDOW_ACCESS,
            qpn,
        });
        b.rkey = new_rkey;
        Ok(())
    }
}

/// The window `rkey` names, if it names one.
fn window_of(rkey: u32) -> Option<Arc<MemoryWindow>> {
    WINDOWS.get(&(rkey >> 8)).map(|w| Arc::clone(w.value()))
}

/// Invalidates the type 2 window `rkey` for a QP of `pd`: a LOCAL_INV (`arrived_on` None), or
/// a SEND_WITH_INV that arrived on QP `arrived_on`, which must be the QP the window was bound
/// through. Errors: no window under that key (a region's key included), a window of another
/// PD or (remotely) bound through another QP, a type 1 window, an unbound one.
pub fn invalidate(
    pd: &Arc<ProtectionDomain>,
    arrived_on: Option<u32>,
    rkey: u32,
) -> Result<(), VerbsError> {
    let window = window_of(rkey).ok_or(VerbsError::Invalid("rkey names no memory window"))?;
    let mut b = window.binding();
    if b.rkey != rkey {
        return Err(VerbsError::Invalid("not the window's current rkey"));
    }
    let other_qp = |qpn| b.bound.as_ref().is_some_and(|bound| bound.qpn != qpn);
    if !Arc::ptr_eq(&window.pd, pd) || arrived_on.is_some_and(other_qp) {
        return Err(VerbsError::Invalid(
            "the window belongs to another PD or was bound through another QP",
        ));
    }
    if window.kind == WindowType::One {
        return Err(VerbsError::Invalid("type 1 windows are not invalidated"));
    }
    if !b.unbind() {
        return Err(VerbsError::Invalid("the window is not bound"));
    }
    Ok(())
}

/// Checks a remote access (as [`super::mr::remote_span`]) arriving on QP `qpn` of `pd`: a
/// region's rkey, or a bound window's (of `pd`, bound through `qpn` if type 2, granting
/// `access` over the whole range).
pub fn remote_span(
    pd: &Arc<ProtectionDomain>,
    qpn: u32,
    rkey: u32,
    addr: u64,
    len: u64,
    access: u32,
) -> Option<AppSpan> {
    if let Some(span) = super::mr::remote_span(pd, rkey, addr, len, access) {
        return Some(span);
    }
    let window = window_of(rkey)?;
    let b = window.binding();
    let bound = b.bound.as_ref()?;
    let inside = addr >= bound.addr
        && addr
            .checked_add(len)
            .is_some_and(|end| end <= bound.addr + bound.len);
    if b.rkey != rkey
        || !Arc::ptr_eq(&window.pd, pd)
        || (window.kind == WindowType::Two && bound.qpn != qpn)
        || bound.access & access != access
        || !inside
    {
        return None;
    }
    let write = access & (ACCESS_REMOTE_WRITE | ACCESS_REMOTE_ATOMIC) != 0;
    bound.registration.span_at(addr, len, write)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake_verbs::context::DeviceContext;
    use crate::fake_verbs::mr::ACCESS_REMOTE_READ;
    use crate::ucp::AppRegion;

    const ODP: u32 = super::super::mr::ACCESS_ON_DEMAND;

    fn setup(access: u32) -> (Arc<ProtectionDomain>, Arc<MemoryRegion>, Vec<u8>) {
        let pd = ProtectionDomain::new(Arc::new(DeviceContext::new().expect("context")));
        let buf = vec![0u8; 8192];
        let a = buf.as_ptr() as u64;
        let mr =
            MemoryRegion::register(&pd, AppRegion::on_demand(a, 8192), a, access | ODP).unwrap();
        (pd, mr, buf)
    }

    fn bind_req(w: &Arc<MemoryWindow>, mr: &Arc<MemoryRegion>, addr: u64, len: u64) -> BindRequest {
        BindRequest {
            window: Arc::clone(w),
            window_rkey: w.rkey(),
            new_rkey: w.rkey().wrapping_add(1),
            region: Some(Arc::clone(mr)),
            addr,
            length: len,
            access: ACCESS_REMOTE_WRITE | ACCESS_REMOTE_READ,
        }
    }

    #[test]
    fn a_type_2_window_grants_its_range_through_its_qp_until_invalidated() {
        let rw = ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE | ACCESS_MW_BIND;
        let (pd, mr, buf) = setup(rw);
        let a = buf.as_ptr() as u64;
        let w = MemoryWindow::allocate(&pd, WindowType::Two).unwrap();
        let first = w.rkey();
        assert!(!super::super::mr::rkey_prefix_in_use(first >> 8));
        w.bind(&pd, 7, &bind_req(&w, &mr, a + 4096, 100)).unwrap();
        let rkey = w.rkey();
        assert_eq!(rkey >> 8, first >> 8);
        assert_eq!(rkey & 0xff, first.wrapping_add(1) & 0xff);
        assert!(remote_span(&pd, 7, rkey, a + 4096, 100, ACCESS_REMOTE_WRITE).is_some());
        assert!(remote_span(&pd, 7, rkey, a + 4095, 2, ACCESS_REMOTE_WRITE).is_none());
        assert!(remote_span(&pd, 7, rkey, a + 4100, 97, ACCESS_REMOTE_WRITE).is_none());
        assert!(remote_span(&pd, 8, rkey, a + 4096, 8, ACCESS_REMOTE_WRITE).is_none());
        assert!(remote_span(&pd, 7, rkey, a + 4096, 8, ACCESS_REMOTE_ATOMIC).is_none());
        assert!(remote_span(&pd, 7, first, a + 4096, 8, ACCESS_REMOTE_WRITE).is_none());
        // Bound: busy region, no second bind.
        assert!(mr.deregister().is_err());
        assert!(w.bind(&pd, 7, &bind_req(&w, &mr, a, 8)).is_err());
        assert!(
            invalidate(&pd, Some(7), mr.rkey()).is_err(),
            "a region's key"
        );
        assert!(invalidate(&pd, Some(7), first).is_err(), "an old key");
        assert!(
            invalidate(&pd, Some(8), rkey).is_err(),
            "bound through another QP"
        );
        let other = ProtectionDomain::new(Arc::new(DeviceContext::new().expect("context")));
        assert!(invalidate(&other, Some(7), rkey).is_err(), "another PD");
        invalidate(&pd, Some(7), rkey).unwrap();
        assert!(invalidate(&pd, Some(7), rkey).is_err(), "already invalid");
        assert!(remote_span(&pd, 7, rkey, a + 4096, 8, ACCESS_REMOTE_WRITE).is_none());
        w.deallocate();
        mr.deregister().unwrap();
        assert_eq!(pd.check_deallocatable(), Ok(()));
    }

    #[test]
    fn binds_are_checked_as_rxe_checks_them() {
        let (pd, mr, buf) = setup(ACCESS_LOCAL_WRITE | ACCESS_REMOTE_WRITE);
        let a = buf.as_ptr() as u64;
        let w = MemoryWindow::allocate(&pd, WindowType::One).unwrap();
        assert!(
            w.bind(&pd, 1, &bind_req(&w, &mr, a, 8)).is_err(),
            "no MW_BIND"
        );
        let (pd2, mr2, buf2) = setup(ACCESS_MW_BIND);
        let a2 = buf2.as_ptr() as u64;
        let w2 = MemoryWindow::allocate(&pd2, WindowType::One).unwrap();
        assert!(
            w2.bind(&pd2, 1, &bind_req(&w2, &mr2, a2, 8)).is_err(),
            "write without local write"
        );
        let mut ro = bind_req(&w2, &mr2, a2, 8);
        ro.access = ACCESS_REMOTE_READ;
        w2.bind(&pd2, 1, &ro).unwrap();
        assert!(
            w.bind(&pd, 1, &bind_req(&w, &mr2, a2, 8)).is_err(),
            "region of another PD"
        );
        let w3 = MemoryWindow::allocate(&pd2, WindowType::Two).unwrap();
        assert!(
            w3.bind(&pd, 1, &bind_req(&w3, &mr2, a2, 8)).is_err(),
            "QP of another PD"
        );
        let mut outside = bind_req(&w2, &mr2, a2 + 8000, 193);
        outside.access = ACCESS_REMOTE_READ;
        assert!(w2.bind(&pd2, 1, &outside).is_err());
        assert!(invalidate(&pd2, Some(1), w2.rkey()).is_err(), "type 1");
        // A type 1 unbind (length 0) changes the key and frees the region.
        let unbind = BindRequest {
            region: None,
            length: 0,
            addr: 0,
            ..bind_req(&w2, &mr2, a2, 0)
        };
        w2.bind(&pd2, 1, &unbind).unwrap();
        mr2.deregister().unwrap();
        for w in [w, w2, w3] {
            w.deallocate();
        }
        mr.deregister().unwrap();
    }
}
