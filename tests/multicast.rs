//! UD multicast: the verbs rules and every completion field (tests/c/multicast.c), rdma_cm's
//! joins and leaves (tests/c/multicast_cm.c), datagrams
//! between processes, and rdmacm-utils' `mckey` with two receivers, on one host and across
//! two network namespaces (no daemon started by anyone).

mod harness;

use harness::*;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::{Command, Output};
use std::time::{Duration, Instant};
use ugdr::engine::address::multicast::{Kind, Message, ip_group};
use ugdr::engine::address::{DEFAULT_QUERY_PORT, port_gid};
use ugdr::engine::auth::Secret;

const DEADLINE: Duration = Duration::from_secs(60);

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn attach_detach_rules_delivery_and_every_completion_field_in_one_process() {
    let exe = build_c("multicast", &["-libverbs"]);
    run_checked_under_ugdr(&exe, &[], "multicast", "multicast: ok");
}

#[test]
fn rdma_cm_join_checks_event_parameters_send_only_members_and_leaving() {
    let exe = build_c("multicast_cm", &["-libverbs", "-lrdmacm"]);
    run_checked_under_ugdr(&exe, &[], "multicast_cm", "multicast_cm: ok");
}

/// `recv` (one or more commands, each printing "ready" once attached) then `send`; all must
/// exit 0 and print "multicast: ok".
fn receivers_then_sender(receivers: Vec<Command>, sender: Command, ready: usize) {
    let mut guarded: Vec<Guarded> = receivers
        .into_iter()
        .map(|c| Guarded::spawn(c, "multicast receiver"))
        .collect();
    // The receivers attach within milliseconds; they print "ready" to their captured output,
    // which is read only at the end, so give them a moment (and check they still run).
    std::thread::sleep(Duration::from_millis(800));
    for g in &mut guarded {
        g.assert_running();
    }
    let deadline = Instant::now() + DEADLINE;
    let s = Guarded::spawn(sender, "multicast sender").wait(deadline);
    assert_success(&s, "multicast sender");
    let mut readies = 0;
    for g in guarded {
        let r = g.wait(deadline);
        assert_success(&r, "multicast receiver");
        let out = stdout(&r);
        readies += out.lines().filter(|l| *l == "ready").count();
        assert_eq!(
            out.lines().filter(|l| *l == "multicast: ok").count(),
            out.lines().filter(|l| *l == "ready").count(),
            "{}",
            text(&r)
        );
    }
    assert_eq!(readies, ready, "receivers that took every datagram");
}

fn program(exe: &std::path::Path, args: &[&str]) -> Command {
    let mut c = Command::new(exe);
    c.args(args).env("LD_PRELOAD", lib_path());
    c
}

#[test]
fn datagrams_reach_every_attached_process_with_every_field() {
    let exe = build_c("multicast", &["-libverbs"]);
    receivers_then_sender(
        vec![
            program(&exe, &["recv", "5", "21"]),
            program(&exe, &["recv", "5", "21"]),
        ],
        program(&exe, &["send", "5", "21"]),
        2,
    );
}

/// What every mckey run prints when its group was joined and its data moved.
fn assert_mckey_passed(out: &str, receivers: usize, group: &str) {
    let count = |s: &str| out.lines().filter(|l| l.contains(s)).count();
    assert_eq!(count("mckey: starting server"), receivers, "{out}");
    assert_eq!(count("mckey: starting client"), 1, "{out}");
    // The kernel CM's MGID for the IPv4 group with rdma_cm's UDP signature.
    assert_eq!(
        count(&format!(
            "mckey: joined dgid: ff12:4001:ffff::{group} mlid 0x"
        )),
        receivers + 1,
        "{out}"
    );
    assert_eq!(count("data transfers complete"), receivers + 1, "{out}");
    assert_eq!(count("return status 0"), receivers + 1, "{out}");
    assert!(!out.contains("failure") && !out.contains("error"), "{out}");
}

/// `mckey` receivers on `addr` in the shell `receivers` runs, then the sender.
fn mckey_run(receivers: Command, sender: Command) -> String {
    let mut r = Guarded::spawn(receivers, "mckey receivers");
    std::thread::sleep(Duration::from_millis(1000));
    r.assert_running();
    let deadline = Instant::now() + DEADLINE;
    let s = Guarded::spawn(sender, "mckey sender").wait(deadline);
    assert_success(&s, "mckey sender");
    // The receivers take all 10 datagrams or poll forever (mckey has no timeout).
    let r = r.wait(deadline);
    assert_success(&r, "mckey receivers");
    format!("{}{}", stdout(&r), stdout(&s))
}

/// Two mckey receivers started by one shell (one host's processes), both must pass; the
/// second's QP is created with IBV_QP_CREATE_BLOCK_SELF_MCAST_LB (`-l`).
fn two_receivers(mckey: &str, group: &str, bind: &str, extra: &str) -> Vec<String> {
    let script = format!(
        "{mckey} -m {group} -b {bind} {extra} & p=$!; {mckey} -m {group} -b {bind} -l {extra}; \
         r=$?; wait $p; exit $(( $? | r ))"
    );
    vec!["-c".into(), script]
}

#[test]
fn mckey_with_two_receivers_on_one_host() {
    let mckey = require("mckey");
    // Datagrams of the full MTU, which the sender's UCX is told to send by rendezvous (the
    // receiving engine fetches them before handing them to its attached QPs).
    let args = two_receivers(&mckey, "239.1.2.31", "127.0.0.1", "-S 4096");
    let mut receivers = Command::new(require("sh"));
    receivers.args(&args).env("LD_PRELOAD", lib_path());
    let mut sender = preloaded(
        "mckey",
        // A send-only full member (`-o`): its QP is not attached.
        &[
            "-m",
            "239.1.2.31",
            "-s",
            "-o",
            "-b",
            "127.0.0.1",
            "-S",
            "4096",
        ],
    );
    sender.env("UCX_RNDV_THRESH", "1024");
    let out = mckey_run(receivers, sender);
    assert_mckey_passed(&out, 2, "f01:21f");
}

#[test]
fn mckey_and_datagrams_across_two_hosts() {
    let ns = NetnsPair::new("m");
    let mckey = require("mckey");
    let args = two_receivers(&mckey, "239.1.2.32", ADDR_A, "");
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = mckey_run(
        ns.command(&ns.a, "sh", &args),
        ns.command(&ns.b, "mckey", &["-m", "239.1.2.32", "-s", "-b", ADDR_B]),
    );
    assert_mckey_passed(&out, 2, "f01:220");

    // Every completion field of datagrams that crossed hosts, to two processes of host A
    // (one shell: they share that host's directory).
    let exe = ns.stage(&build_c("multicast", &["-libverbs"]));
    let exe = exe.to_str().expect("utf-8 path");
    let script =
        format!("{exe} recv 5 33 & p=$!; {exe} recv 5 33; r=$?; wait $p; exit $(( $? | r ))");
    receivers_then_sender(
        vec![ns.command(&ns.a, "sh", &["-c", &script])],
        ns.command(&ns.b, exe, &["send", "5", "33"]),
        2,
    );
}

/// The secret of the discovery tests' ugdr processes, which the tests use to read and make
/// discovery messages.
const TEST_SECRET: &str = "multicast discovery test secret";

fn secret() -> Secret {
    Secret::new(TEST_SECRET.as_bytes(), "test")
}

/// `tests/c/multicast.c`'s MGID for group `tag`.
fn group_gid(tag: u16) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[..6].copy_from_slice(&[0xff, 0x12, 0x40, 0x1b, 0xff, 0xff]);
    g[12..].copy_from_slice(&[0x0e, 0x77, (tag >> 8) as u8, tag as u8]);
    g
}

/// `f` run by a thread inside network namespace `ns` (the sockets it makes stay there).
fn in_netns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/var/run/netns/{ns}");
    std::thread::spawn(move || {
        let netns = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        // SAFETY: setns changes only this thread's network namespace; the fd is open.
        let rc = unsafe { libc::setns(netns.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("thread in the namespace")
}

/// A UDP socket in `ns` on ugdr's discovery port, sharing it with ugdr's sockets there,
/// joined to group `tag`'s discovery address on the interface `iface` (multicast it sends
/// also reaches that host's own sockets).
fn discovery_socket(ns: &str, tag: u16, iface: &str) -> UdpSocket {
    let iface: Ipv4Addr = iface.parse().unwrap();
    in_netns(ns, move || {
        use socket2::{Domain, Socket, Type};
        let s = Socket::new(Domain::IPV4, Type::DGRAM, None).unwrap();
        s.set_reuse_address(true).unwrap();
        s.set_reuse_port(true).unwrap();
        let any = SocketAddr::from((Ipv4Addr::UNSPECIFIED, DEFAULT_QUERY_PORT));
        s.bind(&any.into()).unwrap();
        s.join_multicast_v4(&ip_group(&group_gid(tag)), &iface)
            .unwrap();
        s.set_multicast_if_v4(&iface).unwrap();
        s.set_multicast_loop_v4(true).unwrap();
        s.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        s.into()
    })
}

fn group_address(tag: u16) -> SocketAddrV4 {
    SocketAddrV4::new(ip_group(&group_gid(tag)), DEFAULT_QUERY_PORT)
}

/// Waits (up to 30 s) for the first question about group `tag` that `socket` hears.
fn first_question(socket: &UdpSocket, tag: u16) -> (Message, SocketAddr) {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if let Some((m, _, from)) = receive(socket)
            && m.kind == Kind::Question
            && m.mgid == group_gid(tag)
        {
            return (m, from);
        }
    }
    panic!("no question about group {tag}");
}

/// A discovery message `socket` received, authentic, with its source.
fn receive(socket: &UdpSocket) -> Option<(Message, Vec<u8>, SocketAddr)> {
    let mut buf = [0u8; 512];
    let (n, from) = socket.recv_from(&mut buf).ok()?;
    let (m, _) = Message::decode(&secret(), &buf[..n])?;
    Some((m, buf[..n].to_vec(), from))
}

#[test]
fn a_captured_discovery_message_played_back_changes_nothing() {
    const TAG: u16 = 41;
    let ns = NetnsPair::new("r");
    let exe = ns.stage(&build_c("multicast", &["-libverbs"]));
    let exe = exe.to_str().expect("utf-8 path");
    // A listener on host B's link, as anyone there could run (this one knows nothing secret:
    // the secret only reads what it captured).
    let tap = discovery_socket(&ns.b, TAG, ADDR_B);
    let host_a = discovery_socket(&ns.a, TAG, ADDR_A);
    // The sender is interested in the group (its address handle) long before it sends; it
    // has joined the group's discovery address once it asks.
    let mut sender = ns.command(&ns.b, exe, &["send", "5", &TAG.to_string(), "3000"]);
    sender.env("UGDR_SECRET", TEST_SECRET);
    let sender = Guarded::spawn(sender, "multicast sender");
    first_question(&host_a, TAG);
    // The receiver attaches, leaves and attaches again: it announced, left and announced.
    let mut receiver = ns.command(&ns.a, exe, &["recv", "5", &TAG.to_string(), "rejoin"]);
    receiver.env("UGDR_SECRET", TEST_SECRET);
    let receiver = Guarded::spawn(receiver, "multicast receiver");
    let mut captured = Vec::new();
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until
        && !captured
            .iter()
            .any(|(m, _): &(Message, _)| m.kind == Kind::Left)
    {
        if let Some((m, bytes, _)) = receive(&tap) {
            captured.push((m, bytes));
        }
    }
    let kinds: Vec<Kind> = captured.iter().map(|c| c.0.kind).collect();
    assert!(kinds.contains(&Kind::Left), "no leave captured: {kinds:?}");
    // Played back to the sender's host over and over while it sends: its copy of a leave
    // would make the sender forget the receiver, which then misses the datagrams.
    let deadline = Instant::now() + DEADLINE;
    let replaying = std::thread::spawn(move || {
        let stop = Instant::now() + Duration::from_secs(4);
        let mut sent = 0;
        while Instant::now() < stop {
            for (_, bytes) in &captured {
                tap.send_to(bytes, group_address(TAG)).expect("replay");
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        sent
    });
    let s = sender.wait(deadline);
    assert_success(&s, "multicast sender");
    let r = receiver.wait(deadline);
    assert_success(
        &r,
        "multicast receiver (the replayed leave took it out of the group)",
    );
    assert_eq!(stdout(&r), "ready\nmulticast: ok\n");
    assert!(replaying.join().unwrap() > 100, "played back");
}

/// A fake member host: the lookup service on host A's port, which counts the questions for
/// each LID and never answers them (`hang`: keeps the connection open, else: closes it).
fn fake_lookup_service(
    ns: &str,
    hang: &'static [u16],
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<Vec<(u16, Instant)>> {
    let listener = in_netns(ns, || {
        TcpListener::bind((Ipv4Addr::UNSPECIFIED, DEFAULT_QUERY_PORT)).expect("lookup port")
    });
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut asked = Vec::new();
        let mut held = Vec::new();
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            let Ok((mut c, _)) = listener.accept() else {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            };
            c.set_nonblocking(false).unwrap();
            c.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut q = [0u8; 256];
            let n = c.read(&mut q).unwrap_or(0);
            // `UGDR/3 LOOKUP <lid> <nonce> <mac>`
            let text = String::from_utf8_lossy(&q[..n]).into_owned();
            let lid = text
                .split(' ')
                .nth(2)
                .and_then(|l| u16::from_str_radix(l, 16).ok());
            let Some(lid) = lid else { continue };
            asked.push((lid, Instant::now()));
            if hang.contains(&lid) {
                held.push(c);
            }
        }
        asked
    })
}

#[test]
fn members_whose_lookup_fails_back_off_and_never_stall_discovery() {
    const TAG: u16 = 42;
    // Two members whose lookups hang until the client's timeout, one whose lookup fails at
    // once; all three answer every question, and the last also announces itself every
    // 50 ms. The members are this test (it has the secret), on host A.
    const HANGING: &[u16] = &[0x0111, 0x0112];
    const FAILING: u16 = 0x0113;
    const WINDOW: Duration = Duration::from_secs(6);
    let ns = NetnsPair::new("l");
    let exe = ns.stage(&build_c("multicast", &["-libverbs"]));
    let exe = exe.to_str().expect("utf-8 path");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lookups = fake_lookup_service(&ns.a, HANGING, std::sync::Arc::clone(&stop));
    let member = discovery_socket(&ns.a, TAG, ADDR_A);
    let mut sender = ns.command(&ns.b, exe, &["send", "1", &TAG.to_string(), "8000"]);
    sender.env("UGDR_SECRET", TEST_SECRET);
    let sender = Guarded::spawn(sender, "multicast sender");
    let (mgid, s) = (group_gid(TAG), secret());
    let gid = |lid| port_gid(ADDR_A.parse().unwrap(), lid);
    let mut questions = Vec::new();
    // From the sender's first question on (it has joined the group's address then).
    let mut question = Some(first_question(&member, TAG));
    let start = Instant::now();
    let mut next_announce = start;
    while start.elapsed() < WINDOW {
        if let Some((m, from)) = question.take().or_else(|| {
            receive(&member)
                .filter(|(m, ..)| m.kind == Kind::Question && m.mgid == mgid)
                .map(|(m, _, from)| (m, from))
        }) {
            questions.push(Instant::now());
            for lid in HANGING.iter().chain([&FAILING]) {
                let answer = Message {
                    kind: Kind::Member,
                    mgid,
                    gid: gid(*lid),
                    nonce: m.nonce,
                };
                member.send_to(&answer.encode(&s), from).unwrap();
            }
        }
        if Instant::now() >= next_announce {
            next_announce += Duration::from_millis(50);
            let announce = Message::new(Kind::Member, mgid, gid(FAILING));
            member
                .send_to(&announce.encode(&s), group_address(TAG))
                .unwrap();
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Release);
    let asked = lookups.join().unwrap();
    let count = |lid: u16| asked.iter().filter(|(l, _)| *l == lid).count();
    let counts: Vec<(u16, usize)> = HANGING
        .iter()
        .chain([&FAILING])
        .map(|l| (*l, count(*l)))
        .collect();
    // The discovery thread asks every second, whatever the lookups do.
    assert!(
        questions.len() >= 4,
        "{} questions in {WINDOW:?} (lookups by lid: {counts:x?})",
        questions.len()
    );
    // Looked up at its first answer, then after 1, 2 (and 4) s: not at every answer.
    let failing = count(FAILING);
    assert!(
        (2..=4).contains(&failing),
        "lid {FAILING:#06x} looked up {failing} times"
    );
    for lid in HANGING {
        let n = count(*lid);
        assert!((1..=3).contains(&n), "lid {lid:#06x} looked up {n} times");
    }
    drop(sender);
}

#[test]
fn a_killed_members_entries_are_swept_and_a_live_ones_stay() {
    const TAG: &str = "43";
    let exe = build_c("multicast", &["-libverbs"]);
    let rundir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("mcast-sweep-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rundir);
    let start = |args: &[&str], what: &str| {
        let mut c = program(&exe, args);
        c.env("UGDR_RUNDIR", &rundir);
        Guarded::spawn(c, what)
    };
    // (file name, the pid it names) of the directory's entries.
    let entries = || -> Vec<(String, i32)> {
        let Ok(dir) = std::fs::read_dir(&rundir) else {
            return Vec::new();
        };
        let mut found: Vec<(String, i32)> = dir
            .filter_map(|e| {
                let name = e.ok()?.file_name().into_string().ok()?;
                let text = std::fs::read_to_string(rundir.join(&name)).ok()?;
                let pid = text.split(' ').nth(1)?.trim().parse().ok()?;
                Some((name, pid))
            })
            .collect();
        found.sort();
        found
    };
    let group_entry_of = |pid: i32| {
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let e = entries();
            if let Some((name, _)) = e.iter().find(|(n, p)| *p == pid && n.starts_with("mcast-")) {
                return name.clone();
            }
            assert!(
                Instant::now() < until,
                "no multicast entry of pid {pid}: {e:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let killed = start(&["recv", "1", TAG], "member killed");
    let killed_pid = killed.pid();
    let killed_entry = group_entry_of(killed_pid);
    // SAFETY: kill(2) on our own child's pid.
    assert_eq!(unsafe { libc::kill(killed_pid, libc::SIGKILL) }, 0);
    let _ = killed.wait(Instant::now() + DEADLINE);
    let left: Vec<String> = entries()
        .into_iter()
        .filter(|(_, p)| *p == killed_pid)
        .map(|(n, _)| n)
        .collect();
    assert!(
        left.contains(&killed_entry) && left.iter().any(|n| n.starts_with("lid-")),
        "what the killed member left: {left:?}"
    );
    // A live member: its start (its LID's claim) sweeps what the killed one left. Then a
    // sender, whose start sweeps again: its datagram reaches the live member through the
    // live member's entry, which stayed (the member exits when it has it).
    let mut live = start(&["recv", "1", TAG], "live member");
    group_entry_of(live.pid());
    let e = entries();
    assert!(
        !e.iter().any(|(_, p)| *p == killed_pid),
        "the killed member's files stayed: {e:?}"
    );
    live.assert_running();
    let sender = start(&["send", "1", TAG], "sender").wait(Instant::now() + DEADLINE);
    assert_success(&sender, "sender");
    let live = live.wait(Instant::now() + DEADLINE);
    assert_success(&live, "live member");
    assert_eq!(stdout(&live), "ready\nmulticast: ok\n");
    let e = entries();
    assert!(e.is_empty(), "{e:?}");
    let _ = std::fs::remove_dir_all(&rundir);
}
