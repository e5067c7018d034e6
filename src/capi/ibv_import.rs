//! Sharing a context's objects through its command fd (`ibv_import_device`, `ibv_import_pd`,
//! `ibv_import_mr`, `ibv_import_dm`, `ibv_unimport_*`), within the process.
//!
//! On a kernel device the command fd is the uverbs file; a `dup` of it passed to
//! `ibv_import_device` opens a second context on the same file, whose objects the new context
//! reaches by their kernel handles. ugdr's device is in the process, so its command fd is a
//! memfd of its own per opened device (named [`CMD_NAME`], identified by its inode): importing a
//! duplicate of it gives a new context on the same [`DeviceContext`], where the PDs, MRs and
//! DMs of the first are found by their `handle`. An imported object is a new C struct over
//! the same object: destroying it through any of its structs (`ibv_dealloc_pd`,
//! `ibv_dereg_mr`, `ibv_free_dm`) destroys the object, its handle goes and a second destroy
//! is EINVAL; `ibv_unimport_*` frees one struct and nothing else, as rdma-core's.
//!
//! Objects live in the process that made them: another process's ugdr command fd (passed
//! by SCM_RIGHTS) cannot be imported (EOPNOTSUPP). A real device's command fd goes to the
//! real library, as before.

use super::boundary::{Fallback, ffi_boundary};
use super::ibv_device::device;
use super::ibv_dm::dm_shell;
use super::ibv_pd_mr::{mr_shell, our_pd};
use super::layout::{ContextShell, DmShell, MrShell, PdShell, owned_context};
use super::ops;
use super::passthrough::real_functions;
use crate::fake_verbs::VerbsError;
use crate::fake_verbs::context::DeviceContext;
use crate::fake_verbs::dm::DeviceMemory;
use crate::fake_verbs::mr::MemoryRegion;
use crate::fake_verbs::pd::ProtectionDomain;
use crate::sys::*;
use dashmap::DashMap;
use rustc_hash::FxBuildHasher;
use std::cell::UnsafeCell;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::raw::c_int;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, LazyLock, Weak};

/// The real library's functions of the same names.
mod real {
    use super::*;

    real_functions! {
    ibv_import_device @ "IBVERBS_1.10": fn(c_int) -> *mut ibv_context;
    ibv_import_pd @ "IBVERBS_1.10": fn(*mut ibv_context, u32) -> *mut ibv_pd;
    ibv_unimport_pd @ "IBVERBS_1.10": fn(*mut ibv_pd) -> ();
    ibv_import_mr @ "IBVERBS_1.10": fn(*mut ibv_pd, u32) -> *mut ibv_mr;
    ibv_unimport_mr @ "IBVERBS_1.10": fn(*mut ibv_mr) -> ();
    ibv_import_dm @ "IBVERBS_1.13": fn(*mut ibv_context, u32) -> *mut ibv_dm;
    ibv_unimport_dm @ "IBVERBS_1.13": fn(*mut ibv_dm) -> ();
    }
}

/// The memfd name of a ugdr command fd (`/proc/self/fd/N` shows `/memfd:ugdr-cmd`).
const CMD_NAME: &str = "ugdr-cmd";

/// The command files of the process's contexts, by (device, inode): the context they open,
/// and a descriptor of the file, so its inode is not reused while the entry stands.
struct CommandFile {
    context: Weak<DeviceContext>,
    _keep: OwnedFd,
}

static FILES: LazyLock<DashMap<(u64, u64), CommandFile, FxBuildHasher>> =
    LazyLock::new(DashMap::default);

fn identity(fd: c_int) -> Option<(u64, u64, u32)> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes one `stat` into our buffer; any descriptor value is acceptable.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: written by the successful fstat.
    let st = unsafe { st.assume_init() };
    Some((st.st_dev, st.st_ino, st.st_mode))
}

/// A new command file for `context` (close-on-exec, as rdma-core opens uverbs files).
pub(crate) fn command_file(context: &Arc<DeviceContext>) -> Result<OwnedFd, VerbsError> {
    let name = std::ffi::CString::new(CMD_NAME).expect("no NUL");
    // SAFETY: a NUL-terminated name and flags; the result is a new descriptor or -1.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    // SAFETY: a descriptor memfd_create just made, owned by nobody else.
    let file = unsafe { OwnedFd::from_raw_fd(fd) };
    let keep = file.try_clone()?;
    let (dev, ino, _) = identity(file.as_raw_fd()).ok_or(VerbsError::Invalid("memfd fstat"))?;
    FILES.retain(|_, f| f.context.strong_count() > 0);
    FILES.insert(
        (dev, ino),
        CommandFile {
            context: Arc::downgrade(context),
            _keep: keep,
        },
    );
    Ok(file)
}

/// Whether `fd` names a ugdr command file (of any process).
fn is_ugdr_command_file(fd: c_int) -> bool {
    std::fs::read_link(format!("/proc/self/fd/{fd}")).is_ok_and(|p| {
        p.to_string_lossy()
            .starts_with(&format!("/memfd:{CMD_NAME}"))
    })
}

/// A ugdr context over `inner` whose command fd is `cmd_file`.
pub(crate) fn context_shell(inner: Arc<DeviceContext>, cmd_file: OwnedFd) -> *mut ibv_context {
    let mut vctx = verbs_context::default();
    ops::install_context_ops(&mut vctx);
    vctx.context.device = device().as_raw();
    vctx.context.cmd_fd = cmd_file.as_raw_fd();
    vctx.context.async_fd = inner.async_events.fd();
    vctx.context.num_comp_vectors = 1;
    ContextShell::into_raw(Box::new(ContextShell {
        vctx: UnsafeCell::new(vctx),
        inner,
        cmd_file,
    }))
}

/// `ibv_import_device`: a duplicate of one of this process's ugdr command fds opens a new
/// context on the same device context (it owns `cmd_fd` from then on and closes it in
/// `ibv_close_device`). Another process's ugdr command fd: EOPNOTSUPP. Otherwise rdma-core's
/// first check (a character device, else EINVAL), then the real library, whose own
/// `ibv_get_device_list` call gets the real list.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_import_device(cmd_fd: c_int) -> *mut ibv_context {
    ffi_boundary!("ibv_import_device", {
        let Some((dev, ino, mode)) = identity(cmd_fd) else {
            return <*mut ibv_context>::fail(libc::EINVAL);
        };
        let ours = FILES.get(&(dev, ino)).and_then(|f| f.context.upgrade());
        if let Some(inner) = ours {
            // SAFETY: the caller hands its descriptor over (rdma-core closes it with the
            // context); checked open by fstat above.
            let file = unsafe { OwnedFd::from_raw_fd(cmd_fd) };
            return context_shell(inner, file);
        }
        if is_ugdr_command_file(cmd_fd) {
            tracing::debug!("ibv_import_device: another process's ugdr context");
            return <*mut ibv_context>::fail(libc::EOPNOTSUPP);
        }
        if mode & libc::S_IFMT != libc::S_IFCHR {
            return <*mut ibv_context>::fail(libc::EINVAL);
        }
        match real::ibv_import_device() {
            // SAFETY: the real function with the caller's descriptor.
            Some(real) => unsafe { real(cmd_fd) },
            None => <*mut ibv_context>::fail(libc::ENODEV),
        }
    })
}

// ------------------------------------------------------------------ handles

/// An object a handle names.
#[derive(Clone)]
enum Shared {
    Pd(Arc<ProtectionDomain>),
    Mr(Arc<MemoryRegion>),
    Dm(Arc<DeviceMemory>),
}

/// Live PDs, MRs and DMs by handle (one numbering, as a uverbs file's): an object is in the
/// table from its creation until it is destroyed.
static HANDLES: LazyLock<DashMap<u32, Shared, FxBuildHasher>> = LazyLock::new(DashMap::default);
static NEXT_HANDLE: AtomicU32 = AtomicU32::new(1);

fn publish(object: Shared) -> u32 {
    loop {
        let h = NEXT_HANDLE.fetch_add(1, Ordering::Relaxed);
        if h == 0 {
            continue;
        }
        if let dashmap::Entry::Vacant(v) = HANDLES.entry(h) {
            v.insert(object);
            return h;
        }
    }
}

pub(crate) fn publish_pd(pd: &Arc<ProtectionDomain>) -> u32 {
    publish(Shared::Pd(Arc::clone(pd)))
}

pub(crate) fn publish_mr(mr: &Arc<MemoryRegion>) -> u32 {
    publish(Shared::Mr(Arc::clone(mr)))
}

pub(crate) fn publish_dm(dm: &Arc<DeviceMemory>) -> u32 {
    publish(Shared::Dm(Arc::clone(dm)))
}

/// Whether `handle` still names a live object (not destroyed through another struct of it).
pub(crate) fn is_live(handle: u32) -> bool {
    HANDLES.contains_key(&handle)
}

/// The object was destroyed: its handle goes.
pub(crate) fn retire(handle: u32) {
    HANDLES.remove(&handle);
}

fn lookup(handle: u32) -> Option<Shared> {
    HANDLES.get(&handle).map(|e| e.value().clone())
}

/// `ibv_import_pd`: a new `ibv_pd` of `context` for the PD `pd_handle` names in the same
/// device context (ENOENT if none).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_import_pd(context: *mut ibv_context, pd_handle: u32) -> *mut ibv_pd {
    ffi_boundary!("ibv_import_pd", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(context) }) else {
            return match real::ibv_import_pd() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !context.is_null() => unsafe { real(context, pd_handle) },
                _ => <*mut ibv_pd>::fail(libc::EINVAL),
            };
        };
        let Some(Shared::Pd(pd)) = lookup(pd_handle) else {
            return <*mut ibv_pd>::fail(libc::ENOENT);
        };
        if !Arc::ptr_eq(&pd.context, &shell.inner) {
            return <*mut ibv_pd>::fail(libc::ENOENT);
        }
        PdShell::into_raw(Box::new(PdShell {
            ibv: UnsafeCell::new(ibv_pd {
                context,
                handle: pd_handle,
            }),
            inner: pd,
            parent: None,
        }))
    })
}

/// `ibv_import_mr`: a new `ibv_mr` of `pd` for the MR `mr_handle` names, which must belong
/// to that PD now (ENOENT otherwise). Its `addr` is NULL, as rdma-core's.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_import_mr(pd: *mut ibv_pd, mr_handle: u32) -> *mut ibv_mr {
    ffi_boundary!("ibv_import_mr", {
        if pd.is_null() {
            return <*mut ibv_mr>::fail(libc::EINVAL);
        }
        // SAFETY: a valid ibv_pd (ugdr's or the real library's) has a readable context.
        let Some(pd_shell) = (unsafe { our_pd(pd) }) else {
            return match real::ibv_import_mr() {
                // SAFETY: not ours, so the real library's PD.
                Some(real) => unsafe { real(pd, mr_handle) },
                None => <*mut ibv_mr>::fail(libc::EINVAL),
            };
        };
        let Some(Shared::Mr(mr)) = lookup(mr_handle) else {
            return <*mut ibv_mr>::fail(libc::ENOENT);
        };
        let reg = mr.registration();
        if !Arc::ptr_eq(&reg.pd, &pd_shell.inner) {
            return <*mut ibv_mr>::fail(libc::ENOENT);
        }
        let length = usize::try_from(reg.region.len()).unwrap_or(usize::MAX);
        drop(reg);
        mr_shell(pd, pd_shell, mr, std::ptr::null_mut(), length, mr_handle)
    })
}

/// `ibv_import_dm`: a new `ibv_dm` of `context` for the DM `dm_handle` names (ENOENT if none
/// in that device context).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ibv_import_dm(context: *mut ibv_context, dm_handle: u32) -> *mut ibv_dm {
    ffi_boundary!("ibv_import_dm", {
        // SAFETY: from_raw checks ownership before dereferencing.
        let Some(shell) = (unsafe { ContextShell::from_raw(context) }) else {
            return match real::ibv_import_dm() {
                // SAFETY: not ours, so the real library's context.
                Some(real) if !context.is_null() => unsafe { real(context, dm_handle) },
                _ => <*mut ibv_dm>::fail(libc::EINVAL),
            };
        };
        match lookup(dm_handle) {
            Some(Shared::Dm(dm)) if Arc::ptr_eq(&dm.context, &shell.inner) => {
                dm_shell(context, dm, dm_handle)
            }
            _ => <*mut ibv_dm>::fail(libc::ENOENT),
        }
    })
}

/// Defines `ibv_unimport_*`: a ugdr struct is freed and its object stays (destroyed only
/// through a struct with the destroy verb); another library's goes to the real function.
macro_rules! unimport {
    ($(#[$doc:meta])* $name:ident($arg:ident: *mut $c:ty), $shell:ty) => {
        $(#[$doc])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($arg: *mut $c) {
            ffi_boundary!(stringify!($name), {
                if $arg.is_null() {
                    return;
                }
                // SAFETY: a valid object (ugdr's or the real library's) has a readable
                // context field; owned_context compares it against ugdr's registry.
                if unsafe { owned_context((*$arg).context) }.is_none() {
                    if let Some(real) = real::$name() {
                        // SAFETY: not ours, so the real library's.
                        unsafe { real($arg) };
                    }
                    return;
                }
                // SAFETY: ours, and the application gives this struct up here.
                unsafe { <$shell>::destroy($arg) };
            })
        }
    };
}

unimport!(ibv_unimport_pd(pd: *mut ibv_pd), PdShell);
unimport!(ibv_unimport_mr(mr: *mut ibv_mr), MrShell);
unimport!(ibv_unimport_dm(dm: *mut ibv_dm), DmShell);
