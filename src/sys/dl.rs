//! The dynamic loader's view of a loaded object: glibc's `struct link_map` head (<link.h>),
//! which bindgen does not generate, and the two questions ugdr asks of it.

use std::ffi::{CStr, c_char, c_void};

/// The public head of glibc's `struct link_map`.
#[repr(C)]
struct LinkMap {
    l_addr: usize,
    l_name: *const c_char,
    l_ld: *mut c_void,
    l_next: *mut LinkMap,
    l_prev: *mut LinkMap,
}

/// The link map of `handle` (from `dlopen`/`dlmopen`), or NULL.
///
/// # Safety
/// `handle` is a live handle.
unsafe fn link_map(handle: *mut c_void) -> *const LinkMap {
    let mut map: *mut LinkMap = std::ptr::null_mut();
    // SAFETY: RTLD_DI_LINKMAP writes the handle's `struct link_map *` into `map`.
    if unsafe { libc::dlinfo(handle, libc::RTLD_DI_LINKMAP, (&raw mut map).cast()) } != 0 {
        return std::ptr::null();
    }
    map
}

/// # Safety
/// `map` is NULL or a link map of a loaded object.
unsafe fn name_of(map: *const LinkMap) -> Option<String> {
    // SAFETY: the caller's contract; l_name is NULL or a NUL-terminated path.
    let name = unsafe { map.as_ref()?.l_name };
    // SAFETY: as above.
    (!name.is_null()).then(|| {
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    })
}

/// The file `handle`'s object was loaded from.
///
/// # Safety
/// `handle` is a live handle.
pub unsafe fn object_path(handle: *mut c_void) -> Option<String> {
    // SAFETY: the caller's contract.
    unsafe { name_of(link_map(handle)) }
}

/// Every object loaded in the link-map namespace of `handle`, in load order (the empty name
/// of a namespace's first entry left out).
///
/// # Safety
/// `handle` is a live handle, and no other thread unloads objects of that namespace meanwhile
/// (ugdr's own namespace: its UCX never unloads a module).
pub unsafe fn namespace_objects(handle: *mut c_void) -> Vec<String> {
    // SAFETY: the caller's contract.
    let mut map = unsafe { link_map(handle) };
    // SAFETY: walking the loader's doubly linked list of this namespace.
    while let Some(prev) = unsafe { map.as_ref() }
        .map(|m| m.l_prev)
        .filter(|p| !p.is_null())
    {
        map = prev;
    }
    let mut out = Vec::new();
    // SAFETY: as above.
    while let Some(m) = unsafe { map.as_ref() } {
        // SAFETY: a link map of the list.
        if let Some(name) = unsafe { name_of(map) }.filter(|n| !n.is_empty()) {
            out.push(name);
        }
        map = m.l_next;
    }
    out
}
