//! Queue pairs: create/modify/query/destroy, the post paths, and the `ibv_wr_*` builders.

use super::boundary::{Fallback, ffi_boundary, status};
use super::ibv_ah::our_ah;
use super::layout::{
    ContextShell, CqShell, PdShell, QpShell, RESOURCE_QP, ShellMemory, WrBatch, owned_context,
};
use super::{ops, passthrough};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::qp::{
    AddressVector, GlobalRoute, ModifyRequest, QpAttributes, QpCaps, QueuePair,
};
use crate::fake_verbs::qp_state::{AttrMask, QpState, QpType};
use crate::fake_verbs::work::{
    InlineData, RecvRequest, SendOpcode, SendRequest, Sge, SgeList, UdDestination, sges_length,
};
use crate::sys::*;
use crate::ucp::LockedWorker;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_void};
use std::sync::Arc;

const SEND_FENCE: u32 = ibv_send_flags::IBV_SEND_FENCE.0;
const SEND_SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
const SEND_SOLICITED: u32 = ibv_send_flags::IBV_SEND_SOLICITED.0;
const SEND_INLINE: u32 = ibv_send_flags::IBV_SEND_INLINE.0;

/// The send opcodes each QP type carries, as `ibv_qp_create_send_ops_flags` (rxe's
/// `RXE_SUP_{RC,UC,UD}_QP_SEND_OPS_FLAGS`).
const UD_SEND_OPS: u64 = (ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0
    | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_IMM.0) as u64;
const UC_SEND_OPS: u64 = UD_SEND_OPS
    | (ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_LOCAL_INV.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_BIND_MW.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND_WITH_INV.0) as u64;
const RC_SEND_OPS: u64 = UC_SEND_OPS
    | (ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_WRITE.0) as u64;

/// XRC: SENDs, RDMA and atomics (no memory-window operations).
const XRC_SEND_OPS: u64 = UD_SEND_OPS
    | (ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_READ.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP.0
        | ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.0) as u64;

fn supported_send_ops(qp_type: u32) -> u64 {
    match QpType::from_raw(qp_type) {
        Some(QpType::Rc) => RC_SEND_OPS,
        Some(QpType::Uc) => UC_SEND_OPS,
        Some(QpType::XrcSend) => XRC_SEND_OPS,
        Some(QpType::Ud) => UD_SEND_OPS,
        _ => 0,
    }
}
/// What `ibv_create_qp_ex` accepts in `comp_mask` (CREATE_FLAGS with no flag set, as rxe).
const SUPPORTED_INIT_MASK: u32 = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0
    | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_CREATE_FLAGS.0
    | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0;

/// # Safety
/// `cq` is NULL or a valid `ibv_cq`.
pub(crate) unsafe fn our_cq<'a>(cq: *mut ibv_cq) -> Option<&'a CqShell> {
    if cq.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_cq has a readable `context` field.
    unsafe { owned_context((*cq).context)? };
    // SAFETY: its context is ours, so it is a CqShell.
    unsafe { CqShell::from_raw(cq.cast()) }
}

/// # Safety
/// `qp` is NULL or a valid `ibv_qp`.
pub(crate) unsafe fn our_qp<'a>(qp: *mut ibv_qp) -> Option<&'a QpShell> {
    if qp.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_qp has a readable `context` field.
    unsafe { owned_context((*qp).context)? };
    // SAFETY: its context is ours, so it is a QpShell (ibv_qp is the start of ibv_qp_ex).
    unsafe { QpShell::from_raw(qp.cast()) }
}

struct CreateQp {
    pd: *mut ibv_pd,
    qp_context: *mut c_void,
    send_cq: *mut ibv_cq,
    recv_cq: *mut ibv_cq,
    srq: *mut ibv_srq,
    cap: ibv_qp_cap,
    qp_type: u32,
    sq_sig_all: bool,
}

/// The common fields of `ibv_qp_init_attr` and `ibv_qp_init_attr_ex` (the first is a prefix
/// of the second).
macro_rules! create_args {
    ($pd:expr, $a:expr) => {
        CreateQp {
            pd: $pd,
            qp_context: $a.qp_context,
            send_cq: $a.send_cq,
            recv_cq: $a.recv_cq,
            srq: $a.srq,
            cap: $a.cap,
            qp_type: $a.qp_type.0,
            sq_sig_all: $a.sq_sig_all != 0,
        }
    };
}

fn create_qp(args: &CreateQp) -> Result<(*mut ibv_qp, ibv_qp_cap), VerbsError> {
    // SAFETY: callers pass a PD whose context is ours (checked) or NULL.
    let pd_shell = unsafe { PdShell::from_raw(args.pd) }.ok_or(VerbsError::Invalid("pd"))?;
    // SAFETY: the application's CQ pointers (or NULL), ownership checked.
    let send_cq = unsafe { our_cq(args.send_cq) }.ok_or(VerbsError::Invalid("send_cq"))?;
    let qp_type = QpType::from_raw(args.qp_type).ok_or(VerbsError::Invalid("qp_type"))?;
    // An XRC_SEND QP has no receive queue (and no receive CQ).
    let recv_cq = match qp_type {
        QpType::XrcSend => send_cq,
        // SAFETY: as above.
        _ => unsafe { our_cq(args.recv_cq) }.ok_or(VerbsError::Invalid("recv_cq"))?,
    };
    let srq = if args.srq.is_null() {
        None
    } else {
        // SAFETY: the application's SRQ pointer, ownership checked.
        Some(Arc::clone(
            &unsafe { super::ibv_srq::our_srq(args.srq) }
                .ok_or(VerbsError::Invalid("srq"))?
                .inner,
        ))
    };
    if qp_type == QpType::XrcRecv {
        return Err(VerbsError::Invalid(
            "an XRC_RECV QP is made on an xrcd (ibv_create_qp_ex, IBV_QP_INIT_ATTR_XRCD)",
        ));
    }
    // A QP created through a parent domain with an allocator lives in its memory.
    let memory = ShellMemory::<QpShell>::reserve(Some(pd_shell), RESOURCE_QP)?;
    let caps = QpCaps::grant(QpCaps {
        max_send_wr: args.cap.max_send_wr,
        max_recv_wr: args.cap.max_recv_wr,
        max_send_sge: args.cap.max_send_sge,
        max_recv_sge: args.cap.max_recv_sge,
        max_inline_data: args.cap.max_inline_data,
    })?;
    let engine = Engine::get()?;
    let qp_num = engine.allocate_qpn();
    let qp = QueuePair::new(
        qp_num,
        qp_type,
        Arc::clone(&pd_shell.inner),
        Arc::clone(&send_cq.inner),
        Arc::clone(&recv_cq.inner),
        srq,
        args.sq_sig_all,
        caps,
        engine.lid,
    )?;
    // SAFETY: reading the context field of our own PD.
    let context = unsafe { (*pd_shell.as_raw()).context };
    let base = ibv_qp {
        context,
        qp_context: args.qp_context,
        pd: args.pd,
        send_cq: args.send_cq,
        recv_cq: args.recv_cq,
        srq: args.srq,
        handle: qp_num,
        qp_num,
        state: ibv_qp_state::IBV_QPS_RESET,
        qp_type: ibv_qp_type(args.qp_type),
        ..Default::default()
    };
    let mut ibv = ibv_qp_ex {
        qp_base: base,
        ..Default::default()
    };
    ops::install_qp_ops(&mut ibv);
    let raw = memory
        .place(QpShell {
            ibv: UnsafeCell::new(ibv),
            inner: Arc::clone(&qp),
            batch: UnsafeCell::new(WrBatch::default()),
        })
        .cast::<ibv_qp_ex>();
    qp.set_handle(raw as usize);
    engine.register_qp(qp.qp_num, qp);
    let granted = ibv_qp_cap {
        max_send_wr: caps.max_send_wr,
        max_recv_wr: caps.max_recv_wr,
        max_send_sge: caps.max_send_sge,
        max_recv_sge: caps.max_recv_sge,
        max_inline_data: caps.max_inline_data,
    };
    Ok((raw.cast(), granted))
}

/// Creates an RC QP; writes the granted capabilities back into `attr->cap` (as rdma-core).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_qp(
    pd: *mut ibv_pd,
    attr: *mut ibv_qp_init_attr,
) -> *mut ibv_qp {
    ffi_boundary!("ibv_create_qp", {
        // SAFETY: a valid ibv_pd (or NULL) has a readable context field.
        let ours = !pd.is_null() && unsafe { owned_context((*pd).context) }.is_some();
        if !ours {
            return match passthrough::ibv_create_qp() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) if !pd.is_null() => unsafe { real(pd, attr) },
                _ => <*mut ibv_qp>::fail(libc::EINVAL),
            };
        }
        if attr.is_null() {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &mut *attr };
        let args = create_args!(pd, a);
        match create_qp(&args) {
            Ok((qp, cap)) => {
                a.cap = cap;
                qp
            }
            Err(e) => {
                tracing::debug!("ibv_create_qp: {e}");
                <*mut ibv_qp>::fail(e.errno())
            }
        }
    })
}

/// `verbs_context.create_qp_ex` (the `ibv_create_qp_ex` inline, for masks beyond PD).
pub(crate) unsafe extern "C" fn create_qp_ex_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_qp_init_attr_ex,
) -> *mut ibv_qp {
    ffi_boundary!("ibv_create_qp_ex", {
        if !ContextShell::is_ours(ctx) || attr.is_null() {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let a = unsafe { &mut *attr };
        if a.qp_type == ibv_qp_type::IBV_QPT_XRC_RECV {
            return super::ibv_xrc::create_target_qp(ctx, a);
        }
        let flags_given = a.comp_mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_CREATE_FLAGS.0 != 0;
        // The one creation flag ugdr has: a UD QP that does not get its own multicasts.
        let no_loopback = ibv_qp_create_flags::IBV_QP_CREATE_BLOCK_SELF_MCAST_LB.0;
        let block_loopback = flags_given && a.create_flags & no_loopback != 0;
        if a.comp_mask & !SUPPORTED_INIT_MASK != 0
            || (flags_given && a.create_flags & !no_loopback != 0)
            || (block_loopback && a.qp_type != ibv_qp_type::IBV_QPT_UD)
        {
            return <*mut ibv_qp>::fail(libc::EOPNOTSUPP);
        }
        if a.comp_mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 == 0 || a.pd.is_null() {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        let supported_ops = supported_send_ops(a.qp_type.0);
        if a.comp_mask & ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0 != 0
            && a.send_ops_flags & !supported_ops != 0
        {
            tracing::debug!(
                "ibv_create_qp_ex: send_ops_flags {:#x} not supported for qp_type {}",
                a.send_ops_flags & !supported_ops,
                a.qp_type.0
            );
            return <*mut ibv_qp>::fail(libc::EOPNOTSUPP);
        }
        // SAFETY: a valid ibv_pd has a readable context field.
        if unsafe { (*a.pd).context } != ctx {
            return <*mut ibv_qp>::fail(libc::EINVAL);
        }
        tracing::debug!(
            "ibv_create_qp_ex: comp_mask {:#x} send_ops_flags {:#x}",
            a.comp_mask,
            a.send_ops_flags
        );
        let args = create_args!(a.pd, a);
        match create_qp(&args) {
            Ok((qp, cap)) => {
                a.cap = cap;
                if block_loopback && let Ok(engine) = Engine::get() {
                    // SAFETY: the QP just created, ours.
                    engine.multicast_block_loopback(unsafe { (*qp).qp_num });
                }
                qp
            }
            Err(e) => <*mut ibv_qp>::fail(e.errno()),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut ibv_qp) -> *mut ibv_qp_ex {
    ffi_boundary!("ibv_qp_to_qp_ex", {
        // SAFETY: caller passes a QP (or NULL).
        match unsafe { our_qp(qp) } {
            Some(shell) => shell.as_raw(),
            None => match passthrough::ibv_qp_to_qp_ex() {
                // SAFETY: not ours, so the real library's QP.
                Some(real) if !qp.is_null() => unsafe { real(qp) },
                _ => <*mut ibv_qp_ex>::fail(libc::EINVAL),
            },
        }
    })
}

pub(crate) fn av_from(a: &ibv_ah_attr) -> AddressVector {
    AddressVector {
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: a.is_global != 0,
        port_num: a.port_num,
        grh: GlobalRoute {
            // SAFETY: every bit pattern of the union is a valid byte array.
            dgid: unsafe { a.grh.dgid.raw },
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
    }
}

pub(crate) fn av_to(a: &AddressVector) -> ibv_ah_attr {
    ibv_ah_attr {
        grh: ibv_global_route {
            dgid: ibv_gid { raw: a.grh.dgid },
            flow_label: a.grh.flow_label,
            sgid_index: a.grh.sgid_index,
            hop_limit: a.grh.hop_limit,
            traffic_class: a.grh.traffic_class,
        },
        dlid: a.dlid,
        sl: a.sl,
        src_path_bits: a.src_path_bits,
        static_rate: a.static_rate,
        is_global: u8::from(a.is_global),
        port_num: a.port_num,
    }
}

/// `a` as an `ibv_qp_attr` (what `ibv_query_qp` reports and `rdma_init_qp_attr` returns).
pub(crate) fn qp_attr_from(
    qp_state: ibv_qp_state,
    cur_qp_state: ibv_qp_state,
    a: &QpAttributes,
    cap: ibv_qp_cap,
) -> ibv_qp_attr {
    ibv_qp_attr {
        qp_state,
        cur_qp_state,
        path_mtu: ibv_mtu(a.path_mtu),
        path_mig_state: ibv_mig_state(a.path_mig_state),
        qkey: a.qkey,
        rq_psn: a.rq_psn,
        sq_psn: a.sq_psn,
        dest_qp_num: a.dest_qp_num,
        qp_access_flags: a.access_flags,
        cap,
        ah_attr: av_to(&a.ah),
        alt_ah_attr: av_to(&a.alt_ah),
        pkey_index: a.pkey_index,
        alt_pkey_index: a.alt_pkey_index,
        en_sqd_async_notify: a.en_sqd_async_notify,
        sq_draining: 0,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        min_rnr_timer: a.min_rnr_timer,
        port_num: a.port_num,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        rate_limit: 0,
    }
}

/// Converts `ibv_qp_attr` + mask; enum values the application wrote are checked, not trusted.
fn modify_request(a: &ibv_qp_attr, mask: c_int) -> Result<ModifyRequest, VerbsError> {
    let mask = AttrMask(mask as u32);
    let state = if mask.contains(AttrMask::STATE) {
        Some(QpState::from_raw(a.qp_state.0).ok_or(VerbsError::Invalid("qp_state"))?)
    } else {
        None
    };
    let claimed_cur = if mask.contains(AttrMask::CUR_STATE) {
        Some(QpState::from_raw(a.cur_qp_state.0).ok_or(VerbsError::Invalid("cur_qp_state"))?)
    } else {
        None
    };
    let attrs = QpAttributes {
        qkey: a.qkey,
        rq_psn: a.rq_psn & 0xff_ffff,
        sq_psn: a.sq_psn & 0xff_ffff,
        dest_qp_num: a.dest_qp_num,
        access_flags: a.qp_access_flags,
        pkey_index: a.pkey_index,
        port_num: a.port_num,
        path_mtu: a.path_mtu.0,
        ah: av_from(&a.ah_attr),
        alt_ah: av_from(&a.alt_ah_attr),
        alt_pkey_index: a.alt_pkey_index,
        alt_port_num: a.alt_port_num,
        alt_timeout: a.alt_timeout,
        path_mig_state: a.path_mig_state.0,
        timeout: a.timeout,
        retry_cnt: a.retry_cnt,
        rnr_retry: a.rnr_retry,
        min_rnr_timer: a.min_rnr_timer,
        max_rd_atomic: a.max_rd_atomic,
        max_dest_rd_atomic: a.max_dest_rd_atomic,
        en_sqd_async_notify: a.en_sqd_async_notify,
    };
    Ok(ModifyRequest {
        mask,
        state,
        claimed_cur,
        attrs,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_modify_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
) -> c_int {
    ffi_boundary!("ibv_modify_qp", {
        // SAFETY: caller passes a QP (or NULL).
        let Some(shell) = (unsafe { our_qp(qp) }) else {
            return match passthrough::ibv_modify_qp() {
                // SAFETY: not ours, so the real library's QP.
                Some(real) if !qp.is_null() => unsafe { real(qp, attr, mask) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct, checked non-NULL.
        let req = match modify_request(unsafe { &*attr }, mask) {
            Ok(r) => r,
            Err(e) => return status(Err(e)),
        };
        match shell.inner.modify_resolving(&req) {
            Ok(state) => {
                // SAFETY: `state` is read by the application; only ibv_modify_qp writes it.
                unsafe { (*shell.as_raw()).qp_base.state = ibv_qp_state(state.to_raw()) };
                0
            }
            Err(e) => status(Err(e)),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut ibv_qp,
    attr: *mut ibv_qp_attr,
    mask: c_int,
    init_attr: *mut ibv_qp_init_attr,
) -> c_int {
    ffi_boundary!("ibv_query_qp", {
        // SAFETY: caller passes a QP (or NULL).
        let Some(shell) = (unsafe { our_qp(qp) }) else {
            return match passthrough::ibv_query_qp() {
                // SAFETY: not ours, so the real library's QP.
                Some(real) if !qp.is_null() => unsafe { real(qp, attr, mask, init_attr) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if attr.is_null() || init_attr.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        let q = &shell.inner;
        let (state, a) = q.attributes();
        let cap = ibv_qp_cap {
            max_send_wr: q.caps.max_send_wr,
            max_recv_wr: q.caps.max_recv_wr,
            max_send_sge: q.caps.max_send_sge,
            max_recv_sge: q.caps.max_recv_sge,
            max_inline_data: q.caps.max_inline_data,
        };
        let raw_state = ibv_qp_state(state.to_raw());
        let out = qp_attr_from(raw_state, raw_state, &a, cap);
        // SAFETY: as rdma-core's ibv_query_qp, refresh the public state field (the QP may have
        // gone to ERR on its own); written only under ugdr's calls, read by the application.
        unsafe { (*shell.as_raw()).qp_base.state = ibv_qp_state(state.to_raw()) };
        // SAFETY: reading our own QP's public fields.
        let base = unsafe { &(*shell.as_raw()).qp_base };
        let init = ibv_qp_init_attr {
            qp_context: base.qp_context,
            send_cq: base.send_cq,
            recv_cq: base.recv_cq,
            srq: base.srq,
            cap,
            qp_type: base.qp_type,
            sq_sig_all: c_int::from(q.sq_sig_all),
        };
        // SAFETY: the caller's out-parameters, checked non-NULL.
        unsafe {
            attr.write(out);
            init_attr.write(init);
        }
        0
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int {
    ffi_boundary!("ibv_destroy_qp", {
        // SAFETY: caller passes a QP (or NULL).
        let Some(shell) = (unsafe { our_qp(qp) }) else {
            return match passthrough::ibv_destroy_qp() {
                // SAFETY: not ours, so the real library's QP.
                Some(real) if !qp.is_null() => unsafe { real(qp) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if shell.inner.in_multicast_groups() {
            // As the kernel's uverbs: a QP still attached to a multicast group stays.
            return c_int::fail(libc::EBUSY);
        }
        // SAFETY: ours; not used again when it was one of several handles.
        if unsafe { super::ibv_xrc::close_target_handle(qp, shell) } {
            return 0;
        }
        if let Ok(engine) = Engine::get() {
            let locked = engine.worker.lock();
            shell.inner.flush_ack(&locked);
            engine.unregister_qp(shell.inner.qp_num);
            shell.inner.destroy(&locked);
        }
        // Its unread async events go, and the ones the application holds must be acked first.
        shell.inner.pd.context.forget_object(qp as usize);
        // SAFETY: ours; the application gives it up here.
        unsafe { QpShell::destroy(qp.cast()) };
        0
    })
}

// ------------------------------------------------------------------ post paths

/// An SGE as an application lays it out (`struct ibv_sge`, `struct ugdr_sge`).
pub(crate) trait AppSge {
    fn sge(&self) -> Sge;
}

impl AppSge for ibv_sge {
    fn sge(&self) -> Sge {
        Sge {
            addr: self.addr,
            length: self.length,
            lkey: self.lkey,
        }
    }
}

/// Reads the application's SGE array. `num_sge` is checked against the queue's limit `max`
/// before any entry is read, as rxe's `validate_send_wr` does: the count is the application's
/// word only, and trusting it would read past a short array (EINVAL, the WR becomes `bad_wr`).
///
/// # Safety
/// `sg_list` holds `num_sge` readable entries whenever `0 < num_sge <= max`.
#[inline(always)]
pub(crate) unsafe fn read_sges<S: AppSge>(
    sg_list: *const S,
    num_sge: c_int,
    max: u32,
) -> Result<SgeList, VerbsError> {
    let Ok(count) = u32::try_from(num_sge) else {
        return Err(VerbsError::Invalid("negative num_sge"));
    };
    if count > max {
        return Err(VerbsError::Invalid("num_sge above the queue's max_sge"));
    }
    if count == 0 {
        return Ok(SgeList::new());
    }
    if sg_list.is_null() {
        return Err(VerbsError::Invalid("NULL sg_list"));
    }
    // SAFETY: the caller's array holds `count` entries (count <= max checked above).
    let sges = unsafe { std::slice::from_raw_parts(sg_list, count as usize) };
    Ok(match sges {
        // Most WRs: one SGE, the list built in place.
        [one] => SgeList::from_buf_and_len(
            [one.sge(), Sge::default(), Sge::default(), Sge::default()],
            1,
        ),
        _ => sges.iter().map(AppSge::sge).collect(),
    })
}

/// Copies the bytes of inline SGEs (their lkeys are not used: rdma_post_send passes 0), in
/// place when they are few.
///
/// # Safety
/// Every SGE names application bytes readable during the call.
pub(crate) unsafe fn inline_bytes(sges: &[Sge]) -> InlineData {
    let mut out = InlineData::new();
    for s in sges {
        if s.length > 0 {
            // SAFETY: the caller's contract.
            out.extend_from_slice(unsafe {
                std::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize)
            });
        }
    }
    out
}

/// The destination of a UD send, from `wr.ud` or `ibv_wr_set_ud_addr`.
///
/// # Safety
/// `ah` is NULL or a valid `ibv_ah`.
unsafe fn ud_destination(
    ah: *mut ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) -> Result<UdDestination, VerbsError> {
    // SAFETY: forwarded contract.
    let shell = unsafe { our_ah(ah) }.ok_or(VerbsError::Invalid("ah"))?;
    Ok(UdDestination {
        ah: Arc::clone(&shell.inner),
        remote_qpn: remote_qpn & 0xff_ffff,
        remote_qkey,
    })
}

/// # Safety
/// `wr` points to a valid `ibv_send_wr`.
#[inline(always)]
unsafe fn send_request(
    wr: *const ibv_send_wr,
    caps: &QpCaps,
    qp_type: QpType,
) -> Result<SendRequest, VerbsError> {
    // SAFETY: caller's contract.
    let w = unsafe { &*wr };
    let opcode = SendOpcode::from_raw(w.opcode.0).ok_or(VerbsError::Invalid("opcode"))?;
    // SAFETY: sg_list/num_sge come from the same WR.
    let sges = unsafe { read_sges(w.sg_list, w.num_sge, caps.max_send_sge) }?;
    let inline = w.send_flags & SEND_INLINE != 0;
    let inline_data = if inline {
        if sges_length(&sges) > u64::from(caps.max_inline_data) {
            return Err(VerbsError::Invalid("inline data above max_inline_data"));
        }
        // SAFETY: an inline WR's SGEs name the application's bytes, valid during the post.
        Some(unsafe { inline_bytes(&sges) })
    } else {
        None
    };
    // SAFETY: the unions are plain integers; reading the member for the opcode.
    let (imm_data, remote_addr, rkey, compare_add, swap) = unsafe {
        match opcode {
            SendOpcode::AtomicCmpAndSwp | SendOpcode::AtomicFetchAndAdd => (
                0,
                w.wr.atomic.remote_addr,
                w.wr.atomic.rkey,
                w.wr.atomic.compare_add,
                w.wr.atomic.swap,
            ),
            SendOpcode::LocalInv | SendOpcode::SendWithInv => {
                (0, 0, w.__bindgen_anon_1.invalidate_rkey, 0, 0)
            }
            _ => (
                w.__bindgen_anon_1.imm_data,
                w.wr.rdma.remote_addr,
                w.wr.rdma.rkey,
                0,
                0,
            ),
        }
    };
    let ud = if qp_type == QpType::Ud {
        // SAFETY: a UD QP's WRs carry the `ud` member of the union.
        let (ah, qpn, qkey) = unsafe { (w.wr.ud.ah, w.wr.ud.remote_qpn, w.wr.ud.remote_qkey) };
        // SAFETY: the application's address handle (or NULL).
        Some(unsafe { ud_destination(ah, qpn, qkey) }?)
    } else {
        None
    };
    let bind = if opcode == SendOpcode::BindMw {
        // SAFETY: a BIND_MW WR carries the `bind_mw` member of the union.
        let b = unsafe { &w.__bindgen_anon_2.bind_mw };
        // SAFETY: the application's window and region (or NULL).
        Some(unsafe { super::ibv_mw::posted_bind(b.mw, b.rkey, &b.bind_info) }?)
    } else {
        None
    };
    Ok(SendRequest {
        wr_id: w.wr_id,
        opcode,
        sges,
        inline_data,
        imm_data,
        signaled: w.send_flags & SEND_SIGNALED != 0,
        solicited: w.send_flags & SEND_SOLICITED != 0,
        fence: w.send_flags & SEND_FENCE != 0,
        remote_addr,
        rkey,
        compare_add,
        swap,
        ud,
        bind,
        xrc_srqn: if qp_type == QpType::XrcSend {
            // SAFETY: an XRC_SEND QP's WRs carry the `xrc` member of the union.
            unsafe { w.qp_type.xrc.remote_srqn }
        } else {
            0
        },
    })
}

/// `ibv_context_ops.post_send`: posts the list in order; stops at the first WR that cannot
/// be posted, sets `*bad_wr` to it and returns its errno (earlier WRs stay posted).
pub(crate) unsafe extern "C" fn post_send(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad_wr: *mut *mut ibv_send_wr,
) -> c_int {
    ffi_boundary!("ibv_post_send", {
        // SAFETY: only reached through ugdr's ops table, so `qp` is a QpShell.
        let Some(shell) = (unsafe { QpShell::from_raw(qp.cast()) }) else {
            return libc::EINVAL;
        };
        let Some(engine) = Engine::running() else {
            return libc::EINVAL;
        };
        let qp_obj = &shell.inner;
        // SAFETY: `wr` is the application's WR list (NULL: empty).
        let mut first = if !wr.is_null() && unsafe { (*wr).next }.is_null() {
            // One WR (most lists): if it completes at post time (the same-host direct path),
            // the worker is not needed, nor waited for while the progress thread holds it.
            // SAFETY: as above; `wr` is not NULL.
            let request = unsafe { send_request(wr, &qp_obj.caps, qp_obj.qp_type) };
            // Looked at in place: moving the request out of the Result copies it.
            match request.as_ref().map(|req| qp_obj.post_send_at_once(req)) {
                Ok(Ok(true)) => return 0,
                Ok(Ok(false)) | Err(_) => Some(request),
                Ok(Err(e)) => Some(Err(e)),
            }
        } else {
            None
        };
        let locked = engine.worker.lock();
        let mut cur = wr;
        let requests = std::iter::from_fn(|| {
            if let Some(req) = first.take() {
                // SAFETY: the one WR, read above.
                cur = unsafe { (*cur).next };
                return Some(req);
            }
            if cur.is_null() {
                return None;
            }
            // SAFETY: `cur` walks the application's NULL-terminated WR list.
            let req = unsafe { send_request(cur, &qp_obj.caps, qp_obj.qp_type) };
            // SAFETY: as above.
            cur = unsafe { (*cur).next };
            Some(req)
        });
        match post_send_list(engine, &locked, qp_obj, requests) {
            Ok(()) => 0,
            Err((index, e)) => {
                tracing::debug!("qp {:#x}: post_send: {e}", qp_obj.qp_num);
                if !bad_wr.is_null() {
                    // SAFETY: the list holds at least `index + 1` WRs (the failing one was read);
                    // `bad_wr` is the caller's out-parameter.
                    unsafe { *bad_wr = nth_wr(wr, index) };
                }
                e.errno()
            }
        }
    })
}

/// Posts a send WR list (`ibv_post_send`, `ibv_wr_complete`, `ugdr_post_send`). The
/// application then expects an answer, and the adaptive progress thread stays awake for it,
/// unless every WR completed at post time: direct WRITEs keep no thread spinning beside an
/// application that posts them (on 2 cores that thread took the CPU the application needed).
pub(crate) fn post_send_list(
    engine: &Engine,
    locked: &LockedWorker<'_>,
    qp: &Arc<QueuePair>,
    requests: impl IntoIterator<Item = Result<SendRequest, VerbsError>>,
) -> Result<(), (usize, VerbsError)> {
    let posted = qp.post_send_list(locked, requests);
    if !matches!(posted, Ok(false)) {
        engine.note_post();
    }
    posted.map(|_| ())
}

/// The `index`th WR of a NULL-terminated WR list (`ibv_send_wr` or `ugdr_send_wr`).
///
/// # Safety
/// The list holds more than `index` WRs.
pub(crate) unsafe fn nth_wr<W: WrList>(mut wr: *mut W, index: usize) -> *mut W {
    for _ in 0..index {
        // SAFETY: the caller's contract.
        wr = unsafe { (*wr).next_wr() };
    }
    wr
}

/// A C work request that links to the next one of its list.
pub(crate) trait WrList {
    fn next_wr(&self) -> *mut Self;
}

impl WrList for ibv_send_wr {
    fn next_wr(&self) -> *mut Self {
        self.next
    }
}

/// `ibv_context_ops.post_recv`, with the same list semantics as `post_send`.
pub(crate) unsafe extern "C" fn post_recv(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad_wr: *mut *mut ibv_recv_wr,
) -> c_int {
    ffi_boundary!("ibv_post_recv", {
        // SAFETY: only reached through ugdr's ops table, so `qp` is a QpShell.
        let Some(shell) = (unsafe { QpShell::from_raw(qp.cast()) }) else {
            return libc::EINVAL;
        };
        let Some(engine) = Engine::running() else {
            return libc::EINVAL;
        };
        let qp_obj = &shell.inner;
        // The worker is locked only once a WR needs more than queueing (see
        // `post_recv_queued_only`), and then for the rest of the list.
        let mut locked = None;
        let mut cur = wr;
        while !cur.is_null() {
            // SAFETY: `cur` walks the application's NULL-terminated WR list.
            let w = unsafe { &*cur };
            // SAFETY: sg_list/num_sge of the same WR.
            let result = unsafe { read_sges(w.sg_list, w.num_sge, qp_obj.caps.max_recv_sge) }
                .and_then(|sges| {
                    let req = RecvRequest {
                        wr_id: w.wr_id,
                        sges,
                    };
                    let req = match &locked {
                        Some(_) => req,
                        None => match qp_obj.post_recv_queued_only(req)? {
                            None => return Ok(()),
                            Some(req) => req,
                        },
                    };
                    let locked = locked.get_or_insert_with(|| engine.worker.lock());
                    qp_obj.post_recv(locked, req)
                });
            if let Err(e) = result {
                tracing::debug!("qp {:#x}: post_recv: {e}", qp_obj.qp_num);
                if !bad_wr.is_null() {
                    // SAFETY: the caller's out-parameter.
                    unsafe { *bad_wr = cur };
                }
                return e.errno();
            }
            cur = w.next;
        }
        0
    })
}

// ------------------------------------------------------------------ ibv_wr_* builders

/// # Safety
/// Installed only on ugdr's QPs; the `ibv_wr_*` API is used by one thread per QP between
/// `ibv_wr_start` and `ibv_wr_complete`/`ibv_wr_abort`.
pub(crate) unsafe fn batch<'a>(qp: *mut ibv_qp_ex) -> (&'a QpShell, &'a mut WrBatch) {
    // SAFETY: forwarded contract.
    let shell = unsafe { QpShell::from_raw(qp).expect("wr op called with NULL") };
    // SAFETY: single builder thread per QP (the API's rule).
    let b = unsafe { &mut *shell.batch.get() };
    (shell, b)
}

pub(crate) fn new_request(qp: *mut ibv_qp_ex, opcode: SendOpcode) -> SendRequest {
    // SAFETY: the application writes wr_id/wr_flags before each builder call; read them raw.
    let (wr_id, flags) = unsafe { ((*qp).wr_id, (*qp).wr_flags) };
    SendRequest {
        signaled: flags & SEND_SIGNALED != 0,
        solicited: flags & SEND_SOLICITED != 0,
        fence: flags & SEND_FENCE != 0,
        ..SendRequest::new(wr_id, opcode)
    }
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    ffi_boundary!("ibv_wr_start", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        b.requests.clear();
        b.error = None;
    })
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    ffi_boundary!("ibv_wr_send", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        b.requests.push(new_request(qp, SendOpcode::Send));
    })
}

/// A one-sided request of the `ibv_wr_*` API.
fn push_remote(
    qp: *mut ibv_qp_ex,
    opcode: SendOpcode,
    rkey: u32,
    remote_addr: u64,
    fill: impl FnOnce(&mut SendRequest),
) {
    // SAFETY: see `batch`.
    let (_, b) = unsafe { batch(qp) };
    let mut r = new_request(qp, opcode);
    r.rkey = rkey;
    r.remote_addr = remote_addr;
    fill(&mut r);
    b.requests.push(r);
}

unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    ffi_boundary!("ibv_wr_rdma_write", {
        push_remote(qp, SendOpcode::RdmaWrite, rkey, remote_addr, |_| {})
    })
}

unsafe extern "C" fn wr_rdma_write_imm(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    imm_data: __be32,
) {
    ffi_boundary!("ibv_wr_rdma_write_imm", {
        push_remote(qp, SendOpcode::RdmaWriteWithImm, rkey, remote_addr, |r| {
            r.imm_data = imm_data
        })
    })
}

unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    ffi_boundary!("ibv_wr_rdma_read", {
        push_remote(qp, SendOpcode::RdmaRead, rkey, remote_addr, |_| {})
    })
}

unsafe extern "C" fn wr_atomic_fetch_add(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    add: u64,
) {
    ffi_boundary!("ibv_wr_atomic_fetch_add", {
        push_remote(qp, SendOpcode::AtomicFetchAndAdd, rkey, remote_addr, |r| {
            r.compare_add = add
        })
    })
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    compare: u64,
    swap: u64,
) {
    ffi_boundary!("ibv_wr_atomic_cmp_swp", {
        push_remote(qp, SendOpcode::AtomicCmpAndSwp, rkey, remote_addr, |r| {
            r.compare_add = compare;
            r.swap = swap;
        })
    })
}

unsafe extern "C" fn wr_atomic_write(
    qp: *mut ibv_qp_ex,
    rkey: u32,
    remote_addr: u64,
    atomic_wr: *const c_void,
) {
    ffi_boundary!("ibv_wr_atomic_write", {
        if atomic_wr.is_null() {
            // SAFETY: see `batch`.
            let (_, b) = unsafe { batch(qp) };
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        // SAFETY: the verb's contract: `atomic_wr` points to the 8 bytes to write (any
        // alignment), read now as rxe copies them at this call.
        let bytes = unsafe { std::ptr::read_unaligned(atomic_wr as *const [u8; 8]) };
        push_remote(qp, SendOpcode::AtomicWrite, rkey, remote_addr, |r| {
            r.compare_add = u64::from_ne_bytes(bytes)
        })
    })
}

unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm_data: __be32) {
    ffi_boundary!("ibv_wr_send_imm", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        let mut r = new_request(qp, SendOpcode::SendWithImm);
        r.imm_data = imm_data;
        b.requests.push(r);
    })
}

fn with_last(b: &mut WrBatch, f: impl FnOnce(&mut SendRequest)) {
    match b.requests.last_mut() {
        Some(r) => f(r),
        None => {
            b.error.get_or_insert(libc::EINVAL);
        }
    }
}

unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    ffi_boundary!("ibv_wr_set_sge", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        with_last(b, |r| {
            r.sges.clear();
            r.sges.push(Sge { addr, length, lkey });
        });
    })
}

/// More SGEs than the QP's `max_send_sge` is ENOSPC at `ibv_wr_complete` (rxe's answer),
/// decided before the list is read.
unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, num_sge: usize, sg_list: *const ibv_sge) {
    ffi_boundary!("ibv_wr_set_sge_list", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        if num_sge > shell.inner.caps.max_send_sge as usize {
            b.error.get_or_insert(libc::ENOSPC);
            return;
        }
        // SAFETY: the caller's array of `num_sge` entries (within the QP's limit).
        match unsafe { read_sges(sg_list, num_sge as c_int, shell.inner.caps.max_send_sge) } {
            Ok(sges) => with_last(b, |r| r.sges = sges),
            Err(_) => {
                b.error.get_or_insert(libc::EINVAL);
            }
        }
    })
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, length: usize) {
    ffi_boundary!("ibv_wr_set_inline_data", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        if length > shell.inner.caps.max_inline_data as usize {
            b.error.get_or_insert(libc::ENOSPC);
            return;
        }
        if addr.is_null() && length > 0 {
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        let data = if length == 0 {
            InlineData::new()
        } else {
            // SAFETY: the application's inline buffer, valid during this call.
            InlineData::from_slice(unsafe { std::slice::from_raw_parts(addr as *const u8, length) })
        };
        with_last(b, |r| r.inline_data = Some(data));
    })
}

/// The buffers are read one by one while their total stays within `max_inline_data`; a
/// list that goes beyond (or that has more buffers than the limit has bytes, so some are
/// empty) is ENOSPC at `ibv_wr_complete`, as rxe, and nothing past that point is read.
unsafe extern "C" fn wr_set_inline_data_list(
    qp: *mut ibv_qp_ex,
    num_buf: usize,
    buf_list: *const ibv_data_buf,
) {
    ffi_boundary!("ibv_wr_set_inline_data_list", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        let max = shell.inner.caps.max_inline_data as usize;
        if num_buf > max {
            b.error.get_or_insert(libc::ENOSPC);
            return;
        }
        if num_buf > 0 && buf_list.is_null() {
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        let mut data = InlineData::new();
        for i in 0..num_buf {
            // SAFETY: the caller's array of `num_buf` buffers (within the limit checked above).
            let buf = unsafe { &*buf_list.add(i) };
            if buf.length > max - data.len() {
                b.error.get_or_insert(libc::ENOSPC);
                return;
            }
            if buf.length > 0 {
                // SAFETY: the application's buffer, valid during this call.
                data.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(buf.addr as *const u8, buf.length)
                });
            }
        }
        with_last(b, |r| r.inline_data = Some(data));
    })
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    ffi_boundary!("ibv_wr_complete", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        let requests = std::mem::take(&mut b.requests);
        if let Some(e) = b.error.take() {
            return e;
        }
        let Some(engine) = Engine::running() else {
            return libc::EINVAL;
        };
        let locked = engine.worker.lock();
        match post_send_list(engine, &locked, &shell.inner, requests.into_iter().map(Ok)) {
            Ok(()) => 0,
            Err((_, e)) => e.errno(),
        }
    })
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    ffi_boundary!("ibv_wr_abort", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        b.requests.clear();
        b.error = None;
    })
}

/// A builder for an opcode this QP was not created for: `ibv_wr_complete` fails with EINVAL,
/// and nothing of the batch is posted.
macro_rules! refused_builder {
    ($name:ident, $($arg:ty),*) => {
        unsafe extern "C" fn $name(qp: *mut ibv_qp_ex, $(_: $arg),*) {
            ffi_boundary!(stringify!($name), {
                // SAFETY: see `batch`.
                let (_, b) = unsafe { batch(qp) };
                b.error.get_or_insert(libc::EINVAL);
            })
        }
    };
}

refused_builder!(wr_send_tso, *mut c_void, u16, u16);

unsafe extern "C" fn wr_set_ud_addr(
    qp: *mut ibv_qp_ex,
    ah: *mut ibv_ah,
    remote_qpn: u32,
    remote_qkey: u32,
) {
    ffi_boundary!("ibv_wr_set_ud_addr", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        if shell.inner.qp_type != QpType::Ud {
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        // SAFETY: the application's address handle (or NULL).
        match unsafe { ud_destination(ah, remote_qpn, remote_qkey) } {
            Ok(dest) => with_last(b, |r| r.ud = Some(dest)),
            Err(_) => {
                b.error.get_or_insert(libc::EINVAL);
            }
        }
    })
}

/// `ibv_wr_set_xrc_srqn`: the SRQ at the target of the last XRC_SEND request built.
unsafe extern "C" fn wr_set_xrc_srqn(qp: *mut ibv_qp_ex, remote_srqn: u32) {
    ffi_boundary!("ibv_wr_set_xrc_srqn", {
        // SAFETY: see `batch`.
        let (shell, b) = unsafe { batch(qp) };
        if shell.inner.qp_type != QpType::XrcSend {
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        with_last(b, |r| r.xrc_srqn = remote_srqn);
    })
}

pub(crate) fn install_wr_ops(qp: &mut ibv_qp_ex) {
    qp.wr_start = Some(wr_start);
    qp.wr_complete = Some(wr_complete);
    qp.wr_abort = Some(wr_abort);
    qp.wr_send = Some(wr_send);
    qp.wr_send_imm = Some(wr_send_imm);
    qp.wr_set_sge = Some(wr_set_sge);
    qp.wr_set_sge_list = Some(wr_set_sge_list);
    qp.wr_set_inline_data = Some(wr_set_inline_data);
    qp.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    qp.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    qp.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    qp.wr_bind_mw = Some(super::ibv_mw::wr_bind_mw);
    qp.wr_local_inv = Some(super::ibv_mw::wr_local_inv);
    qp.wr_rdma_read = Some(wr_rdma_read);
    qp.wr_rdma_write = Some(wr_rdma_write);
    qp.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    qp.wr_send_inv = Some(super::ibv_mw::wr_send_inv);
    qp.wr_send_tso = Some(wr_send_tso);
    qp.wr_set_ud_addr = Some(wr_set_ud_addr);
    qp.wr_set_xrc_srqn = Some(wr_set_xrc_srqn);
    qp.wr_atomic_write = Some(wr_atomic_write);
}
