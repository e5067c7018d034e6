//! What librdmacm offers and ugdr's fabric has not: ECE (enhanced connection
//! establishment). Each export fails with EOPNOTSUPP for ugdr's ids; an id of the real
//! librdmacm goes to it.

use super::id::our_id;
use super::{cm_boundary, fail, forward};
use crate::sys::*;
use std::os::raw::c_int;

macro_rules! not_offered {
    ($name:ident ( id: $idty:ty $(, $arg:ident : $ty:ty)* )) => {
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(id: $idty $(, $arg: $ty)*) -> c_int {
            cm_boundary!(stringify!($name), {
                if our_id(id).is_none() {
                    return forward!($name(id $(, $arg)*));
                }
                tracing::debug!(concat!(stringify!($name), ": not offered by ugdr"));
                fail(libc::EOPNOTSUPP)
            })
        }
    };
}

not_offered!(rdma_set_local_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece));
not_offered!(rdma_get_remote_ece(id: *mut rdma_cm_id, ece: *mut ibv_ece));
