//! Is `[addr, addr + len)` host memory this process may register? `ugdr_reg_mr` asks before
//! it registers anything, and never touches the memory to find out: it reads the process's
//! mappings (`/proc/self/maps`, see `crate::ucp::mappings`). Every byte must lie in a readable
//! mapping, and in a writable one when the access flags let ugdr write there, else the
//! registration fails with EFAULT, as the kernel's pinning fails for `ibv_reg_mr` on
//! hardware. A GPU device pointer is refused before this check (EOPNOTSUPP, see `crate::cuda`).
//! `ibv_reg_mr*` makes the same check (via `capi::ibv_pd_mr::register_host`), and `shmdt`
//! asks here how long the segment it detaches is.

use crate::fake_verbs::VerbsError;
use crate::ucp::mappings::{self, Mapping, Unusable, parse_maps};

/// The length of the run of mappings of one file (a SysV shared-memory segment, for `shmdt`)
/// that starts at `addr`; `None` if no mapping starts there.
pub fn extent_at(maps: &[Mapping], addr: u64) -> Option<u64> {
    let first = maps.iter().position(|m| m.start == addr)?;
    let mut end = maps[first].end;
    for m in &maps[first + 1..] {
        if m.start != end || m.inode != maps[first].inode {
            break;
        }
        end = m.end;
    }
    Some(end - addr)
}

/// [`extent_at`] in this process's mappings now.
pub fn attached_extent(addr: u64) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/maps").ok()?;
    extent_at(&parse_maps(&text), addr)
}

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
    fn extent_of_a_segment_spans_its_split_mappings() {
        let m = parse_maps(
            "\
7f0000000000-7f0000001000 rw-s 00000000 00:01 42 /SYSV00000000 (deleted)
7f0000001000-7f0000003000 r--s 00001000 00:01 42 /SYSV00000000 (deleted)
7f0000003000-7f0000004000 rw-s 00000000 00:01 43 /SYSV00000001 (deleted)
",
        );
        assert_eq!(extent_at(&m, 0x7f00_0000_0000), Some(0x3000));
        assert_eq!(extent_at(&m, 0x7f00_0000_3000), Some(0x1000));
        assert_eq!(extent_at(&m, 0x7f00_0000_0800), None);
    }

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
