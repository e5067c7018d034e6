//! The per-host directory (`UGDR_RUNDIR`, default `/dev/shm/ugdr-<euid>`): one file
//! `lid-XXXX` per port on this host, `ugdr2 <pid> <worker address> <proof>\n` (both in hex;
//! the proof is a MAC with the user's secret, `engine::auth`, which readers check), written by the
//! port's process and read by every ugdr process of the same user on the host (and by their
//! lookup services, which answer peers on other hosts from it).
//!
//! What it holds decides where other processes send their traffic, so only its owner may
//! write there. The directory is created 0700; an existing one must be a directory (not a
//! symbolic link) owned by this effective uid and not writable by group or others, and its
//! parent must not let others replace it (world-writable only with the sticky bit, as
//! `/dev/shm` and `/tmp` are). Anything else is refused with an error that names the path and
//! `UGDR_RUNDIR`, and the engine does not start. Files are created 0600 with `O_EXCL` and
//! read with `O_NOFOLLOW`, at most [`MAX_ENTRY`] bytes, and only when this uid owns them.
//!
//! Claiming a LID holds an exclusive `flock` on `.lock`: it sweeps the entries (and claim
//! files) of processes that no longer exist, then publishes the new entry atomically (written
//! to a private `.claim-<pid>` file, then hard-linked under its `lid-XXXX` name, which fails
//! if the name exists). Lookups take no lock: an entry is complete or absent.
//!
//! The sweep also takes the multicast entries (`mcast-XXXX`, `address::multicast`) of
//! processes that are gone, and a claim of a LID removes the `mcast-XXXX` an earlier owner
//! of that LID left.

use super::multicast::{PREFIX as GROUP_PREFIX, TMP_PREFIX as GROUP_TMP_PREFIX};
use super::{MAX_WORKER_ADDRESS, check_worker_address, hex_decode, hex_encode};
use nix::fcntl::{Flock, FlockArg};
use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{ErrorKind, Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

const ENTRY_MAGIC: &str = "ugdr2";
/// The longest proof an entry carries.
pub const MAX_PROOF: usize = 64;
/// The longest entry file: magic, pid, the longest worker address and proof, separators.
const MAX_ENTRY: usize =
    ENTRY_MAGIC.len() + 1 + 10 + 1 + 2 * MAX_WORKER_ADDRESS + 1 + 2 * MAX_PROOF + 1;
const LOCK_FILE: &str = ".lock";
const CLAIM_PREFIX: &str = ".claim-";
const LID_PREFIX: &str = "lid-";

/// Why the per-host directory cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DirectoryError {
    #[error(
        "refusing the per-host directory {} (UGDR_RUNDIR): {why}; remove it, or set \
         UGDR_RUNDIR to a directory owned by uid {uid} with mode 0700",
        path.display()
    )]
    Unsafe {
        path: PathBuf,
        uid: u32,
        why: String,
    },
    #[error("per-host directory {} (UGDR_RUNDIR): {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no free LID slot in the per-host directory {} (UGDR_RUNDIR)", .0.display())]
    Full(PathBuf),
}

impl DirectoryError {
    /// The errno `ibv_open_device` reports for this.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Unsafe { .. } => libc::EACCES,
            Self::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Self::Full(_) => libc::ENOMEM,
        }
    }
}

impl From<DirectoryError> for super::super::EngineError {
    fn from(e: DirectoryError) -> Self {
        Self::Directory {
            errno: e.errno(),
            message: e.to_string(),
        }
    }
}

/// The per-host directory: one file per LID naming its owner and UCX worker address.
pub struct Directory {
    dir: PathBuf,
}

/// A LID this process owns; the file goes away with [`Directory::release`].
#[derive(Debug, Clone)]
pub struct LidClaim {
    pub lid: u16,
    path: PathBuf,
}

/// What a live port's entry says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Published {
    pub pid: i32,
    pub worker_address: Vec<u8>,
    /// What its owner proves the entry with (opaque here, 1..=[`MAX_PROOF`] bytes).
    pub proof: Vec<u8>,
}

/// What a `lid-XXXX` file says.
#[derive(Debug, PartialEq, Eq)]
enum Entry {
    Live(Published),
    /// Its process no longer exists.
    Dead,
    /// Absent, or not an entry this process can trust (foreign owner, not a regular file,
    /// malformed): neither an answer nor something to sweep.
    Unusable,
}

impl Directory {
    /// `UGDR_RUNDIR`, or `/dev/shm/ugdr-<euid>` (`/tmp/…` without `/dev/shm`), created or
    /// checked as the module comment says. A refusal is logged as an error.
    pub fn open() -> Result<Directory, DirectoryError> {
        let dir = match std::env::var_os("UGDR_RUNDIR") {
            Some(d) if !d.is_empty() => PathBuf::from(d),
            _ => {
                let uid = nix::unistd::geteuid().as_raw();
                let base = if Path::new("/dev/shm").is_dir() {
                    "/dev/shm"
                } else {
                    "/tmp"
                };
                PathBuf::from(format!("{base}/ugdr-{uid}"))
            }
        };
        Directory::open_at(dir).inspect_err(|e| tracing::error!("{e}"))
    }

    pub(super) fn open_at(dir: PathBuf) -> Result<Directory, DirectoryError> {
        let uid = nix::unistd::geteuid().as_raw();
        let refuse = |why: String| DirectoryError::Unsafe {
            path: dir.clone(),
            uid,
            why,
        };
        let io = |source| DirectoryError::Io {
            path: dir.clone(),
            source,
        };
        check_parent(&dir).map_err(refuse)?;
        let created = match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => true,
            Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
            Err(e) => return Err(io(e)),
        };
        // Checked on what was opened, not on the name: a symlink is not followed.
        let handle = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
            .open(&dir)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::ELOOP | libc::ENOTDIR) => {
                    let link = fs::symlink_metadata(&dir).is_ok_and(|m| m.is_symlink());
                    refuse(
                        if link {
                            "it is a symbolic link"
                        } else {
                            "it is not a directory"
                        }
                        .into(),
                    )
                }
                _ => io(e),
            })?;
        let meta = handle.metadata().map_err(io)?;
        if meta.uid() != uid {
            return Err(refuse(format!("it belongs to uid {}", meta.uid())));
        }
        if created {
            // The umask may have taken bits from 0700.
            handle
                .set_permissions(Permissions::from_mode(0o700))
                .map_err(io)?;
        } else if meta.mode() & 0o022 != 0 {
            return Err(refuse(format!(
                "group or others may write to it (mode {:04o})",
                meta.mode() & 0o7777
            )));
        }
        Ok(Directory { dir })
    }

    /// The directory itself (its other entries: `address::multicast`).
    pub(super) fn path(&self) -> &Path {
        &self.dir
    }

    fn io_error(&self, source: std::io::Error) -> DirectoryError {
        DirectoryError::Io {
            path: self.dir.clone(),
            source,
        }
    }

    fn lid_path(&self, lid: u16) -> PathBuf {
        self.dir.join(format!("{LID_PREFIX}{lid:04x}"))
    }

    /// Claims a free LID on this host and publishes `worker_address` and `proof` (made for
    /// this process's pid) under it; first sweeps the entries of processes that no longer
    /// exist.
    pub fn claim(
        &self,
        host_tag: u8,
        worker_address: &[u8],
        proof: &[u8],
    ) -> Result<LidClaim, DirectoryError> {
        let lock = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(self.dir.join(LOCK_FILE))
            .map_err(|e| self.io_error(e))?;
        let _locked = Flock::lock(lock, FlockArg::LockExclusive)
            .map_err(|(_, errno)| self.io_error(errno.into()))?;
        self.sweep();
        let pid = std::process::id();
        let tmp = self.dir.join(format!("{CLAIM_PREFIX}{pid}"));
        let _ = fs::remove_file(&tmp); // left by an earlier claim of this process
        let content = format!(
            "{ENTRY_MAGIC} {pid} {} {}\n",
            hex_encode(worker_address),
            hex_encode(proof)
        );
        let result = write_private(&tmp, content.as_bytes())
            .map_err(|e| self.io_error(e))
            .and_then(|()| self.link_free_slot(&tmp, host_tag, pid));
        let _ = fs::remove_file(&tmp);
        if let Ok(claim) = &result {
            // Groups an earlier owner of the LID published are not this process's; only the
            // LID's owner writes there, and this process publishes nothing before it returns.
            let _ = fs::remove_file(self.group_path(claim.lid));
        }
        result
    }

    /// Hard-links `tmp` under the first free `lid-XXXX` name, starting at a slot that
    /// depends on `pid` (so that processes starting together rarely collide).
    fn link_free_slot(
        &self,
        tmp: &Path,
        host_tag: u8,
        pid: u32,
    ) -> Result<LidClaim, DirectoryError> {
        let first = (pid % 255) as u16;
        for i in 0..255u16 {
            let lid = (u16::from(host_tag) << 8) | (((first + i) % 255) + 1);
            let path = self.lid_path(lid);
            // Atomic, and fails if the name exists: a complete entry or none.
            match fs::hard_link(tmp, &path) {
                Ok(()) => return Ok(LidClaim { lid, path }),
                Err(e) if e.kind() == ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(self.io_error(e)),
            }
        }
        Err(DirectoryError::Full(self.dir.clone()))
    }

    /// Removes the entries and claim files of processes that no longer exist. Call with the
    /// lock held (a dead entry's slot may otherwise be claimed between reading and removing).
    fn sweep(&self) {
        let Ok(names) = fs::read_dir(&self.dir) else {
            return;
        };
        let mut swept = 0;
        for name in names.filter_map(|n| n.ok()).map(|n| n.file_name()) {
            let Some(name) = name.to_str() else { continue };
            let path = self.dir.join(name);
            let pid_gone = |rest: &str| {
                let pid = rest.split('-').next().and_then(|p| p.parse().ok());
                pid.is_some_and(|pid| !pid_alive(pid))
            };
            let dead = if name.starts_with(LID_PREFIX) {
                read_entry(&path) == Entry::Dead
            } else if let Some(rest) = name.strip_prefix(CLAIM_PREFIX) {
                pid_gone(rest)
            } else if let Some(rest) = name.strip_prefix(GROUP_TMP_PREFIX) {
                pid_gone(rest)
            } else if let Some(hex) = name.strip_prefix(GROUP_PREFIX) {
                let lid = Some(hex)
                    .filter(|h| h.len() == 4)
                    .and_then(|h| u16::from_str_radix(h, 16).ok());
                lid.is_some_and(|lid| self.group_entry_stale(lid))
            } else {
                false
            };
            if dead && fs::remove_file(&path).is_ok() {
                swept += 1;
            }
        }
        if swept > 0 {
            tracing::debug!("swept {swept} stale entries from {}", self.dir.display());
        }
    }

    /// What the owner of `lid` published, if it is alive and the entry is sound.
    pub fn lookup(&self, lid: u16) -> Option<Published> {
        match read_entry(&self.lid_path(lid)) {
            Entry::Live(published) => Some(published),
            Entry::Dead | Entry::Unusable => None,
        }
    }

    pub fn release(&self, claim: &LidClaim) {
        let _ = fs::remove_file(&claim.path);
    }
}

/// Refuses a parent directory in which others could rename or replace `dir`.
fn check_parent(dir: &Path) -> Result<(), String> {
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    // An unreadable parent: creating or opening `dir` reports it.
    let Ok(meta) = fs::metadata(parent) else {
        return Ok(());
    };
    if meta.mode() & 0o002 != 0 && meta.mode() & libc::S_ISVTX == 0 {
        return Err(format!(
            "its parent {} may be written by anyone and is not sticky (mode {:04o}), so others \
             could replace it",
            parent.display(),
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

/// Creates `path` (which must not exist, and is never followed if it is a link) with mode
/// 0600 and writes `content`.
pub(in crate::engine) fn write_private(path: &Path, content: &[u8]) -> std::io::Result<()> {
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    f.set_permissions(Permissions::from_mode(0o600))?; // whatever the umask
    f.write_all(content)
}

/// The text of `path` if it is a regular file of this euid of at most `max` bytes, never
/// following a link nor blocking on a FIFO.
pub(super) fn read_own_file(path: &Path, max: usize) -> Option<String> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let sound = f.metadata().is_ok_and(|m| {
        m.is_file() && m.uid() == nix::unistd::geteuid().as_raw() && m.len() <= max as u64
    });
    let mut text = String::new();
    (sound && File::take(f, max as u64).read_to_string(&mut text).is_ok()).then_some(text)
}

fn read_entry(path: &Path) -> Entry {
    match read_own_file(path, MAX_ENTRY) {
        Some(text) => parse_entry(&text),
        None => Entry::Unusable,
    }
}

fn parse_entry(text: &str) -> Entry {
    let Some(line) = text.strip_suffix('\n') else {
        return Entry::Unusable;
    };
    let fields: Vec<&str> = line.split(' ').collect();
    let [ENTRY_MAGIC, pid, hex, proof] = fields.as_slice() else {
        return Entry::Unusable;
    };
    let Some(pid) = pid.parse::<i32>().ok().filter(|p| *p > 0) else {
        return Entry::Unusable;
    };
    if !pid_alive(pid) {
        return Entry::Dead;
    }
    let address = hex_decode(hex).filter(|a| check_worker_address(a).is_ok());
    let proof = hex_decode(proof).filter(|p| !p.is_empty() && p.len() <= MAX_PROOF);
    match (address, proof) {
        (Some(worker_address), Some(proof)) => Entry::Live(Published {
            pid,
            worker_address,
            proof,
        }),
        _ => Entry::Unusable,
    }
}

/// Whether process `pid` (on this host) still exists.
pub fn pid_alive(pid: i32) -> bool {
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        // A zombie (dead, its parent has not reaped it yet) answers too, but touches nothing.
        Ok(()) => !zombie(pid),
        Err(nix::errno::Errno::ESRCH) => false,
        Err(_) => !zombie(pid), // EPERM: exists, owned by someone else
    }
}

/// Whether `/proc` shows `pid` as a zombie (unknown: no).
fn zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the command name, which is in parentheses and may hold any byte.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A UCX-like worker address (format version 1 in the low nibble of the first byte).
    fn worker(tag: u8) -> Vec<u8> {
        vec![0x01, 0x20, tag, tag, tag]
    }

    const PROOF: [u8; 2] = [0xab, 0xcd];

    fn published(pid: u32, worker_address: Vec<u8>) -> Option<Published> {
        Some(Published {
            pid: pid as i32,
            worker_address,
            proof: PROOF.to_vec(),
        })
    }

    /// A fresh directory under the system temp dir, removed on drop.
    struct Scratch(PathBuf);

    impl Scratch {
        fn new(what: &str) -> Scratch {
            let p = std::env::temp_dir().join(format!("ugdr-dir-{what}-{}", std::process::id()));
            let _ = fs::remove_dir_all(&p);
            let _ = fs::remove_file(&p);
            Scratch(p)
        }
    }

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
            let _ = fs::remove_file(&self.0);
        }
    }

    fn mode(p: &Path) -> u32 {
        fs::symlink_metadata(p).unwrap().mode() & 0o7777
    }

    #[test]
    fn directory_claims_unique_lids_and_reclaims_dead_owners() {
        let s = Scratch::new("claims");
        let d = Directory::open_at(s.0.clone()).unwrap();
        let a = d.claim(7, &worker(0xa), &PROOF).unwrap();
        let b = d.claim(7, &worker(0xb), &PROOF).unwrap();
        assert_ne!(a.lid, b.lid);
        assert_eq!(a.lid >> 8, 7);
        let me = std::process::id();
        assert_eq!(d.lookup(a.lid), published(me, worker(0xa)));
        assert_eq!(d.lookup(b.lid), published(me, worker(0xb)));
        // A file left by a process that no longer exists is not an answer.
        let stale = (7u16 << 8) | 200;
        fs::write(d.lid_path(stale), "ugdr2 2147483646 0120 abcd\n").unwrap();
        assert_eq!(d.lookup(stale), None);
        d.release(&a);
        assert_eq!(d.lookup(a.lid), None);
    }

    #[test]
    fn a_new_directory_is_private_and_so_are_its_entries_whatever_the_umask() {
        let s = Scratch::new("private");
        let old = nix::sys::stat::umask(nix::sys::stat::Mode::empty());
        let opened = Directory::open_at(s.0.clone());
        nix::sys::stat::umask(old);
        let d = opened.unwrap();
        assert_eq!(mode(&s.0), 0o700);
        let c = d.claim(3, &worker(1), &PROOF).unwrap();
        assert_eq!(mode(&d.lid_path(c.lid)), 0o600);
        let names: Vec<_> = fs::read_dir(&s.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(
            !names.iter().any(|n| n.starts_with(CLAIM_PREFIX)),
            "the claim file is gone: {names:?}"
        );
    }

    #[test]
    fn unsafe_directories_are_refused_with_the_path_and_the_variable() {
        let s = Scratch::new("unsafe");
        fs::create_dir(&s.0).unwrap();
        let open_err = |p: &Path| match Directory::open_at(p.to_path_buf()) {
            Ok(_) => panic!("{} was accepted", p.display()),
            Err(e) => e,
        };
        // World-writable.
        let shared = s.0.join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, Permissions::from_mode(0o777)).unwrap();
        let e = open_err(&shared);
        assert!(matches!(e, DirectoryError::Unsafe { .. }), "{e}");
        assert_eq!(e.errno(), libc::EACCES);
        let msg = e.to_string();
        assert!(
            msg.contains(&shared.display().to_string()) && msg.contains("UGDR_RUNDIR"),
            "{msg}"
        );
        assert!(msg.contains("0777"), "{msg}");
        // Group-writable.
        fs::set_permissions(&shared, Permissions::from_mode(0o770)).unwrap();
        assert!(matches!(open_err(&shared), DirectoryError::Unsafe { .. }));
        // A symbolic link to a good directory.
        let good = s.0.join("good");
        fs::create_dir(&good).unwrap();
        fs::set_permissions(&good, Permissions::from_mode(0o700)).unwrap();
        let link = s.0.join("link");
        std::os::unix::fs::symlink(&good, &link).unwrap();
        let e = open_err(&link);
        assert!(e.to_string().contains("symbolic link"), "{e}");
        // A file.
        let file = s.0.join("file");
        fs::write(&file, "x").unwrap();
        assert!(open_err(&file).to_string().contains("not a directory"));
        // Inside a world-writable, non-sticky parent (others could swap it).
        fs::set_permissions(&shared, Permissions::from_mode(0o777)).unwrap();
        let inner = shared.join("inner");
        assert!(open_err(&inner).to_string().contains("not sticky"));
        // The good one is accepted.
        assert!(Directory::open_at(good).is_ok());
    }

    #[test]
    fn claiming_sweeps_entries_and_claim_files_of_dead_processes() {
        let s = Scratch::new("sweep");
        let d = Directory::open_at(s.0.clone()).unwrap();
        let me = std::process::id();
        let dead = (5u16 << 8) | 9;
        let live = (5u16 << 8) | 10;
        let foreign = (5u16 << 8) | 11;
        fs::write(d.lid_path(dead), "ugdr2 2147483646 0120 abcd\n").unwrap();
        fs::write(d.lid_path(live), format!("ugdr2 {me} 0120 abcd\n")).unwrap();
        fs::write(d.lid_path(foreign), "not an entry\n").unwrap();
        let dead_claim = s.0.join(".claim-2147483646-d7");
        fs::write(&dead_claim, "ugdr2 2147483646 0120 abcd\n").unwrap();
        let claim = d.claim(5, &worker(2), &PROOF).unwrap();
        // The dead entry is gone: its slot is free, or this claim took it (the search starts
        // at a slot the pid picks, so a test process whose pid picks 9 takes it).
        if claim.lid == dead {
            assert_eq!(
                d.lookup(dead),
                published(me, worker(2)),
                "dead entry replaced"
            );
        } else {
            assert!(!d.lid_path(dead).exists(), "dead entry swept");
        }
        assert!(!dead_claim.exists(), "dead claim file swept");
        assert_eq!(d.lookup(live), published(me, vec![0x01, 0x20]));
        assert!(d.lid_path(foreign).exists(), "what is not an entry stays");
    }

    #[test]
    fn claiming_sweeps_multicast_entries_only_of_processes_that_are_gone() {
        let s = Scratch::new("sweep-mcast");
        let d = Directory::open_at(s.0.clone()).unwrap();
        let me = std::process::id();
        let entry = |pid: u32| format!("ugdr-mcast1 {pid} ff00 abcd\n");
        let mine = d.claim(6, &worker(1), &PROOF).unwrap();
        // Far from the slots the claims below take (the ones after `mine`'s, which depends
        // on the pid): a claim removes the groups of the slot it takes.
        let away = |k: u16| (6u16 << 8) | ((((mine.lid & 0xff) - 1 + k) % 255) + 1);
        let gone = away(100);
        let unheld_live_pid = away(101);
        let foreign = away(102);
        fs::write(d.group_path(mine.lid), entry(me)).unwrap();
        fs::write(d.group_path(gone), entry(2147483646)).unwrap();
        fs::write(d.lid_path(gone), "ugdr2 2147483646 0120 abcd\n").unwrap();
        fs::write(d.group_path(unheld_live_pid), entry(me)).unwrap();
        fs::write(d.group_path(foreign), "not an entry\n").unwrap();
        let dead_tmp = s.0.join(format!("{GROUP_TMP_PREFIX}2147483646"));
        let live_tmp = s.0.join(format!("{GROUP_TMP_PREFIX}{me}"));
        fs::write(&dead_tmp, entry(2147483646)).unwrap();
        fs::write(&live_tmp, entry(me)).unwrap();
        let other = d.claim(6, &worker(2), &PROOF).unwrap();
        assert!(
            !d.group_path(gone).exists(),
            "entry of a dead process swept"
        );
        assert!(!dead_tmp.exists(), "private file of a dead process swept");
        assert!(
            d.group_path(mine.lid).exists(),
            "a live owner's entry stays"
        );
        assert!(live_tmp.exists(), "a live process's private file stays");
        assert!(d.group_path(unheld_live_pid).exists(), "its pid lives");
        assert!(d.group_path(foreign).exists(), "what is not an entry stays");
        // A LID claimed anew starts without its earlier owner's groups.
        d.release(&other);
        fs::write(d.group_path(other.lid), entry(me)).unwrap();
        let again = d.claim(6, &worker(3), &PROOF).unwrap();
        assert_eq!(again.lid, other.lid, "the first free slot again");
        assert!(
            !d.group_path(again.lid).exists(),
            "the earlier owner's groups"
        );
    }

    #[test]
    fn entries_are_parsed_strictly() {
        let me = std::process::id();
        let live = |t: String| parse_entry(&t);
        assert_eq!(
            live(format!("ugdr2 {me} 0120 abcd\n")),
            Entry::Live(published(me, vec![1, 0x20]).unwrap())
        );
        for bad in [
            format!("ugdr2 {me} 0120 abcd"),     // no newline
            format!("ugdr2 {me} 0120 abcd x\n"), // trailing field
            format!("ugdr2 {me} 0120\n"),        // no proof
            format!("ugdr2 {me} 0120 \n"),       // empty proof
            format!("ugdr2 {me} 0120 abc\n"),    // odd proof
            format!("ugdr2 {me}  abcd\n"),       // empty address
            format!("ugdr2 {me} 0F20 abcd\n"),   // upper case
            format!("ugdr2 {me} +f20 abcd\n"),   // a sign
            format!("ugdr2 {me} 0f20 abcd\n"),   // UCX format version 15
            format!("ugdr1 {me} 0120 abcd\n"),   // another format
            format!("ugdr2 -{me} 0120 abcd\n"),  // a negative pid
            format!("ugdr2  {me} 0120 abcd\n"),  // two spaces
            format!("ugdr2 {me} {} abcd\n", "01".repeat(MAX_WORKER_ADDRESS + 1)),
            format!("ugdr2 {me} 0120 {}\n", "ab".repeat(MAX_PROOF + 1)),
        ] {
            assert_eq!(live(bad.clone()), Entry::Unusable, "{bad:?}");
        }
        assert_eq!(live("ugdr2 2147483646 zz zz\n".into()), Entry::Dead);
    }
}
