//! Debian's perftest, unmodified, under ugdr: server and client must both exit 0.
//! ugdr reports its own device identity, so perftest takes its generic (old) post-send path;
//! `--use_old_post_send` says so explicitly.

mod harness;

use harness::*;
use std::time::Duration;

fn perftest(program: &str, opts: &[&str], timeout_s: u64) {
    let port = free_port().to_string();
    let mut args = vec!["-p", port.as_str()];
    args.extend_from_slice(opts);
    let mut client = args.clone();
    client.push("127.0.0.1");
    let (s, c) = run_pingpong(
        preloaded(program, &args),
        preloaded(program, &client),
        port.parse().unwrap(),
        Duration::from_secs(timeout_s),
    );
    assert_success(&s, &format!("{program} server {opts:?}"));
    assert_success(&c, &format!("{program} client {opts:?}"));
    let out = String::from_utf8_lossy(&c.stdout);
    assert!(out.contains("#bytes"), "no result table\n{}", text(&c));
}

const OLD: &str = "--use_old_post_send";

#[test]
fn ib_send_bw() {
    perftest("ib_send_bw", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_send_lat() {
    perftest("ib_send_lat", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_write_bw() {
    perftest("ib_write_bw", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_write_lat() {
    perftest("ib_write_lat", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_read_bw() {
    perftest("ib_read_bw", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_read_lat() {
    perftest("ib_read_lat", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_atomic_bw() {
    perftest("ib_atomic_bw", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_atomic_lat() {
    perftest("ib_atomic_lat", &["-n", "1000", OLD], 90);
}

#[test]
fn ib_send_bw_all_sizes() {
    perftest("ib_send_bw", &["-a"], 240);
}

#[test]
fn ib_write_bw_all_sizes() {
    perftest("ib_write_bw", &["-a"], 240);
}

#[test]
fn ib_read_bw_all_sizes() {
    perftest("ib_read_bw", &["-a"], 240);
}

#[test]
fn ib_write_bw_four_qps() {
    perftest("ib_write_bw", &["-q", "4", "-n", "1000"], 90);
}

#[test]
fn ib_atomic_bw_compare_and_swap() {
    perftest("ib_atomic_bw", &["-A", "CMP_AND_SWAP", "-n", "1000"], 90);
}

fn perftest_across_namespaces(tag: &str, program: &str, opts: &[&str]) {
    let ns = NetnsPair::new(tag);
    let port = free_port().to_string();
    let mut args = vec!["-p", port.as_str()];
    args.extend_from_slice(opts);
    let mut client = args.clone();
    client.push(ADDR_A);
    let (s, c) = ns.run_pingpong(
        ns.command(&ns.a, program, &args),
        ns.command(&ns.b, program, &client),
        port.parse().unwrap(),
        Duration::from_secs(120),
    );
    assert_success(&s, &format!("{program} server in namespace A"));
    assert_success(&c, &format!("{program} client in namespace B"));
}

#[test]
fn ib_write_lat_across_hosts() {
    perftest_across_namespaces("w", "ib_write_lat", &["-n", "1000"]);
}

#[test]
fn ib_read_bw_across_hosts() {
    perftest_across_namespaces("r", "ib_read_bw", &["-n", "1000"]);
}
