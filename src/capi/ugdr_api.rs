//! The `ugdr_*` C API (`include/ugdr.h`): opaque handles over the same verbs objects and engine
//! as `ibv_*`. Each export checks its pointers, converts, calls the safe core (`fake_verbs`,
//! `crate::ugdr`, `crate::topology`) and maps the result: pointers are NULL with errno set on
//! failure, ints are 0 or a positive errno, `ugdr_poll_cq` is a count or a negative errno.
//! Out-parameters are written only on success.

use super::boundary::{Fallback, ffi_boundary, set_errno, status};
use super::ibv_pd_mr::register_host;
use super::ibv_qp::{AppSge, read_sges};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::context::DeviceContext;
use crate::fake_verbs::cq::CompletionQueue;
use crate::fake_verbs::device;
use crate::fake_verbs::mr::MemoryRegion;
use crate::fake_verbs::pd::ProtectionDomain;
use crate::fake_verbs::qp::{QpCaps, QueuePair};
use crate::fake_verbs::qp_state::QpType;
use crate::fake_verbs::work::{RecvRequest, SendRequest, Sge, WorkCompletion, sges_length};
use crate::topology;
use crate::ugdr::address::{ADDR_LEN, PortAddress};
use crate::ugdr::modify::{UgdrModify, plan};
use crate::ugdr::{self as core, SEND_INLINE, SEND_SIGNALED};
use std::collections::HashMap;
use std::mem::{offset_of, size_of};
use std::os::raw::{c_char, c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, LazyLock, Mutex};

// ------------------------------------------------------------------ the C types

pub const DEVICE_NAME_MAX: usize = 64;
pub const MAX_GPUS_PER_DEV: usize = 16;

/// `struct ugdr_device`.
#[repr(C)]
pub struct ugdr_device {
    name: [c_char; DEVICE_NAME_MAX],
    numa_node: c_int,
    num_gpu: c_int,
    gpus: [c_int; MAX_GPUS_PER_DEV],
}

/// `struct ugdr_addr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ugdr_addr {
    raw: [u8; ADDR_LEN],
}

/// `struct ugdr_mr` (public in the header).
#[repr(C)]
pub struct ugdr_mr {
    context: *mut UgdrContext,
    pd: *mut UgdrPd,
    addr: *mut c_void,
    length: usize,
    handle: u32,
    lkey: u32,
    rkey: u32,
}

/// The anonymous caps struct of `struct ugdr_qp_init_attr`.
#[repr(C)]
pub struct ugdr_qp_caps {
    max_send_wr: u32,
    max_recv_wr: u32,
    max_sge: u32,
}

/// `struct ugdr_qp_init_attr`.
#[repr(C)]
pub struct ugdr_qp_init_attr {
    qp_context: *mut c_void,
    send_cq: *mut UgdrCq,
    recv_cq: *mut UgdrCq,
    cap: ugdr_qp_caps,
    qp_type: c_int,
    sq_sig_all: c_int,
}

/// `struct ugdr_qp_attr` (enum fields as the application wrote them: checked, not trusted).
#[repr(C)]
pub struct ugdr_qp_attr {
    qp_state: u32,
    cur_qp_state: u32,
    dest_qp_num: u32,
    dest_addr: ugdr_addr,
}

/// `struct ugdr_wc`.
#[repr(C)]
pub struct ugdr_wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    byte_len: u32,
    qp_num: u32,
}

/// `struct ugdr_sge`.
#[repr(C)]
pub struct ugdr_sge {
    addr: u64,
    length: u32,
    lkey: u32,
}

/// `struct ugdr_recv_wr`.
#[repr(C)]
pub struct ugdr_recv_wr {
    wr_id: u64,
    next: *mut ugdr_recv_wr,
    sg_list: *mut ugdr_sge,
    num_sge: c_int,
}

/// The `rdma` member of `struct ugdr_send_wr`.
#[repr(C)]
pub struct ugdr_rdma {
    remote_addr: u64,
    rkey: u32,
}

/// `struct ugdr_send_wr`.
#[repr(C)]
pub struct ugdr_send_wr {
    wr_id: u64,
    next: *mut ugdr_send_wr,
    sg_list: *mut ugdr_sge,
    num_sge: c_int,
    opcode: u32,
    send_flags: u32,
    rdma: ugdr_rdma,
}

// The header's layout on LP64 (tests/c/ugdr_checks.c asserts the same numbers in C).
const _: () = assert!(size_of::<ugdr_device>() == 136);
const _: () = assert!(size_of::<ugdr_addr>() == 32);
const _: () = assert!(size_of::<ugdr_mr>() == 48 && offset_of!(ugdr_mr, lkey) == 36);
const _: () = assert!(size_of::<ugdr_qp_init_attr>() == 48);
const _: () = assert!(offset_of!(ugdr_qp_init_attr, qp_type) == 36);
const _: () = assert!(size_of::<ugdr_qp_attr>() == 44);
const _: () = assert!(size_of::<ugdr_wc>() == 24);
const _: () = assert!(size_of::<ugdr_sge>() == 16);
const _: () = assert!(size_of::<ugdr_recv_wr>() == 32);
const _: () = assert!(size_of::<ugdr_send_wr>() == 56 && offset_of!(ugdr_send_wr, rdma) == 40);

// ------------------------------------------------------------------ the handles

/// `struct ugdr_context` (opaque): an opened device, i.e. one NUMA node's view of the
/// process's one port.
pub struct UgdrContext {
    inner: Arc<DeviceContext>,
}

/// `struct ugdr_pd` (opaque).
pub struct UgdrPd {
    inner: Arc<ProtectionDomain>,
    context: *mut UgdrContext,
}

/// What `ugdr_reg_mr` returns: the public `struct ugdr_mr` first, then the MR.
#[repr(C)]
pub struct UgdrMr {
    public: ugdr_mr,
    inner: Arc<MemoryRegion>,
}
const _: () = assert!(offset_of!(UgdrMr, public) == 0);

/// `struct ugdr_cq` (opaque).
pub struct UgdrCq {
    inner: Arc<CompletionQueue>,
}

/// `struct ugdr_qp` (opaque).
pub struct UgdrQp {
    inner: Arc<QueuePair>,
}

/// The device lists handed out: list address → (devices address, count).
static LISTS: LazyLock<Mutex<HashMap<usize, (usize, usize)>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn device_name(node: i32) -> String {
    format!("ugdr{node}")
}

/// The C handle behind a non-NULL pointer.
///
/// # Safety
/// `p` is NULL or a live handle of type `T` returned by this file's constructors.
unsafe fn handle<'a, T>(p: *const T) -> Result<&'a T, VerbsError> {
    // SAFETY: forwarded contract.
    unsafe { p.as_ref() }.ok_or(VerbsError::Invalid("NULL handle"))
}

fn fail<T: Fallback>(verb: &str, e: VerbsError) -> T {
    tracing::debug!("{verb}: {e}");
    T::fail(e.errno())
}

// ------------------------------------------------------------------ devices

/// One device per NUMA node, with its NVIDIA GPUs (`crate::topology`); NULL-terminated.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_get_device_list(num_devices: *mut c_int) -> *mut *mut ugdr_device {
    ffi_boundary!("ugdr_get_device_list", {
        let root = topology::sysfs_root();
        let nodes = match topology::discover(&root) {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!("ugdr_get_device_list: cannot read {}: {e}", root.display());
                return <*mut *mut ugdr_device>::fail(e.raw_os_error().unwrap_or(libc::EIO));
            }
        };
        let mut devices: Vec<ugdr_device> = Vec::with_capacity(nodes.len());
        for n in &nodes {
            let mut d = ugdr_device {
                name: [0; DEVICE_NAME_MAX],
                numa_node: n.node,
                num_gpu: 0,
                gpus: [0; MAX_GPUS_PER_DEV],
            };
            for (dst, src) in d.name.iter_mut().zip(device_name(n.node).bytes()) {
                *dst = src as c_char;
            }
            if n.gpus.len() > MAX_GPUS_PER_DEV {
                tracing::warn!(
                    "numa node {}: {} GPUs, listing the first {MAX_GPUS_PER_DEV}",
                    n.node,
                    n.gpus.len()
                );
            }
            for (dst, src) in d.gpus.iter_mut().zip(&n.gpus) {
                *dst = *src;
                d.num_gpu += 1;
            }
            devices.push(d);
        }
        let count = devices.len();
        let devices = Box::into_raw(devices.into_boxed_slice()) as *mut ugdr_device;
        let mut list: Vec<*mut ugdr_device> = (0..count)
            // SAFETY: within the `count` devices just allocated.
            .map(|i| unsafe { devices.add(i) })
            .collect();
        list.push(null_mut());
        let raw = Box::into_raw(list.into_boxed_slice()) as *mut *mut ugdr_device;
        LISTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(raw as usize, (devices as usize, count));
        if !num_devices.is_null() {
            // SAFETY: the caller's out-parameter, checked non-NULL.
            unsafe { *num_devices = count as c_int };
        }
        raw
    })
}

/// Frees a list and its devices (contexts opened from them stay valid).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_free_device_list(list: *mut *mut ugdr_device) {
    ffi_boundary!("ugdr_free_device_list", {
        let entry = LISTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&(list as usize));
        let Some((devices, count)) = entry else {
            tracing::debug!("ugdr_free_device_list: {list:p} is not a live list");
            set_errno(libc::EINVAL);
            return;
        };
        // SAFETY: both boxed slices were leaked by ugdr_get_device_list with these lengths and
        // are freed once (the registry entry is gone).
        unsafe {
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                list,
                count + 1,
            )));
            drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                devices as *mut ugdr_device,
                count,
            )));
        }
    })
}

/// Opens the device named by `device->name` (a copy of a listed device works too).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_open_device(device: *mut ugdr_device) -> *mut UgdrContext {
    ffi_boundary!("ugdr_open_device", {
        // SAFETY: NULL or the caller's device struct.
        let Ok(d) = (unsafe { handle(device.cast_const()) }) else {
            return <*mut UgdrContext>::fail(libc::EINVAL);
        };
        let name: Vec<u8> = d.name.iter().map(|c| *c as u8).collect();
        let Some(len) = name.iter().position(|b| *b == 0) else {
            return <*mut UgdrContext>::fail(libc::EINVAL);
        };
        let name = String::from_utf8_lossy(&name[..len]).into_owned();
        let known = topology::discover(&topology::sysfs_root())
            .map(|nodes| nodes.iter().any(|n| device_name(n.node) == name))
            .unwrap_or(false);
        if !known {
            tracing::debug!("ugdr_open_device: no device {name:?}");
            return <*mut UgdrContext>::fail(libc::ENODEV);
        }
        let opened = Engine::get()
            .map_err(VerbsError::from)
            .and_then(|_| DeviceContext::new());
        match opened {
            Ok(ctx) => Box::into_raw(Box::new(UgdrContext {
                inner: Arc::new(ctx),
            })),
            Err(e) => fail("ugdr_open_device", e),
        }
    })
}

/// Closes a context; EBUSY while PDs or CQs remain.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_close_device(ctx: *mut UgdrContext) -> c_int {
    ffi_boundary!("ugdr_close_device", {
        // SAFETY: NULL or a live context.
        let c = match unsafe { handle(ctx.cast_const()) } {
            Ok(c) => c,
            Err(e) => return status(Err(e)),
        };
        if let Err(e) = c.inner.check_closable() {
            return status(Err(e));
        }
        // SAFETY: leaked by ugdr_open_device; the application gives it up here.
        drop(unsafe { Box::from_raw(ctx) });
        0
    })
}

/// This process's address (the same for every context: one port per process).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_query_addr(ctx: *mut UgdrContext, addr_out: *mut ugdr_addr) -> c_int {
    ffi_boundary!("ugdr_query_addr", {
        // SAFETY: NULL or a live context.
        if let Err(e) = unsafe { handle(ctx.cast_const()) } {
            return status(Err(e));
        }
        if addr_out.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        match Engine::get() {
            Ok(engine) => {
                let raw = PortAddress {
                    lid: engine.lid,
                    gid: engine.gid,
                }
                .encode();
                // SAFETY: the caller's out-parameter, checked non-NULL.
                unsafe { addr_out.write(ugdr_addr { raw }) };
                0
            }
            Err(e) => status(Err(e.into())),
        }
    })
}

// ------------------------------------------------------------------ PD and MR

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_alloc_pd(ctx: *mut UgdrContext) -> *mut UgdrPd {
    ffi_boundary!("ugdr_alloc_pd", {
        // SAFETY: NULL or a live context.
        match unsafe { handle(ctx.cast_const()) } {
            Ok(c) => Box::into_raw(Box::new(UgdrPd {
                inner: ProtectionDomain::new(Arc::clone(&c.inner)),
                context: ctx,
            })),
            Err(e) => fail("ugdr_alloc_pd", e),
        }
    })
}

/// EBUSY while MRs or QPs use the PD.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_dealloc_pd(pd: *mut UgdrPd) -> c_int {
    ffi_boundary!("ugdr_dealloc_pd", {
        // SAFETY: NULL or a live PD.
        let p = match unsafe { handle(pd.cast_const()) } {
            Ok(p) => p,
            Err(e) => return status(Err(e)),
        };
        if let Err(e) = p.inner.check_deallocatable() {
            return status(Err(e));
        }
        // SAFETY: leaked by ugdr_alloc_pd; the application gives it up here.
        drop(unsafe { Box::from_raw(pd) });
        0
    })
}

/// Registers host memory. EINVAL for bad arguments or access flags, EOPNOTSUPP for GPU
/// memory (the CUDA driver says so), EFAULT for memory that is not mapped (or not writable
/// when the flags let ugdr write). Nothing is read or written to decide.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_reg_mr(
    pd: *mut UgdrPd,
    addr: *mut c_void,
    length: usize,
    access: c_int,
) -> *mut ugdr_mr {
    ffi_boundary!("ugdr_reg_mr", {
        // SAFETY: NULL or a live PD.
        let p = match unsafe { handle(pd.cast_const()) } {
            Ok(p) => p,
            Err(e) => return fail("ugdr_reg_mr", e),
        };
        if addr.is_null() || length == 0 {
            return fail(
                "ugdr_reg_mr",
                VerbsError::Invalid("NULL address or zero length"),
            );
        }
        let result = core::check_access(access).and_then(|bits| {
            if crate::cuda::is_device_memory(addr as u64) {
                return Err(VerbsError::Unsupported(
                    "GPU memory (needs a UCX built with CUDA; see README)",
                ));
            }
            register_host(&p.inner, addr as u64, length as u64, addr as u64, bits)
        });
        match result {
            Ok(mr) => {
                let public = ugdr_mr {
                    context: p.context,
                    pd,
                    addr,
                    length,
                    handle: mr.lkey(),
                    lkey: mr.lkey(),
                    rkey: mr.rkey(),
                };
                Box::into_raw(Box::new(UgdrMr { public, inner: mr })).cast()
            }
            Err(e) => fail("ugdr_reg_mr", e),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_dereg_mr(mr: *mut ugdr_mr) -> c_int {
    ffi_boundary!("ugdr_dereg_mr", {
        if mr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: returned by ugdr_reg_mr (an UgdrMr whose first field is the ugdr_mr); the
        // application gives it up here.
        let owned = unsafe { Box::from_raw(mr.cast::<UgdrMr>()) };
        // The ugdr_* API binds no memory windows, so nothing keeps its regions busy.
        match owned.inner.deregister() {
            Ok(()) => 0,
            Err(e) => c_int::fail(e.errno()),
        }
    })
}

// ------------------------------------------------------------------ CQ

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_create_cq(ctx: *mut UgdrContext, cqe: c_int) -> *mut UgdrCq {
    ffi_boundary!("ugdr_create_cq", {
        // SAFETY: NULL or a live context.
        let c = match unsafe { handle(ctx.cast_const()) } {
            Ok(c) => c,
            Err(e) => return fail("ugdr_create_cq", e),
        };
        if !(1..=device::MAX_CQE).contains(&cqe) {
            return fail("ugdr_create_cq", VerbsError::Invalid("cqe out of range"));
        }
        let cq = CompletionQueue::new(Arc::clone(&c.inner), cqe as usize, None);
        let raw = Box::into_raw(Box::new(UgdrCq {
            inner: Arc::clone(&cq),
        }));
        cq.set_handle(raw as usize);
        raw
    })
}

/// EBUSY while QPs use the CQ.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_destroy_cq(cq: *mut UgdrCq) -> c_int {
    ffi_boundary!("ugdr_destroy_cq", {
        // SAFETY: NULL or a live CQ.
        let c = match unsafe { handle(cq.cast_const()) } {
            Ok(c) => c,
            Err(e) => return status(Err(e)),
        };
        if let Err(e) = c.inner.check_destroyable() {
            return status(Err(e));
        }
        c.inner.destroy();
        // SAFETY: leaked by ugdr_create_cq; the application gives it up here.
        drop(unsafe { Box::from_raw(cq) });
        0
    })
}

fn to_wc(w: &WorkCompletion) -> ugdr_wc {
    ugdr_wc {
        wr_id: w.wr_id,
        status: core::wc_status(w.status),
        opcode: core::wc_opcode(w.opcode),
        byte_len: w.byte_len,
        qp_num: w.qp_num,
    }
}

/// Up to `num_entries` completions, oldest first: the count, or -EINVAL (errno EINVAL).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_poll_cq(
    cq: *mut UgdrCq,
    num_entries: c_int,
    wc: *mut ugdr_wc,
) -> c_int {
    ffi_boundary!("ugdr_poll_cq", on_panic = -libc::EIO, {
        // SAFETY: NULL or a live CQ.
        let Ok(c) = (unsafe { handle(cq.cast_const()) }) else {
            set_errno(libc::EINVAL);
            return -libc::EINVAL;
        };
        if num_entries < 0 || (num_entries > 0 && wc.is_null()) {
            set_errno(libc::EINVAL);
            return -libc::EINVAL;
        }
        let mut i = 0;
        let n = c.inner.poll_progressing(
            num_entries as usize,
            |w| {
                // SAFETY: the caller's array of `num_entries` entries; i < num_entries.
                unsafe { wc.add(i).write(to_wc(w)) };
                i += 1;
            },
            super::ibv_cq::progress_from_app,
        );
        n as c_int
    })
}

// ------------------------------------------------------------------ QP

fn create_qp(p: &UgdrPd, a: &ugdr_qp_init_attr) -> Result<(*mut UgdrQp, QpCaps), VerbsError> {
    // SAFETY: NULL or live CQs.
    let send_cq = unsafe { handle(a.send_cq.cast_const()) }?;
    // SAFETY: as above.
    let recv_cq = unsafe { handle(a.recv_cq.cast_const()) }?;
    if a.qp_type != 0 {
        return Err(VerbsError::Invalid("qp_type (ugdr has UGDR_QPT_RC only)"));
    }
    let caps = QpCaps::grant(QpCaps {
        max_send_wr: a.cap.max_send_wr,
        max_recv_wr: a.cap.max_recv_wr,
        max_send_sge: a.cap.max_sge,
        max_recv_sge: a.cap.max_sge,
        max_inline_data: device::MAX_INLINE_DATA,
    })?;
    let engine = Engine::get()?;
    let qp = QueuePair::new(
        engine.allocate_qpn(),
        QpType::Rc,
        Arc::clone(&p.inner),
        Arc::clone(&send_cq.inner),
        Arc::clone(&recv_cq.inner),
        None,
        a.sq_sig_all != 0,
        caps,
        engine.lid,
    )?;
    let raw = Box::into_raw(Box::new(UgdrQp {
        inner: Arc::clone(&qp),
    }));
    qp.set_handle(raw as usize);
    engine.register_qp(qp.qp_num, qp);
    Ok((raw, caps))
}

/// Creates an RC QP in RESET; writes the granted sizes back into `init_attr` (as verbs).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_create_qp(
    pd: *mut UgdrPd,
    init_attr: *mut ugdr_qp_init_attr,
) -> *mut UgdrQp {
    ffi_boundary!("ugdr_create_qp", {
        // SAFETY: NULL or a live PD.
        let p = match unsafe { handle(pd.cast_const()) } {
            Ok(p) => p,
            Err(e) => return fail("ugdr_create_qp", e),
        };
        if init_attr.is_null() {
            return fail("ugdr_create_qp", VerbsError::Invalid("NULL init_attr"));
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &mut *init_attr };
        match create_qp(p, a) {
            Ok((qp, caps)) => {
                a.cap.max_send_wr = caps.max_send_wr;
                a.cap.max_recv_wr = caps.max_recv_wr;
                a.cap.max_sge = caps.max_send_sge;
                qp
            }
            Err(e) => fail("ugdr_create_qp", e),
        }
    })
}

/// The QP's number (what a peer puts in `dest_qp_num`); 0 with errno EINVAL for NULL.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_qp_num(qp: *const UgdrQp) -> u32 {
    ffi_boundary!("ugdr_qp_num", {
        // SAFETY: NULL or a live QP.
        match unsafe { handle(qp) } {
            Ok(q) => q.inner.qp_num,
            Err(e) => fail("ugdr_qp_num", e),
        }
    })
}

/// ugdr's state machine (`crate::ugdr::modify`): all or nothing, EINVAL otherwise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_modify_qp(
    qp: *mut UgdrQp,
    attr: *mut ugdr_qp_attr,
    attr_mask: c_int,
) -> c_int {
    ffi_boundary!("ugdr_modify_qp", {
        // SAFETY: NULL or a live QP.
        let q = match unsafe { handle(qp.cast_const()) } {
            Ok(q) => &q.inner,
            Err(e) => return status(Err(e)),
        };
        if attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &*attr };
        let request = UgdrModify {
            mask: attr_mask as u32,
            qp_state: a.qp_state,
            cur_qp_state: a.cur_qp_state,
            dest_qp_num: a.dest_qp_num,
            dest_addr: a.dest_addr.raw,
        };
        let engine = match Engine::get() {
            Ok(e) => e,
            Err(e) => return status(Err(e.into())),
        };
        let step = match plan(q.state(), &request) {
            Ok(s) => s,
            Err(e) => {
                tracing::debug!("modify qp {:#x}: {e}", q.qp_num);
                return status(Err(e));
            }
        };
        // Resolving may ask another host: before taking the worker lock.
        let remote = match step.destination {
            Some(d) => match engine.resolve(d.lid, Some(&d.gid)) {
                Ok(r) => Some(r),
                Err(e) => return status(Err(e.into())),
            },
            None => None,
        };
        let locked = engine.worker.lock();
        let peer = match remote {
            Some(r) => match engine.connect(&locked, &r, request.dest_qp_num) {
                Ok(p) => Some(p),
                Err(e) => return status(Err(e.into())),
            },
            None => None,
        };
        let mut peer = peer;
        for s in &step.steps {
            // Only the INIT→RTR step takes a peer; the second step of RESET→ERR cannot fail.
            if let Err(e) = q.modify(&locked, s, peer.take()) {
                return status(Err(e));
            }
        }
        0
    })
}

/// Destroys a QP without completions for what was outstanding (as verbs).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_destroy_qp(qp: *mut UgdrQp) -> c_int {
    ffi_boundary!("ugdr_destroy_qp", {
        // SAFETY: NULL or a live QP.
        let q = match unsafe { handle(qp.cast_const()) } {
            Ok(q) => &q.inner,
            Err(e) => return status(Err(e)),
        };
        if let Ok(engine) = Engine::get() {
            let locked = engine.worker.lock();
            q.flush_ack(&locked);
            engine.unregister_qp(q.qp_num);
            q.destroy(&locked);
        }
        // SAFETY: leaked by ugdr_create_qp; the application gives it up here.
        drop(unsafe { Box::from_raw(qp) });
        0
    })
}

impl AppSge for ugdr_sge {
    fn sge(&self) -> Sge {
        Sge {
            addr: self.addr,
            length: self.length,
            lkey: self.lkey,
        }
    }
}

/// # Safety
/// `w` is the caller's valid send WR; inline SGEs point at readable bytes.
unsafe fn send_request(w: &ugdr_send_wr, caps: &QpCaps) -> Result<SendRequest, VerbsError> {
    if w.send_flags & !(SEND_SIGNALED | SEND_INLINE) != 0 {
        return Err(VerbsError::Invalid("unknown send_flags"));
    }
    let opcode = core::send_opcode(w.opcode)?;
    // SAFETY: sg_list/num_sge of the same WR.
    let sges = unsafe { read_sges(w.sg_list, w.num_sge, caps.max_send_sge) }?;
    let inline_data = if w.send_flags & SEND_INLINE != 0 {
        if sges_length(&sges) > u64::from(caps.max_inline_data) {
            return Err(VerbsError::Invalid("inline data above the QP's limit"));
        }
        // SAFETY: inline SGEs name application bytes valid during this call (their lkeys are
        // not used, as in verbs).
        Some(unsafe { super::ibv_qp::inline_bytes(&sges) })
    } else {
        None
    };
    Ok(SendRequest {
        wr_id: w.wr_id,
        opcode,
        sges,
        inline_data,
        imm_data: 0,
        signaled: w.send_flags & SEND_SIGNALED != 0,
        solicited: false,
        fence: false,
        remote_addr: w.rdma.remote_addr,
        rkey: w.rdma.rkey,
        compare_add: 0,
        swap: 0,
        ud: None,
        bind: None,
        xrc_srqn: 0,
    })
}

/// Posts the list in order; at the first WR that cannot be posted, sets `*bad_wr` to it and
/// returns its errno (earlier WRs stay posted).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_post_send(
    qp: *mut UgdrQp,
    wr: *mut ugdr_send_wr,
    bad_wr: *mut *mut ugdr_send_wr,
) -> c_int {
    ffi_boundary!("ugdr_post_send", {
        // SAFETY: NULL or a live QP.
        let q = match unsafe { handle(qp.cast_const()) } {
            Ok(q) => &q.inner,
            Err(e) => return status(Err(e)),
        };
        let Some(engine) = Engine::running() else {
            return c_int::fail(libc::EINVAL);
        };
        let locked = engine.worker.lock();
        let mut cur = wr;
        let requests = std::iter::from_fn(|| {
            if cur.is_null() {
                return None;
            }
            // SAFETY: `cur` walks the application's NULL-terminated WR list.
            let w = unsafe { &*cur };
            cur = w.next;
            // SAFETY: as above.
            Some(unsafe { send_request(w, &q.caps) })
        });
        match super::ibv_qp::post_send_list(engine, &locked, q, requests) {
            Ok(()) => 0,
            Err((index, e)) => {
                tracing::debug!("qp {:#x}: ugdr_post_send: {e}", q.qp_num);
                if !bad_wr.is_null() {
                    // SAFETY: the list holds at least `index + 1` WRs (the failing one was
                    // read); `bad_wr` is the caller's out-parameter.
                    unsafe { *bad_wr = super::ibv_qp::nth_wr(wr, index) };
                }
                c_int::fail(e.errno())
            }
        }
    })
}

impl super::ibv_qp::WrList for ugdr_send_wr {
    fn next_wr(&self) -> *mut Self {
        self.next
    }
}

/// Posts receive WRs, with `ugdr_post_send`'s list semantics.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ugdr_post_recv(
    qp: *mut UgdrQp,
    wr: *mut ugdr_recv_wr,
    bad_wr: *mut *mut ugdr_recv_wr,
) -> c_int {
    ffi_boundary!("ugdr_post_recv", {
        // SAFETY: NULL or a live QP.
        let q = match unsafe { handle(qp.cast_const()) } {
            Ok(q) => &q.inner,
            Err(e) => return status(Err(e)),
        };
        let Some(engine) = Engine::running() else {
            return c_int::fail(libc::EINVAL);
        };
        let locked = engine.worker.lock();
        let mut cur = wr;
        while !cur.is_null() {
            // SAFETY: `cur` walks the application's NULL-terminated WR list.
            let w = unsafe { &*cur };
            // SAFETY: sg_list/num_sge of the same WR.
            let result =
                unsafe { read_sges(w.sg_list, w.num_sge, q.caps.max_recv_sge) }.and_then(|sges| {
                    q.post_recv(
                        &locked,
                        RecvRequest {
                            wr_id: w.wr_id,
                            sges,
                        },
                    )
                });
            if let Err(e) = result {
                tracing::debug!("qp {:#x}: ugdr_post_recv: {e}", q.qp_num);
                if !bad_wr.is_null() {
                    // SAFETY: the caller's out-parameter.
                    unsafe { *bad_wr = cur };
                }
                return c_int::fail(e.errno());
            }
            cur = w.next;
        }
        0
    })
}
