//! rsockets on ugdr: rdmacm-utils' `rstream` (its `-T` modes, with `-T v` verifying every
//! byte), `riostream` (riomap/riowrite, verified) and `rcopy` (a file compared byte for byte),
//! unmodified, on one host and across two network namespaces; and a C program of the API's
//! edge cases and data integrity (tests/c/rsocket_api.c). Datagram rsockets: rdmacm-utils'
//! `udpong` (echo, stream, blocking, async; IPv4 and IPv6; across two namespaces) and a C
//! program of the datagram API (tests/c/rsocket_dgram.c).

mod harness;

use harness::*;
use std::os::unix::process::CommandExt;
use std::process::{Child, Command};
use std::time::Duration;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The report line of an rstream/riostream custom run: `custom <size> <count> ...`.
fn assert_report(out: &str, size: &str, count: &str) {
    assert!(
        out.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 3 && f[0] == "custom" && f[1] == size && f[2] == count
        }),
        "no report of {count} transfers of {size}:\n{out}"
    );
}

/// `program` as server and client on 127.0.0.1 with `args`; both exit 0 and report.
fn local(program: &str, args: &[&str]) {
    let port = free_port();
    let p = port.to_string();
    let mut s = vec!["-p", &p];
    s.extend_from_slice(args);
    let mut c = vec!["-s", "127.0.0.1"];
    c.extend_from_slice(&s);
    let (so, co) = run_pingpong(
        preloaded(program, &s),
        preloaded(program, &c),
        port,
        Duration::from_secs(120),
    );
    assert_success(&so, &format!("{program} server {args:?}"));
    assert_success(&co, &format!("{program} client {args:?}"));
    for out in [stdout(&so), stdout(&co)] {
        assert_report(&out, "97k", "40");
    }
}

const SIZE: [&str; 4] = ["-S", "100000", "-C", "40"];

#[test]
fn rstream_verified_nonblocking_by_default() {
    local("rstream", &[&SIZE[..], &["-T", "v"]].concat());
}

/// `program`'s own default test set (rstream's and riostream's are the same rows) with
/// `args`: latency and bandwidth runs from 64 B (100,000 transfers) to 1 MiB, every row
/// reported by the client.
fn default_test_set(program: &str, args: &[&str]) {
    default_test_set_on(program, args, None, Duration::from_secs(120));
}

/// [`default_test_set`] with both sides confined to `cpus`, for at most `limit`.
fn default_test_set_on(program: &str, args: &[&str], cpus: Option<&[usize]>, limit: Duration) {
    let port = free_port();
    let p = port.to_string();
    let mut s = vec!["-p", p.as_str()];
    s.extend_from_slice(args);
    let mut c = vec!["-s", "127.0.0.1"];
    c.extend_from_slice(&s);
    let (mut server, mut client) = (preloaded(program, &s), preloaded(program, &c));
    if let Some(cpus) = cpus {
        pin(&mut server, cpus);
        pin(&mut client, cpus);
    }
    let (so, co) = run_pingpong(server, client, port, limit);
    assert_success(&so, &format!("{program} server {args:?}"));
    assert_success(&co, &format!("{program} client {args:?}"));
    let out = stdout(&co);
    for (name, size, xfers, iters) in [
        ("64_lat", "64", "1", "100k"),
        ("4k_lat", "4k", "1", "10k"),
        ("64k_lat", "64k", "1", "1k"),
        ("1m_lat", "1m", "1", "100"),
        ("64_bw", "64", "100k", "1"),
        ("4k_bw", "4k", "10k", "1"),
        ("64k_bw", "64k", "1k", "1"),
        ("1m_bw", "1m", "100", "1"),
    ] {
        assert!(
            out.lines()
                .any(|l| l.split_whitespace().take(4).eq([name, size, xfers, iters])),
            "{program} {args:?}: no {name} row:\n{out}"
        );
    }
}

#[test]
fn rstream_default_test_set() {
    default_test_set("rstream", &[]);
}

/// Runs `cmd` on `cpus` only.
fn pin(cmd: &mut Command, cpus: &[usize]) {
    let mut set = nix::sched::CpuSet::new();
    for &c in cpus {
        set.set(c).expect("cpu number");
    }
    // SAFETY: sched_setaffinity is async-signal-safe; nothing else runs between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &set)
                .map_err(std::io::Error::from)
        });
    }
}

/// Busy loops (shell `while :`), one per CPU of `cpus`, pinned there; killed when dropped.
struct BusyCpus(Vec<Child>);

impl BusyCpus {
    fn on(cpus: &[usize]) -> BusyCpus {
        BusyCpus(
            cpus.iter()
                .map(|&c| {
                    let mut cmd = Command::new("sh");
                    cmd.args(["-c", "while :; do :; done"]);
                    pin(&mut cmd, &[c]);
                    cmd.spawn().expect("sh")
                })
                .collect(),
        )
    }
}

impl Drop for BusyCpus {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// rstream's default set (non-blocking sockets: both sides spin on EAGAIN) on two CPUs that
/// also run a busy loop each, as a CI runner with other jobs does. A spin that waited for the
/// engine's progress thread, and yielded the CPU on every EAGAIN, took past 2 minutes there
/// (Linux's EEVDF scheduler pushes a yielding thread's deadline back a slice per yield);
/// calls that progress the worker themselves and pause by a short sleep take seconds.
#[test]
fn rstream_default_test_set_beside_busy_cpus() {
    let Some((cpus, _busy)) = busy_cpus() else {
        return;
    };
    default_test_set_on("rstream", &[], Some(&cpus), Duration::from_secs(60));
}

/// CPUs 0 and 1, each running a busy loop while the returned guard lives; None (and said
/// so) on a host with fewer CPUs.
fn busy_cpus() -> Option<([usize; 2], BusyCpus)> {
    let cpus = [0, 1];
    let online = std::thread::available_parallelism().map_or(1, |n| n.get());
    if online < 2 {
        eprintln!("skipped: needs 2 CPUs, {online} available");
        return None;
    }
    Some((cpus, BusyCpus::on(&cpus)))
}

/// Blocking sockets beside busy CPUs: the application sleeps in the kernel while the engine's
/// progress thread delivers, and that thread polled between yields for a while after every
/// message. Beside a busy loop, under Linux's EEVDF scheduler (each yield pushes the
/// yielding thread's deadline a slice further), it got ever less of the CPU: 20,000 4 KiB
/// ping-pongs took ~19 s, against ~0.4 s on idle CPUs. A yield that comes back a slice late,
/// with the application not polling meanwhile, now sends the thread to sleep on the worker's
/// event fd for a while (woken by the next message, it gets the CPU in time): ~2 s.
#[test]
fn rstream_blocking_beside_busy_cpus() {
    rstream_4k_transfers_beside_busy_cpus("b");
}

/// Asynchronous sockets (`-T a`: non-blocking, `rpoll` with timeout 0 before every call)
/// beside busy CPUs: every `rpoll` that found nothing yielded the CPU, and under EEVDF such a
/// thread gets ever less of it (22–26 s for 20,000 4 KiB transfers, and the client, lagging,
/// often still had data to read when the server hung up, which rstream takes for an error).
/// Now it is paused as a spin on EAGAIN is, by a short sleep now and then: ~0.5 s.
#[test]
fn rstream_async_beside_busy_cpus() {
    rstream_4k_transfers_beside_busy_cpus("a");
}

/// rstream `-T mode -S 4096 -C 20000` on CPUs 0 and 1 with a busy loop on each, within 10 s.
fn rstream_4k_transfers_beside_busy_cpus(mode: &str) {
    let Some((cpus, _busy)) = busy_cpus() else {
        return;
    };
    let port = free_port();
    let p = port.to_string();
    let s = ["-p", p.as_str(), "-T", mode, "-S", "4096", "-C", "20000"];
    let mut c = vec!["-s", "127.0.0.1"];
    c.extend_from_slice(&s);
    let (mut server, mut client) = (preloaded("rstream", &s), preloaded("rstream", &c));
    pin(&mut server, &cpus);
    pin(&mut client, &cpus);
    let (so, co) = run_pingpong(server, client, port, Duration::from_secs(10));
    assert_success(&so, &format!("rstream server -T {mode} -S 4096 -C 20000"));
    assert_success(&co, &format!("rstream client -T {mode} -S 4096 -C 20000"));
    let out = stdout(&co);
    assert!(
        out.lines().any(|l| l
            .split_whitespace()
            .take(4)
            .eq(["custom", "4k", "20k", "1"])),
        "-T {mode}: no custom row:\n{out}"
    );
}

/// A program that uses rsockets only (no verbs context of its own) shuts ugdr's engine down
/// at exit, as a verbs program does: its progress thread stops before UCX's own destructors
/// run, and its LID entry leaves the per-host directory. Only opening a verbs context
/// registered that shutdown: an rsocket program's progress thread went on progressing while
/// UCX was torn down (once aborting riostream inside UCX after its last transfer), and its
/// entries stayed in the directory until the next process swept them.
#[test]
fn an_rsocket_program_shuts_the_engine_down_at_exit() {
    use std::os::unix::fs::DirBuilderExt;
    let rundir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("rundir-exit-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rundir);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&rundir)
        .expect("rundir");
    let port = free_port();
    let p = port.to_string();
    let s = ["-p", p.as_str(), "-S", "1024", "-C", "10"];
    let mut c = vec!["-s", "127.0.0.1"];
    c.extend_from_slice(&s);
    let (mut server, mut client) = (preloaded("rstream", &s), preloaded("rstream", &c));
    server.env("UGDR_RUNDIR", &rundir);
    client.env("UGDR_RUNDIR", &rundir);
    let (so, co) = run_pingpong(server, client, port, Duration::from_secs(30));
    assert_success(&so, "rstream server");
    assert_success(&co, "rstream client");
    let left: Vec<String> = std::fs::read_dir(&rundir)
        .expect("rundir")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("lid-"))
        .collect();
    let _ = std::fs::remove_dir_all(&rundir);
    assert!(
        left.is_empty(),
        "entries left in the directory after both rstreams exited: {left:?}"
    );
}

/// Blocking sockets (`-T b`, MSG_WAITALL): a send that has sent part of its bytes goes on
/// until the peer's credits let it send the rest. It once decided what to wait on after
/// credits had come in and, seeing room, waited for nothing (no completion comes for a
/// credit): both sides blocked for good, in most runs of this set.
#[test]
fn rstream_blocking_default_test_set() {
    default_test_set("rstream", &["-T", "b"]);
}

/// riostream writes into the peer's `riomap`ped buffer with RDMA WRITEs while the peer
/// spins on that buffer's last byte, never calling into rsockets: the WRITEs must land
/// without the peer's CPU. Its 64-byte rows map 64 bytes of a page: reached through the
/// kernel (cross-memory attach) since the same-host path covers part pages; before, each
/// went as a message the spinning target's progress thread had to be scheduled for, about
/// 5 ms apiece on 2 cores (the set ran for many minutes).
#[test]
fn riostream_default_test_set() {
    if let Some(why) = cross_memory_attach_refused() {
        eprintln!("skipped: {why}");
        return;
    }
    default_test_set("riostream", &[]);
}

/// librspreload.so (rdma-core's socket-to-rsocket preload) beside ugdr: `rstream -T s` uses
/// plain sockets, which librspreload turns into rsockets, i.e. ugdr's; ugdr's own CM, lookup
/// and discovery sockets must not become rsockets in turn (they are made by system call).
#[test]
fn plain_sockets_become_ugdr_rsockets_under_librspreload() {
    let rspreload = "/usr/lib/x86_64-linux-gnu/rsocket/librspreload.so";
    assert!(
        std::path::Path::new(rspreload).exists(),
        "{rspreload} (package librdmacm1) missing"
    );
    let preload = format!("{} {rspreload}", lib_path().display());
    let port = free_port();
    let p = port.to_string();
    let args = ["-T", "s", "-S", "100000", "-C", "40", "-p", &p];
    let mut server = preloaded("rstream", &args);
    let mut client = preloaded("rstream", &[&args[..], &["-s", "127.0.0.1"]].concat());
    for c in [&mut server, &mut client] {
        c.env("LD_PRELOAD", &preload).env("UGDR_LOG", "debug");
    }
    let (so, co) = run_pingpong(server, client, port, Duration::from_secs(120));
    assert_success(&so, "rstream -T s server under librspreload");
    assert_success(&co, "rstream -T s client under librspreload");
    for out in [stdout(&so), stdout(&co)] {
        assert_report(&out, "97k", "40");
    }
    let log = String::from_utf8_lossy(&co.stderr);
    assert!(
        log.contains("ugdr::rsocket::stream: rsocket") && log.contains("ConnectResponse status 0"),
        "the client's socket was not one of ugdr's rsockets:\n{log}"
    );
}

#[test]
fn rstream_verified_blocking() {
    local("rstream", &[&SIZE[..], &["-T", "v", "-T", "b"]].concat());
}

#[test]
fn rstream_verified_async_through_rpoll() {
    local("rstream", &[&SIZE[..], &["-T", "v", "-T", "a"]].concat());
}

#[test]
fn rstream_verified_async_blocking_with_rdma_getaddrinfo() {
    local(
        "rstream",
        &[&SIZE[..], &["-T", "v", "-T", "a", "-T", "b", "-T", "r"]].concat(),
    );
}

#[test]
fn rstream_verified_nonblocking_explicitly() {
    local("rstream", &[&SIZE[..], &["-T", "v", "-T", "n"]].concat());
}

#[test]
fn riostream_verified() {
    local("riostream", &[&SIZE[..], &["-T", "v"]].concat());
}

#[test]
fn riostream_verified_async() {
    local("riostream", &[&SIZE[..], &["-T", "v", "-T", "a"]].concat());
}

/// rcopy's server writes where the client says; the copy must equal the source.
fn rcopy(ns: Option<&NetnsPair>) {
    let dir = match ns {
        Some(n) => n.stage_dir().to_path_buf(),
        None => std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")),
    };
    let src = dir.join(format!("rcopy-src-{}", std::process::id()));
    let dst = dir.join(format!("rcopy-dst-{}", std::process::id()));
    let mut data = vec![0u8; 3_000_017];
    let mut x = 0x1234_5678u32;
    for b in data.iter_mut() {
        x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
        *b = (x >> 16) as u8;
    }
    std::fs::write(&src, &data).expect("source file");
    let _ = std::fs::remove_file(&dst);
    let port = free_port();
    let p = port.to_string();
    let (srcs, dsts) = (src.display().to_string(), dst.display().to_string());
    let server_addr = if ns.is_some() { ADDR_A } else { "127.0.0.1" };
    let target = format!("{server_addr}:{dsts}");
    let cargs = [srcs.as_str(), target.as_str(), "-p", &p];
    // The server serves forever: it must still run after the copy; dropping it kills it.
    let (server_cmd, client_cmd) = match ns {
        Some(n) => (
            n.command(&n.a, "rcopy", &["-p", &p]),
            n.command(&n.b, "rcopy", &cargs),
        ),
        None => (preloaded("rcopy", &["-p", &p]), preloaded("rcopy", &cargs)),
    };
    let mut server = Guarded::spawn(server_cmd, "rcopy server");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let up = || match ns {
        Some(n) => n.listening(&n.a, port),
        None => listening(
            port,
            &std::fs::read_to_string("/proc/net/tcp").unwrap_or_default(),
        ),
    };
    while !up() {
        server.assert_running();
        assert!(
            std::time::Instant::now() < deadline,
            "rcopy server never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let co = run(client_cmd, "rcopy client", Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(300));
    server.assert_running();
    assert_success(&co, "rcopy client");
    assert!(stdout(&co).contains("3000017 bytes"), "{}", text(&co));
    let copy = std::fs::read(&dst).unwrap_or_else(|e| panic!("no copy: {e}"));
    assert!(copy == data, "the copy differs from the source");
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(&dst);
}

#[test]
fn rcopy_copies_a_file_exactly() {
    rcopy(None);
}

/// `program` with server in namespace A, client in B (two hosts joined by a link).
fn across(program: &str, args: &[&str]) {
    let ns = NetnsPair::new(&program[..2]);
    let port = free_port();
    let p = port.to_string();
    let mut s = vec!["-p", &p];
    s.extend_from_slice(args);
    let mut c = vec!["-s", ADDR_A];
    c.extend_from_slice(&s);
    let (so, co) = ns.run_pingpong(
        ns.command(&ns.a, program, &s),
        ns.command(&ns.b, program, &c),
        port,
        Duration::from_secs(120),
    );
    assert_success(&so, &format!("{program} server in namespace A"));
    assert_success(&co, &format!("{program} client in namespace B"));
    assert_report(&stdout(&co), "97k", "40");
}

#[test]
fn rstream_verified_across_two_hosts() {
    across("rstream", &[&SIZE[..], &["-T", "v"]].concat());
}

#[test]
fn riostream_verified_across_two_hosts() {
    across("riostream", &[&SIZE[..], &["-T", "v", "-T", "b"]].concat());
}

#[test]
fn rcopy_across_two_hosts() {
    let ns = NetnsPair::new("rc");
    rcopy(Some(&ns));
}

#[test]
fn rsocket_api_edge_cases_and_data_integrity() {
    let exe = build_c("rsocket_api", &["-lrdmacm"]);
    // The second port is one no other test gets and nobody listens on (ECONNREFUSED).
    let (port, unused) = (free_port().to_string(), free_port().to_string());
    run_checked_under_ugdr(&exe, &[&port, &unused], "rsocket_api", "rsocket_api: ok");
}

#[test]
fn rsocket_datagram_api_on_data_and_its_error_cases() {
    let exe = build_c("rsocket_dgram", &["-lrdmacm"]);
    run_checked_under_ugdr(&exe, &[], "rsocket_dgram", "rsocket_dgram: ok");
}

/// Whether a UDP socket is bound to `port`, in the text of /proc/net/udp and /proc/net/udp6.
fn udp_bound(port: u16, proc_net_udp: &str) -> bool {
    proc_net_udp.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 2
            && f[0].ends_with(':')
            && f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// One udpong client run against a server on `addr` (in namespace A of `ns` when given, the
/// client in B): it must exit 0 and report `custom <size> [<xfers>]`.
///
/// udpong's echo waits 1 ms for each answer and then sends again, and a late answer it then
/// reads overwrites the sequence number it sends (its own bug): on a loaded runner a
/// scheduling delay over 1 ms can make it send stale messages forever. A client that has not
/// finished within 20 s is therefore run again, at most twice; nothing else is repeated.
fn udpong_client(ns: Option<&NetnsPair>, addr: &str, port: u16, args: &[&str], report: &[&str]) {
    let p = port.to_string();
    let mut c = vec!["-s", addr, "-p", &p];
    c.extend_from_slice(args);
    for attempt in 0..3 {
        let cmd = match ns {
            Some(n) => n.command(&n.b, "udpong", &c),
            None => preloaded("udpong", &c),
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        let out = match Guarded::spawn(cmd, "udpong client").wait_until(deadline) {
            Ok(out) => out,
            Err(out) if attempt < 2 => {
                eprintln!(
                    "udpong client {args:?} did not finish; once more\n{}",
                    text(&out)
                );
                continue;
            }
            Err(out) => panic!("udpong client {args:?} timed out 3 times\n{}", text(&out)),
        };
        assert_success(&out, &format!("udpong client {args:?}"));
        let line = stdout(&out)
            .lines()
            .find(|l| l.starts_with("custom"))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("udpong {args:?}: no report\n{}", text(&out)));
        let fields: Vec<&str> = line.split_whitespace().collect();
        assert!(
            fields.len() >= 7 && fields[1..].starts_with(report),
            "udpong {args:?}: expected custom {report:?}, got {line:?}"
        );
        return;
    }
}

/// A udpong server on `addr` with `server_args` (in namespace A of `ns` when given), then each
/// client run of `runs` (arguments, expected report fields); the server must still serve after
/// them (it never exits by itself).
fn udpong(ns: Option<&NetnsPair>, addr: &str, server_args: &[&str], runs: &[(&[&str], &[&str])]) {
    let port = free_port();
    let p = port.to_string();
    let mut s = vec!["-b", addr, "-p", &p];
    s.extend_from_slice(server_args);
    let cmd = match ns {
        Some(n) => n.command(&n.a, "udpong", &s),
        None => preloaded("udpong", &s),
    };
    let mut server = Guarded::spawn(cmd, "udpong server");
    let bound = || {
        let text = match ns {
            Some(n) => {
                let out = std::process::Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &n.a,
                        "cat",
                        "/proc/net/udp",
                        "/proc/net/udp6",
                    ])
                    .output()
                    .expect("ip netns exec");
                String::from_utf8_lossy(&out.stdout).into_owned()
            }
            None => {
                std::fs::read_to_string("/proc/net/udp").unwrap_or_default()
                    + &std::fs::read_to_string("/proc/net/udp6").unwrap_or_default()
            }
        };
        udp_bound(port, &text)
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !bound() {
        server.assert_running();
        assert!(
            std::time::Instant::now() < deadline,
            "udpong server never bound"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for (args, report) in runs {
        udpong_client(ns, addr, port, args, report);
    }
    server.assert_running();
}

/// Non-blocking (udpong's default): echo (every datagram answered, so exactly 2 × 20
/// transfers), then a stream of 3000 datagrams the server counts (some may be lost to a full
/// receive ring, as UDP loses them), then the largest size udpong sends.
#[test]
fn udpong_nonblocking_echo_and_stream() {
    udpong(
        None,
        "127.0.0.1",
        &[],
        &[
            (&["-T", "e", "-C", "20", "-S", "1000"], &["1000", "40"]),
            (&["-C", "3000", "-S", "1024"], &["1k"]),
            (&["-T", "e", "-C", "20", "-S", "2048"], &["2k", "40"]),
        ],
    );
}

#[test]
fn udpong_blocking() {
    udpong(
        None,
        "127.0.0.1",
        &["-T", "b"],
        &[
            (
                &["-T", "b", "-T", "e", "-C", "20", "-S", "64"],
                &["64", "40"],
            ),
            (&["-T", "b", "-C", "2000", "-S", "512"], &["512"]),
        ],
    );
}

/// rpoll-driven on both sides, over IPv6 loopback.
#[test]
fn udpong_async_ipv6() {
    udpong(
        None,
        "::1",
        &["-T", "a"],
        &[
            (
                &["-T", "a", "-T", "e", "-C", "20", "-S", "1024"],
                &["1k", "40"],
            ),
            (&["-T", "a", "-C", "2000", "-S", "100"], &["100"]),
        ],
    );
}

#[test]
fn udpong_across_two_hosts() {
    let ns = NetnsPair::new("ud");
    udpong(
        Some(&ns),
        ADDR_A,
        &[],
        &[
            (&["-T", "e", "-C", "20", "-S", "1000"], &["1000", "40"]),
            (&["-C", "2000", "-S", "2048"], &["2k"]),
        ],
    );
}

/// A stream rsocket's credit writes (an inline RDMA WRITE of a count into the peer's credit
/// word) take the same-host direct path: the credit word's area is whole pages, which
/// registration moves onto shared memory. (An 8-byte area stayed private, "ERANGE", and every
/// credit write fell back to a message.)
#[test]
fn rsocket_credit_writes_take_the_direct_path() {
    let port = free_port();
    let p = port.to_string();
    let args = ["-S", "100000", "-C", "40", "-T", "v", "-p", &p];
    let mut server = preloaded("rstream", &args);
    let mut client = preloaded("rstream", &[&args[..], &["-s", "127.0.0.1"]].concat());
    for c in [&mut server, &mut client] {
        c.env("UGDR_LOG", "debug");
    }
    let (so, co) = run_pingpong(server, client, port, Duration::from_secs(120));
    assert_success(&so, "rstream server");
    assert_success(&co, "rstream client");
    let logs =
        String::from_utf8_lossy(&so.stderr).into_owned() + &String::from_utf8_lossy(&co.stderr);
    assert!(
        !logs.contains("stays private"),
        "rsocket memory was left off the direct path:\n{logs}"
    );
    assert!(
        logs.lines().any(|l| l.contains("direct path to pid")
            && !l.contains(", 0 writes")
            && l.ends_with(", 0 fell back to messages")),
        "no credit write took the direct path:\n{logs}"
    );
}
