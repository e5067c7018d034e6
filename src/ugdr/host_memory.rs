//! Is `[addr, addr + len)` host memory this process may register? `ugdr_reg_mr` asks before
//! it registers anything, and never touches the memory to find out: it reads the process's
//! mappings (`/proc/self/maps`). Every byte must lie in a readable mapping, and in a writable
//! one when the access flags let ugdr write there, else the registration fails with EFAULT, as
//! the kernel's pinning fails for `ibv_reg_mr` on hardware. A GPU device pointer is refused
//! before this check (EOPNOTSUPP, see `crate::cuda`).

use crate::fake_verbs::VerbsError;

/// One line of `/proc/self/maps`: `[start, end)` and its read/write permissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
}

/// Parses `/proc/<pid>/maps` text (lines `start-end perms offset dev inode [path]`), in order.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines()
        .filter_map(|line| {
            let mut fields = line.split_ascii_whitespace();
            let (start, end) = fields.next()?.split_once('-')?;
            let perms = fields.next()?.as_bytes();
            Some(Mapping {
                start: u64::from_str_radix(start, 16).ok()?,
                end: u64::from_str_radix(end, 16).ok()?,
                read: perms.first() == Some(&b'r'),
                write: perms.get(1) == Some(&b'w'),
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
                write: true
            }
        );
        assert!(!m[3].read);
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
