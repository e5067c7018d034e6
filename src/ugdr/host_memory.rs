//! Is `[addr, addr + len)` host memory this process may register? `ugdr_reg_mr` asks before
//! it registers anything, and never touches the memory to find out: it reads the process's
//! mappings (`/proc/self/maps`, see `crate::ucp::mappings`). Every byte must lie in a readable
//! mapping, and in a writable one when the access flags let ugdr write there, else the
//! registration fails with EFAULT, as the kernel's pinning fails for `ibv_reg_mr` on
//! hardware. A GPU device pointer is refused before this check (EOPNOTSUPP, see `crate::cuda`).

use crate::fake_verbs::VerbsError;
use crate::ucp::mappings::{self, Unusable};

/// Checks the range against this process's mappings now.
pub fn check(addr: u64, len: u64, write: bool) -> Result<(), VerbsError> {
    mappings::check(addr, len, write).map_err(|e| match e {
        Unusable::Unknown(errno) => VerbsError::Os(errno),
        other => VerbsError::BadAddress(other.reason()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_heap_is_host_memory_and_page_zero_is_not() {
        let v = vec![0u8; 100_000];
        assert_eq!(check(v.as_ptr() as u64, v.len() as u64, true), Ok(()));
        assert_eq!(
            check(8, 8, false),
            Err(VerbsError::BadAddress("memory is not mapped"))
        );
    }
}
