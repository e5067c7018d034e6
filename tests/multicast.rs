//! UD multicast: the verbs rules and every completion field (tests/c/multicast.c), rdma_cm's
//! joins and leaves (tests/c/multicast_cm.c), datagrams
//! between processes, and rdmacm-utils' `mckey` with two receivers, on one host and across
//! two network namespaces (no daemon started by anyone).

mod harness;

use harness::*;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

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
