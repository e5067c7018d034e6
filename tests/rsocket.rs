//! rsockets on ugdr: rdmacm-utils' `rstream` (its `-T` modes, with `-T v` verifying every
//! byte), `riostream` (riomap/riowrite, verified) and `rcopy` (a file compared byte for byte),
//! unmodified, on one host and across two network namespaces; and a C program of the API's
//! edge cases and data integrity (tests/c/rsocket_api.c).

mod harness;

use harness::*;
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

/// rstream's own default test set: latency and bandwidth runs from 64 B (100,000 transfers)
/// to 1 MiB, every row reported by both sides.
#[test]
fn rstream_default_test_set() {
    let port = free_port();
    let p = port.to_string();
    let (so, co) = run_pingpong(
        preloaded("rstream", &["-p", &p]),
        preloaded("rstream", &["-s", "127.0.0.1", "-p", &p]),
        port,
        Duration::from_secs(120),
    );
    assert_success(&so, "rstream server");
    assert_success(&co, "rstream client");
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
            "no {name} row:\n{out}"
        );
    }
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
