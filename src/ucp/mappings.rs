//! Is `[addr, addr + len)` mapped in this process, readable (and writable)? Answered from the
//! kernel's list of the process's mappings (`/proc/self/maps`), without touching the memory.
//! `ugdr_reg_mr` asks before it registers; on-demand-paging regions ask before every access
//! (see [`super::AppRegion::on_demand`]), so an address the application never mapped, or
//! unmapped since, is an access error instead of a fault.

use std::fmt;

/// One line of `/proc/<pid>/maps`: `[start, end)` and its read/write permissions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
}

/// Why a range is not usable memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    Wraps,
    Unmapped,
    NotReadable,
    NotWritable,
    /// `/proc/self/maps` could not be read (errno).
    Unknown(i32),
}

impl Unusable {
    pub fn reason(&self) -> &'static str {
        match self {
            Unusable::Wraps => "range wraps the address space",
            Unusable::Unmapped => "memory is not mapped",
            Unusable::NotReadable => "memory is not readable",
            Unusable::NotWritable => "memory is not writable",
            Unusable::Unknown(_) => "the process's mappings cannot be read",
        }
    }
}

impl fmt::Display for Unusable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.reason())
    }
}

/// Parses one maps line (`start-end perms offset dev inode [path]`).
fn parse_line(line: &str) -> Option<Mapping> {
    let mut fields = line.split_ascii_whitespace();
    let (start, end) = fields.next()?.split_once('-')?;
    let perms = fields.next()?.as_bytes();
    Some(Mapping {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        read: perms.first() == Some(&b'r'),
        write: perms.get(1) == Some(&b'w'),
    })
}

/// Parses `/proc/<pid>/maps` text, in order.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    text.lines().filter_map(parse_line).collect()
}

/// Checks that consecutive `maps` (sorted, as the kernel lists them) cover the range with the
/// permissions needed.
pub fn check_range(
    maps: impl IntoIterator<Item = Mapping>,
    addr: u64,
    len: u64,
    write: bool,
) -> Result<(), Unusable> {
    let end = addr.checked_add(len).ok_or(Unusable::Wraps)?;
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
        if !m.read {
            return Err(Unusable::NotReadable);
        }
        if write && !m.write {
            return Err(Unusable::NotWritable);
        }
        covered = m.end;
    }
    if covered < end {
        return Err(Unusable::Unmapped);
    }
    Ok(())
}

/// Checks the range against this process's mappings now. Reads the list only as far as the
/// range's end (the kernel produces it in address order, a page at a time).
pub fn check(addr: u64, len: u64, write: bool) -> Result<(), Unusable> {
    use std::io::BufRead;
    let end = addr.checked_add(len).ok_or(Unusable::Wraps)?;
    let file = std::fs::File::open("/proc/self/maps")
        .map_err(|e| Unusable::Unknown(e.raw_os_error().unwrap_or(libc::EIO)))?;
    let lines = std::io::BufReader::with_capacity(16 * 1024, file).lines();
    let maps = lines
        .map_while(Result::ok)
        .filter_map(|l| parse_line(&l))
        .take_while(|m| m.start < end);
    check_range(maps, addr, len, write)
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
        let check = |a, l, w| check_range(m.iter().copied(), a, l, w);
        assert_eq!(check(0x600100, 0x2000, true), Ok(()), "spans two mappings");
        assert_eq!(
            check(0x602800, 0x1000, false),
            Err(Unusable::Unmapped),
            "runs into a hole"
        );
        assert_eq!(check(0x500000, 8, false), Err(Unusable::Unmapped));
        assert_eq!(check(0x700000, 8, false), Err(Unusable::NotReadable));
        assert_eq!(check(0x800000, 8, false), Ok(()));
        assert_eq!(check(0x800000, 8, true), Err(Unusable::NotWritable));
        assert_eq!(check(u64::MAX - 1, 8, false), Err(Unusable::Wraps));
    }

    #[test]
    fn own_stack_and_heap_are_mapped_and_page_zero_is_not() {
        let v = vec![0u8; 100_000];
        assert_eq!(check(v.as_ptr() as u64, v.len() as u64, true), Ok(()));
        assert_eq!(check(8, 8, false), Err(Unusable::Unmapped));
        let x = 5u64;
        assert_eq!(check(&x as *const u64 as u64, 8, true), Ok(()));
    }
}
