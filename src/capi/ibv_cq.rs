//! Completion channels and completion queues (`ibv_cq` and `ibv_cq_ex`).

use super::boundary::{Attempt, Fallback, blocking, ffi_boundary, set_errno, status};
use super::ibv_pd_mr::our_pd;
use super::layout::{
    CHANNELS, ChannelShell, ContextShell, CqShell, PdShell, RESOURCE_CQ, ShellMemory, owned_context,
};
use super::{ops, passthrough};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::cq::{CompletionChannel, CompletionQueue, Timestamps};
use crate::fake_verbs::device;
use crate::fake_verbs::work::WorkCompletion;
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::{c_int, c_uint, c_void};
use std::sync::Arc;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut ibv_context) -> *mut ibv_comp_channel {
    ffi_boundary!("ibv_create_comp_channel", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return match passthrough::ibv_create_comp_channel() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe { real(ctx) },
                _ => <*mut ibv_comp_channel>::fail(libc::EINVAL),
            };
        };
        match CompletionChannel::new(Arc::clone(&shell.inner)) {
            Ok(ch) => {
                let ibv = ibv_comp_channel {
                    context: ctx,
                    fd: ch.events.fd(),
                    refcnt: 0,
                };
                let raw = ChannelShell::into_raw(Box::new(ChannelShell {
                    ibv: UnsafeCell::new(ibv),
                    inner: Arc::clone(&ch),
                }));
                CHANNELS.insert(raw as usize, ch);
                raw
            }
            Err(e) => <*mut ibv_comp_channel>::fail(e.errno()),
        }
    })
}

/// One of ugdr's completion channels: the caller's own reference, good however long it
/// keeps it (the shell may be destroyed meanwhile).
fn our_channel(ch: *mut ibv_comp_channel) -> Option<Arc<CompletionChannel>> {
    CHANNELS.get(&(ch as usize)).map(|c| Arc::clone(c.value()))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int {
    ffi_boundary!("ibv_destroy_comp_channel", {
        let Some(channel) = our_channel(ch) else {
            return match passthrough::ibv_destroy_comp_channel() {
                // SAFETY: not ours, so the real library's channel.
                Some(real) if !ch.is_null() => unsafe { real(ch) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        // Removed only if no CQ uses it, and by one destroy only (a second, racing one
        // finds nothing and fails as for a destroyed channel).
        let removed = CHANNELS.remove_if(&(ch as usize), |_, c| c.check_destroyable().is_ok());
        if removed.is_none() {
            let busy = channel.check_destroyable();
            return status(busy.and(Err(VerbsError::Invalid("destroyed by another thread"))));
        }
        // SAFETY: ours and unregistered above, by this call alone; the application gives it
        // up here.
        unsafe { ChannelShell::destroy(ch) };
        0
    })
}

/// What `ibv_create_cq_ex` adds to `ibv_create_cq`'s arguments.
#[derive(Default)]
struct CqExtras<'a> {
    timestamps: Timestamps,
    /// The parent domain it is created through (`IBV_CQ_INIT_ATTR_MASK_PD`).
    parent: Option<&'a PdShell>,
}

fn create_cq(
    ctx: *mut ibv_context,
    shell: &ContextShell,
    cqe: i64,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: i64,
    extras: CqExtras,
) -> Result<*mut ibv_cq_ex, VerbsError> {
    if cqe < 1 || cqe > i64::from(device::MAX_CQE) {
        return Err(VerbsError::Invalid("cqe out of range"));
    }
    if !(0..1).contains(&comp_vector) {
        return Err(VerbsError::Invalid("comp_vector out of range"));
    }
    let channel_obj = if channel.is_null() {
        None
    } else {
        match our_channel(channel) {
            Some(ch) => Some(ch),
            None => return Err(VerbsError::Invalid("completion channel is not ugdr's")),
        }
    };
    let memory = ShellMemory::<CqShell>::reserve(extras.parent, RESOURCE_CQ)?;
    let cq = CompletionQueue::with_timestamps(
        Arc::clone(&shell.inner),
        cqe as usize,
        channel_obj,
        extras.timestamps,
    );
    let mut ibv = ibv_cq_ex {
        context: ctx,
        channel,
        cq_context,
        cqe: cqe as c_int,
        ..Default::default()
    };
    ops::install_cq_ops(&mut ibv);
    let raw = memory
        .place(CqShell {
            ibv: UnsafeCell::new(ibv),
            inner: Arc::clone(&cq),
            current: UnsafeCell::new(None),
        })
        .cast::<ibv_cq_ex>();
    cq.set_handle(raw as usize);
    Ok(raw)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut ibv_context,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut ibv_comp_channel,
    comp_vector: c_int,
) -> *mut ibv_cq {
    ffi_boundary!("ibv_create_cq", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return match passthrough::ibv_create_cq() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !ctx.is_null() => unsafe {
                    real(ctx, cqe, cq_context, channel, comp_vector)
                },
                _ => <*mut ibv_cq>::fail(libc::EINVAL),
            };
        };
        match create_cq(
            ctx,
            shell,
            cqe.into(),
            cq_context,
            channel,
            comp_vector.into(),
            CqExtras::default(),
        ) {
            Ok(cq) => cq.cast(),
            Err(e) => <*mut ibv_cq>::fail(e.errno()),
        }
    })
}

const SUPPORTED_WC_FLAGS: u64 = (ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_IMM.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_QP_NUM.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SRC_QP.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SLID.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SL.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_DLID_PATH_BITS.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP.0
    | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK.0)
    as u64;

/// `enum ibv_cq_init_attr_mask` and `enum ibv_create_cq_attr_flags`.
const CQ_ATTR_FLAGS: u32 = 1;
const CQ_ATTR_PD: u32 = 1 << 1;
/// The application polls the CQ from one thread: nothing to change (ugdr locks anyway).
/// (`IBV_CREATE_CQ_ATTR_IGNORE_OVERRUN` is not offered: an overrun raises IBV_EVENT_CQ_ERR.)
const CQ_FLAG_SINGLE_THREADED: u32 = 1;

/// `verbs_context.create_cq_ex` (the `ibv_create_cq_ex` inline).
pub(crate) unsafe extern "C" fn create_cq_ex_op(
    ctx: *mut ibv_context,
    attr: *mut ibv_cq_init_attr_ex,
) -> *mut ibv_cq_ex {
    ffi_boundary!("ibv_create_cq_ex", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(ctx) }) else {
            return <*mut ibv_cq_ex>::fail(libc::EINVAL);
        };
        if attr.is_null() {
            return <*mut ibv_cq_ex>::fail(libc::EINVAL);
        }
        // SAFETY: the caller's attribute struct.
        let a = unsafe { &*attr };
        if a.comp_mask & !(CQ_ATTR_FLAGS | CQ_ATTR_PD) != 0 {
            return <*mut ibv_cq_ex>::fail(libc::EINVAL);
        }
        if a.comp_mask & CQ_ATTR_FLAGS != 0 && a.flags & !CQ_FLAG_SINGLE_THREADED != 0 {
            return <*mut ibv_cq_ex>::fail(libc::EOPNOTSUPP);
        }
        let parent = if a.comp_mask & CQ_ATTR_PD != 0 {
            // SAFETY: the caller's PD pointer (or NULL), ownership checked; a plain PD (not a
            // parent domain) or one of another context is EINVAL, as in rdma-core's mlx5.
            match unsafe { our_pd(a.parent_domain) } {
                // SAFETY: our own PD (checked above): its context field is readable.
                Some(p) if p.parent.is_some() && unsafe { (*p.as_raw()).context } == ctx => Some(p),
                _ => return <*mut ibv_cq_ex>::fail(libc::EINVAL),
            }
        } else {
            None
        };
        if a.wc_flags & !SUPPORTED_WC_FLAGS != 0 {
            tracing::debug!(
                "ibv_create_cq_ex: wc_flags {:#x} not supported",
                a.wc_flags & !SUPPORTED_WC_FLAGS
            );
            return <*mut ibv_cq_ex>::fail(libc::EOPNOTSUPP);
        }
        match create_cq(
            ctx,
            shell,
            a.cqe.into(),
            a.cq_context,
            a.channel,
            a.comp_vector.into(),
            CqExtras {
                timestamps: Timestamps {
                    raw: a.wc_flags
                        & ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP.0 as u64
                        != 0,
                    wallclock: a.wc_flags
                        & ibv_create_cq_wc_flags::IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK.0
                            as u64
                        != 0,
                },
                parent,
            },
        ) {
            Ok(cq) => cq,
            Err(e) => <*mut ibv_cq_ex>::fail(e.errno()),
        }
    })
}

/// # Safety
/// `cq` is NULL or a valid `ibv_cq`.
unsafe fn our_cq<'a>(cq: *mut ibv_cq) -> Option<&'a CqShell> {
    if cq.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_cq has a readable `context` field.
    unsafe { owned_context((*cq).context)? };
    // SAFETY: its context is ours, so it is a CqShell (ibv_cq is the start of ibv_cq_ex).
    unsafe { CqShell::from_raw(cq.cast()) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut ibv_cq, cqe: c_int) -> c_int {
    ffi_boundary!("ibv_resize_cq", {
        // SAFETY: caller passes a CQ (or NULL).
        let Some(shell) = (unsafe { our_cq(cq) }) else {
            return match passthrough::ibv_resize_cq() {
                // SAFETY: not ours, so the real library's CQ.
                Some(real) if !cq.is_null() => unsafe { real(cq, cqe) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if !(1..=device::MAX_CQE).contains(&cqe) {
            return c_int::fail(libc::EINVAL);
        }
        match shell.inner.resize(cqe as usize) {
            Ok(n) => {
                // SAFETY: `cqe` is only written here, under no Rust reference.
                unsafe { (*shell.as_raw()).cqe = n as c_int };
                0
            }
            Err(e) => status(Err(e)),
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int {
    ffi_boundary!("ibv_destroy_cq", {
        // SAFETY: caller passes a CQ (or NULL).
        let Some(shell) = (unsafe { our_cq(cq) }) else {
            return match passthrough::ibv_destroy_cq() {
                // SAFETY: not ours, so the real library's CQ.
                Some(real) if !cq.is_null() => unsafe { real(cq) },
                _ => c_int::fail(libc::EINVAL),
            };
        };
        if let Err(e) = shell.inner.check_destroyable() {
            return status(Err(e));
        }
        shell.inner.context.forget_object(cq as usize);
        shell.inner.wait_events_acked();
        shell.inner.destroy();
        // SAFETY: ours; the application gives it up here.
        unsafe { CqShell::destroy(cq.cast()) };
        0
    })
}

/// Returns 0, or -1 with errno set (EAGAIN on a non-blocking channel with no event). Blocks
/// as rdma-core's does, in a cancellation point (`pthread_cancel` ends the thread there; see
/// `boundary`). While it waits it also watches the UCX worker's event fd and progresses when
/// it fires, so the waiting thread delivers its own completion instead of waiting for the
/// progress thread to wake first.
#[unsafe(no_mangle)]
pub unsafe extern "C-unwind" fn ibv_get_cq_event(
    ch: *mut ibv_comp_channel,
    cq_out: *mut *mut ibv_cq,
    cq_context_out: *mut *mut c_void,
) -> c_int {
    // Looked up once: a wait goes on on the channel found, even if its shell is destroyed.
    let mut found: Option<Option<Arc<CompletionChannel>>> = None;
    blocking(
        "ibv_get_cq_event",
        || -1,
        |ready| {
            let Some(channel) = found.get_or_insert_with(|| our_channel(ch)).clone() else {
                return match passthrough::ibv_get_cq_event() {
                    Some(real) if !ch.is_null() => Attempt::Outside(Box::new(move || {
                        // SAFETY: not ours, so the real library's channel.
                        unsafe { real(ch, cq_out, cq_context_out) }
                    })),
                    _ => {
                        set_errno(libc::EINVAL);
                        Attempt::Done(-1)
                    }
                };
            };
            if cq_out.is_null() || cq_context_out.is_null() {
                set_errno(libc::EINVAL);
                return Attempt::Done(-1);
            }
            let engine = Engine::running();
            // Sends UCX holds (a peer's FIFO was full) go out only from a progress call, and
            // nothing makes the worker's fd readable when room comes: this waiter looks every
            // millisecond while there are some (the progress thread may have slept through the
            // wake-up this thread took).
            let sends_pending = engine.is_some_and(|e| e.worker.sends_pending() > 0);
            if let (true, Some(engine)) = (ready[1] || sends_pending, engine) {
                engine.progress_for_waiter();
            }
            let events = &channel.events;
            // The event a CQ armed while holding completions owes comes after those queued,
            // and to a blocking wait only: a non-blocking channel's application waits on its
            // fd, which that event never makes readable (SPDK's `--interrupt-mode`, handed it
            // besides the fd's own, ran slower).
            let mut nonblocking = None;
            let mut is_nonblocking = || *nonblocking.get_or_insert_with(|| events.is_nonblocking());
            let taken = loop {
                match events.try_wait() {
                    Ok(None) if !is_nonblocking() => break Ok(channel.take_arming_event()),
                    Ok(Some(handle)) if !is_nonblocking() && stale_event(handle) => continue,
                    taken => break taken,
                }
            };
            match taken {
                Ok(Some(handle)) => {
                    let cq = handle as *mut ibv_cq_ex;
                    // SAFETY: events carry live CQ shells (a CQ's events are discarded when it is
                    // destroyed); the out-parameters were checked non-NULL.
                    unsafe {
                        if let Some(cq_shell) = CqShell::from_raw(cq) {
                            cq_shell.inner.event_delivered();
                        }
                        *cq_out = cq.cast();
                        *cq_context_out = (*cq).cq_context;
                    }
                    Attempt::Done(0)
                }
                Ok(None) if is_nonblocking() => {
                    set_errno(libc::EAGAIN);
                    Attempt::Done(-1)
                }
                Ok(None) => match engine {
                    Some(engine) => {
                        engine.blocking_for_event();
                        Attempt::Wait {
                            fds: [events.fd(), engine.worker.event_fd()],
                            count: 2,
                            timeout_ms: if engine.worker.sends_pending() > 0 {
                                1
                            } else {
                                100
                            },
                        }
                    }
                    None => Attempt::Wait {
                        fds: [events.fd(), -1],
                        count: 1,
                        timeout_ms: -1,
                    },
                },
                Err(e) => {
                    set_errno(e.errno());
                    Attempt::Done(-1)
                }
            }
        },
    )
}

/// Whether the event of CQ `handle` a blocking wait took stands for an arming event no
/// longer owed ([`CompletionQueue::take_stale_event`]).
fn stale_event(handle: usize) -> bool {
    // SAFETY: events carry live CQ shells (a CQ's events are discarded when it is destroyed).
    unsafe { CqShell::from_raw(handle as *mut ibv_cq_ex) }
        .is_some_and(|cq| cq.inner.take_stale_event())
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut ibv_cq, nevents: c_uint) {
    ffi_boundary!("ibv_ack_cq_events", {
        // SAFETY: caller passes a CQ (or NULL).
        match unsafe { our_cq(cq) } {
            Some(shell) => shell.inner.ack_events(u64::from(nevents)),
            None => {
                if let Some(real) = passthrough::ibv_ack_cq_events().filter(|_| !cq.is_null()) {
                    // SAFETY: not ours, so the real library's CQ.
                    unsafe { real(cq, nevents) };
                }
            }
        }
    })
}

fn to_ibv_wc(w: &WorkCompletion) -> ibv_wc {
    ibv_wc {
        wr_id: w.wr_id,
        status: ibv_wc_status(w.status as u32),
        opcode: ibv_wc_opcode(w.opcode as u32),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        __bindgen_anon_1: ibv_wc__bindgen_ty_1 {
            imm_data: w.imm_data,
        },
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags,
        pkey_index: w.pkey_index,
        slid: w.slid,
        sl: w.sl,
        dlid_path_bits: w.dlid_path_bits,
    }
}

/// Polls into the caller's array; on an empty CQ the engine progresses from this thread
/// and the CQ is polled again (`CompletionQueue::poll_progressing`).
fn poll_into(shell: &CqShell, max: usize, wc: *mut ibv_wc) -> usize {
    let mut i = 0;
    shell.inner.poll_progressing(
        max,
        |w| {
            // SAFETY: the caller's array holds `max` entries and `i < max`.
            unsafe { wc.add(i).write(to_ibv_wc(w)) };
            i += 1;
        },
        progress_from_app,
    )
}

/// The engine progressed from an application thread that found its CQ empty (the
/// `progress` of [`CompletionQueue::poll_progressing`]).
pub(crate) fn progress_from_app() {
    if let Some(engine) = Engine::running() {
        engine.progress_from_app();
    }
}

/// `ibv_context_ops.poll_cq` (the `ibv_poll_cq` inline): count, or negative on error.
pub(crate) unsafe extern "C" fn poll_cq(
    cq: *mut ibv_cq,
    num_entries: c_int,
    wc: *mut ibv_wc,
) -> c_int {
    ffi_boundary!("ibv_poll_cq", on_panic = -1, {
        // SAFETY: only reached through ugdr's ops table, so `cq` is a CqShell.
        let Some(shell) = (unsafe { CqShell::from_raw(cq.cast()) }) else {
            return -1;
        };
        if num_entries < 0 || (num_entries > 0 && wc.is_null()) {
            return -1;
        }
        poll_into(shell, num_entries as usize, wc) as c_int
    })
}

/// `ibv_context_ops.req_notify_cq`.
pub(crate) unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    ffi_boundary!("ibv_req_notify_cq", {
        // SAFETY: only reached through ugdr's ops table, so `cq` is a CqShell.
        let Some(shell) = (unsafe { CqShell::from_raw(cq.cast()) }) else {
            return c_int::fail(libc::EINVAL);
        };
        if let Some(engine) = Engine::running() {
            engine.note_event_wait();
        }
        status(shell.inner.arm(solicited_only != 0))
    })
}

// ------------------------------------------------------------------ ibv_cq_ex polling

/// # Safety
/// `cq` came from ugdr's create functions (the cq_ex ops are only installed there).
unsafe fn cq_ex<'a>(cq: *mut ibv_cq_ex) -> &'a CqShell {
    // SAFETY: forwarded contract; never NULL when called through the installed table.
    unsafe { CqShell::from_raw(cq).expect("cq_ex op called with NULL") }
}

fn take_current(shell: &CqShell) -> c_int {
    let mut next = None;
    let got = shell
        .inner
        .poll_progressing(1, |w| next = Some(*w), progress_from_app);
    // SAFETY: `current` and the public wr_id/status are only touched by the one thread that
    // polls this CQ between start_poll and end_poll (the API's rule).
    unsafe {
        *shell.current.get() = next;
        if let Some(w) = next {
            let raw = shell.as_raw();
            (*raw).wr_id = w.wr_id;
            (*raw).status = ibv_wc_status(w.status as u32);
        }
    }
    if got == 0 { libc::ENOENT } else { 0 }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, attr: *mut ibv_poll_cq_attr) -> c_int {
    ffi_boundary!("ibv_start_poll", {
        // SAFETY: `attr` is NULL or the caller's struct.
        if !attr.is_null() && unsafe { (*attr).comp_mask } != 0 {
            return libc::EINVAL;
        }
        // SAFETY: installed only on ugdr's CQs.
        take_current(unsafe { cq_ex(cq) })
    })
}

unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: installed only on ugdr's CQs.
    ffi_boundary!("ibv_next_poll", { take_current(unsafe { cq_ex(cq) }) })
}

unsafe extern "C" fn end_poll(cq: *mut ibv_cq_ex) {
    ffi_boundary!("ibv_end_poll", {
        // SAFETY: installed only on ugdr's CQs; same single-poller rule as take_current.
        unsafe { *cq_ex(cq).current.get() = None };
    })
}

fn current(cq: *mut ibv_cq_ex) -> WorkCompletion {
    // SAFETY: installed only on ugdr's CQs; read by the polling thread between start/next and
    // end_poll. Reading with no current completion is an application error: zeros.
    unsafe {
        (*cq_ex(cq).current.get()).unwrap_or_else(|| {
            WorkCompletion::new(
                0,
                crate::fake_verbs::work::WcStatus::GeneralErr,
                crate::fake_verbs::work::WcOpcode::Send,
                0,
            )
        })
    }
}

unsafe extern "C" fn read_opcode(cq: *mut ibv_cq_ex) -> ibv_wc_opcode {
    ffi_boundary!("ibv_wc_read_opcode", on_panic = ibv_wc_opcode(0), {
        ibv_wc_opcode(current(cq).opcode as u32)
    })
}
unsafe extern "C" fn read_vendor_err(cq: *mut ibv_cq_ex) -> u32 {
    ffi_boundary!("ibv_wc_read_vendor_err", { current(cq).vendor_err })
}
unsafe extern "C" fn read_byte_len(cq: *mut ibv_cq_ex) -> u32 {
    ffi_boundary!("ibv_wc_read_byte_len", { current(cq).byte_len })
}
unsafe extern "C" fn read_imm_data(cq: *mut ibv_cq_ex) -> __be32 {
    ffi_boundary!("ibv_wc_read_imm_data", { current(cq).imm_data })
}
unsafe extern "C" fn read_qp_num(cq: *mut ibv_cq_ex) -> u32 {
    ffi_boundary!("ibv_wc_read_qp_num", { current(cq).qp_num })
}
unsafe extern "C" fn read_src_qp(cq: *mut ibv_cq_ex) -> u32 {
    ffi_boundary!("ibv_wc_read_src_qp", { current(cq).src_qp })
}
unsafe extern "C" fn read_wc_flags(cq: *mut ibv_cq_ex) -> c_uint {
    ffi_boundary!("ibv_wc_read_wc_flags", { current(cq).wc_flags })
}
unsafe extern "C" fn read_slid(cq: *mut ibv_cq_ex) -> u32 {
    ffi_boundary!("ibv_wc_read_slid", { u32::from(current(cq).slid) })
}
unsafe extern "C" fn read_sl(cq: *mut ibv_cq_ex) -> u8 {
    ffi_boundary!("ibv_wc_read_sl", { current(cq).sl })
}
unsafe extern "C" fn read_dlid_path_bits(cq: *mut ibv_cq_ex) -> u8 {
    ffi_boundary!("ibv_wc_read_dlid_path_bits", { current(cq).dlid_path_bits })
}
/// The device clock when the completion reached the CQ (0 unless the CQ was created with
/// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`).
unsafe extern "C" fn read_completion_ts(cq: *mut ibv_cq_ex) -> u64 {
    ffi_boundary!("ibv_wc_read_completion_ts", { current(cq).completion_ts })
}
/// The wall clock then, ns since the epoch (0 unless created with `..._WALLCLOCK`).
unsafe extern "C" fn read_completion_wallclock_ns(cq: *mut ibv_cq_ex) -> u64 {
    ffi_boundary!("ibv_wc_read_completion_wallclock_ns", {
        current(cq).completion_wallclock_ns
    })
}
/// Fields ugdr does not produce (not offered in wc_flags): zero, as a CQ without them reads.
unsafe extern "C" fn read_zero_u16(_: *mut ibv_cq_ex) -> u16 {
    0
}
unsafe extern "C" fn read_zero_u32(_: *mut ibv_cq_ex) -> u32 {
    0
}
unsafe extern "C" fn read_tm_info(_: *mut ibv_cq_ex, info: *mut ibv_wc_tm_info) {
    if !info.is_null() {
        // SAFETY: the caller's out-parameter.
        unsafe { info.write(ibv_wc_tm_info::default()) };
    }
}

pub(crate) fn install_poll_ops(cq: &mut ibv_cq_ex) {
    cq.start_poll = Some(start_poll);
    cq.next_poll = Some(next_poll);
    cq.end_poll = Some(end_poll);
    cq.read_opcode = Some(read_opcode);
    cq.read_vendor_err = Some(read_vendor_err);
    cq.read_byte_len = Some(read_byte_len);
    cq.read_imm_data = Some(read_imm_data);
    cq.read_qp_num = Some(read_qp_num);
    cq.read_src_qp = Some(read_src_qp);
    cq.read_wc_flags = Some(read_wc_flags);
    cq.read_slid = Some(read_slid);
    cq.read_sl = Some(read_sl);
    cq.read_dlid_path_bits = Some(read_dlid_path_bits);
    cq.read_completion_ts = Some(read_completion_ts);
    cq.read_cvlan = Some(read_zero_u16);
    cq.read_flow_tag = Some(read_zero_u32);
    cq.read_tm_info = Some(read_tm_info);
    cq.read_completion_wallclock_ns = Some(read_completion_wallclock_ns);
}
