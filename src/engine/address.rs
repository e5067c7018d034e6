//! Addressing: which process a LID or GID names, and how to reach its UCX worker.
//!
//! * Every process that opens ugdr's device gets its own port: a LID that is unique on the
//!   host, `host_tag << 8 | slot`, where `host_tag` is the last octet of the host's IPv4
//!   address and `slot` (1..=255) is claimed in the per-host directory; and a GID
//!   `fe80::0255:LLLL:AABB:CCDD` that carries the LID and the full IPv4 address.
//! * The per-host directory (`UGDR_RUNDIR`, default `/dev/shm/ugdr-<uid>`) holds one file per
//!   LID with the owner's pid and UCX worker address; a LID whose owner died is reclaimed.
//! * A peer on another host is asked over TCP (`UGDR_PORT`, default 18517): every ugdr process
//!   listens there with SO_REUSEPORT and answers from its host's directory. A GID gives the
//!   peer's address directly; a bare LID names the host `subnet | host_tag` on one of the
//!   local IPv4 subnets.

use super::EngineError;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

pub const DEFAULT_QUERY_PORT: u16 = 18517;
const GUID_MARK: [u8; 2] = [0x02, 0x55];
const QUERY_TIMEOUT: Duration = Duration::from_secs(2);

/// The IPv4 address that identifies this host, and the subnets it can reach directly.
#[derive(Debug, Clone)]
pub struct HostNetwork {
    pub ipv4: Ipv4Addr,
    /// (address, prefix length) of every non-loopback IPv4 interface that is up.
    pub subnets: Vec<(Ipv4Addr, u8)>,
}

impl HostNetwork {
    /// `UGDR_IFACE`'s address, else the first non-loopback IPv4 interface that is up (by
    /// name), else 127.0.0.1.
    pub fn discover() -> HostNetwork {
        let wanted = std::env::var("UGDR_IFACE").ok();
        let mut found: Vec<(String, Ipv4Addr, u8)> = Vec::new();
        if let Ok(addrs) = nix::ifaddrs::getifaddrs() {
            for ifa in addrs {
                let up = ifa.flags.contains(nix::net::if_::InterfaceFlags::IFF_UP);
                let loopback = ifa
                    .flags
                    .contains(nix::net::if_::InterfaceFlags::IFF_LOOPBACK);
                let Some(addr) = ifa
                    .address
                    .as_ref()
                    .and_then(|a| a.as_sockaddr_in())
                    .map(|s| s.ip())
                else {
                    continue;
                };
                let prefix = ifa
                    .netmask
                    .as_ref()
                    .and_then(|m| m.as_sockaddr_in())
                    .map(|m| u32::from(m.ip()).count_ones() as u8)
                    .unwrap_or(32);
                let named = wanted.as_deref() == Some(ifa.interface_name.as_str());
                if named || (wanted.is_none() && up && !loopback) {
                    found.push((ifa.interface_name.clone(), addr, prefix));
                }
            }
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        let ipv4 = found.first().map(|f| f.1).unwrap_or(Ipv4Addr::LOCALHOST);
        HostNetwork {
            ipv4,
            subnets: found.iter().map(|f| (f.1, f.2)).collect(),
        }
    }

    /// The tag that this host's LIDs carry in their high byte (never 0).
    pub fn host_tag(&self) -> u8 {
        match self.ipv4.octets()[3] {
            0 => 1,
            t => t,
        }
    }

    /// The node GUID of ugdr's device on this host (network byte order bytes).
    pub fn node_guid(&self) -> [u8; 8] {
        let ip = self.ipv4.octets();
        [GUID_MARK[0], GUID_MARK[1], 0, 0, ip[0], ip[1], ip[2], ip[3]]
    }

    /// The hosts a LID from another host may name: `subnet | host_tag` on each local subnet.
    fn candidates_for_tag(&self, tag: u8) -> Vec<Ipv4Addr> {
        self.subnets
            .iter()
            .filter(|(_, prefix)| *prefix >= 24 && *prefix < 32)
            .map(|(addr, prefix)| {
                let mask = u32::MAX << (32 - u32::from(*prefix));
                let ip = (u32::from(*addr) & 0xffff_ff00) | u32::from(tag);
                (Ipv4Addr::from(ip), (u32::from(*addr) & mask) == (ip & mask))
            })
            .filter(|(ip, same_net)| *same_net && *ip != self.ipv4)
            .map(|(ip, _)| ip)
            .collect()
    }
}

/// The GID of a port: `fe80::` + `02 55 LID_hi LID_lo IPv4`.
pub fn port_gid(ipv4: Ipv4Addr, lid: u16) -> [u8; 16] {
    let mut gid = [0u8; 16];
    gid[0] = 0xfe;
    gid[1] = 0x80;
    gid[8..10].copy_from_slice(&GUID_MARK);
    gid[10..12].copy_from_slice(&lid.to_be_bytes());
    gid[12..16].copy_from_slice(&ipv4.octets());
    gid
}

/// The (IPv4 address, LID) a ugdr GID names.
pub fn parse_gid(gid: &[u8; 16]) -> Option<(Ipv4Addr, u16)> {
    if gid[8..10] != GUID_MARK {
        return None;
    }
    let lid = u16::from_be_bytes([gid[10], gid[11]]);
    let ip = Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]);
    Some((ip, lid))
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

impl Directory {
    pub fn open() -> Result<Directory, EngineError> {
        let dir = match std::env::var_os("UGDR_RUNDIR") {
            Some(d) => PathBuf::from(d),
            None => {
                let uid = nix::unistd::getuid().as_raw();
                let base = if Path::new("/dev/shm").is_dir() {
                    "/dev/shm"
                } else {
                    "/tmp"
                };
                PathBuf::from(format!("{base}/ugdr-{uid}"))
            }
        };
        fs::create_dir_all(&dir)?;
        Ok(Directory { dir })
    }

    fn lid_path(&self, lid: u16) -> PathBuf {
        self.dir.join(format!("lid-{lid:04x}"))
    }

    /// Claims a free LID on this host and publishes `worker_address` under it.
    pub fn claim(&self, host_tag: u8, worker_address: &[u8]) -> Result<LidClaim, EngineError> {
        let pid = std::process::id();
        let content = format!("ugdr1 {pid} {}\n", hex_encode(worker_address));
        let tmp = self
            .dir
            .join(format!(".claim-{pid}-{:x}", worker_address.len()));
        fs::write(&tmp, content.as_bytes())?;
        let first = (pid % 255) as u16;
        let result = (0..255u16)
            .map(|i| ((first + i) % 255) + 1)
            .find_map(|slot| {
                let lid = (u16::from(host_tag) << 8) | slot;
                let path = self.lid_path(lid);
                for _ in 0..2 {
                    // hard_link is atomic and fails if the name exists: a complete file or none.
                    match fs::hard_link(&tmp, &path) {
                        Ok(()) => return Some(LidClaim { lid, path }),
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                            if owner_alive(&path) {
                                return None;
                            }
                            let _ = fs::remove_file(&path); // stale: its owner died
                        }
                        Err(_) => return None,
                    }
                }
                None
            });
        let _ = fs::remove_file(&tmp);
        result.ok_or(EngineError::NoFreeLid)
    }

    /// The owner's pid and worker address published under `lid`, if the owner is alive.
    pub fn lookup(&self, lid: u16) -> Option<(i32, Vec<u8>)> {
        let path = self.lid_path(lid);
        let text = fs::read_to_string(&path).ok()?;
        let (pid, addr) = parse_entry(&text)?;
        if !pid_alive(pid) {
            return None;
        }
        Some((pid, addr))
    }

    pub fn release(&self, claim: &LidClaim) {
        let _ = fs::remove_file(&claim.path);
    }
}

fn parse_entry(text: &str) -> Option<(i32, Vec<u8>)> {
    let mut parts = text.split_whitespace();
    if parts.next()? != "ugdr1" {
        return None;
    }
    let pid: i32 = parts.next()?.parse().ok()?;
    let addr = hex_decode(parts.next()?)?;
    Some((pid, addr))
}

fn owner_alive(path: &Path) -> bool {
    match fs::read_to_string(path).ok().and_then(|t| parse_entry(&t)) {
        Some((pid, _)) => pid_alive(pid),
        None => true, // being written, or not ours: leave it
    }
}

/// Whether process `pid` (on this host) still exists.
pub fn pid_alive(pid: i32) -> bool {
    match nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None) {
        Ok(()) => true,
        Err(nix::errno::Errno::ESRCH) => false,
        Err(_) => true, // EPERM: exists, owned by someone else
    }
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hex_decode(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

/// Why a peer could not be found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("lid {0:#06x}: no such port on this host")]
    NoSuchLocalLid(u16),
    #[error("gid does not name a ugdr port")]
    ForeignGid,
    #[error("lid {0:#06x}: no local subnet holds its host")]
    NoRoute(u16),
    #[error("lid {lid:#06x} at {host}: {why}")]
    Remote {
        lid: u16,
        host: Ipv4Addr,
        why: String,
    },
}

/// Where a port lives: its worker address, and its pid when it is on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolved {
    pub worker_address: Vec<u8>,
    pub local_pid: Option<i32>,
    /// The port's LID.
    pub lid: u16,
}

/// Finds the UCX worker address of the port `lid` (or the one `gid` names).
pub fn resolve(
    net: &HostNetwork,
    dir: &Directory,
    lid: u16,
    gid: Option<&[u8; 16]>,
) -> Result<Resolved, ResolveError> {
    let (hosts, lid) = match gid {
        Some(g) => {
            let (ip, lid) = parse_gid(g).ok_or(ResolveError::ForeignGid)?;
            (vec![ip], lid)
        }
        None if (lid >> 8) as u8 == net.host_tag() => (vec![net.ipv4], lid),
        None => (net.candidates_for_tag((lid >> 8) as u8), lid),
    };
    if hosts.iter().any(|h| *h == net.ipv4 || h.is_loopback()) {
        let (pid, worker_address) = dir.lookup(lid).ok_or(ResolveError::NoSuchLocalLid(lid))?;
        return Ok(Resolved {
            worker_address,
            local_pid: Some(pid),
            lid,
        });
    }
    let mut last = ResolveError::NoRoute(lid);
    for host in hosts {
        match query_remote(host, lid) {
            Ok(worker_address) => {
                return Ok(Resolved {
                    worker_address,
                    local_pid: None,
                    lid,
                });
            }
            Err(why) => last = ResolveError::Remote { lid, host, why },
        }
    }
    Err(last)
}

/// The TCP port of the LID query service (`UGDR_PORT`, default 18517).
pub fn query_port() -> u16 {
    std::env::var("UGDR_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(DEFAULT_QUERY_PORT)
}

fn query_remote(host: Ipv4Addr, lid: u16) -> Result<Vec<u8>, String> {
    let addr = SocketAddr::new(IpAddr::V4(host), query_port());
    let mut stream = TcpStream::connect_timeout(&addr, QUERY_TIMEOUT).map_err(|e| e.to_string())?;
    stream
        .set_read_timeout(Some(QUERY_TIMEOUT))
        .map_err(|e| e.to_string())?;
    writeln!(stream, "UGDR-Q1 {lid:04x}").map_err(|e| e.to_string())?;
    let mut line = String::new();
    BufReader::new(&stream)
        .read_line(&mut line)
        .map_err(|e| e.to_string())?;
    let mut parts = line.split_whitespace();
    match parts.next() {
        Some("OK") => parts
            .next()
            .and_then(hex_decode)
            .ok_or_else(|| "malformed answer".to_string()),
        Some("NO") => Err("no such port".to_string()),
        _ => Err("not a ugdr peer".to_string()),
    }
}

/// Binds the host's query port (shared by every ugdr process on the host).
pub fn bind_query_listener() -> std::io::Result<TcpListener> {
    use socket2::{Domain, Socket, Type};
    let sock = Socket::new(Domain::IPV4, Type::STREAM, None)?;
    sock.set_reuse_address(true)?;
    sock.set_reuse_port(true)?;
    sock.set_cloexec(true)?;
    let addr = SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), query_port());
    sock.bind(&addr.into())?;
    sock.listen(64)?;
    Ok(sock.into())
}

/// Answers peers' LID queries from this host's directory, forever (a daemon thread).
pub fn serve_queries(listener: TcpListener, dir: Directory) {
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else { continue };
        let _ = stream.set_read_timeout(Some(QUERY_TIMEOUT));
        let _ = stream.set_write_timeout(Some(QUERY_TIMEOUT));
        let mut line = String::new();
        if BufReader::new(&stream).read_line(&mut line).is_err() {
            continue;
        }
        let mut parts = line.split_whitespace();
        let answer = match (
            parts.next(),
            parts.next().and_then(|l| u16::from_str_radix(l, 16).ok()),
        ) {
            (Some("UGDR-Q1"), Some(lid)) => match dir.lookup(lid) {
                Some((_, addr)) => format!("OK {}\n", hex_encode(&addr)),
                None => "NO\n".to_string(),
            },
            _ => "ERR\n".to_string(),
        };
        let _ = stream.write_all(answer.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gid_carries_lid_and_ipv4() {
        let gid = port_gid(Ipv4Addr::new(10, 199, 0, 2), 0x0207);
        assert_eq!(&gid[..2], &[0xfe, 0x80]);
        assert_ne!(
            u64::from_be_bytes(gid[8..16].try_into().unwrap()),
            0,
            "interface id must be non-zero"
        );
        assert_eq!(
            parse_gid(&gid),
            Some((Ipv4Addr::new(10, 199, 0, 2), 0x0207))
        );
        assert_eq!(parse_gid(&[0u8; 16]), None);
    }

    #[test]
    fn bare_lid_names_the_host_with_its_tag_on_a_local_subnet() {
        let net = HostNetwork {
            ipv4: Ipv4Addr::new(10, 199, 0, 1),
            subnets: vec![(Ipv4Addr::new(10, 199, 0, 1), 24)],
        };
        assert_eq!(net.host_tag(), 1);
        assert_eq!(
            net.candidates_for_tag(2),
            vec![Ipv4Addr::new(10, 199, 0, 2)]
        );
        assert!(
            net.candidates_for_tag(1).is_empty(),
            "our own tag is local, never remote"
        );
        let narrow = HostNetwork {
            ipv4: Ipv4Addr::new(10, 0, 0, 5),
            subnets: vec![(Ipv4Addr::new(10, 0, 0, 5), 30)],
        };
        assert_eq!(
            narrow.candidates_for_tag(6),
            vec![Ipv4Addr::new(10, 0, 0, 6)]
        );
        assert!(narrow.candidates_for_tag(9).is_empty(), "outside a /30");
    }

    #[test]
    fn directory_claims_unique_lids_and_reclaims_dead_owners() {
        let dir = std::env::temp_dir().join(format!("ugdr-dir-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        let d = Directory { dir: dir.clone() };
        let a = d.claim(7, b"worker-a").unwrap();
        let b = d.claim(7, b"worker-b").unwrap();
        assert_ne!(a.lid, b.lid);
        assert_eq!(a.lid >> 8, 7);
        let me = std::process::id() as i32;
        assert_eq!(d.lookup(a.lid), Some((me, b"worker-a".to_vec())));
        assert_eq!(d.lookup(b.lid), Some((me, b"worker-b".to_vec())));
        // A file left by a process that no longer exists is not an answer, and is reclaimed.
        let stale = (7u16 << 8) | 200;
        fs::write(d.lid_path(stale), "ugdr1 2147483646 00ff\n").unwrap();
        assert_eq!(d.lookup(stale), None);
        d.release(&a);
        assert_eq!(d.lookup(a.lid), None);
        let _ = fs::remove_dir_all(&dir);
    }
}
