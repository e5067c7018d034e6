//! Is `[addr, addr + len)` host memory this process may register? `ugdr_reg_mr` asks before
//! it registers anything, and never touches the memory to find out: it reads the process's
//! mappings (`/proc/self/maps`). Every byte must lie in a readable mapping, and in a writable
//! one when the access flags let ugdr write there, else the registration fails with EFAULT, as
//! the kernel's pinning fails for `ibv_reg_mr` on hardware. A GPU device pointer is refused
//! before this check (EOPNOTSUPP, see `crate::cuda`). `ibv_reg_mr*` makes the same check (via
//! `capi::ibv_pd_mr::register_host`), and `shmdt` asks here how long the segment it detaches
//! is.

use crate::fake_verbs::VerbsError;

/// One line of `/proc/self/maps`: `[start, end)`, its read/write permissions, and the inode
/// of what it maps (0 for anonymous memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
    pub inode: u64,
}

/// Parses `/proc/<pid>/maps` text (lines `start-end perms offset dev inode [path]`), in order.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.as_bytes();
            let inode = fields.nth(2).and_then(|i| i.parse().ok()).unwrap_or(0);
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                read: perms.first() == Some(&b'r'),
                write: perms.get(1) == Some(&b'w'),
                inode,
            })
        })
        .collect()
}

/// Checks that consecutive `maps` (sorted, as the kernel lists them) cover the range with the
/// permissions needed.
pub fn check_range(maps: &[Mapping], addr: u64, len: u64, write: bool) -> Result<(), VerbsError> {
    let end = addr
        .checked_add(len)
        .ok_or(VerbsError::BadAddress("range wraps the address space"))?;
    let mut covered = addr;
    for m in maps {
        if covered >= end {
            break;
        }
        if m.end <= covered {
            continue;
        }
        if m.start > covered {
            break; // a hole
        }
        if !m.read || (write && !m.write) {
            return Err(VerbsError::BadAddress(if m.read {
                "memory is not writable"
            } else {
                "memory is not readable"
            }));
        }
        covered = m.end;
    }
    if covered < end {
        return Err(VerbsError::BadAddress("memory is not mapped"));
    }
    Ok(())
}

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
    let text = std::fs::read_to_string("/proc/self/maps")?;
    check_range(&parse_maps(&text), addr, len, write)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
00400000-00401000 r-xp 00000000 08:01 1 /bin/x
00600000-00602000 rw-p 00000000 00:00 0
00602000-00603000 rw-p 00000000 00:00 0 [heap]
00700000-00701000 ---p 00000000 00:00 0
00800000-00801000 r--p 00000000 00:00 0
";

    #[test]
    fn parses_lines() {
        let m = parse_maps(MAPS);
        assert_eq!(m.len(), 5);
        assert_eq!(
            m[1],
            Mapping {
                start: 0x600000,
                end: 0x602000,
                read: true,
                write: true,
                inode: 0
            }
        );
        assert!(!m[3].read);
        assert_eq!(m[0].inode, 1);
    }

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
    fn checks_cover_and_permissions() {
        let m = parse_maps(MAPS);
        assert_eq!(
            check_range(&m, 0x600100, 0x2000, true),
            Ok(()),
            "spans two mappings"
        );
        assert!(
            check_range(&m, 0x602800, 0x1000, false).is_err(),
            "runs into a hole"
        );
        assert!(check_range(&m, 0x500000, 8, false).is_err(), "unmapped");
        assert!(check_range(&m, 0x700000, 8, false).is_err(), "PROT_NONE");
        assert_eq!(check_range(&m, 0x800000, 8, false), Ok(()));
        assert_eq!(
            check_range(&m, 0x800000, 8, true),
            Err(VerbsError::BadAddress("memory is not writable"))
        );
        assert!(check_range(&m, u64::MAX - 1, 8, false).is_err());
    }

    #[test]
    fn own_stack_and_heap_are_host_memory() {
        let v = vec![0u8; 100_000];
        assert_eq!(check(v.as_ptr() as u64, v.len() as u64, true), Ok(()));
        assert!(check(8, 8, false).is_err(), "page 0 is never mapped");
    }
}
