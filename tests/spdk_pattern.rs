//! SPDK's NVMe-oF RDMA pattern without SPDK (`tests/c/spdk_pattern.c`, built with `cc`
//! against the real verbs.h and rdma_cma.h): a target with one SRQ per poll group shared by
//! RC QPs made with `rdma_create_qp`, an initiator whose qpairs connect and disconnect (either
//! side first) with READ/WRITE/in-capsule commands in flight, completion channels, CQs
//! resized as qpairs come and go, every byte checked. Both processes keep a registry of their
//! live QPs, so an async event that outlives its QP (the use-after-free SPDK hit) or a second
//! LAST_WQE_REACHED fails them. On this host and across two network namespaces.

mod harness;

use harness::*;
use std::path::PathBuf;
use std::process::Output;
use std::sync::OnceLock;
use std::time::Duration;

fn program() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("spdk_pattern", &["-lrdmacm", "-libverbs"]))
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The value of `key=` in `line`.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {key}= in {line:?}"))
        .parse()
        .unwrap()
}

/// Both sides passed, every qpair ended with exactly one LAST_WQE_REACHED, and the pattern
/// really ran (commands, bytes, disconnects from both sides, flushed commands, resizes).
fn assert_passed(qpairs: u64, target: &Output, initiator: &Output) {
    assert_success(target, "spdk_pattern target");
    assert_success(initiator, "spdk_pattern initiator");
    let (t, i) = (stdout(target), stdout(initiator));
    let t = t
        .lines()
        .find(|l| l.starts_with("spdk_pattern target: ok"))
        .unwrap_or_else(|| panic!("no target report\n{}", text(target)))
        .to_string();
    let i = i
        .lines()
        .find(|l| l.starts_with("spdk_pattern initiator: ok"))
        .unwrap_or_else(|| panic!("no initiator report\n{}", text(initiator)))
        .to_string();
    assert_eq!(field(&t, "qpairs"), qpairs, "{t}");
    assert_eq!(field(&t, "last_wqe"), qpairs, "{t}");
    assert_eq!(field(&i, "qpairs"), qpairs, "{i}");
    // A third of the qpairs each: the target disconnects first, the initiator with commands
    // in flight, the initiator once idle.
    assert_eq!(field(&t, "target_disconnects"), qpairs / 3, "{t}");
    assert_eq!(field(&i, "inflight_disconnects"), qpairs / 3, "{i}");
    assert!(field(&i, "commands") >= qpairs * 20, "{i}");
    assert!(field(&t, "commands") >= field(&i, "commands"), "{t}\n{i}");
    assert!(field(&i, "bytes") > 10 << 20, "{i}");
    assert!(field(&i, "flushed_commands") > 0, "{i}");
    assert!(field(&t, "resizes") >= 2 * qpairs, "{t}");
    assert!(field(&i, "resizes") >= qpairs, "{i}");
}

#[test]
fn spdk_pattern_on_this_host() {
    let port = free_port();
    let p = port.to_string();
    let exe = program().display().to_string();
    let (t, i) = run_pingpong(
        preloaded(&exe, &["target", "127.0.0.1", &p, "192"]),
        preloaded(&exe, &["initiator", "127.0.0.1", &p, "192", "8"]),
        port,
        Duration::from_secs(60),
    );
    assert_passed(192, &t, &i);
}

#[test]
fn spdk_pattern_across_namespaces() {
    let ns = NetnsPair::new("spdk");
    let exe = ns.stage(program()).display().to_string();
    let port = free_port();
    let p = port.to_string();
    let (t, i) = ns.run_pingpong(
        ns.command(&ns.a, &exe, &["target", ADDR_A, &p, "96"]),
        ns.command(&ns.b, &exe, &["initiator", ADDR_A, &p, "96", "8"]),
        port,
        Duration::from_secs(90),
    );
    assert_passed(96, &t, &i);
}
