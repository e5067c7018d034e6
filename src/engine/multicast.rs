//! UD multicast: which QPs of this process are attached to which groups, who else is, and
//! carrying a datagram to all of them. No daemon: every process is its own switch.
//!
//! * *Attaching* (`ibv_attach_mcast`) records the QP under the group's MGID here and
//!   publishes the process's groups in the per-host directory (`address::multicast`); the
//!   first QP of a group also joins the group's discovery address and announces itself to
//!   other hosts, the last one to leave announces that.
//! * *Sending*: a UD SEND through an address handle whose GID is a multicast GID is
//!   replicated by the sender's engine, one message per member process: this process's own
//!   attached QPs get it at once (IB's rule: the sending QP gets its own message only if it
//!   is attached itself, and not when created with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`),
//!   every other member process gets one UCX message carrying the MGID in
//!   front of the payload ([`wire::FLAG_MULTICAST`], destination QPN 0xFFFFFF). Members on
//!   this host come from the directory (re-read when it changed), members on other hosts
//!   from the discovery thread, which asks the group's IPv4 multicast address at the first
//!   send interest ([`Engine::multicast_interest`], at `ibv_create_ah` and at an rdma_cm
//!   join), every [`REFRESH`] after, and hears members announce and leave. A discovery
//!   message is taken once (a replay is dropped), and a leave no newer than the member's
//!   latest answer is stale. A new member's worker address is looked up by a thread of its
//!   own (at most [`MAX_LOOKUPS`] at once), never by the discovery thread; a member whose
//!   lookup failed is not asked for again before a back-off that doubles with each failure
//!   ([`LOOKUP_BACKOFF`] up to [`MAX_LOOKUP_BACKOFF`]), however often it answers.
//! * *Receiving*: the member process hands the datagram to each of its QPs attached to the
//!   group at that moment (detaching stops delivery at once, whatever senders still believe).
//!
//! As on a fabric, multicast is unreliable: a member that joined an instant ago, or one on
//! another host that has not answered yet, may miss a datagram.

use super::address::multicast::{self as directory_groups, Kind, Message};
use super::address::{Resolved, parse_gid};
use super::{Engine, wire};
use crate::ucp::{AmPayload, AppSpan, LockedWorker, SendPayload, SendState};
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// The destination QPN of a multicast datagram (IBA 10.5.2.2, the "multicast QP").
pub const MULTICAST_QPN: u32 = 0x00ff_ffff;
/// How many groups a process's QPs may be attached to (`max_mcast_grp`).
pub const MAX_GROUPS: usize = directory_groups::MAX_ENTRY_GROUPS;
/// How many QPs of a process may be attached to one group (`max_mcast_qp_attach`).
pub const MAX_GROUP_QPS: usize = 56;
/// How many members on other hosts a group keeps.
const MAX_REMOTE_MEMBERS: usize = 64;
/// The largest multicast datagram fetched from a peer: the MGID in front of a UD message of
/// at most 4096 bytes (the port's MTU; the verbs layer sends nothing larger).
pub const MAX_FRAMED_DATAGRAM: usize = 16 + 4096;
/// Discovery messages read per wake-up of the discovery thread.
const MAX_MESSAGES_PER_WAKE: usize = 64;
/// How many groups a process sends to across hosts.
const MAX_INTEREST: usize = 256;
/// How often the discovery thread asks again who is in the groups this process sends to.
pub const REFRESH: Duration = Duration::from_secs(1);
/// A member on another host that has not answered for this long is forgotten.
const FORGET: Duration = Duration::from_millis(3500);
/// How long the first interest in a group waits for members on other hosts to answer.
const FIRST_ANSWERS: Duration = Duration::from_millis(300);
/// How long an exiting process waits for its multicast sends to leave.
const EXIT_DRAIN: Duration = Duration::from_secs(1);
/// How many member lookups run at once (each a thread; a lookup may take
/// `address::lookup::QUERY_TIMEOUT`).
pub const MAX_LOOKUPS: usize = 4;
/// How long a member whose lookup failed is not looked up again, the first time.
pub const LOOKUP_BACKOFF: Duration = Duration::from_secs(1);
/// The longest back-off after failed lookups.
pub const MAX_LOOKUP_BACKOFF: Duration = Duration::from_secs(30);

/// A multicast GID (IBA 4.1.1: the first byte is 0xFF).
pub fn is_multicast_gid(gid: &[u8; 16]) -> bool {
    gid[0] == 0xff
}

/// A multicast LID (IBA 4.1.2: 0xC000–0xFFFE; 0xFFFF is the permissive LID).
pub fn is_multicast_lid(lid: u16) -> bool {
    (0xc000..=0xfffe).contains(&lid)
}

/// The multicast LID ugdr's connection manager gives a group (as a subnet manager would):
/// derived from the MGID, so every host gives the same one.
pub fn mlid_of(mgid: &[u8; 16]) -> u16 {
    let h = mgid.iter().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(*b)).wrapping_mul(0x0100_0193)
    });
    0xc000 + (h % 0x3fff) as u16
}

/// Why a QP cannot be attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AttachError {
    #[error("the process's QPs are attached to {MAX_GROUPS} groups already")]
    TooManyGroups,
    #[error("{MAX_GROUP_QPS} QPs of this process are attached to the group already")]
    TooManyQps,
}

#[derive(Default)]
struct Multicast {
    /// This process's QPs by group.
    attached: Mutex<HashMap<[u8; 16], Vec<u32>>>,
    local: Mutex<LocalView>,
    /// Groups this process sends to, with their members on other hosts.
    remote: Mutex<HashMap<[u8; 16], Members>>,
    /// QPs created with `IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`: their own datagrams never come
    /// back to them.
    no_loopback: Mutex<HashSet<u32>>,
    /// Member messages UCX has not finished sending.
    in_flight: Arc<AtomicUsize>,
    /// Member lookups running.
    lookups: AtomicUsize,
    discovery: OnceLock<Option<Discovery>>,
}

/// The directory's group entries as last read.
#[derive(Default)]
struct LocalView {
    read_at: Option<SystemTime>,
    members: HashMap<[u8; 16], Vec<u16>>,
    resolved: HashMap<u16, Resolved>,
}

/// A group's members on other hosts, by GID.
type Members = HashMap<[u8; 16], Member>;

struct Member {
    seen: Instant,
    /// The time (its sender's clock) of its latest announcement or answer: a leave older
    /// than that is stale.
    announced: u64,
    resolved: Option<Resolved>,
    /// When its worker address may be looked up (again): [`FORGET`] after it was found
    /// (the GID's LID may have passed to another process, one that crashed announces
    /// nothing), a back-off after a failure.
    lookup_after: Instant,
    /// Lookups failed in a row.
    failures: u32,
    /// A lookup thread is asking for it.
    looking_up: bool,
}

impl Member {
    fn new(announced: u64) -> Member {
        let now = Instant::now();
        Member {
            seen: now,
            announced,
            resolved: None,
            lookup_after: now,
            failures: 0,
            looking_up: false,
        }
    }

    /// The back-off after the `failures`-th failed lookup in a row.
    fn backoff(failures: u32) -> Duration {
        LOOKUP_BACKOFF
            .saturating_mul(1 << failures.saturating_sub(1).min(16))
            .min(MAX_LOOKUP_BACKOFF)
    }
}

/// The discovery sockets: one on `UGDR_PORT` joined to the groups' IPv4 addresses (shared by
/// this user's processes), one of its own for the answers to this process's questions.
struct Discovery {
    group_socket: UdpSocket,
    query_socket: UdpSocket,
    iface: Ipv4Addr,
    port: u16,
    joined: Mutex<HashSet<Ipv4Addr>>,
}

static STATE: LazyLock<Multicast> = LazyLock::new(Multicast::default);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Engine {
    /// Attaches QP `qpn` to group `mgid` (again: nothing changes).
    pub fn multicast_attach(&self, mgid: &[u8; 16], qpn: u32) -> Result<(), AttachError> {
        let mut attached = lock(&STATE.attached);
        let new_group = !attached.contains_key(mgid);
        if new_group && attached.len() >= MAX_GROUPS {
            return Err(AttachError::TooManyGroups);
        }
        let qps = attached.entry(*mgid).or_default();
        if qps.contains(&qpn) {
            return Ok(());
        }
        if qps.len() >= MAX_GROUP_QPS {
            return Err(AttachError::TooManyQps);
        }
        qps.push(qpn);
        if new_group {
            if self.stopping.load(Ordering::Acquire) {
                // The entry was withdrawn with the LID (`multicast_withdraw`).
                return Ok(());
            }
            self.publish_groups(&attached);
            drop(attached);
            if let Some(d) = self.discovery() {
                d.join(mgid);
                d.send_to_group(self, &Message::new(Kind::Member, *mgid, self.gid));
            }
        }
        Ok(())
    }

    /// Detaches QP `qpn` from group `mgid`; false when it was not attached.
    pub fn multicast_detach(&self, mgid: &[u8; 16], qpn: u32) -> bool {
        let mut attached = lock(&STATE.attached);
        let Some(qps) = attached.get_mut(mgid) else {
            return false;
        };
        let Some(i) = qps.iter().position(|q| *q == qpn) else {
            return false;
        };
        qps.remove(i);
        if qps.is_empty() {
            attached.remove(mgid);
            if self.stopping.load(Ordering::Acquire) {
                return true;
            }
            self.publish_groups(&attached);
            drop(attached);
            if let Some(d) = self.discovery() {
                d.send_to_group(self, &Message::new(Kind::Left, *mgid, self.gid));
                if !lock(&STATE.remote).contains_key(mgid) {
                    d.leave(mgid);
                }
            }
        }
        true
    }

    /// QP `qpn` does not receive the datagrams it sends to groups it is attached to
    /// (`IBV_QP_CREATE_BLOCK_SELF_MCAST_LB`).
    pub fn multicast_block_loopback(&self, qpn: u32) {
        lock(&STATE.no_loopback).insert(qpn);
    }

    /// QP `qpn` is gone.
    pub(super) fn multicast_forget_qp(&self, qpn: u32) {
        if lock(&STATE.no_loopback).remove(&qpn) {
            tracing::trace!("multicast: qp {qpn:#x} forgotten");
        }
    }

    /// How many groups QP `qpn` is attached to.
    pub fn multicast_groups_of(&self, qpn: u32) -> usize {
        lock(&STATE.attached)
            .values()
            .filter(|q| q.contains(&qpn))
            .count()
    }

    fn publish_groups(&self, attached: &HashMap<[u8; 16], Vec<u32>>) {
        let groups: Vec<[u8; 16]> = attached.keys().copied().collect();
        self.directory
            .publish_groups(self.gate.secret(), self.lid, &groups);
    }

    /// This process will send to `mgid`: from now on its members on other hosts are asked
    /// for and kept up to date; the first time, waits briefly for their answers. Blocking:
    /// call without the worker lock.
    pub fn multicast_interest(&self, mgid: &[u8; 16]) {
        let Some(d) = self.discovery() else {
            return;
        };
        {
            let mut remote = lock(&STATE.remote);
            if remote.contains_key(mgid) || remote.len() >= MAX_INTEREST {
                return;
            }
            remote.insert(*mgid, HashMap::new());
        }
        d.join(mgid);
        d.ask(self, mgid);
        std::thread::sleep(FIRST_ANSWERS);
    }

    /// The member processes of `mgid` other than this one: on this host from the directory,
    /// on others from discovery.
    fn multicast_members(&self, mgid: &[u8; 16]) -> Vec<Resolved> {
        let mut out = Vec::new();
        {
            let mut local = lock(&STATE.local);
            let changed = self.directory.changed_at();
            if changed.is_none() || changed != local.read_at {
                local.read_at = changed;
                local.members = self.directory.group_members(self.gate.secret());
                // A LID may have passed to another process since.
                local.resolved.clear();
            }
            let lids = local.members.get(mgid).cloned().unwrap_or_default();
            for lid in lids.into_iter().filter(|l| *l != self.lid) {
                if !local.resolved.contains_key(&lid)
                    && let Ok(r) = self.resolve(lid, None)
                {
                    local.resolved.insert(lid, r);
                }
                out.extend(local.resolved.get(&lid).cloned());
            }
        }
        if let Some(members) = lock(&STATE.remote).get(mgid) {
            out.extend(members.values().filter_map(|m| m.resolved.clone()));
        }
        out
    }

    /// Sends a UD datagram (`header` as the requester built it, `data` its payload) to every
    /// QP attached to `mgid`, here and in other processes.
    pub fn multicast_send(
        &self,
        locked: &LockedWorker<'_>,
        mgid: &[u8; 16],
        header: &wire::Header,
        data: &[u8],
    ) {
        let mut h = *header;
        h.flags |= wire::FLAG_MULTICAST;
        h.dst_qpn = MULTICAST_QPN;
        let members = self.multicast_members(mgid);
        if !members.is_empty() {
            let mut framed = crate::ucp::OwnedBytes::with_capacity(16 + data.len());
            framed.extend_from_slice(mgid);
            framed.extend_from_slice(data);
            let encoded = h.encode();
            for member in members {
                let peer = match self.connect(locked, &member, MULTICAST_QPN) {
                    Ok(p) => p,
                    Err(e) => {
                        tracing::debug!("multicast: member lid {:#06x}: {e}", member.lid);
                        continue;
                    }
                };
                let in_flight = Arc::clone(&STATE.in_flight);
                in_flight.fetch_add(1, Ordering::AcqRel);
                let done = Arc::clone(&in_flight);
                let sent = peer.endpoint.am_send(
                    locked,
                    wire::AM_ID,
                    &encoded,
                    SendPayload::Owned(framed.clone()),
                    move |_, _| {
                        done.fetch_sub(1, Ordering::AcqRel);
                    },
                );
                if !matches!(sent, Ok(SendState::Pending)) {
                    in_flight.fetch_sub(1, Ordering::AcqRel);
                }
            }
        }
        let own = lock(&STATE.no_loopback)
            .contains(&header.src_qpn)
            .then_some(header.src_qpn);
        self.deliver_to_group(locked, &h, mgid, data, own);
    }

    /// A multicast datagram from another process (the MGID, then the payload).
    /// Rendezvous payloads larger than [`MAX_FRAMED_DATAGRAM`] are dropped unfetched.
    pub(super) fn multicast_arrived(
        &self,
        locked: &LockedWorker<'_>,
        h: wire::Header,
        payload: AmPayload<'_>,
    ) -> bool {
        match payload {
            AmPayload::Transient(b) => self.deliver_framed(locked, &h, b),
            AmPayload::Persistent(d) => self.deliver_framed(locked, &h, d.bytes()),
            AmPayload::Rendezvous(d) if d.len() > MAX_FRAMED_DATAGRAM => {
                // The sender names the length: nothing larger than a UD message is fetched.
                tracing::debug!("multicast: dropping a {}-byte datagram", d.len());
            }
            AmPayload::Rendezvous(d) => {
                tracing::debug!("multicast: fetching a {}-byte datagram", d.len());
                let buf = Arc::new(Mutex::new(vec![0u8; d.len()]));
                let span = AppSpan::of_owned(&lock(&buf));
                let kept = Arc::clone(&buf);
                let done = Box::new(move |locked: &LockedWorker<'_>, r: Result<usize, _>| {
                    if r.is_ok()
                        && let Some(e) = Engine::running()
                    {
                        e.deliver_framed(locked, &h, &lock(&kept));
                    }
                });
                match locked.receive_rendezvous(d, &[span], done) {
                    Ok(true) => self.deliver_framed(locked, &h, &lock(&buf)),
                    Ok(false) => {}
                    Err(e) => tracing::debug!("multicast: cannot receive a datagram: {e}"),
                }
            }
        }
        false
    }

    fn deliver_framed(&self, locked: &LockedWorker<'_>, h: &wire::Header, framed: &[u8]) {
        let Some((mgid, data)) = framed.split_first_chunk::<16>() else {
            tracing::debug!("multicast: dropping a datagram without its group");
            return;
        };
        self.deliver_to_group(locked, h, mgid, data, None);
    }

    /// Hands a datagram to every QP of this process attached to `mgid` now (but `skip`).
    fn deliver_to_group(
        &self,
        locked: &LockedWorker<'_>,
        h: &wire::Header,
        mgid: &[u8; 16],
        data: &[u8],
        skip: Option<u32>,
    ) {
        let qpns = lock(&STATE.attached).get(mgid).cloned().unwrap_or_default();
        for qpn in qpns.into_iter().filter(|q| Some(*q) != skip) {
            if let Some(qp) = self.receiver(qpn) {
                let mut h = *h;
                h.dst_qpn = qpn;
                qp.group_datagram(locked, h, mgid, AmPayload::Transient(data));
            }
        }
    }

    /// At exit, before the LID is released (whoever claims it next must not find this
    /// process's entry, nor have its own removed by this process): the groups are left and
    /// the entry removed; nothing is published after (`stopping` is set).
    pub(super) fn multicast_withdraw(&self) -> Vec<[u8; 16]> {
        let mut attached = lock(&STATE.attached);
        let groups: Vec<[u8; 16]> = attached.keys().copied().collect();
        attached.clear();
        if !groups.is_empty() {
            self.publish_groups(&attached);
        }
        groups
    }

    /// At exit: other hosts hear that this process left `groups` (from
    /// [`Engine::multicast_withdraw`]), and multicast sends still in UCX's hands get a moment
    /// to leave.
    pub(super) fn multicast_shutdown(&self, locked: &LockedWorker<'_>, groups: &[[u8; 16]]) {
        if let Some(d) = STATE.discovery.get().and_then(Option::as_ref) {
            for mgid in groups {
                d.send_to_group(self, &Message::new(Kind::Left, *mgid, self.gid));
            }
        }
        let until = Instant::now() + EXIT_DRAIN;
        while STATE.in_flight.load(Ordering::Acquire) > 0 && Instant::now() < until {
            locked.progress();
        }
    }

    fn discovery(&self) -> Option<&'static Discovery> {
        STATE
            .discovery
            .get_or_init(|| {
                Discovery::start(self)
                    .inspect_err(|e| {
                        tracing::warn!(
                            "multicast: no discovery across hosts (members on this host only): {e}"
                        )
                    })
                    .ok()
                    .flatten()
            })
            .as_ref()
    }
}

impl Discovery {
    /// The sockets and their thread; None when the host has no interface to other hosts.
    fn start(engine: &Engine) -> std::io::Result<Option<Discovery>> {
        use socket2::{Domain, Type};
        let iface = engine.network.ipv4;
        if iface.is_loopback() {
            return Ok(None);
        }
        let port = super::address::query_port();
        let udp = |port: u16, shared: bool| -> std::io::Result<UdpSocket> {
            let s = crate::sys::socket::new_socket(Domain::IPV4, Type::DGRAM)?;
            if shared {
                s.set_reuse_address(true)?;
                s.set_reuse_port(true)?;
            }
            s.bind(&SocketAddr::new(Ipv4Addr::UNSPECIFIED.into(), port).into())?;
            s.set_multicast_if_v4(&iface)?;
            // Members on this host are found in the directory.
            s.set_multicast_loop_v4(false)?;
            s.set_read_timeout(Some(Duration::from_millis(1)))?;
            Ok(s.into())
        };
        let d = Discovery {
            group_socket: udp(port, true)?,
            query_socket: udp(0, false)?,
            iface,
            port,
            joined: Mutex::new(HashSet::new()),
        };
        crate::sys::process::spawn_thread("ugdr-multicast", discovery_loop)?;
        Ok(Some(d))
    }

    fn join(&self, mgid: &[u8; 16]) {
        let group = directory_groups::ip_group(mgid);
        if lock(&self.joined).insert(group)
            && let Err(e) = self.group_socket.join_multicast_v4(&group, &self.iface)
        {
            // Linux allows 20 memberships per socket (net.ipv4.igmp_max_memberships).
            tracing::warn!("multicast: cannot join {group} for discovery: {e}");
            lock(&self.joined).remove(&group);
        }
    }

    fn leave(&self, mgid: &[u8; 16]) {
        let group = directory_groups::ip_group(mgid);
        if lock(&self.joined).remove(&group) {
            let _ = self.group_socket.leave_multicast_v4(&group, &self.iface);
        }
    }

    fn group_address(&self, mgid: &[u8; 16]) -> SocketAddrV4 {
        SocketAddrV4::new(directory_groups::ip_group(mgid), self.port)
    }

    fn send_to_group(&self, engine: &Engine, m: &Message) {
        let to = self.group_address(&m.mgid);
        if let Err(e) = self
            .group_socket
            .send_to(&m.encode(engine.gate.secret()), to)
        {
            tracing::debug!("multicast: cannot send to {to}: {e}");
        }
    }

    fn ask(&self, engine: &Engine, mgid: &[u8; 16]) {
        let m = Message::new(Kind::Question, *mgid, engine.gid);
        let to = self.group_address(mgid);
        if let Err(e) = self
            .query_socket
            .send_to(&m.encode(engine.gate.secret()), to)
        {
            tracing::debug!("multicast: cannot ask {to}: {e}");
        }
    }
}

/// The discovery thread: answers questions about the groups this process is in, keeps the
/// members of the groups it sends to, asks again every [`REFRESH`].
fn discovery_loop() {
    let mut next_refresh = Instant::now() + REFRESH;
    let mut buf = [0u8; directory_groups::MAX_MESSAGE + 1];
    let mut replays = directory_groups::Replays::default();
    // Started while the sockets are being published.
    let d = loop {
        match STATE.discovery.get() {
            Some(Some(d)) => break d,
            Some(None) => return,
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    loop {
        let Some(engine) = Engine::running() else {
            return;
        };
        let fds = [d.group_socket.as_raw_fd(), d.query_socket.as_raw_fd()];
        let ready = crate::ucp::wait_readable(&fds, 100);
        for i in ready {
            let socket = if i == 0 {
                &d.group_socket
            } else {
                &d.query_socket
            };
            // Bounded per wake-up: a flood must not keep the refresh and the sweep from running.
            for _ in 0..MAX_MESSAGES_PER_WAKE {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    break;
                };
                match Message::decode(engine.gate.secret(), &buf[..n]) {
                    Some((m, stamp)) if replays.first_time(&stamp) => {
                        heard(engine, d, m, stamp.time, from)
                    }
                    Some(_) => {
                        tracing::debug!("multicast: dropped a replayed message from {from}")
                    }
                    None => tracing::debug!("multicast: dropped a discovery message from {from}"),
                }
            }
        }
        if Instant::now() >= next_refresh {
            next_refresh = Instant::now() + REFRESH;
            let groups: Vec<[u8; 16]> = {
                let mut remote = lock(&STATE.remote);
                for members in remote.values_mut() {
                    members.retain(|_, m| m.seen.elapsed() < FORGET);
                }
                remote.keys().copied().collect()
            };
            for mgid in groups {
                d.ask(engine, &mgid);
            }
        }
    }
}

/// A discovery message sent at `time` (by its sender's clock).
fn heard(engine: &'static Engine, d: &Discovery, m: Message, time: u64, from: SocketAddr) {
    let Some((ip, lid)) = parse_gid(&m.gid) else {
        return;
    };
    if ip == engine.network.ipv4 {
        return; // this host's members are in the directory
    }
    match m.kind {
        Kind::Question => {
            if lock(&STATE.attached).contains_key(&m.mgid) {
                let answer = Message {
                    kind: Kind::Member,
                    mgid: m.mgid,
                    gid: engine.gid,
                    nonce: m.nonce,
                };
                let _ = d
                    .group_socket
                    .send_to(&answer.encode(engine.gate.secret()), from);
            }
        }
        Kind::Left => {
            if let Some(members) = lock(&STATE.remote).get_mut(&m.mgid)
                && members.get(&m.gid).is_some_and(|mb| time >= mb.announced)
            {
                members.remove(&m.gid);
            }
        }
        Kind::Member => {
            {
                let mut remote = lock(&STATE.remote);
                let Some(members) = remote.get_mut(&m.mgid) else {
                    return;
                };
                let full = members.len() >= MAX_REMOTE_MEMBERS;
                let member = match members.entry(m.gid) {
                    Entry::Occupied(e) => e.into_mut(),
                    Entry::Vacant(_) if full => {
                        tracing::debug!("multicast: group full, ignoring lid {lid:#06x} at {ip}");
                        return;
                    }
                    Entry::Vacant(e) => e.insert(Member::new(time)),
                };
                member.seen = Instant::now();
                member.announced = member.announced.max(time);
                if member.looking_up || Instant::now() < member.lookup_after {
                    return;
                }
                if STATE.lookups.fetch_add(1, Ordering::AcqRel) >= MAX_LOOKUPS {
                    // Asked again at its next answer.
                    STATE.lookups.fetch_sub(1, Ordering::AcqRel);
                    return;
                }
                member.looking_up = true;
            }
            let (mgid, gid) = (m.mgid, m.gid);
            let spawned = crate::sys::process::spawn_thread("ugdr-mcast-lookup", move || {
                look_up_member(engine, mgid, gid, lid, ip)
            });
            if let Err(e) = spawned {
                tracing::debug!("multicast: no thread to look lid {lid:#06x} up: {e}");
                lookup_done(&mgid, &gid, None);
            }
        }
    }
}

/// A lookup thread: a member's worker address through the authenticated lookup, and an
/// endpoint opened now rather than at the first datagram.
fn look_up_member(engine: &Engine, mgid: [u8; 16], gid: [u8; 16], lid: u16, ip: Ipv4Addr) {
    let resolved = engine.resolve(lid, Some(&gid)).ok();
    if let Some(r) = &resolved {
        let locked = engine.worker.lock();
        if let Err(e) = engine.connect(&locked, r, MULTICAST_QPN) {
            tracing::debug!("multicast: lid {lid:#06x} at {ip}: {e}");
        }
        tracing::debug!("multicast: lid {lid:#06x} at {ip} is a member");
    } else {
        tracing::debug!("multicast: lid {lid:#06x} at {ip}: lookup failed");
    }
    lookup_done(&mgid, &gid, resolved);
}

/// A member's lookup ended (`resolved`: found).
fn lookup_done(mgid: &[u8; 16], gid: &[u8; 16], resolved: Option<Resolved>) {
    if let Some(member) = lock(&STATE.remote)
        .get_mut(mgid)
        .and_then(|members| members.get_mut(gid))
    {
        member.looking_up = false;
        match resolved {
            Some(r) => {
                member.resolved = Some(r);
                member.failures = 0;
                member.lookup_after = Instant::now() + FORGET;
            }
            None => {
                // What was found before stays in use until the member is forgotten.
                member.failures = member.failures.saturating_add(1);
                member.lookup_after = Instant::now() + Member::backoff(member.failures);
            }
        }
    }
    STATE.lookups.fetch_sub(1, Ordering::AcqRel);
}
