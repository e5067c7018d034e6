//! Who is attached to a multicast group: on this host, the per-host directory; on other
//! hosts, the group members' answers to an authenticated question sent by IP multicast.
//!
//! * *This host.* A process whose QPs are attached to groups publishes them in
//!   `mcast-XXXX` (its LID) next to its `lid-XXXX` entry:
//!   `ugdr-mcast1 <pid> <mgid>,<mgid>,… <mac>\n` (MGIDs in hex, the MAC with the user's
//!   secret over pid, LID and the groups), rewritten atomically (a private temporary file
//!   renamed over it) on every attach and detach, removed when the last group is left and at
//!   exit. Readers take only entries of live pids whose MAC verifies. A reader notices a change
//!   by the directory's modification time, so it re-reads only after a rename.
//! * *Other hosts.* Every process that is attached to a group, or sends to one, joins an IPv4
//!   multicast group derived from the MGID ([`ip_group`]; for rdma_cm's IPv4-mapped MGIDs,
//!   the application's own group address, as IPoIB maps them) on UDP port `UGDR_PORT`, on
//!   the interface that identifies the host. One datagram per message, one ASCII line:
//!
//! | line | meaning |
//! |---|---|
//! | `UGDR/3 MQ <mgid> <gid> <time> <nonce> <mac>` | a sender asks who on the link is in `mgid` (to the group) |
//! | `UGDR/3 MA <mgid> <gid> <time> <nonce> <mac>` | port `gid` is in `mgid`: the answer to a question (unicast, the question's nonce) or an announcement when it attached (to the group) |
//! | `UGDR/3 ML <mgid> <gid> <time> <nonce> <mac>` | port `gid` left `mgid` (to the group) |
//!
//! The MAC covers the kind, the MGID, the GID, the time (Unix seconds) and the nonce; a
//! message whose MAC does not verify, whose time is more than [`MAX_SKEW`] away, or that
//! is longer than [`MAX_MESSAGE`] is dropped (counted). The GID only names a port: its
//! worker address is then asked for with the authenticated LID lookup, as for any peer.

use super::directory::{read_own_file, write_private};
use super::{Directory, hex_decode, hex_encode, pid_alive};
use crate::engine::auth::{MAC_LEN, Secret};
use std::collections::HashMap;
use std::fs;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const ENTRY_MAGIC: &str = "ugdr-mcast1";
const PREFIX: &str = "mcast-";
const ENTRY_LABEL: &[u8] = b"ugdr multicast entry";
const MESSAGE_LABEL: &[u8] = b"ugdr multicast message";
/// The most groups one entry names (a process's `max_mcast_grp`).
pub const MAX_ENTRY_GROUPS: usize = 1024;
const MAX_ENTRY: usize = ENTRY_MAGIC.len() + 12 + MAX_ENTRY_GROUPS * 33 + 2 * MAC_LEN + 4;
/// The longest discovery datagram read.
pub const MAX_MESSAGE: usize = 256;
/// How far a message's time may be from this host's clock.
pub const MAX_SKEW: Duration = Duration::from_secs(60);
const NONCE_LEN: usize = 16;

impl Directory {
    fn group_path(&self, lid: u16) -> PathBuf {
        self.path().join(format!("{PREFIX}{lid:04x}"))
    }

    /// Publishes that port `lid` (this process) is attached to `groups`; none removes the
    /// entry.
    pub fn publish_groups(&self, secret: &Secret, lid: u16, groups: &[[u8; 16]]) {
        let path = self.group_path(lid);
        if groups.is_empty() {
            let _ = fs::remove_file(&path);
            return;
        }
        let pid = std::process::id() as i32;
        let list = group_list(groups);
        let mac = entry_mac(secret, pid, lid, &list);
        let content = format!("{ENTRY_MAGIC} {pid} {list} {}\n", hex_encode(&mac));
        let tmp = self.path().join(format!(".mcast-{pid}"));
        let _ = fs::remove_file(&tmp);
        let written =
            write_private(&tmp, content.as_bytes()).and_then(|()| fs::rename(&tmp, &path));
        if let Err(e) = written {
            let _ = fs::remove_file(&tmp);
            tracing::warn!(
                "multicast: cannot publish lid {lid:#06x}'s groups in {}: {e}",
                self.path().display()
            );
        }
    }

    /// When the directory last changed (entries created, renamed or removed).
    pub fn changed_at(&self) -> Option<SystemTime> {
        fs::metadata(self.path()).and_then(|m| m.modified()).ok()
    }

    /// The ports on this host attached to each group, from the entries of live processes
    /// whose MAC verifies.
    pub fn group_members(&self, secret: &Secret) -> HashMap<[u8; 16], Vec<u16>> {
        let mut members: HashMap<[u8; 16], Vec<u16>> = HashMap::new();
        let Ok(names) = fs::read_dir(self.path()) else {
            return members;
        };
        for name in names.filter_map(|n| n.ok()).map(|n| n.file_name()) {
            let Some(lid) = name
                .to_str()
                .and_then(|n| n.strip_prefix(PREFIX))
                .filter(|h| h.len() == 4)
                .and_then(|h| u16::from_str_radix(h, 16).ok())
            else {
                continue;
            };
            let Some(text) = read_own_file(&self.group_path(lid), MAX_ENTRY) else {
                continue;
            };
            for mgid in parse_entry(secret, lid, &text).unwrap_or_default() {
                members.entry(mgid).or_default().push(lid);
            }
        }
        members
    }
}

fn group_list(groups: &[[u8; 16]]) -> String {
    groups
        .iter()
        .map(|g| hex_encode(g))
        .collect::<Vec<_>>()
        .join(",")
}

/// What an entry's MAC covers (the same for making and checking it).
fn entry_parts<'a>(pid: &'a [u8; 4], lid: &'a [u8; 2], list: &'a str) -> [&'a [u8]; 4] {
    [ENTRY_LABEL, pid, lid, list.as_bytes()]
}

fn entry_mac(secret: &Secret, pid: i32, lid: u16, list: &str) -> [u8; MAC_LEN] {
    secret.mac(&entry_parts(&pid.to_le_bytes(), &lid.to_le_bytes(), list))
}

/// The groups an `mcast-XXXX` entry of port `lid` names, if it is sound, proven and its
/// process alive.
fn parse_entry(secret: &Secret, lid: u16, text: &str) -> Option<Vec<[u8; 16]>> {
    let line = text.strip_suffix('\n')?;
    let fields: Vec<&str> = line.split(' ').collect();
    let [ENTRY_MAGIC, pid, list, mac] = fields.as_slice() else {
        return None;
    };
    let pid = pid.parse::<i32>().ok().filter(|p| *p > 0)?;
    let mac = hex_decode(mac)?;
    if !secret.verify(
        &entry_parts(&pid.to_le_bytes(), &lid.to_le_bytes(), list),
        &mac,
    ) || !pid_alive(pid)
    {
        return None;
    }
    list.split(',')
        .take(MAX_ENTRY_GROUPS)
        .map(|g| hex_decode(g).and_then(|b| <[u8; 16]>::try_from(b).ok()))
        .collect()
}

/// The IPv4 multicast group discovery for `mgid` uses: the IPv4 group an rdma_cm MGID was
/// made from (`ff1x:401b:…` or rdma_cm's `ff1x:4001:…`, the group's low 28 bits in the last
/// four bytes, as IPoIB maps them), else one in 239.255.0.0/16 (organization-local scope)
/// chosen by a hash of the MGID.
pub fn ip_group(mgid: &[u8; 16]) -> Ipv4Addr {
    if mgid[0] == 0xff && mgid[2] == 0x40 && matches!(mgid[3], 0x1b | 0x01) {
        let low = u32::from_be_bytes([mgid[12], mgid[13], mgid[14], mgid[15]]) & 0x0fff_ffff;
        return Ipv4Addr::from(0xe000_0000 | low);
    }
    let h = mgid.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    });
    Ipv4Addr::new(239, 255, (h >> 8) as u8, h as u8)
}

/// What a discovery message says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Who is in the group?
    Question,
    /// This port is in the group.
    Member,
    /// This port left the group.
    Left,
}

impl Kind {
    fn word(self) -> &'static str {
        match self {
            Kind::Question => "MQ",
            Kind::Member => "MA",
            Kind::Left => "ML",
        }
    }
}

/// One discovery message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub kind: Kind,
    pub mgid: [u8; 16],
    /// The sending port.
    pub gid: [u8; 16],
    pub nonce: [u8; NONCE_LEN],
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// What a message's MAC covers (the same for making and checking it).
fn message_parts<'a>(m: &'a Message, time: &'a [u8; 8]) -> [&'a [u8]; 6] {
    [
        MESSAGE_LABEL,
        m.kind.word().as_bytes(),
        &m.mgid,
        &m.gid,
        time,
        &m.nonce,
    ]
}

fn message_mac(secret: &Secret, m: &Message, time: u64) -> [u8; MAC_LEN] {
    secret.mac(&message_parts(m, &time.to_le_bytes()))
}

impl Message {
    /// A message with a fresh nonce.
    pub fn new(kind: Kind, mgid: [u8; 16], gid: [u8; 16]) -> Message {
        let mut nonce = [0u8; NONCE_LEN];
        let _ = getrandom::fill(&mut nonce);
        Message {
            kind,
            mgid,
            gid,
            nonce,
        }
    }

    /// The line, MAC'd now.
    pub fn encode(&self, secret: &Secret) -> Vec<u8> {
        let time = now_secs();
        format!(
            "{} {} {} {} {time} {} {}\n",
            super::lookup::VERSION,
            self.kind.word(),
            hex_encode(&self.mgid),
            hex_encode(&self.gid),
            hex_encode(&self.nonce),
            hex_encode(&message_mac(secret, self, time))
        )
        .into_bytes()
    }

    /// A message whose fields, time and MAC check out.
    pub fn decode(secret: &Secret, bytes: &[u8]) -> Option<Message> {
        if bytes.len() > MAX_MESSAGE {
            return None;
        }
        let line = std::str::from_utf8(bytes).ok()?.strip_suffix('\n')?;
        let fields: Vec<&str> = line.split(' ').collect();
        let [version, kind, mgid, gid, time, nonce, mac] = fields.as_slice() else {
            return None;
        };
        if *version != super::lookup::VERSION {
            return None;
        }
        let kind = [Kind::Question, Kind::Member, Kind::Left]
            .into_iter()
            .find(|k| k.word() == *kind)?;
        let time: u64 = time.parse().ok()?;
        if now_secs().abs_diff(time) > MAX_SKEW.as_secs() {
            return None;
        }
        let m = Message {
            kind,
            mgid: hex_decode(mgid)?.try_into().ok()?,
            gid: hex_decode(gid)?.try_into().ok()?,
            nonce: hex_decode(nonce)?.try_into().ok()?,
        };
        secret
            .verify(&message_parts(&m, &time.to_le_bytes()), &hex_decode(mac)?)
            .then_some(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rdma_cm_mgids_map_back_to_their_ipv4_group_and_others_hash() {
        // rdma_cm's MGID for 239.1.1.1 (RDMA_PS_UDP signature 0x4001, P_Key 0xffff).
        let mut mgid = [0u8; 16];
        mgid[..6].copy_from_slice(&[0xff, 0x12, 0x40, 0x01, 0xff, 0xff]);
        mgid[12..].copy_from_slice(&[0x0f, 1, 1, 1]);
        assert_eq!(ip_group(&mgid), Ipv4Addr::new(239, 1, 1, 1));
        let other = [0xffu8; 16];
        let g = ip_group(&other);
        assert_eq!(&g.octets()[..2], &[239, 255]);
        assert!(g.is_multicast());
    }

    #[test]
    fn messages_round_trip_and_refuse_other_secrets_and_tampering() {
        let secret = Secret::new(b"k", "test");
        let m = Message::new(Kind::Member, [0xff; 16], [0xfe; 16]);
        let line = m.encode(&secret);
        assert_eq!(Message::decode(&secret, &line), Some(m.clone()));
        assert_eq!(Message::decode(&Secret::new(b"other", "t"), &line), None);
        let mut tampered = line.clone();
        let i = tampered.iter().position(|b| *b == b'M').unwrap() + 1;
        tampered[i] = b'L';
        assert_eq!(Message::decode(&secret, &tampered), None);
        assert_eq!(Message::decode(&secret, &[b'x'; MAX_MESSAGE + 1]), None);
    }

    #[test]
    fn entries_are_published_read_back_and_refused_when_forged() {
        let dir = std::env::temp_dir().join(format!("ugdr-mcast-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let d = Directory::open_at(dir.clone()).unwrap();
        let secret = Secret::new(b"k", "test");
        let (a, b) = ([0xff; 16], [0xfe; 16]);
        d.publish_groups(&secret, 0x0102, &[a, b]);
        d.publish_groups(&secret, 0x0103, &[a]);
        let m = d.group_members(&secret);
        let mut in_a = m[&a].clone();
        in_a.sort();
        assert_eq!(in_a, [0x0102, 0x0103]);
        assert_eq!(m[&b], [0x0102]);
        assert!(d.group_members(&Secret::new(b"other", "t")).is_empty());
        d.publish_groups(&secret, 0x0102, &[]);
        assert_eq!(d.group_members(&secret).get(&b), None);
        let _ = fs::remove_dir_all(&dir);
    }
}
