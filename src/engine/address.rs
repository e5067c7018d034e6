//! Addressing: which process a LID or GID names, and how to reach its UCX worker.
//!
//! * Every process that opens ugdr's device gets its own port: a LID that is unique on the
//!   host, `host_tag << 8 | slot`, where `host_tag` is the last octet of the host's IPv4
//!   address and `slot` (1..=255) is claimed in the per-host directory; and a GID
//!   `fe80::0255:LLLL:AABB:CCDD` that carries the LID and the full IPv4 address.
//! * The per-host directory (`UGDR_RUNDIR`, default `/dev/shm/ugdr-<euid>`, [`Directory`])
//!   holds one file per LID with the owner's pid and UCX worker address. It must be the
//!   user's own (owned by the euid, no group/other write, not a symlink); the entries of
//!   dead processes are swept when a process claims its LID.
//! * A peer on another host is asked over TCP (`UGDR_PORT`, default 18517, [`lookup`]): every
//!   ugdr process listens there with SO_REUSEPORT and answers from its host's directory. A
//!   GID gives the peer's address directly; a bare LID names the host `subnet | host_tag` on
//!   one of the local IPv4 subnets.
//! * Every worker address, from the directory or from a peer, passes
//!   [`check_worker_address`] before it can reach UCX, and comes with a MAC made with the
//!   user's secret (`engine::auth`) that was checked: a directory entry's proof, a lookup
//!   answer's MAC.

mod directory;
pub mod lookup;
pub mod multicast;

pub(in crate::engine) use directory::write_private;
pub use directory::{Directory, DirectoryError, LidClaim, Published, pid_alive};
pub use lookup::{LookupError, bind_query_listener, query_port, serve_queries};

use super::auth::{self, Secret};
use std::net::Ipv4Addr;

pub const DEFAULT_QUERY_PORT: u16 = 18517;
const GUID_MARK: [u8; 2] = [0x02, 0x55];

/// The longest UCX worker address ugdr accepts (a worker with TCP and shared memory on a
/// host with a few interfaces packs ~200 bytes).
pub const MAX_WORKER_ADDRESS: usize = 8192;

/// Whether `address` may be handed to `ucp_ep_create`. UCX unpacks an address without
/// knowing its length and aborts the process (`ucs_assertv_always`) on an address format
/// version it does not know, so this checks what can be checked without UCX: the length, and
/// the format version in the low 4 bits of the first byte (0 and 1: UCX's address v1 and v2).
/// It cannot tell a well-formed address from a forged one; authenticating the answer can.
pub fn check_worker_address(address: &[u8]) -> Result<(), &'static str> {
    const UCX_ADDRESS_VERSIONS: [u8; 2] = [0, 1];
    match address.first() {
        None => Err("empty worker address"),
        Some(_) if address.len() > MAX_WORKER_ADDRESS => Err("worker address too long"),
        Some(h) if !UCX_ADDRESS_VERSIONS.contains(&(h & 0x0f)) => {
            Err("not a UCX worker address (unknown format version)")
        }
        Some(_) => Ok(()),
    }
}

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

/// Lowercase hex, as the directory entries and the lookup protocol carry addresses.
fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The bytes of lowercase hex `s` (nothing else: no sign, no upper case, no odd length).
fn hex_decode(s: &str) -> Option<Vec<u8>> {
    fn nibble(c: u8) -> Option<u8> {
        match c {
            b'0'..=b'9' => Some(c - b'0'),
            b'a'..=b'f' => Some(c - b'a' + 10),
            _ => None,
        }
    }
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return None;
    }
    s.chunks(2)
        .map(|p| Some(nibble(p[0])? << 4 | nibble(p[1])?))
        .collect()
}

/// Why a peer could not be found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("lid {0:#06x}: no such port on this host")]
    NoSuchLocalLid(u16),
    #[error(
        "lid {lid:#06x}: its process (pid {pid}) on this host uses another ugdr secret than \
         this one ({origin}); give both the same UGDR_SECRET (or neither)"
    )]
    LocalSecretDiffers { lid: u16, pid: i32, origin: String },
    #[error("gid does not name a ugdr port")]
    ForeignGid,
    #[error("lid {0:#06x}: no local subnet holds its host")]
    NoRoute(u16),
    #[error("lid {lid:#06x} at {host}: {why}")]
    Remote {
        lid: u16,
        host: Ipv4Addr,
        why: LookupError,
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

/// Finds the UCX worker address of the port `lid` (or the one `gid` names), proven with
/// `secret`.
pub fn resolve(
    net: &HostNetwork,
    dir: &Directory,
    secret: &Secret,
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
        let entry = dir.lookup(lid).ok_or(ResolveError::NoSuchLocalLid(lid))?;
        if !auth::entry_proven(secret, entry.pid, &entry.worker_address, &entry.proof) {
            let e = ResolveError::LocalSecretDiffers {
                lid,
                pid: entry.pid,
                origin: secret.origin().to_string(),
            };
            tracing::warn!("{e}");
            return Err(e);
        }
        return Ok(Resolved {
            worker_address: entry.worker_address,
            local_pid: Some(entry.pid),
            lid,
        });
    }
    let mut last = ResolveError::NoRoute(lid);
    for host in hosts {
        match lookup::query(secret, host, lid) {
            Ok(worker_address) => {
                return Ok(Resolved {
                    worker_address,
                    local_pid: None,
                    lid,
                });
            }
            Err(why) => {
                if why.is_bad_answer() {
                    tracing::warn!("lid {lid:#06x}: {host} answered what ugdr refuses: {why}");
                } else if why.is_auth_failure() {
                    tracing::warn!(
                        "lid {lid:#06x} at {host}: {why}; this process's secret is {}",
                        secret.origin()
                    );
                }
                last = ResolveError::Remote { lid, host, why };
            }
        }
    }
    Err(last)
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
}
