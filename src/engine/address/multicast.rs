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
//! is longer than [`MAX_MESSAGE`] is dropped (counted). A message heard before is dropped
//! too ([`Replays`]: the MACs of the messages of the last [`MAX_SKEW`], at most
//! [`MAX_REMEMBERED`]), so one captured on the link cannot be played back within the
//! window. The GID only names a port: its worker address is then asked for with the
//! authenticated LID lookup, as for any peer.
//!
//! Stale entries: a process killed before it could remove its `mcast-XXXX` entry (or its
//! private `.mcast-<pid>` file) leaves it behind; the next claim of a LID sweeps it under the
//! directory's lock once its pid is gone and no live process holds `lid-XXXX`, and a process
//! that claims LID `XXXX` removes any `mcast-XXXX` left by an earlier owner before it can
//! publish its own (`Directory::claim`), so no sweep ever removes a live owner's entry.

use super::directory::{read_own_file, write_private};
use super::{Directory, hex_decode, hex_encode, pid_alive};
use crate::engine::auth::{MAC_LEN, Secret};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const ENTRY_MAGIC: &str = "ugdr-mcast1";
pub(super) const PREFIX: &str = "mcast-";
/// The private file an entry is written to before it is renamed into place.
pub(super) const TMP_PREFIX: &str = ".mcast-";
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
/// How many messages [`Replays`] remembers.
pub const MAX_REMEMBERED: usize = 4096;

impl Directory {
    pub(super) fn group_path(&self, lid: u16) -> PathBuf {
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
        let tmp = self.path().join(format!("{TMP_PREFIX}{pid}"));
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

    /// Whether the `mcast-XXXX` entry of `lid` was left by a process that is gone: its pid
    /// no longer exists and no live process holds the LID (call with the directory's lock
    /// held, so that nobody claims the LID meanwhile; see the module comment).
    pub(super) fn group_entry_stale(&self, lid: u16) -> bool {
        read_own_file(&self.group_path(lid), MAX_ENTRY)
            .and_then(|text| entry_pid(&text))
            .is_some_and(|pid| !pid_alive(pid) && self.lookup(lid).is_none())
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
            let Some((pid, groups)) = parse_entry(secret, lid, &text) else {
                continue;
            };
            // Only the LID's owner speaks for it (a pid may have been reused since).
            if self.lookup(lid).is_none_or(|owner| owner.pid != pid) {
                continue;
            }
            for mgid in groups {
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

/// The fields of an `mcast-XXXX` entry: pid, group list, MAC (not checked).
fn entry_fields(text: &str) -> Option<(i32, &str, &str)> {
    let line = text.strip_suffix('\n')?;
    let fields: Vec<&str> = line.split(' ').collect();
    let [ENTRY_MAGIC, pid, list, mac] = fields.as_slice() else {
        return None;
    };
    let pid = pid.parse::<i32>().ok().filter(|p| *p > 0)?;
    Some((pid, list, mac))
}

/// The pid an `mcast-XXXX` entry names, if it is an entry (for sweeping; not proven).
fn entry_pid(text: &str) -> Option<i32> {
    entry_fields(text).map(|(pid, ..)| pid)
}

/// The pid and the groups of an `mcast-XXXX` entry of port `lid`, if it is sound, proven
/// and its process alive.
fn parse_entry(secret: &Secret, lid: u16, text: &str) -> Option<(i32, Vec<[u8; 16]>)> {
    let (pid, list, mac) = entry_fields(text)?;
    let mac = hex_decode(mac)?;
    if !secret.verify(
        &entry_parts(&pid.to_le_bytes(), &lid.to_le_bytes(), list),
        &mac,
    ) || !pid_alive(pid)
    {
        return None;
    }
    let groups = list
        .split(',')
        .take(MAX_ENTRY_GROUPS)
        .map(|g| hex_decode(g).and_then(|b| <[u8; 16]>::try_from(b).ok()))
        .collect::<Option<Vec<_>>>()?;
    Some((pid, groups))
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

    /// A message whose fields, time and MAC check out, with its time and MAC.
    pub fn decode(secret: &Secret, bytes: &[u8]) -> Option<(Message, Stamp)> {
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
        let mac: [u8; MAC_LEN] = hex_decode(mac)?.try_into().ok()?;
        secret
            .verify(&message_parts(&m, &time.to_le_bytes()), &mac)
            .then_some((m, Stamp { time, mac }))
    }
}

/// When a message was sent (by its sender's clock, Unix seconds) and its MAC, which tells
/// one message from every other.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    pub time: u64,
    pub mac: [u8; MAC_LEN],
}

/// The messages heard within the last [`MAX_SKEW`] (older ones fail [`Message::decode`]'s
/// time check anyway), by time, at most [`MAX_REMEMBERED`]: beyond that the oldest second
/// is forgotten and every message of that second or before is refused from then on, so a
/// flood of authentic messages can make the set forget nothing it would still accept.
#[derive(Default)]
pub struct Replays {
    by_time: BTreeMap<u64, HashSet<[u8; MAC_LEN]>>,
    count: usize,
    /// Messages of this second or older are refused (seconds forgotten when full).
    floor: Option<u64>,
}

impl Replays {
    /// Whether `stamp`'s message is heard for the first time (it is remembered then).
    pub fn first_time(&mut self, stamp: &Stamp) -> bool {
        self.first_time_at(stamp, now_secs())
    }

    fn first_time_at(&mut self, stamp: &Stamp, now: u64) -> bool {
        let oldest = now.saturating_sub(MAX_SKEW.as_secs());
        while let Some(entry) = self.by_time.first_entry() {
            if *entry.key() >= oldest {
                break;
            }
            self.count -= entry.remove().len();
        }
        if self.floor.is_some_and(|f| stamp.time <= f)
            || !self
                .by_time
                .entry(stamp.time)
                .or_default()
                .insert(stamp.mac)
        {
            return false;
        }
        self.count += 1;
        while self.count > MAX_REMEMBERED {
            let Some((time, macs)) = self.by_time.pop_first() else {
                break;
            };
            self.count -= macs.len();
            self.floor = Some(self.floor.map_or(time, |f| f.max(time)));
        }
        true
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
        assert_eq!(
            Message::decode(&secret, &line).map(|d| d.0),
            Some(m.clone())
        );
        assert_eq!(Message::decode(&Secret::new(b"other", "t"), &line), None);
        let mut tampered = line.clone();
        let i = tampered.iter().position(|b| *b == b'M').unwrap() + 1;
        tampered[i] = b'L';
        assert_eq!(Message::decode(&secret, &tampered), None);
        assert_eq!(Message::decode(&secret, &[b'x'; MAX_MESSAGE + 1]), None);
    }

    #[test]
    fn a_message_is_taken_once_and_a_full_memory_refuses_what_it_forgot() {
        let secret = Secret::new(b"k", "test");
        let m = Message::new(Kind::Left, [0xff; 16], [0xfe; 16]);
        let (_, stamp) = Message::decode(&secret, &m.encode(&secret)).unwrap();
        let mut seen = Replays::default();
        assert!(seen.first_time(&stamp));
        assert!(!seen.first_time(&stamp), "the same message again");
        // Another message of the same second (an answer to another question) is new.
        let other = Message::new(Kind::Left, [0xff; 16], [0xfe; 16]);
        let (_, other) = Message::decode(&secret, &other.encode(&secret)).unwrap();
        assert!(seen.first_time(&other));
        // Seconds older than the window are forgotten (such messages fail decoding).
        let now = 1_000_000;
        let mut seen = Replays::default();
        let at = |time: u64, n: u32| Stamp {
            time,
            mac: {
                let mut mac = [0u8; MAC_LEN];
                mac[..4].copy_from_slice(&n.to_le_bytes());
                mac
            },
        };
        assert!(seen.first_time_at(&at(now - 60, 1), now));
        assert!(seen.first_time_at(&at(now, 2), now + 1));
        assert_eq!(seen.count, 1, "second {} left the window", now - 60);
        // Full: the oldest second goes, and nothing of it or before is taken again.
        let mut seen = Replays::default();
        for n in 0..MAX_REMEMBERED as u32 {
            assert!(seen.first_time_at(&at(now - 1 + u64::from(n % 2), n), now));
        }
        assert_eq!(seen.count, MAX_REMEMBERED);
        assert!(seen.first_time_at(&at(now, u32::MAX), now));
        assert_eq!(seen.count, MAX_REMEMBERED / 2 + 1);
        assert!(
            !seen.first_time_at(&at(now - 1, 0), now),
            "forgotten, refused"
        );
        assert!(
            !seen.first_time_at(&at(now - 1, u32::MAX - 1), now),
            "new but old"
        );
        assert!(!seen.first_time_at(&at(now, 1), now), "remembered");
        assert!(seen.first_time_at(&at(now, u32::MAX - 1), now));
    }

    #[test]
    fn entries_are_published_read_back_and_refused_when_forged() {
        let dir = std::env::temp_dir().join(format!("ugdr-mcast-test-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let d = Directory::open_at(dir.clone()).unwrap();
        let secret = Secret::new(b"k", "test");
        let (a, b) = ([0xff; 16], [0xfe; 16]);
        let claim = |tag| d.claim(tag, &[0x01, 0x20], &[1]).unwrap().lid;
        let (one, two) = (claim(1), claim(1));
        d.publish_groups(&secret, one, &[a, b]);
        d.publish_groups(&secret, two, &[a]);
        // An entry for a LID no live process of the entry's pid holds is no member.
        d.publish_groups(&secret, 0x0203, &[a]);
        let m = d.group_members(&secret);
        let mut in_a = m[&a].clone();
        in_a.sort();
        let mut both = [one, two];
        both.sort();
        assert_eq!(in_a, both);
        assert_eq!(m[&b], [one]);
        assert!(d.group_members(&Secret::new(b"other", "t")).is_empty());
        d.publish_groups(&secret, one, &[]);
        assert_eq!(d.group_members(&secret).get(&b), None);
        let _ = fs::remove_dir_all(&dir);
    }
}
