//! A C verbs program (the real verbs.h inlines, linked with -libverbs) built with `cc` and
//! run with libugdr.so preloaded.

mod harness;

use harness::*;
use std::process::Command;
use std::time::Duration;

#[test]
fn c_program_with_verbs_inlines_runs_under_ugdr() {
    let exe = build_c("rc_loopback", &["-libverbs"]);
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", lib_path());
    let out = run(cmd, "rc_loopback", Duration::from_secs(60));
    assert_success(&out, "rc_loopback");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("rc_loopback: ok"),
        "{}",
        text(&out)
    );
    // Without ugdr the same program finds no device (there is no RDMA hardware): the test
    // above really ran over ugdr.
    let bare = run(
        Command::new(&exe),
        "rc_loopback without ugdr",
        Duration::from_secs(30),
    );
    assert!(
        !bare.status.success(),
        "expected no RDMA device without ugdr\n{}",
        text(&bare)
    );
}
