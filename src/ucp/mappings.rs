//! Is `[addr, addr + len)` mapped in this process, readable (and writable)? Answered from the
//! kernel's list of the process's mappings (`/proc/self/maps`: its PROCMAP_QUERY ioctl where
//! the kernel has it, the text otherwise), without touching the memory.
//! `ugdr_reg_mr` asks before it registers; on-demand-paging regions ask before every access
//! (see [`super::AppRegion::on_demand`]), so an address the application never mapped, or
//! unmapped since, is an access error instead of a fault.

use std::fmt;

/// One line of `/proc/<pid>/maps`: `[start, end)`, its read/write permissions, and the inode
/// of what it maps (0 for anonymous memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
    pub inode: u64,
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
    vma_of_line(line).map(|v| Mapping {
        start: v.start,
        end: v.end,
        read: v.read,
        write: v.write,
        inode: v.inode,
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

/// `struct procmap_query` (linux/fs.h, Linux 6.11+): one mapping of the process, found by
/// address with an ioctl on `/proc/<pid>/maps` instead of reading the whole list.
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
const VMA_READABLE: u64 = 1;
const VMA_WRITABLE: u64 = 2;

const VMA_SHARED: u64 = 8;
/// The mapping covering the address, or else the next one above it.
const COVERING_OR_NEXT: u64 = 0x10;
const _: () = assert!(size_of::<ProcmapQuery>() == 104);

/// This process's `/proc/self/maps`, opened by the process that asks (a forked child opens
/// its own), or None where the kernel does not answer PROCMAP_QUERY.
static QUERY_FILE: std::sync::Mutex<Option<(u32, Option<std::fs::File>)>> =
    std::sync::Mutex::new(None);

/// Runs `f` with this process's `/proc/self/maps` open for PROCMAP_QUERY; None where the
/// kernel lacks it.
fn with_query_file<R>(f: impl FnOnce(&std::fs::File) -> R) -> Option<R> {
    let mut slot = QUERY_FILE.lock().unwrap_or_else(|p| p.into_inner());
    let pid = std::process::id();
    if slot.as_ref().is_none_or(|(owner, _)| *owner != pid) {
        // Asked about this module's code, which is mapped: an old kernel answers ENOTTY (or
        // EINVAL).
        let here = query as *const () as u64;
        let file = std::fs::File::open("/proc/self/maps")
            .ok()
            .filter(|f| query(f, here, 0, None).is_ok());
        *slot = Some((pid, file));
    }
    slot.as_ref()?.1.as_ref().map(f)
}

/// The mapping covering `addr` (with [`COVERING_OR_NEXT`] in `flags`: or else the next one
/// above), None if there is none; Err when the kernel has no PROCMAP_QUERY. With `name`, the
/// name the maps show for it is written there (NUL-terminated; `vma_name_size` says its
/// length with the NUL).
fn query(
    file: &std::fs::File,
    addr: u64,
    flags: u64,
    name: Option<&mut [u8]>,
) -> Result<Option<ProcmapQuery>, ()> {
    use std::os::fd::AsRawFd;
    let (name_addr, name_size) = name.map_or((0, 0), |n| (n.as_mut_ptr() as u64, n.len() as u32));
    let mut q = ProcmapQuery {
        size: size_of::<ProcmapQuery>() as u64,
        query_flags: flags,
        query_addr: addr,
        vma_name_addr: name_addr,
        vma_name_size: name_size,
        ..Default::default()
    };
    // SAFETY: the ioctl reads and writes one `struct procmap_query` (its size given in
    // `size`), and writes at most `vma_name_size` bytes to `vma_name_addr` (a live buffer of
    // that size borrowed for the call, or none), asks for no build id, and touches nothing
    // else.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), PROCMAP_QUERY, &mut q) };
    if rc == 0 {
        return Ok(Some(q));
    }
    match std::io::Error::last_os_error().raw_os_error() {
        Some(libc::ENOENT) => Ok(None),
        _ => Err(()),
    }
}

/// The check by PROCMAP_QUERY (one ioctl per mapping the range crosses); None where the
/// kernel lacks it.
fn check_by_query(addr: u64, end: u64, write: bool) -> Option<Result<(), Unusable>> {
    with_query_file(|file| {
        let mut covered = addr;
        while covered < end {
            let q = match query(file, covered, 0, None) {
                Ok(Some(q)) => q,
                Ok(None) => return Some(Err(Unusable::Unmapped)),
                Err(()) => return None,
            };
            if q.vma_flags & VMA_READABLE == 0 {
                return Some(Err(Unusable::NotReadable));
            }
            if write && q.vma_flags & VMA_WRITABLE == 0 {
                return Some(Err(Unusable::NotWritable));
            }
            covered = q.vma_end;
        }
        Some(Ok(()))
    })?
}

/// One mapping with all that a line of `/proc/self/maps` says of it (what
/// `shared_memory::Backing` checks before it moves, adopts or reuses memory).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vma {
    pub start: u64,
    pub end: u64,
    pub read: bool,
    pub write: bool,
    pub shared: bool,
    /// Offset in the file.
    pub offset: u64,
    pub dev: u64,
    pub inode: u64,
    /// What follows the inode for mappings of no file (`[heap]`, `[stack]`, a name given
    /// with `PR_SET_VMA`; empty for most). Not filled for files.
    pub anonymous_name: String,
}

fn vma_of_line(line: &str) -> Option<Vma> {
    let mut f = line.split_ascii_whitespace();
    let (range, perms, offset, dev, inode) =
        (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let (start, end) = range.split_once('-')?;
    let (major, minor) = dev.split_once(':')?;
    let inode: u64 = inode.parse().ok()?;
    let perms = perms.as_bytes();
    Some(Vma {
        start: u64::from_str_radix(start, 16).ok()?,
        end: u64::from_str_radix(end, 16).ok()?,
        read: perms.first() == Some(&b'r'),
        write: perms.get(1) == Some(&b'w'),
        shared: perms.get(3) == Some(&b's'),
        offset: u64::from_str_radix(offset, 16).ok()?,
        dev: libc::makedev(
            u32::from_str_radix(major, 16).ok()?,
            u32::from_str_radix(minor, 16).ok()?,
        ),
        inode,
        anonymous_name: if inode == 0 {
            f.next().unwrap_or("").to_string()
        } else {
            String::new()
        },
    })
}

/// The mappings of `maps` (`/proc/<pid>/maps` text) that overlap `[start, end)`.
pub fn vmas_of_text(maps: &str, start: u64, end: u64) -> Vec<Vma> {
    maps.lines()
        .filter_map(vma_of_line)
        .filter(|v| v.end > start && v.start < end)
        .collect()
}

/// Every mapping of this process, from one read of `/proc/self/maps` (cheaper than a query
/// per mapping when many are asked about).
pub fn all_vmas() -> std::io::Result<Vec<Vma>> {
    Ok(vmas_of_text(
        &std::fs::read_to_string("/proc/self/maps")?,
        0,
        u64::MAX,
    ))
}

/// The mappings of this process that overlap `[start, end)`, in address order: by
/// PROCMAP_QUERY where the kernel has it (the text costs the kernel a path lookup per file
/// mapping, hundreds with UCX loaded: ~100 µs, on every registration the direct path
/// publishes), else from the text.
pub fn vmas_overlapping(start: u64, end: u64) -> std::io::Result<Vec<Vma>> {
    if let Some(Ok(found)) = with_query_file(|file| vmas_by_query(file, start, end)) {
        return Ok(found);
    }
    Ok(vmas_of_text(
        &std::fs::read_to_string("/proc/self/maps")?,
        start,
        end,
    ))
}

fn vmas_by_query(file: &std::fs::File, start: u64, end: u64) -> Result<Vec<Vma>, ()> {
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let Some(q) = query(file, at, COVERING_OR_NEXT, None)? else {
            break;
        };
        if q.vma_start >= end {
            break;
        }
        let mut vma = Vma {
            start: q.vma_start,
            end: q.vma_end,
            read: q.vma_flags & VMA_READABLE != 0,
            write: q.vma_flags & VMA_WRITABLE != 0,
            shared: q.vma_flags & VMA_SHARED != 0,
            offset: q.vma_offset,
            dev: libc::makedev(q.dev_major, q.dev_minor),
            inode: q.inode,
            anonymous_name: String::new(),
        };
        if vma.inode == 0 {
            vma.anonymous_name = anonymous_name(file, vma.start)?;
        }
        at = vma.end;
        out.push(vma);
    }
    Ok(out)
}

/// The name the maps show for the mapping of no file at `addr` (`[heap]`, ...).
fn anonymous_name(file: &std::fs::File, addr: u64) -> Result<String, ()> {
    let mut name = [0u8; 256];
    let q = query(file, addr, 0, Some(&mut name))?.ok_or(())?;
    let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
    Ok(String::from_utf8_lossy(&name[..len]).into_owned())
}

/// Checks the range against this process's mappings now: by PROCMAP_QUERY where the kernel
/// has it, else from the text, read only as far as the range's end (the kernel produces it
/// in address order, a page at a time).
pub fn check(addr: u64, len: u64, write: bool) -> Result<(), Unusable> {
    use std::io::BufRead;
    let end = addr.checked_add(len).ok_or(Unusable::Wraps)?;
    if let Some(verdict) = check_by_query(addr, end, write) {
        return verdict;
    }
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
                write: true,
                inode: 0
            }
        );
        assert!(!m[3].read);
        assert_eq!(m[0].inode, 1);
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

    /// The text of the maps, checked as `check` does without PROCMAP_QUERY.
    fn check_by_text(addr: u64, len: u64, write: bool) -> Result<(), Unusable> {
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        check_range(parse_maps(&text), addr, len, write)
    }

    #[test]
    fn the_query_and_the_text_agree() {
        let v = vec![0u8; 100_000];
        let code = parses_lines as *const () as u64;
        let cases = [
            (v.as_ptr() as u64, v.len() as u64, true),
            (code, 64, false),
            (code, 64, true),
            (8, 8, false),
            (u64::MAX - 4096, 8, false),
        ];
        for (addr, len, write) in cases {
            assert_eq!(
                check(addr, len, write),
                check_by_text(addr, len, write),
                "{addr:#x}+{len} write {write}"
            );
        }
    }

    /// Both ways of listing the mappings over a range agree, over ranges of every kind this
    /// process has (its code, heap, a thread's stack, anonymous and file mappings, gaps), on
    /// a kernel that answers the query; elsewhere only the text is there to read.
    #[test]
    fn the_query_and_the_text_list_the_same_mappings() {
        let heap = Box::new([0u8; 64]);
        let stack = 0u64;
        let text = std::fs::read_to_string("/proc/self/maps").unwrap();
        // The vsyscall page is no mapping of the process (the kernel lists it, the query
        // does not know it).
        let all: Vec<Vma> = vmas_of_text(&text, 0, u64::MAX)
            .into_iter()
            .filter(|v| v.anonymous_name != "[vsyscall]")
            .collect();
        assert!(all.len() > 3);
        let code = parses_lines as *const () as u64;
        let here = &stack as *const u64 as u64;
        let probes = [
            (all[0].start, all.last().unwrap().end),
            (code, code + 1),
            (heap.as_ptr() as u64, heap.as_ptr() as u64 + 64),
            (here, here + 8),
            (all[1].start.saturating_sub(1), all[2].end + 1),
            (0, 4096),
        ];
        let answered = with_query_file(|_| ()).is_some();
        for (start, end) in probes {
            // Other tests' threads map and unmap memory meanwhile (a thread's stack, a test's
            // pages): the answer must agree with the text read just before or just after it,
            // in one of a few tries.
            let agrees = || {
                let before = std::fs::read_to_string("/proc/self/maps").unwrap();
                let found = vmas_overlapping(start, end).unwrap();
                let after = std::fs::read_to_string("/proc/self/maps").unwrap();
                (found == vmas_of_text(&before, start, end)
                    || found == vmas_of_text(&after, start, end))
                .then_some(())
                .ok_or(found)
            };
            let mut last = Ok(());
            for _ in 0..20 {
                last = agrees();
                if last.is_ok() {
                    break;
                }
            }
            assert!(
                last.is_ok(),
                "[{start:#x}, {end:#x}) (query answered: {answered}): {last:#?}"
            );
        }
        assert_eq!(vmas_overlapping(0, 4096).unwrap(), vec![]);
        let stack_vma = vmas_overlapping(here, here + 8).unwrap();
        assert_eq!(stack_vma.len(), 1);
        assert!(stack_vma[0].read && stack_vma[0].write && !stack_vma[0].shared);
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
