//! XRC domains (`ibv_open_xrcd`) and the numbers of XRC SRQs (`ibv_get_srq_num`).
//!
//! **What "the same domain" is in ugdr.** The kernel keeps one XRC domain per device and
//! inode: every `ibv_open_xrcd` of the same file (by any process) gets the same domain, and an
//! XRC target QP delivers into any XRC SRQ of it. In ugdr every process is its own device
//! (its own LID and engine), and a message reaches the process that owns the target QP, so a
//! domain is one per **device context and file** (`st_dev`, `st_ino`) in a process: opening
//! the same file again in that process gives the same domain (a new handle, each closed on its
//! own); other processes that open the file get a domain of their own, which they use exactly
//! as the kernel's (target QPs, SRQs, `ibv_open_qp` by number) among the objects they
//! created. A target QP therefore delivers to the SRQs its own process created in its domain;
//! an SRQ number from anywhere else (another domain, another process, none) is an invalid
//! request. `fd = -1` (librdmacm's) makes a domain no file names.
//!
//! An XRC target QP has neither a PD nor CQs of its own: the domain gives it an internal PD
//! (no memory is registered in it) and CQ (never written: a target QP sends nothing, its
//! receives complete on the SRQ's CQ), as mlx5_ib gives target QPs its device resources.

use super::VerbsError;
use super::context::DeviceContext;
use super::cq::CompletionQueue;
use super::pd::ProtectionDomain;
use super::qp::QueuePair;
use super::srq::SharedReceiveQueue;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};

/// A file's identity (`st_dev`, `st_ino`): what the kernel keys XRC domains by.
pub type FileKey = (u64, u64);

/// One XRC domain of this process.
pub struct XrcDomain {
    pub context: Arc<DeviceContext>,
    file: Option<FileKey>,
    /// What the domain's target QPs use for a PD and CQs (see the module comment).
    pub target_pd: Arc<ProtectionDomain>,
    pub target_cq: Arc<CompletionQueue>,
    /// Its target QPs by number (`ibv_open_qp`).
    targets: Mutex<HashMap<u32, Weak<QueuePair>>>,
}

impl Drop for XrcDomain {
    fn drop(&mut self) {
        self.target_cq.destroy();
    }
}

/// The open domains, to find one by context and file.
static DOMAINS: LazyLock<Mutex<Vec<Weak<XrcDomain>>>> = LazyLock::new(|| Mutex::new(Vec::new()));

/// One `ibv_xrcd` the application holds: the domain and the SRQs and QPs made through it
/// (closing it fails with EBUSY while any remain, as the kernel's per-handle count).
pub struct XrcdHandle {
    pub domain: Arc<XrcDomain>,
    users: AtomicUsize,
}

impl XrcdHandle {
    /// `ibv_open_xrcd`: `file` None is a new domain no file names (`fd = -1`); else the
    /// domain of that file, created when `create` (O_CREAT) allows (else EAGAIN), refused with
    /// EINVAL when it exists and `exclusive` (O_EXCL), as the kernel's.
    pub fn open(
        context: &Arc<DeviceContext>,
        file: Option<FileKey>,
        create: bool,
        exclusive: bool,
    ) -> Result<Arc<XrcdHandle>, VerbsError> {
        let mut domains = DOMAINS.lock().unwrap_or_else(|p| p.into_inner());
        domains.retain(|w| w.strong_count() > 0);
        let existing = file.and_then(|key| {
            domains
                .iter()
                .filter_map(Weak::upgrade)
                .find(|d| d.file == Some(key) && Arc::ptr_eq(&d.context, context))
        });
        let domain = match existing {
            Some(_) if exclusive => {
                return Err(VerbsError::Invalid("xrcd exists and O_EXCL was given"));
            }
            Some(d) => d,
            None if !create => {
                // The kernel's answer: nothing to open, and no O_CREAT.
                return Err(VerbsError::Os(libc::EAGAIN));
            }
            None => {
                let d = Arc::new(XrcDomain {
                    context: Arc::clone(context),
                    file,
                    target_pd: ProtectionDomain::new(Arc::clone(context)),
                    target_cq: CompletionQueue::new(Arc::clone(context), 1, None),
                    targets: Mutex::new(HashMap::new()),
                });
                domains.push(Arc::downgrade(&d));
                d
            }
        };
        Ok(Arc::new(XrcdHandle {
            domain,
            users: AtomicUsize::new(0),
        }))
    }

    pub fn adopt_user(&self) {
        self.users.fetch_add(1, Ordering::AcqRel);
    }

    pub fn release_user(&self) {
        self.users.fetch_sub(1, Ordering::AcqRel);
    }

    /// `ibv_close_xrcd`: EBUSY while SRQs or QPs made (or opened) through this handle remain.
    pub fn check_closable(&self) -> Result<(), VerbsError> {
        if self.users.load(Ordering::Acquire) != 0 {
            return Err(VerbsError::Busy("xrcd still has XRC SRQs or target QPs"));
        }
        Ok(())
    }
}

/// What makes an SRQ an XRC SRQ: its number, domain and CQ.
pub struct XrcSrq {
    pub number: u32,
    pub handle: Arc<XrcdHandle>,
    pub cq: Arc<CompletionQueue>,
}

/// Every XRC SRQ of the process by number (numbers are unique in the process, so a number
/// from another domain is never taken for one of this domain).
static SRQS: LazyLock<Mutex<HashMap<u32, Weak<SharedReceiveQueue>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn srqs() -> std::sync::MutexGuard<'static, HashMap<u32, Weak<SharedReceiveQueue>>> {
    SRQS.lock().unwrap_or_else(|p| p.into_inner())
}

/// Makes `srq` an XRC SRQ of `handle`'s domain whose completions go to `cq`: gives it a
/// random 24-bit number unique in the process.
pub fn attach_srq(
    srq: &Arc<SharedReceiveQueue>,
    handle: &Arc<XrcdHandle>,
    cq: &Arc<CompletionQueue>,
) {
    let mut all = srqs();
    all.retain(|_, w| w.strong_count() > 0);
    let number = loop {
        let n = crate::engine::random_u32() & 0xff_ffff;
        if n != 0 && !all.contains_key(&n) {
            break n;
        }
    };
    handle.adopt_user();
    cq.adopt_user();
    srq.make_xrc(XrcSrq {
        number,
        handle: Arc::clone(handle),
        cq: Arc::clone(cq),
    });
    all.insert(number, Arc::downgrade(srq));
}

/// Undoes [`attach_srq`] when the SRQ is destroyed.
pub fn detach_srq(x: &XrcSrq) {
    srqs().remove(&x.number);
    x.handle.release_user();
    x.cq.release_user();
}

impl XrcDomain {
    /// The XRC SRQ numbered `number` if it is one of this domain's.
    pub fn srq(self: &Arc<Self>, number: u32) -> Option<Arc<SharedReceiveQueue>> {
        let srq = srqs().get(&number)?.upgrade()?;
        let x = srq.xrc()?;
        Arc::ptr_eq(&x.handle.domain, self).then_some(srq)
    }

    fn targets(&self) -> std::sync::MutexGuard<'_, HashMap<u32, Weak<QueuePair>>> {
        self.targets.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a new target QP of this domain.
    pub fn add_target(&self, qp: &Arc<QueuePair>) {
        self.targets().insert(qp.qp_num, Arc::downgrade(qp));
    }

    /// Forgets a destroyed target QP.
    pub fn remove_target(&self, qp_num: u32) {
        self.targets().remove(&qp_num);
    }

    /// `ibv_open_qp`: the target QP numbered `qp_num` in this domain.
    pub fn target(&self, qp_num: u32) -> Option<Arc<QueuePair>> {
        self.targets().get(&qp_num)?.upgrade()
    }
}
