//! `rdma_getaddrinfo` / `rdma_freeaddrinfo`: the system resolver's answer as an
//! `rdma_addrinfo` (RC on RDMA_PS_TCP for stream sockets, UD on RDMA_PS_UDP for datagrams), in
//! memory from `malloc` so the chain is freed field by field as librdmacm does.

use crate::capi::boundary::{ffi_boundary, set_errno};
use crate::sys::*;
use std::ffi::CStr;
use std::os::raw::{c_char, c_int};
use std::ptr;

pub(super) const RAI_PASSIVE: c_int = 0x1;
const RAI_NUMERICHOST: c_int = 0x2;
const RAI_FAMILY: c_int = 0x8;

const QPT_RC: c_int = 2;
const QPT_UD: c_int = 4;
const PS_TCP: c_int = 0x0106;
const PS_UDP: c_int = 0x0111;

/// A `malloc`ed copy of `len` bytes (NULL when there is nothing to copy).
///
/// # Safety
/// `src` points to `len` readable bytes when non-NULL.
unsafe fn copy_out(src: *const u8, len: usize) -> *mut u8 {
    if src.is_null() || len == 0 {
        return ptr::null_mut();
    }
    // SAFETY: plain allocation.
    let dst = unsafe { libc::malloc(len) } as *mut u8;
    if !dst.is_null() {
        // SAFETY: both regions hold `len` bytes.
        unsafe { ptr::copy_nonoverlapping(src, dst, len) };
    }
    dst
}

/// # Safety
/// `s` is NULL or a C string.
unsafe fn dup_cstr(s: *const c_char) -> *mut c_char {
    if s.is_null() {
        return ptr::null_mut();
    }
    // SAFETY: the caller's C string.
    unsafe { libc::strdup(s) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_getaddrinfo(
    node: *const c_char,
    service: *const c_char,
    hints: *const rdma_addrinfo,
    res: *mut *mut rdma_addrinfo,
) -> c_int {
    ffi_boundary!(
        "rdma_getaddrinfo",
        on_panic = {
            set_errno(libc::EIO);
            -1
        },
        {
            if (node.is_null() && service.is_null() && hints.is_null()) || res.is_null() {
                set_errno(libc::EINVAL);
                return -1;
            }
            // SAFETY: the caller's hints (or NULL).
            let h = unsafe { hints.as_ref() }.copied().unwrap_or_default();
            // SAFETY: plain C data.
            let rai = unsafe { libc::calloc(1, std::mem::size_of::<rdma_addrinfo>()) }
                as *mut rdma_addrinfo;
            if rai.is_null() {
                set_errno(libc::ENOMEM);
                return -1;
            }
            // SAFETY: just allocated and zeroed.
            let r = unsafe { &mut *rai };
            if !node.is_null() || !service.is_null() {
                // SAFETY: plain C data.
                let mut ai_hints: libc::addrinfo = unsafe { std::mem::zeroed() };
                if h.ai_flags & RAI_PASSIVE != 0 {
                    ai_hints.ai_flags |= libc::AI_PASSIVE;
                }
                if h.ai_flags & RAI_NUMERICHOST != 0 {
                    ai_hints.ai_flags |= libc::AI_NUMERICHOST;
                }
                if h.ai_flags & RAI_FAMILY != 0 {
                    ai_hints.ai_family = h.ai_family;
                }
                ai_hints.ai_socktype = match h.ai_qp_type {
                    QPT_UD => libc::SOCK_DGRAM,
                    0 => 0,
                    _ => libc::SOCK_STREAM,
                };
                ai_hints.ai_protocol = match h.ai_port_space {
                    PS_TCP => libc::IPPROTO_TCP,
                    PS_UDP => libc::IPPROTO_UDP,
                    _ => 0,
                };
                let mut ai: *mut libc::addrinfo = ptr::null_mut();
                // SAFETY: the caller's strings (or NULL), our hints, our out-pointer.
                let rc = unsafe { libc::getaddrinfo(node, service, &ai_hints, &mut ai) };
                if rc != 0 {
                    // SAFETY: our own allocation, still empty.
                    unsafe { libc::free(rai.cast()) };
                    tracing::debug!(
                        "rdma_getaddrinfo: {}",
                        // SAFETY: gai_strerror returns a static string.
                        unsafe { CStr::from_ptr(libc::gai_strerror(rc)) }.to_string_lossy()
                    );
                    return rc;
                }
                // SAFETY: getaddrinfo succeeded, so `ai` is a valid list of at least one.
                let first = unsafe { &*ai };
                r.ai_qp_type = if h.ai_qp_type != 0 {
                    h.ai_qp_type
                } else if first.ai_socktype == libc::SOCK_DGRAM {
                    QPT_UD
                } else {
                    QPT_RC
                };
                r.ai_port_space = if h.ai_port_space != 0 {
                    h.ai_port_space
                } else if first.ai_protocol == libc::IPPROTO_UDP {
                    PS_UDP
                } else {
                    PS_TCP
                };
                r.ai_family = first.ai_family;
                let addr = first.ai_addr as *const u8;
                let len = first.ai_addrlen as usize;
                if first.ai_flags & libc::AI_PASSIVE != 0 {
                    r.ai_flags = RAI_PASSIVE;
                    // SAFETY: the resolver's address of `len` bytes.
                    r.ai_src_addr = unsafe { copy_out(addr, len) }.cast();
                    r.ai_src_len = len as socklen_t;
                    // SAFETY: the resolver's canonical name (or NULL).
                    r.ai_src_canonname = unsafe { dup_cstr(first.ai_canonname) };
                } else {
                    // SAFETY: as above.
                    r.ai_dst_addr = unsafe { copy_out(addr, len) }.cast();
                    r.ai_dst_len = len as socklen_t;
                    // SAFETY: as above.
                    r.ai_dst_canonname = unsafe { dup_cstr(first.ai_canonname) };
                }
                // SAFETY: the list getaddrinfo returned.
                unsafe { libc::freeaddrinfo(ai) };
            } else {
                r.ai_flags = h.ai_flags;
                r.ai_family = h.ai_family;
                r.ai_qp_type = h.ai_qp_type;
                r.ai_port_space = h.ai_port_space;
                // SAFETY: the hints' destination of ai_dst_len bytes.
                r.ai_dst_addr =
                    unsafe { copy_out(h.ai_dst_addr.cast(), h.ai_dst_len as usize) }.cast();
                r.ai_dst_len = if r.ai_dst_addr.is_null() {
                    0
                } else {
                    h.ai_dst_len
                };
            }
            if r.ai_src_len == 0 && h.ai_src_len != 0 {
                // SAFETY: the hints' source of ai_src_len bytes.
                r.ai_src_addr =
                    unsafe { copy_out(h.ai_src_addr.cast(), h.ai_src_len as usize) }.cast();
                r.ai_src_len = if r.ai_src_addr.is_null() {
                    0
                } else {
                    h.ai_src_len
                };
            }
            // SAFETY: the caller's out-pointer, checked non-NULL.
            unsafe { *res = rai };
            0
        }
    )
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn rdma_freeaddrinfo(res: *mut rdma_addrinfo) {
    ffi_boundary!("rdma_freeaddrinfo", {
        let mut next = res;
        while !next.is_null() {
            // SAFETY: a chain from rdma_getaddrinfo; each field was malloc'ed (or is NULL).
            unsafe {
                let r = &*next;
                let following = r.ai_next;
                libc::free(r.ai_connect);
                libc::free(r.ai_route);
                libc::free(r.ai_src_canonname.cast());
                libc::free(r.ai_dst_canonname.cast());
                libc::free(r.ai_src_addr.cast());
                libc::free(r.ai_dst_addr.cast());
                libc::free(next.cast());
                next = following;
            }
        }
    })
}
