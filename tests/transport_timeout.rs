//! The RC transport timeout: a peer that stops answering (the link between two hosts cut)
//! ends the connection with IBV_WC_RETRY_EXC_ERR within the QP's timeout × (retry_cnt + 1),
//! as on hardware, instead of a sender that waits forever. (A peer that dies is noticed
//! sooner, by its endpoint: tests/async_events.rs, tests/rdma_cm.rs.)

mod harness;

use harness::*;
use std::process::Command;
use std::time::{Duration, Instant};

/// The veth end inside namespace `ns`.
fn veth_in(ns: &str) -> String {
    let out = Command::new("ip")
        .args(["-n", ns, "-o", "link", "show", "type", "veth"])
        .output()
        .expect("ip link show");
    assert_success(&out, "ip link show type veth");
    let listing = String::from_utf8_lossy(&out.stdout);
    let name = listing
        .split(':')
        .nth(1)
        .map(|n| n.trim().split('@').next().unwrap_or("").to_string())
        .unwrap_or_default();
    assert!(!name.is_empty(), "no veth in {ns}: {listing}");
    name
}

/// ibv_rc_pingpong across two hosts (namespaces) with its own attributes (timeout 14: about
/// 67 ms, retry_cnt 7); the link is cut mid-run. The side whose message is stuck fails with
/// "transport retry counter exceeded" after about 8 × 67 ms (the other may wait for a
/// message forever, as on hardware: it has nothing outstanding).
#[test]
fn a_cut_link_ends_rc_pingpong_with_retry_exc_err_within_the_qp_timeout() {
    let ns = NetnsPair::new("cut");
    let port = free_port();
    let p = port.to_string();
    let args = ["-p", p.as_str(), "-n", "100000000"];
    let mut server = Guarded::spawn(
        ns.command(&ns.a, "ibv_rc_pingpong", &args),
        "ibv_rc_pingpong server",
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ns.listening(&ns.a, port) {
        server.assert_running();
        assert!(Instant::now() < deadline, "the server never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut cargs = args.to_vec();
    cargs.push(ADDR_A);
    let mut client = Guarded::spawn(
        ns.command(&ns.b, "ibv_rc_pingpong", &cargs),
        "ibv_rc_pingpong client",
    );
    // Well into the ping-pong (100 million iterations take far longer than the test).
    std::thread::sleep(Duration::from_millis(1500));
    server.assert_running();
    client.assert_running();

    let veth = veth_in(&ns.b);
    let down = Command::new("ip")
        .args(["-n", &ns.b, "link", "set", "dev", &veth, "down"])
        .output()
        .expect("ip link set down");
    assert_success(&down, "ip link set down");
    let cut = Instant::now();
    let (side, out) = loop {
        if let Some(out) = client.exited() {
            break ("client", out);
        }
        if let Some(out) = server.exited() {
            break ("server", out);
        }
        assert!(
            cut.elapsed() < Duration::from_secs(30),
            "neither side noticed the cut link within 30 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = cut.elapsed();
    eprintln!("{side} ended {took:?} after the link was cut");
    assert!(!out.status.success(), "{side}\n{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains("Failed status transport retry counter exceeded (12)"),
        "{side}\n{}",
        text(&out)
    );
    // 8 × 67 ms = 0.54 s by the IB formula; ugdr's timer ticks every 10 ms. Bounded with
    // margin for a loaded machine, and not sooner than the formula.
    assert!(took < Duration::from_secs(2), "{side} took {took:?}");
    assert!(
        took >= Duration::from_millis(7 * 67),
        "{side} failed after only {took:?}"
    );
}
