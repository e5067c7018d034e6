//! Memory windows at the C boundary: the context ops behind the inline `ibv_alloc_mw`,
//! `ibv_dealloc_mw` and `ibv_bind_mw` (type 1: posted as a BIND_MW WR with the next key,
//! `ibv_inc_rkey(mw->rkey)`, which `mw->rkey` takes at once, as rxe's provider does), the
//! window of an `IBV_WR_BIND_MW` WR (type 2), and the `ibv_wr_bind_mw`, `ibv_wr_local_inv`
//! and `ibv_wr_send_inv` builders. The rules are in `fake_verbs::mw`.

use super::boundary::{Fallback, ffi_boundary};
use super::ibv_pd_mr::our_pd;
use super::ibv_qp::{batch, new_request, our_qp};
use super::layout::{MrShell, MwShell, owned_context};
use crate::engine::Engine;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::mr::ACCESS_ZERO_BASED;
use crate::fake_verbs::mw::{BindRequest, MemoryWindow, WindowType};
use crate::fake_verbs::work::{SendOpcode, SendRequest};
use crate::sys::*;
use std::cell::UnsafeCell;
use std::os::raw::c_int;
use std::sync::Arc;

/// # Safety
/// `mw` is NULL or a valid `ibv_mw`.
unsafe fn our_mw<'a>(mw: *mut ibv_mw) -> Option<&'a MwShell> {
    if mw.is_null() {
        return None;
    }
    // SAFETY: a valid ibv_mw has a readable `context` field.
    unsafe { owned_context((*mw).context)? };
    // SAFETY: its context is ours, so it is an MwShell.
    unsafe { MwShell::from_raw(mw) }
}

/// `ibv_context_ops.alloc_mw`: an unbound window of type 1 or 2 (else EINVAL).
pub(crate) unsafe extern "C" fn alloc_mw_op(pd: *mut ibv_pd, type_: ibv_mw_type) -> *mut ibv_mw {
    ffi_boundary!("ibv_alloc_mw", {
        // SAFETY: the application's PD (or NULL).
        let Some(shell) = (unsafe { our_pd(pd) }) else {
            return <*mut ibv_mw>::fail(libc::EINVAL);
        };
        let Some(kind) = WindowType::from_raw(type_.0) else {
            return <*mut ibv_mw>::fail(libc::EINVAL);
        };
        match MemoryWindow::allocate(&shell.inner, kind) {
            Ok(window) => {
                let ibv = ibv_mw {
                    // SAFETY: reading the context field of our own PD.
                    context: unsafe { (*shell.as_raw()).context },
                    pd,
                    rkey: window.rkey(),
                    handle: window.rkey() >> 8,
                    type_,
                };
                MwShell::into_raw(Box::new(MwShell {
                    ibv: UnsafeCell::new(ibv),
                    inner: window,
                }))
            }
            Err(e) => <*mut ibv_mw>::fail(e.errno()),
        }
    })
}

/// `ibv_context_ops.dealloc_mw`: unbinds the window (if bound) and frees it.
pub(crate) unsafe extern "C" fn dealloc_mw_op(mw: *mut ibv_mw) -> c_int {
    ffi_boundary!("ibv_dealloc_mw", {
        // SAFETY: the application's window (or NULL).
        let Some(shell) = (unsafe { our_mw(mw) }) else {
            return c_int::fail(libc::EINVAL);
        };
        shell.inner.deallocate();
        // SAFETY: ours; the application gives it up here.
        unsafe { MwShell::destroy(mw) };
        0
    })
}

/// The bind request of window `mw` to `info` with key `rkey` (a BIND_MW WR, or
/// `ibv_wr_bind_mw`): type 2 windows only (a type 1 window is bound by `ibv_bind_mw`), else
/// EINVAL at post.
///
/// # Safety
/// `mw` and `info.mr` are NULL or valid objects.
pub(crate) unsafe fn posted_bind(
    mw: *mut ibv_mw,
    rkey: u32,
    info: &ibv_mw_bind_info,
) -> Result<Box<BindRequest>, VerbsError> {
    // SAFETY: forwarded contract.
    let shell = unsafe { our_mw(mw) }.ok_or(VerbsError::Invalid("not a memory window"))?;
    if shell.inner.kind != WindowType::Two {
        return Err(VerbsError::Invalid(
            "a type 1 window is bound with ibv_bind_mw",
        ));
    }
    // SAFETY: forwarded contract.
    unsafe { bind_request(shell, rkey, info) }
}

/// # Safety
/// `info.mr` is NULL or a valid `ibv_mr`.
unsafe fn bind_request(
    shell: &MwShell,
    rkey: u32,
    info: &ibv_mw_bind_info,
) -> Result<Box<BindRequest>, VerbsError> {
    let region = if info.mr.is_null() {
        None
    } else {
        // SAFETY: a valid ibv_mr has a readable `context` field.
        unsafe { owned_context((*info.mr).context) }
            .ok_or(VerbsError::Invalid("region of another device"))?;
        // SAFETY: its context is ours, so it is an MrShell.
        let mr = unsafe { MrShell::from_raw(info.mr) }.ok_or(VerbsError::Invalid("mr"))?;
        Some(Arc::clone(&mr.inner))
    };
    Ok(Box::new(BindRequest {
        window: Arc::clone(&shell.inner),
        // SAFETY: reading our own window's rkey field (the application's view of it).
        window_rkey: unsafe { (*shell.as_raw()).rkey },
        new_rkey: rkey,
        region,
        addr: info.addr,
        length: info.length,
        access: info.mw_access_flags,
    }))
}

/// `ibv_context_ops.bind_mw` (type 1; the inline `ibv_bind_mw` checked the type, a missing
/// region with a range, and the PDs): posts the bind on `qp` with the next key; zero-based
/// access is EINVAL, as in rxe's provider. The window takes the key when the WR executes;
/// `mw->rkey` takes it now (the application undoes it if the bind completes with an error).
pub(crate) unsafe extern "C" fn bind_mw_op(
    qp: *mut ibv_qp,
    mw: *mut ibv_mw,
    mw_bind: *mut ibv_mw_bind,
) -> c_int {
    ffi_boundary!("ibv_bind_mw", {
        // SAFETY: the application's QP, window and bind description (or NULL).
        let (Some(qp_shell), Some(mw_shell)) = (unsafe { our_qp(qp) }, unsafe { our_mw(mw) })
        else {
            return c_int::fail(libc::EINVAL);
        };
        if mw_bind.is_null() {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: checked non-NULL; the caller's struct.
        let b = unsafe { &*mw_bind };
        if b.bind_info.mw_access_flags & ACCESS_ZERO_BASED != 0 {
            return c_int::fail(libc::EINVAL);
        }
        // SAFETY: our window's rkey field.
        let new_rkey = ibv_inc_rkey(unsafe { (*mw).rkey });
        // SAFETY: `bind_info.mr` is NULL or the application's MR.
        let bind = match unsafe { bind_request(mw_shell, new_rkey, &b.bind_info) } {
            Ok(bind) => bind,
            Err(e) => return c_int::fail(e.errno()),
        };
        let req = SendRequest {
            signaled: b.send_flags & ibv_send_flags::IBV_SEND_SIGNALED.0 != 0,
            bind: Some(bind),
            ..SendRequest::new(b.wr_id, SendOpcode::BindMw)
        };
        let Some(engine) = Engine::running() else {
            return c_int::fail(libc::EINVAL);
        };
        let locked = engine.worker.lock();
        if let Err(e) = qp_shell.inner.post_send(&locked, req) {
            return c_int::fail(e.errno());
        }
        // SAFETY: our window; the application reads its rkey field.
        unsafe { (*mw).rkey = new_rkey };
        0
    })
}

/// verbs.h's `ibv_inc_rkey`: the next key of the low 8 bits, the index kept.
fn ibv_inc_rkey(rkey: u32) -> u32 {
    (rkey & !0xff) | (rkey.wrapping_add(1) & 0xff)
}

pub(crate) unsafe extern "C" fn wr_bind_mw(
    qp: *mut ibv_qp_ex,
    mw: *mut ibv_mw,
    rkey: u32,
    info: *const ibv_mw_bind_info,
) {
    ffi_boundary!("ibv_wr_bind_mw", {
        // SAFETY: see `batch`.
        let (_, b) = unsafe { batch(qp) };
        if info.is_null() {
            b.error.get_or_insert(libc::EINVAL);
            return;
        }
        // SAFETY: the application's window and bind description (checked non-NULL).
        match unsafe { posted_bind(mw, rkey, &*info) } {
            Ok(bind) => {
                let mut r = new_request(qp, SendOpcode::BindMw);
                r.bind = Some(bind);
                b.requests.push(r);
            }
            Err(e) => {
                b.error.get_or_insert(e.errno());
            }
        }
    })
}

/// A request carrying only a key to invalidate (LOCAL_INV, SEND_WITH_INV).
fn push_invalidation(qp: *mut ibv_qp_ex, opcode: SendOpcode, invalidate_rkey: u32) {
    // SAFETY: see `batch`.
    let (_, b) = unsafe { batch(qp) };
    let mut r = new_request(qp, opcode);
    r.rkey = invalidate_rkey;
    b.requests.push(r);
}

pub(crate) unsafe extern "C" fn wr_local_inv(qp: *mut ibv_qp_ex, invalidate_rkey: u32) {
    ffi_boundary!("ibv_wr_local_inv", {
        push_invalidation(qp, SendOpcode::LocalInv, invalidate_rkey)
    })
}

pub(crate) unsafe extern "C" fn wr_send_inv(qp: *mut ibv_qp_ex, invalidate_rkey: u32) {
    ffi_boundary!("ibv_wr_send_inv", {
        push_invalidation(qp, SendOpcode::SendWithInv, invalidate_rkey)
    })
}
