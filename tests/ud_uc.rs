//! The UD, UC and XRC programs of ibverbs-utils, unmodified, under libugdr.so: on one host and
//! across two network namespaces; `ibv_asyncwatch` waits for events.

mod harness;

use harness::*;
use std::time::{Duration, Instant};

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn uc_pingpong_validated() {
    pingpong("ibv_uc_pingpong", &["-c"], 60);
}

#[test]
fn uc_pingpong_events() {
    pingpong("ibv_uc_pingpong", &["-e", "-c"], 90);
}

#[test]
fn uc_pingpong_64k() {
    pingpong("ibv_uc_pingpong", &["-s", "65536", "-c"], 60);
}

#[test]
fn ud_pingpong_validated() {
    pingpong("ibv_ud_pingpong", &["-c"], 60);
}

#[test]
fn ud_pingpong_4000_bytes() {
    pingpong("ibv_ud_pingpong", &["-s", "4000", "-c"], 60);
}

#[test]
fn ud_pingpong_events() {
    pingpong("ibv_ud_pingpong", &["-e", "-c"], 90);
}

#[test]
fn ud_pingpong_with_a_grh() {
    pingpong("ibv_ud_pingpong", &["-g", "0", "-c"], 60);
}

fn ud_pingpong_across_namespaces(tag: &str, opts: &[&str]) {
    let ns = NetnsPair::new(tag);
    pingpong_across_namespaces(&ns, "ibv_ud_pingpong", opts, 90);
}

#[test]
fn ud_pingpong_across_hosts_by_lid() {
    ud_pingpong_across_namespaces("ul", &["-c"]);
}

#[test]
fn ud_pingpong_across_hosts_by_gid() {
    ud_pingpong_across_namespaces("ug", &["-g", "0", "-s", "4000", "-c"]);
}

#[test]
fn uc_pingpong_across_hosts() {
    let ns = NetnsPair::new("uc");
    pingpong_across_namespaces(&ns, "ibv_uc_pingpong", &["-c"], 90);
}

/// The `local:`/`remote:` line of an `ibv_xsrq_pingpong` output, without its label: `LID …,
/// QPN RECV … SEND …, PSN …, SRQN …, GID …`.
fn xsrq_line(out: &std::process::Output, label: &str) -> String {
    let so = stdout(out);
    let line = so
        .lines()
        .find_map(|l| l.trim().strip_prefix(label))
        .unwrap_or_else(|| panic!("no `{label}` line\n{}", text(out)));
    line.trim().to_string()
}

/// Both sides of `ibv_xsrq_pingpong` exited 0 with "success" (every ping got its pong: the
/// program counts the receive completions on the XRC SRQ's CQ, finds their XRC_RECV QP by
/// `wc.qp_num`, and fails on any error completion), and each side's view of the other is what
/// the other printed about itself: XRC_RECV and XRC_SEND QP numbers, and a non-zero SRQ number.
fn assert_xsrq_passed(s: &std::process::Output, c: &std::process::Output) {
    for (side, o) in [("server", s), ("client", c)] {
        assert_success(o, &format!("ibv_xsrq_pingpong {side}"));
        assert_eq!(
            stdout(o).lines().last(),
            Some("success"),
            "{side}\n{}",
            text(o)
        );
        let local = xsrq_line(o, "local:");
        let srqn = local
            .split("SRQN ")
            .nth(1)
            .and_then(|r| r.split(',').next())
            .and_then(|n| u32::from_str_radix(n.trim(), 16).ok())
            .unwrap_or_else(|| panic!("{side}: no SRQN in `{local}`"));
        assert!(srqn != 0 && srqn <= 0xff_ffff, "{side}: SRQN {srqn:#x}");
    }
    // The PSN column is the one each side chose for the other: compare the rest.
    let without_psn = |l: String| -> String {
        l.split(", ")
            .filter(|f| !f.starts_with("PSN"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    assert_eq!(
        without_psn(xsrq_line(s, "remote:")),
        without_psn(xsrq_line(c, "local:"))
    );
    assert_eq!(
        without_psn(xsrq_line(c, "remote:")),
        without_psn(xsrq_line(s, "local:"))
    );
}

fn xsrq_pingpong(opts: &[&str]) {
    let port = free_port().to_string();
    let mut sargs = vec!["-p", port.as_str()];
    sargs.extend_from_slice(opts);
    let mut cargs = sargs.clone();
    cargs.push("127.0.0.1");
    let (s, c) = run_pingpong(
        preloaded("ibv_xsrq_pingpong", &sargs),
        preloaded("ibv_xsrq_pingpong", &cargs),
        port.parse().unwrap(),
        Duration::from_secs(60),
    );
    assert_xsrq_passed(&s, &c);
}

#[test]
fn xsrq_pingpong_on_one_host() {
    xsrq_pingpong(&["-n", "200"]);
}

#[test]
fn xsrq_pingpong_events_and_rendezvous_sizes() {
    xsrq_pingpong(&["-e", "-n", "50", "-s", "200000"]);
}

/// `-o`: the buffer is an ODP MR (`xrc_odp_caps` says SEND, SRQ_RECV, WRITE, READ, ATOMIC).
#[test]
fn xsrq_pingpong_on_demand_paging() {
    xsrq_pingpong(&["-o", "-n", "50"]);
}

#[test]
fn xsrq_pingpong_across_namespaces() {
    let ns = NetnsPair::new("xs");
    let port = free_port().to_string();
    let args = ["-p", port.as_str(), "-n", "100"];
    let mut cargs = args.to_vec();
    cargs.push(ADDR_A);
    let (s, c) = ns.run_pingpong(
        ns.command(&ns.a, "ibv_xsrq_pingpong", &args),
        ns.command(&ns.b, "ibv_xsrq_pingpong", &cargs),
        port.parse().unwrap(),
        Duration::from_secs(90),
    );
    assert_xsrq_passed(&s, &c);
}

#[test]
fn asyncwatch_opens_ugdr0_and_waits_for_events() {
    let mut watch = Guarded::spawn(preloaded("ibv_asyncwatch", &[]), "ibv_asyncwatch");
    std::thread::sleep(Duration::from_secs(1));
    watch.assert_running();
    // It blocks in ibv_get_async_event: the port is up from the start, so no event is due.
    let out = watch
        .wait_until(Instant::now())
        .expect_err("ibv_asyncwatch must still be waiting");
    assert!(
        stdout(&out).contains("ugdr0: async event FD"),
        "{}",
        text(&out)
    );
}
