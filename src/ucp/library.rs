//! Loading libucp on demand, in a link-map namespace of its own.
//!
//! ugdr is preloaded into every process a user starts (`LD_PRELOAD` is inherited by shells and
//! children), so it must not load UCX until a verbs call needs it: linking libucp would run
//! libucs's constructor, and its signal handlers, in every one of them.
//!
//! ugdr's UCX is loaded with `dlmopen(LM_ID_NEWLM)`: a namespace the preload does not reach,
//! with its own copies of libucp, libucs, UCX's modules and their libibverbs, librdmacm and
//! libc. There UCX's InfiniBand and rdmacm modules bind to the real libibverbs, never to
//! ugdr's exports, so they may be loaded (`UGDR_UCX_RDMA=auto`, the default) and ugdr runs
//! over a real NIC where one exists; its global options (`MODULES`) are its own, not those of
//! an application's own UCX. Where no namespace can be had (glibc has 16, and the static TLS
//! reserve holds about 11 libc copies), ugdr falls back to the application's namespace,
//! where ugdr's exports send the calls of UCX's modules to the real libraries by their caller
//! (docs/design.md, "UCX beside real RDMA hardware").

use super::Error;
use crate::sys;
use std::ffi::{CStr, c_void};
use std::sync::OnceLock;

/// The UCX entry points, resolved from `libucp.so.0` once per process.
pub struct Ucx {
    pub(crate) api: sys::UcxLibrary,
    /// The `dlmopen`/`dlopen` handle of libucp (kept open by `api`).
    handle: usize,
    namespace: Namespace,
    rdma: Rdma,
    /// The signal handlers UCX installed as it loaded: (signal, handler address).
    signal_handlers: Vec<(i32, usize)>,
}

/// Where ugdr's UCX lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Namespace {
    /// Its own link-map namespace (this `Lmid_t`).
    Own(i64),
    /// The application's: `dlmopen` failed with this error.
    Shared(String),
}

/// `UGDR_UCX_RDMA`: whether ugdr's UCX loads its InfiniBand and rdmacm modules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rdma {
    /// Loaded (the default): UCX uses the RDMA devices the real libibverbs finds, if any.
    Auto,
    /// Not loaded (UCX's `MODULES=^ib,rdmacm`).
    Off,
}

static UCX: OnceLock<Result<Ucx, Error>> = OnceLock::new();

/// UCX's module list without the modules that use RDMA devices.
const UCX_MODULES_WITHOUT_RDMA: &CStr = c"^ib,rdmacm";
/// The size of a shared-memory FIFO element (see [`Ucx::context_options`]).
const SHARED_MEMORY_FIFO_ELEMENT: &CStr = c"256";
const SHARED_MEMORY_FIFO_ELEMENT_BYTES: usize = 256;
/// UCX's default number of elements in a shared-memory FIFO (`UCX_MM_FIFO_SIZE`).
const SHARED_MEMORY_FIFO_SLOTS: u64 = 64;
/// IOV entries a TCP send takes in one piece (see [`Ucx::context_options`]): UCP's own
/// limit (`UCP_MAX_IOV`), one entry of which its AM header takes.
const TCP_SEND_IOV_MAX: &CStr = c"16";
const LIBUCP: &CStr = c"libucp.so.0";
const LIBIBVERBS: &CStr = c"libibverbs.so.1";

impl Rdma {
    fn from_env() -> Rdma {
        match std::env::var("UGDR_UCX_RDMA").as_deref() {
            Ok("off") => Rdma::Off,
            Ok("auto") | Err(_) => Rdma::Auto,
            Ok(other) => {
                tracing::warn!("UGDR_UCX_RDMA={other}: expected auto or off; using auto");
                Rdma::Auto
            }
        }
    }
}

/// Makes the application's libc treat the process as multi-threaded before UCX, loaded in a
/// namespace of its own, starts threads through *its* libc (its async thread, at worker
/// creation), which the application's libc never hears of. Called first thing in every
/// [`super::Context::new`] (which loads UCX the first time).
///
/// Why it matters: glibc's `malloc` skips its locks while `__libc_single_threaded` is set, and
/// each libc copy keeps its own flag, cleared only by its own `pthread_create`. The dynamic
/// linker allocates a thread's TLS blocks of dynamically loaded libraries with the *main*
/// namespace's `malloc` — and UCX's async thread allocates libucs's TLS at once
/// (`ucs_log_set_thread_name`). In an application that had not started a thread itself (most
/// verbs programs), that thread and the application's own thread then ran the main `malloc`
/// at the same time without locks, and the heap was sometimes corrupted ("malloc(): mismatching
/// next->prev_size", "corrupted double-linked list"), seen at engine start under load.
///
/// A thread started and joined through the application's libc clears the flag for good (it is
/// set again only in the child of a `fork`, hence the call before every context). Where UCX
/// shares the application's namespace the thread is not needed, and costs as little.
pub(crate) fn mark_process_multithreaded() {
    match std::thread::Builder::new()
        .name("ugdr-start".into())
        .spawn(|| {})
    {
        Ok(thread) => {
            let _ = thread.join();
        }
        Err(e) => tracing::warn!("cannot start a thread before UCX starts its own: {e}"),
    }
}

/// Loads libucp into a new link-map namespace; Err(reason) when the loader refuses.
fn load_in_own_namespace() -> Result<(sys::UcxLibrary, usize, i64), String> {
    // SAFETY: loading libucp runs its constructors (libucs's ucs_init) in the new namespace,
    // which is what any UCX user does; the library is kept loaded for the life of the process.
    let handle = unsafe {
        libc::dlmopen(
            libc::LM_ID_NEWLM,
            LIBUCP.as_ptr(),
            libc::RTLD_NOW | libc::RTLD_LOCAL,
        )
    };
    if handle.is_null() {
        return Err(dl_error());
    }
    let mut lmid: libc::Lmid_t = 0;
    // SAFETY: a live handle; RTLD_DI_LMID writes one Lmid_t.
    unsafe { libc::dlinfo(handle, libc::RTLD_DI_LMID, (&raw mut lmid).cast()) };
    // SAFETY: a handle from dlmopen, handed to libloading, which closes it only on drop.
    let lib = unsafe { libloading::os::unix::Library::from_raw(handle) };
    // SAFETY: the symbols are UCX's functions with bindgen's signatures from ucp.h.
    let api = unsafe { sys::UcxLibrary::from_library(lib) }.map_err(|e| e.to_string())?;
    Ok((api, handle as usize, lmid))
}

/// The loader's last error text.
fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        return "unknown dlopen error".into();
    }
    // SAFETY: as above.
    unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
}

/// Every signal with a handler now: (signal, handler address).
fn signal_handlers() -> Vec<(i32, usize)> {
    (1..=libc::SIGRTMAX())
        .filter_map(|sig| sys::process::signal_action(sig).map(|(handler, _)| (sig, handler)))
        .collect()
}

impl Ucx {
    /// Loads libucp (once) and sets its module list.
    pub fn get() -> Result<&'static Ucx, Error> {
        UCX.get_or_init(Ucx::load).as_ref().map_err(Clone::clone)
    }

    fn load() -> Result<Ucx, Error> {
        let rdma = Rdma::from_env();
        let handlers_before = signal_handlers();
        let (api, handle, namespace) = match load_in_own_namespace() {
            Ok((api, handle, lmid)) => (api, handle, Namespace::Own(lmid)),
            Err(reason) => {
                tracing::warn!(
                    "ucx: no link-map namespace of its own ({reason}); UCX shares the \
                     application's, its modules' verbs calls reach the real libraries by caller"
                );
                // SAFETY: as in load_in_own_namespace, in the application's namespace.
                let lib = unsafe { libloading::os::unix::Library::new("libucp.so.0") }
                    .map_err(|e| Error::Load(e.to_string()))?;
                let handle = lib.into_raw();
                // SAFETY: the handle just opened, handed back to libloading.
                let lib = unsafe { libloading::os::unix::Library::from_raw(handle) };
                // SAFETY: as in load_in_own_namespace.
                let api = unsafe { sys::UcxLibrary::from_library(lib) }
                    .map_err(|e| Error::Load(e.to_string()))?;
                (api, handle as usize, Namespace::Shared(reason))
            }
        };
        if rdma == Rdma::Off {
            // SAFETY: both strings are NUL-terminated and outlive the call; UCX copies the value.
            let status = unsafe {
                api.ucs_global_opts_set_value(
                    c"MODULES".as_ptr(),
                    UCX_MODULES_WITHOUT_RDMA.as_ptr(),
                )
            };
            if status != sys::ucs_status_t::UCS_OK {
                tracing::warn!("ucx: cannot set MODULES=^ib,rdmacm (status {})", status.0);
            }
        }
        let signal_handlers: Vec<(i32, usize)> = signal_handlers()
            .into_iter()
            .filter(|h| !handlers_before.contains(h))
            .collect();
        tracing::debug!(
            "ucx: loaded in namespace {namespace:?}, rdma modules {rdma:?}, signal handlers \
             installed {:?}",
            signal_handlers
                .iter()
                .map(|(sig, _)| sig)
                .collect::<Vec<_>>()
        );
        Ok(Ucx {
            api,
            handle,
            namespace,
            rdma,
            signal_handlers,
        })
    }

    /// Whether the handler of `signal` now is one UCX installed as it loaded (its debug
    /// signal, SIGHUP, and its backtrace on faults), not one of the application's.
    pub fn installed_handler(&self, signal: i32, handler: usize) -> bool {
        self.signal_handlers.contains(&(signal, handler))
    }

    pub fn namespace(&self) -> &Namespace {
        &self.namespace
    }

    pub fn rdma(&self) -> Rdma {
        self.rdma
    }

    /// UCX options ugdr sets in every context's configuration, unless the user set them
    /// (`UCX_<name>`).
    ///
    /// * Shared-memory FIFO elements of 256 bytes instead of 128: a ugdr message is its
    ///   52-byte header (with the authentication trailer) and the payload, so with 128-byte
    ///   elements only payloads up to ~56 bytes went inline; every 64-byte SEND took UCX's
    ///   buffer-copy path instead of its short one (callgrind, one 64-byte SEND over posix:
    ///   ~6,000 instructions with 128-byte elements, ~5,000 with 256). Every ugdr process sets
    ///   the same (a sender writes into its peer's FIFO at its own element size); not set
    ///   when the user sized the elements (`UCX_{MM,POSIX,SYSV}_FIFO_ELEM_SIZE`) or left
    ///   shared memory out of `UCX_TLS` (UCX would warn about an unused option).
    /// * In a namespace of its own, UCX's memory hooks see only that namespace's
    ///   `mmap`/`munmap`, not the application's, so a registration cache could keep serving a
    ///   registration of pages the application has since unmapped (or ugdr has remapped for the
    ///   same-host path): where UCX has RDMA devices, application memory is registered per use.
    ///   (Without devices this is not set: UCX warns about an option no component reads.)
    /// * TCP sends of up to 16 IOV entries in one piece instead of 6 (`UCX_TCP_MAX_IOV`): a
    ///   [`Spliced`](super::Spliced) payload is a gather list of owned bytes and up to
    ///   `SPLICED_SPANS_MAX` application spans, and a message whose list UCX's limit cuts
    ///   goes in fragments that the receiver copies back together. UCX
    ///   matches a transport's option by its name without the transport's prefix, so this
    ///   is `MAX_IOV`, which the cross-memory-attach transport reads too (its default is 16
    ///   already). Not set where `UCX_TLS` leaves TCP out, or where the user set
    ///   `UCX_TCP_MAX_IOV` or `UCX_CMA_MAX_IOV`.
    pub(crate) fn context_options(&self) -> Vec<(&'static CStr, &'static CStr)> {
        let mut options = Vec::new();
        let tls = std::env::var("UCX_TLS").ok();
        if shared_memory_transports_wanted(tls.as_deref())
            && !fifo_option_set_by_user("FIFO_ELEM_SIZE")
        {
            options.push((c"MM_FIFO_ELEM_SIZE", SHARED_MEMORY_FIFO_ELEMENT));
        }
        if tcp_wanted(tls.as_deref())
            && ["TCP", "CMA"]
                .iter()
                .all(|tl| std::env::var_os(format!("UCX_{tl}_MAX_IOV")).is_none())
        {
            options.push((c"MAX_IOV", TCP_SEND_IOV_MAX));
        }
        if matches!(self.namespace, Namespace::Own(_))
            && self.rdma != Rdma::Off
            && self.devices(true).is_some_and(|d| !d.is_empty())
        {
            options.extend([(c"IB_REG_METHODS", c"direct"), (c"RCACHE_ENABLE", c"n")]);
        }
        options.retain(|(name, _)| {
            std::env::var_os(format!("UCX_{}", name.to_string_lossy())).is_none()
        });
        options
    }

    /// The files loaded in UCX's namespace (its own: all of UCX and what it pulled in; the
    /// application's: everything there), in load order.
    pub fn namespace_objects(&self) -> Vec<String> {
        // SAFETY: libucp's handle, kept open by `api`; UCX never unloads a module.
        unsafe { sys::dl::namespace_objects(self.handle as *mut c_void) }
    }

    /// The names of the RDMA devices that the libibverbs UCX's InfiniBand module uses lists;
    /// None when that module did not load libibverbs (`UGDR_UCX_RDMA=off`).
    pub fn rdma_devices(&self) -> Option<Vec<String>> {
        self.devices(false)
    }

    /// The devices the libibverbs of UCX's namespace lists, loading it there first when `load`.
    fn devices(&self, load: bool) -> Option<Vec<String>> {
        let mode = libc::RTLD_LAZY | if load { 0 } else { libc::RTLD_NOLOAD };
        // SAFETY: opens (or only looks up) libibverbs in UCX's namespace.
        let handle = unsafe {
            match self.namespace {
                Namespace::Own(lmid) => libc::dlmopen(lmid, LIBIBVERBS.as_ptr(), mode),
                Namespace::Shared(_) => libc::dlopen(LIBIBVERBS.as_ptr(), mode),
            }
        };
        if handle.is_null() {
            return None;
        }
        let names = list_devices(handle);
        if !load {
            // SAFETY: the reference taken above. (One that loaded the library stays: UCX's
            // ib module loads it next.)
            unsafe { libc::dlclose(handle) };
        }
        names
    }
}

/// `ibv_get_device_list` of the libibverbs behind `handle`: the devices' names.
fn list_devices(handle: *mut c_void) -> Option<Vec<String>> {
    type GetList = unsafe extern "C" fn(*mut i32) -> *mut *mut c_void;
    type FreeList = unsafe extern "C" fn(*mut *mut c_void);
    type Name = unsafe extern "C" fn(*mut c_void) -> *const std::ffi::c_char;
    let sym = |name: &CStr| {
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlvsym(handle, name.as_ptr(), c"IBVERBS_1.1".as_ptr()) };
        (!p.is_null()).then_some(p)
    };
    let (get, free, name) = (
        sym(c"ibv_get_device_list")?,
        sym(c"ibv_free_device_list")?,
        sym(c"ibv_get_device_name")?,
    );
    // SAFETY: libibverbs' functions of these names at IBVERBS_1.1 have these signatures.
    let (get, free, name) = unsafe {
        (
            std::mem::transmute::<*mut c_void, GetList>(get),
            std::mem::transmute::<*mut c_void, FreeList>(free),
            std::mem::transmute::<*mut c_void, Name>(name),
        )
    };
    let mut n = 0;
    // SAFETY: the real function with a valid out-parameter.
    let list = unsafe { get(&mut n) };
    if list.is_null() {
        return Some(Vec::new());
    }
    let names = (0..usize::try_from(n).unwrap_or(0))
        .filter_map(|i| {
            // SAFETY: the list holds `n` devices; each name is a NUL-terminated string.
            let p = unsafe { name(*list.add(i)) };
            // SAFETY: as above.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        })
        .collect();
    // SAFETY: the list this library returned.
    unsafe { free(list) };
    Some(names)
}

/// UCX's version string, e.g. "1.13.1".
pub fn ucx_version() -> Result<String, Error> {
    let lib = Ucx::get()?;
    // SAFETY: returns a static NUL-terminated string.
    let p = unsafe { lib.api.ucp_get_version_string() };
    if p.is_null() {
        return Ok(String::new());
    }
    // SAFETY: non-NULL static NUL-terminated string per UCX's contract.
    Ok(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Whether `UCX_TLS` (`tls`, if set) may select TCP.
fn tcp_wanted(tls: Option<&str>) -> bool {
    let Some(tls) = tls else {
        return true;
    };
    let named = |list: &str| list.split(',').any(|t| t.trim() == "tcp");
    match tls.strip_prefix('^') {
        Some(excluded) => !named(excluded),
        None => named(tls) || tls.split(',').any(|t| t.trim() == "all"),
    }
}

/// Whether `UCX_TLS` (`tls`, if set) may select a shared-memory transport.
fn shared_memory_transports_wanted(tls: Option<&str>) -> bool {
    let Some(tls) = tls else {
        return true;
    };
    tls.starts_with('^')
        || tls
            .split(',')
            .any(|t| matches!(t.trim(), "all" | "sm" | "shm" | "posix" | "sysv" | "mm"))
}

/// The shape of the shared-memory FIFOs this process's UCX makes: the element size ugdr sets
/// and UCX's default of 64 elements. None where the user sized either, or left shared memory
/// out of `UCX_TLS`.
pub(crate) fn shared_memory_fifo_geometry() -> Option<super::fifo::Geometry> {
    let tls = std::env::var("UCX_TLS").ok();
    (shared_memory_transports_wanted(tls.as_deref())
        && !fifo_option_set_by_user("FIFO_SIZE")
        && !fifo_option_set_by_user("FIFO_ELEM_SIZE"))
    .then_some(super::fifo::Geometry {
        slots: SHARED_MEMORY_FIFO_SLOTS,
        slot_size: SHARED_MEMORY_FIFO_ELEMENT_BYTES,
    })
}

/// Whether the user set the shared-memory FIFO option `option` (`FIFO_SIZE`,
/// `FIFO_ELEM_SIZE`) for any of UCX's shared-memory transports.
fn fifo_option_set_by_user(option: &str) -> bool {
    ["MM", "POSIX", "SYSV"]
        .iter()
        .any(|tl| std::env::var_os(format!("UCX_{tl}_{option}")).is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fifo_element_size_set_is_the_one_watched() {
        assert_eq!(
            SHARED_MEMORY_FIFO_ELEMENT
                .to_str()
                .unwrap()
                .parse::<usize>()
                .unwrap(),
            SHARED_MEMORY_FIFO_ELEMENT_BYTES
        );
    }

    #[test]
    fn tcp_iov_is_set_only_where_tcp_may_be_used() {
        for tls in [
            None,
            Some("all"),
            Some("tcp"),
            Some("sm, tcp"),
            Some("^posix"),
        ] {
            assert!(tcp_wanted(tls), "{tls:?}");
        }
        for tls in [
            Some("sm"),
            Some("^tcp"),
            Some("^sm,tcp"),
            Some("rc,ud"),
            Some(""),
        ] {
            assert!(!tcp_wanted(tls), "{tls:?}");
        }
        assert_eq!(
            TCP_SEND_IOV_MAX.to_str().unwrap().parse::<usize>().unwrap(),
            2 * crate::ucp::SPLICED_SPANS_MAX + 2,
            "a bundle's gather list and UCX's header fit in one TCP send"
        );
    }

    #[test]
    fn fifo_elements_are_sized_only_where_shared_memory_may_be_used() {
        for tls in [
            None,
            Some("all"),
            Some("sm,self"),
            Some("tcp, posix"),
            Some("^tcp"),
        ] {
            assert!(shared_memory_transports_wanted(tls), "{tls:?}");
        }
        for tls in [Some("tcp"), Some("tcp,self"), Some("rc,ud"), Some("")] {
            assert!(!shared_memory_transports_wanted(tls), "{tls:?}");
        }
    }
}
