//! UCX macros that bindgen cannot translate, as `const fn`s. The C text is quoted above each.

use super::{ucp_datatype_t, ucp_dt_type, ucs_status_ptr_t, ucs_status_t};

/// `#define ucp_dt_make_contig(_elem_size) (((ucp_datatype_t)(_elem_size) << UCP_DATATYPE_SHIFT) | UCP_DATATYPE_CONTIG)`
pub const fn dt_make_contig(elem_size: usize) -> ucp_datatype_t {
    ((elem_size as ucp_datatype_t) << ucp_dt_type::UCP_DATATYPE_SHIFT.0)
        | ucp_dt_type::UCP_DATATYPE_CONTIG.0 as ucp_datatype_t
}

/// `#define ucp_dt_make_iov() ((ucp_datatype_t)UCP_DATATYPE_IOV)`
pub const fn dt_make_iov() -> ucp_datatype_t {
    ucp_dt_type::UCP_DATATYPE_IOV.0 as ucp_datatype_t
}

/// `#define UCS_PTR_IS_ERR(_ptr) (((uintptr_t)(_ptr)) >= ((uintptr_t)UCS_ERR_LAST))`
/// (UCS_ERR_LAST is -100, so error pointers are the top 100 addresses.)
pub fn ptr_is_err(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize) >= (-100isize as usize)
}

/// `#define UCS_PTR_IS_PTR(_ptr) (((uintptr_t)(_ptr) - 1) < ((uintptr_t)UCS_ERR_LAST - 1))`
/// (`wrapping_sub`: NULL must not overflow).
pub fn ptr_is_ptr(ptr: ucs_status_ptr_t) -> bool {
    (ptr as usize).wrapping_sub(1) < (-100isize as usize).wrapping_sub(1)
}

/// `#define UCS_PTR_STATUS(_ptr) ((ucs_status_t)(intptr_t)(_ptr))`, for pointers that are not
/// request handles: NULL is UCS_OK, the error range maps to its code.
pub fn ptr_status(ptr: ucs_status_ptr_t) -> ucs_status_t {
    ucs_status_t(ptr as isize as i8)
}
