//! The UD, UC and XRC programs of ibverbs-utils, unmodified, under libugdr.so: on one host and
//! (UD) across two network namespaces; `ibv_xsrq_pingpong` fails cleanly (XRC is not carried);
//! `ibv_asyncwatch` waits for events.

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

#[test]
fn xsrq_pingpong_fails_cleanly_because_xrc_is_not_carried() {
    let port = free_port().to_string();
    for (side, args) in [
        ("server", vec!["-p", port.as_str()]),
        ("client", vec!["-p", port.as_str(), "127.0.0.1"]),
    ] {
        let out = run(
            preloaded("ibv_xsrq_pingpong", &args),
            &format!("ibv_xsrq_pingpong {side}"),
            Duration::from_secs(30),
        );
        assert_eq!(out.status.code(), Some(1), "{side}: {}", text(&out));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains("Couldn't Open the XRC Domain 95"),
            "{side}: open_xrcd must fail with EOPNOTSUPP (95)\n{}",
            text(&out)
        );
    }
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
