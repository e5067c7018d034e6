//! Who made the call: the application, or a library whose verbs belong to the real hardware.
//!
//! ugdr's exports are unversioned, so they interpose every caller in the application's
//! link-map namespace, including an application's own UCX (its `libuct_ib` and
//! `libuct_rdmacm` modules) and rdma-core's libraries calling each other (`librdmacm` calls
//! `ibv_get_device_list`). Those must reach the real libibverbs and librdmacm and never see
//! `ugdr0` (docs/design.md, "UCX beside real RDMA hardware").
//!
//! Only the *root* calls, which carry no object, need to know their caller:
//! `ibv_get_device_list`, `rdma_create_event_channel`, `rdma_create_id` without a channel,
//! `rdma_create_ep`, `rdma_getaddrinfo` and `rdma_get_devices`. Every later call carries an
//! object, which is ugdr's or else the real library's (pass-through by ownership). Such an
//! export is a naked trampoline ([`export_with_caller!`]): it copies its return address (the
//! instruction after the caller's `call`) into the next free argument register and jumps to
//! the Rust function, which gets it as a [`Caller`]. The trampoline touches neither the stack
//! nor any other register, so it is not inside `ffi_boundary!`; its target is.
//!
//! The caller is named by the object file `dladdr` finds at that address. Its file name is
//! compared with UCX's libraries (`libucs`, `libucp`, `libuct*`, `libucm`), rdma-core's
//! (`libibverbs`, `librdmacm`, the providers `lib*-rdmav*.so` and the direct-verbs libraries
//! `libmlx4`, `libmlx5`, `libefa`, `libhns`, `libmana`) and the prefixes a user adds in
//! `UGDR_REAL_VERBS_FOR`. A tail call (`jmp`) into a root function from such a library would be
//! attributed to that library's own caller; the libraries listed call them with `call`.

use std::ffi::{CStr, c_void};
use std::sync::LazyLock;

/// The return address of a call into an export: an address inside the calling object.
#[repr(transparent)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller(*const c_void);

/// File-name prefixes of the libraries whose root calls go to the real libraries.
const REAL_VERBS_USERS: &[&str] = &[
    "libucs",
    "libucp",
    "libuct",
    "libucm",
    "libibverbs",
    "librdmacm",
    "libmlx4",
    "libmlx5",
    "libefa",
    "libhns",
    "libmana",
];

/// The prefixes added with `UGDR_REAL_VERBS_FOR` (comma-separated file-name prefixes).
static EXTRA_USERS: LazyLock<Vec<String>> =
    LazyLock::new(|| prefixes(&std::env::var("UGDR_REAL_VERBS_FOR").unwrap_or_default()));

fn prefixes(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(str::to_owned)
        .collect()
}

/// True for a file name (no directory) whose verbs calls belong to the real libraries.
pub(crate) fn uses_real_verbs(file_name: &str) -> bool {
    REAL_VERBS_USERS.iter().any(|p| file_name.starts_with(p))
        || (file_name.contains("-rdmav") && file_name.contains(".so"))
        || EXTRA_USERS
            .iter()
            .any(|p| file_name.starts_with(p.as_str()))
}

impl Caller {
    /// A caller not known (an architecture without the trampoline): the application.
    #[allow(dead_code)]
    pub(crate) const UNKNOWN: Caller = Caller(std::ptr::null());

    /// The path of the calling object when its calls go to the real libraries (UCX, rdma-core
    /// or a `UGDR_REAL_VERBS_FOR` library); None for the application and everything else.
    pub(crate) fn real_verbs_user(self) -> Option<String> {
        if self.0.is_null() {
            return None;
        }
        // SAFETY: Dl_info is plain C data; dladdr only reads the loader's tables.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: any address may be asked about; dladdr fills `info` or returns 0.
        if unsafe { libc::dladdr(self.0, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dli_fname is the NUL-terminated name of a loaded object (the loader's copy).
        let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
        let file = path.rsplit('/').next().unwrap_or(&path);
        uses_real_verbs(file).then(|| path.into_owned())
    }
}

/// Defines the export `$name`: a trampoline that calls `$target` with the same arguments and
/// one more, its [`Caller`], placed in the next argument register (`$x86` on x86-64, `$a64` on
/// AArch64: the register of argument number `count + 1`). Elsewhere the export calls
/// `$target` with [`Caller::UNKNOWN`].
macro_rules! export_with_caller {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty
        => $target:path, caller in $x86:literal / $a64:literal) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[unsafe(no_mangle)]
        #[unsafe(naked)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // On entry the return address is on top of the stack; the tail jump leaves the
            // stack and every argument register as the caller set them.
            core::arch::naked_asm!(
                concat!("mov ", $x86, ", qword ptr [rsp]"),
                "jmp {target}",
                target = sym $target,
            )
        }
        $(#[$doc])*
        #[cfg(target_arch = "aarch64")]
        #[unsafe(no_mangle)]
        #[unsafe(naked)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // On entry the return address is in the link register, x30.
            core::arch::naked_asm!(
                concat!("mov ", $a64, ", x30"),
                "b {target}",
                target = sym $target,
            )
        }
        $(#[$doc])*
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> $ret {
            // SAFETY: the same arguments, passed on.
            unsafe { $target($($arg,)* $crate::capi::caller::Caller::UNKNOWN) }
        }
    };
}
pub(crate) use export_with_caller;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ucx_and_rdma_core_libraries_use_the_real_verbs() {
        for f in [
            "libuct_ib.so.0",
            "libuct_rdmacm.so.0",
            "libucs.so.0",
            "libucp.so.0",
            "librdmacm.so.1",
            "libibverbs.so.1",
            "libmlx5-rdmav34.so",
            "libmlx5.so.1",
        ] {
            assert!(uses_real_verbs(f), "{f}");
        }
        for f in [
            "ib_send_lat",
            "rping",
            "libspdk_rdma.so",
            "libugdr.so",
            "libc.so.6",
        ] {
            assert!(!uses_real_verbs(f), "{f}");
        }
    }

    #[test]
    fn ugdr_real_verbs_for_is_a_comma_separated_list_of_prefixes() {
        assert_eq!(
            prefixes(" libfabric, libverbs-fi ,,"),
            ["libfabric", "libverbs-fi"]
        );
        assert!(prefixes("").is_empty());
    }

    #[test]
    fn an_address_in_the_test_binary_is_the_application() {
        let here = an_address_in_the_test_binary_is_the_application as *const c_void;
        assert!(Caller(here).real_verbs_user().is_none());
        assert!(Caller::UNKNOWN.real_verbs_user().is_none());
    }

    #[test]
    fn an_address_in_libibverbs_is_named_by_its_file() {
        // SAFETY: loading rdma-core's libibverbs (no constructor side effects) and looking up
        // one of its pure helpers, which is never called.
        let addr = unsafe {
            let handle = libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_LAZY);
            assert!(!handle.is_null(), "libibverbs.so.1 is installed");
            libc::dlsym(handle, c"ibv_wc_status_str".as_ptr())
        };
        assert!(!addr.is_null());
        let inside = Caller((addr as *const u8).wrapping_add(4).cast());
        let path = inside
            .real_verbs_user()
            .expect("libibverbs uses the real verbs");
        assert!(path.ends_with("libibverbs.so.1"), "{path}");
        // libc is named too, and is not on the list.
        assert!(
            Caller(libc::getpid as *const c_void)
                .real_verbs_user()
                .is_none()
        );
    }
}
