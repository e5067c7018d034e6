//! The per-user secret that ugdr's peers prove they know: `UGDR_SECRET`, else the file
//! `$XDG_CONFIG_HOME/ugdr/secret` (`~/.config/ugdr/secret` without it), created with 32
//! random bytes (as 64 hex digits) the first time a process of the user needs it.
//!
//! The file is the key to every one of the user's processes, so only its owner may read it:
//! it must be a regular file owned by the effective uid with no group or other access, in a
//! directory of the same owner that group and others cannot write (ugdr creates both, 0600
//! and 0700, whatever the umask). Anything else is refused with an error that names the file
//! and `UGDR_SECRET`, and the engine does not start. Creating is atomic (a private file
//! hard-linked under the name, which fails if it exists), so processes that start together,
//! also in network namespaces that share the home directory, end up with the same secret.
//!
//! The key is the value with surrounding whitespace removed, so that
//! `UGDR_SECRET="$(cat ~/.config/ugdr/secret)"` and the file are the same key.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::fs::{self, OpenOptions, Permissions};
use std::io::{ErrorKind, Read};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

type HmacSha256 = Hmac<Sha256>;

/// The length of a MAC (HMAC-SHA-256).
pub const MAC_LEN: usize = 32;
/// The longest secret file ugdr reads.
const MAX_FILE: u64 = 4096;
/// Random bytes in a secret ugdr creates.
const NEW_SECRET_BYTES: usize = 32;

/// A key shared by the user's processes on every host, and where it came from.
pub struct Secret {
    /// HMAC-SHA-256 keyed with the secret (cloned for each MAC: the key is hashed once).
    keyed: HmacSha256,
    origin: String,
}

/// Why there is no secret to use.
#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error(
        "refusing the secret file {}: {why}; it must be yours with mode 0600 in a directory \
         only you can write (chmod 600 it), or set UGDR_SECRET",
        path.display()
    )]
    Unsafe { path: PathBuf, why: String },
    #[error("the secret file {}: {source}; set UGDR_SECRET instead", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no home directory to keep the secret file in (HOME unset); set UGDR_SECRET")]
    NoHome,
    #[error(
        "{0} is empty; ugdr's peers authenticate with it (set UGDR_SECRET, or remove the file)"
    )]
    Empty(String),
}

impl SecretError {
    /// The errno `ibv_open_device` reports for this.
    pub fn errno(&self) -> i32 {
        match self {
            Self::Unsafe { .. } | Self::Empty(_) => libc::EACCES,
            Self::Io { source, .. } => source.raw_os_error().unwrap_or(libc::EIO),
            Self::NoHome => libc::ENOENT,
        }
    }
}

impl Secret {
    /// A secret with this key (surrounding whitespace removed); `origin` names it in errors.
    pub fn new(key: &[u8], origin: impl Into<String>) -> Secret {
        Secret {
            keyed: HmacSha256::new_from_slice(key.trim_ascii()).expect("HMAC takes any key"),
            origin: origin.into(),
        }
    }

    /// `UGDR_SECRET`, else the secret file (created if missing). A refusal is logged as an
    /// error.
    pub fn load() -> Result<Secret, SecretError> {
        let loaded = match std::env::var_os("UGDR_SECRET") {
            Some(v) => {
                use std::os::unix::ffi::OsStrExt;
                if v.as_bytes().trim_ascii().is_empty() {
                    Err(SecretError::Empty("UGDR_SECRET".into()))
                } else {
                    Ok(Secret::new(v.as_bytes(), "UGDR_SECRET"))
                }
            }
            None => default_path().and_then(|p| load_file(&p)),
        };
        loaded.inspect_err(|e| tracing::error!("{e}"))
    }

    /// Where the key came from: `UGDR_SECRET` or the file's path.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// HMAC-SHA-256 over `parts`, each prefixed with its length (so that no two lists of
    /// parts hash alike).
    pub fn mac(&self, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        self.keyed_over(parts).finalize().into_bytes().into()
    }

    /// Whether `tag` is the MAC of `parts` (compared in constant time).
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        self.keyed_over(parts).verify_slice(tag).is_ok()
    }

    fn keyed_over(&self, parts: &[&[u8]]) -> HmacSha256 {
        let mut m = self.keyed.clone();
        for p in parts {
            m.update(&(p.len() as u32).to_le_bytes());
            m.update(p);
        }
        m
    }
}

/// `$XDG_CONFIG_HOME/ugdr/secret`, else `<home>/.config/ugdr/secret` (home from `HOME`, else
/// the password database).
pub fn default_path() -> Result<PathBuf, SecretError> {
    let absolute = |var: &str| {
        std::env::var_os(var)
            .map(PathBuf::from)
            .filter(|p| p.is_absolute())
    };
    let config = match absolute("XDG_CONFIG_HOME") {
        Some(c) => c,
        None => absolute("HOME")
            .or_else(|| {
                nix::unistd::User::from_uid(nix::unistd::geteuid())
                    .ok()
                    .flatten()
                    .map(|u| u.dir)
                    .filter(|d| d.is_absolute())
            })
            .ok_or(SecretError::NoHome)?
            .join(".config"),
    };
    Ok(config.join("ugdr").join("secret"))
}

/// The secret in file `path`, created first if it does not exist.
pub fn load_file(path: &Path) -> Result<Secret, SecretError> {
    let io = |source| SecretError::Io {
        path: path.to_path_buf(),
        source,
    };
    let unsafe_because = |why: String| SecretError::Unsafe {
        path: path.to_path_buf(),
        why,
    };
    let dir = path.parent().unwrap_or(Path::new("/"));
    private_directory(dir).map_err(|e| match e {
        Refusal::Unsafe(why) => unsafe_because(why),
        Refusal::Io(e) => io(e),
    })?;
    let file = match open_secret(path) {
        Err(e) if e.kind() == ErrorKind::NotFound => {
            create_secret(dir, path).map_err(io)?;
            open_secret(path)
        }
        other => other,
    }
    .map_err(|e| match e.raw_os_error() {
        Some(libc::ELOOP) => unsafe_because("it is a symbolic link".into()),
        _ => io(e),
    })?;
    let meta = file.metadata().map_err(io)?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_file() {
        return Err(unsafe_because("it is not a regular file".into()));
    }
    if meta.uid() != uid {
        return Err(unsafe_because(format!(
            "it belongs to uid {}, not to uid {uid}",
            meta.uid()
        )));
    }
    if meta.mode() & 0o077 != 0 {
        return Err(unsafe_because(format!(
            "group or others may access it (mode {:04o})",
            meta.mode() & 0o7777
        )));
    }
    let mut key = Vec::new();
    file.take(MAX_FILE + 1).read_to_end(&mut key).map_err(io)?;
    if key.len() as u64 > MAX_FILE {
        return Err(unsafe_because(format!(
            "it is longer than {MAX_FILE} bytes"
        )));
    }
    if key.trim_ascii().is_empty() {
        return Err(SecretError::Empty(path.display().to_string()));
    }
    tracing::debug!("secret: {}", path.display());
    Ok(Secret::new(&key, path.display().to_string()))
}

enum Refusal {
    Unsafe(String),
    Io(std::io::Error),
}

/// Creates `dir` (0700, its missing parents too) or checks that only its owner, this euid,
/// can write to it.
fn private_directory(dir: &Path) -> Result<(), Refusal> {
    let created = match fs::DirBuilder::new()
        .recursive(false)
        .mode(0o700)
        .create(dir)
    {
        Ok(()) => true,
        Err(e) if e.kind() == ErrorKind::AlreadyExists => false,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(Refusal::Io)?;
            true
        }
        Err(e) => return Err(Refusal::Io(e)),
    };
    let meta = fs::symlink_metadata(dir).map_err(Refusal::Io)?;
    let uid = nix::unistd::geteuid().as_raw();
    if !meta.is_dir() {
        return Err(Refusal::Unsafe(format!(
            "{} is not a directory",
            dir.display()
        )));
    }
    if meta.uid() != uid {
        return Err(Refusal::Unsafe(format!(
            "its directory belongs to uid {}, not to uid {uid}",
            meta.uid()
        )));
    }
    if created {
        // The umask may have taken bits from 0700.
        fs::set_permissions(dir, Permissions::from_mode(0o700)).map_err(Refusal::Io)?;
    } else if meta.mode() & 0o022 != 0 {
        return Err(Refusal::Unsafe(format!(
            "group or others may write to its directory (mode {:04o})",
            meta.mode() & 0o7777
        )));
    }
    Ok(())
}

fn open_secret(path: &Path) -> std::io::Result<fs::File> {
    // O_NONBLOCK: a FIFO in its place must not hang the process.
    OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(path)
}

/// Writes a new random secret to `path` unless one appears there first.
fn create_secret(dir: &Path, path: &Path) -> std::io::Result<()> {
    let mut raw = [0u8; NEW_SECRET_BYTES];
    getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut text: String = raw.iter().map(|b| format!("{b:02x}")).collect();
    text.push('\n');
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).map_err(|e| std::io::Error::other(e.to_string()))?;
    let tmp = dir.join(format!(
        ".secret-{}-{:016x}",
        std::process::id(),
        u64::from_le_bytes(suffix)
    ));
    crate::engine::address::write_private(&tmp, text.as_bytes())?;
    // Atomic, and fails if the name exists: then another process created it, and that one
    // is the secret.
    let linked = match fs::hard_link(&tmp, path) {
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Ok(()),
        other => other,
    };
    let _ = fs::remove_file(&tmp);
    if linked.is_ok() {
        tracing::debug!("secret: created {}", path.display());
    }
    linked
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(what: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("ugdr-secret-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&p);
        p
    }

    #[test]
    fn macs_depend_on_key_and_on_how_the_parts_split() {
        let a = Secret::new(b"alpha", "test");
        let b = Secret::new(b" alpha\n", "test");
        let other = Secret::new(b"other", "test");
        let tag = a.mac(&[b"ab", b"c"]);
        assert!(a.verify(&[b"ab", b"c"], &tag));
        assert!(b.verify(&[b"ab", b"c"], &tag), "whitespace around the key");
        assert!(!other.verify(&[b"ab", b"c"], &tag), "another key");
        assert!(!a.verify(&[b"a", b"bc"], &tag), "another split");
        assert!(!a.verify(&[b"ab", b"c"], &tag[..31]), "a short tag");
    }

    #[test]
    fn a_missing_file_is_created_private_once_and_read_back() {
        let root = scratch("create");
        let path = root.join("config/ugdr/secret");
        let first = load_file(&path).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
        let text = fs::read_to_string(&path).unwrap();
        assert_eq!(text.len(), 2 * NEW_SECRET_BYTES + 1, "{text:?}");
        let again = load_file(&path).unwrap();
        assert_eq!(first.mac(&[b"x"]), again.mac(&[b"x"]), "the same secret");
        assert_eq!(
            first.mac(&[b"x"]),
            Secret::new(text.as_bytes(), "env").mac(&[b"x"]),
            "UGDR_SECRET=\"$(cat file)\" is the same key"
        );
        let names: Vec<_> = fs::read_dir(path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["secret"], "no temporary file left");
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn unsafe_files_and_directories_are_refused_naming_the_file_and_the_variable() {
        let root = scratch("unsafe");
        let dir = root.join("ugdr");
        fs::create_dir_all(&dir).unwrap();
        fs::set_permissions(&dir, Permissions::from_mode(0o700)).unwrap();
        let path = dir.join("secret");
        fs::write(&path, "k\n").unwrap();
        let refused = |why: &str| {
            let e = load_file(&path).err().expect(why).to_string();
            assert!(
                e.contains(&path.display().to_string()) && e.contains("UGDR_SECRET"),
                "{e}"
            );
            assert!(e.contains(why), "{e}");
        };
        fs::set_permissions(&path, Permissions::from_mode(0o640)).unwrap();
        refused("mode 0640");
        fs::set_permissions(&path, Permissions::from_mode(0o604)).unwrap();
        refused("mode 0604");
        fs::set_permissions(&path, Permissions::from_mode(0o600)).unwrap();
        assert!(load_file(&path).is_ok());
        fs::set_permissions(&dir, Permissions::from_mode(0o777)).unwrap();
        refused("write to its directory");
        fs::set_permissions(&dir, Permissions::from_mode(0o700)).unwrap();
        fs::remove_file(&path).unwrap();
        std::os::unix::fs::symlink(root.join("elsewhere"), &path).unwrap();
        refused("symbolic link");
        fs::remove_file(&path).unwrap();
        fs::write(&path, " \n").unwrap();
        fs::set_permissions(&path, Permissions::from_mode(0o600)).unwrap();
        let e = load_file(&path).err().unwrap().to_string();
        assert!(e.contains("is empty") && e.contains("UGDR_SECRET"), "{e}");
        if nix::unistd::geteuid().is_root() {
            fs::write(&path, "k\n").unwrap();
            std::os::unix::fs::chown(&path, Some(65534), Some(65534)).unwrap();
            refused("belongs to uid 65534");
        }
        fs::remove_dir_all(&root).unwrap();
    }
}
