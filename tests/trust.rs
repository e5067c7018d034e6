//! What an application may get wrong, or do on purpose, without ugdr harming the process:
//! SGE counts far above the QP's limit, `pthread_cancel` of threads blocked in ugdr's waits,
//! registering memory that is not there, and unmapping (or remapping) registered memory while
//! a peer still writes to it. Each scenario is a C program (tests/c/trust.c) run with
//! libugdr.so preloaded; the remap case runs it as two processes.

mod harness;

use harness::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

fn trust_exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/c/trust.c");
        let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("trust");
        let out = Command::new(require("cc"))
            .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .args(["-libverbs", "-lrdmacm", "-lpthread", "-lucm", "-lucs"])
            .output()
            .expect("cc");
        assert!(out.status.success(), "cc trust.c failed\n{}", text(&out));
        exe
    })
}

fn scenario(name: &str, args: &[&str]) -> Command {
    let mut cmd = Command::new(trust_exe());
    cmd.arg(name).args(args).env("LD_PRELOAD", lib_path());
    cmd
}

/// Runs one scenario to its end; fails on any failed check (or a crash).
fn run_scenario(mut cmd: Command, name: &str) -> String {
    cmd.env_remove("UGDR_LOG");
    finish(run(cmd, name, Duration::from_secs(90)), name)
}

fn finish(out: std::process::Output, name: &str) -> String {
    assert_success(&out, name);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(stdout.contains(&format!("{name}: ")), "{}", text(&out));
    assert!(stdout.contains(" checks ok"), "{}", text(&out));
    stdout
}

#[test]
fn sge_counts_far_above_the_limit_are_refused_before_the_list_is_read() {
    run_scenario(scenario("counts", &[]), "counts");
}

#[test]
fn cancelled_waiters_end_and_their_objects_still_work() {
    run_scenario(scenario("cancel", &[]), "cancel");
}

#[test]
fn a_pending_cancel_acts_only_after_the_call_into_ugdr_returns() {
    // The debug log makes ugdr write(2) inside the call: a cancellation point.
    let mut cmd = scenario("cancel_pending", &[]);
    cmd.env("UGDR_LOG", "debug");
    finish(
        run(cmd, "cancel_pending", Duration::from_secs(90)),
        "cancel_pending",
    );
}

#[test]
fn registering_memory_that_is_not_there_is_efault() {
    run_scenario(scenario("reg_mr", &[]), "reg_mr");
}

#[test]
fn unmapped_or_replaced_registered_memory_is_refused_and_never_written() {
    run_scenario(scenario("local_remap", &[]), "local_remap");
}

#[test]
fn ucx_memory_hooks_and_ugdr_both_see_every_unmap() {
    // ucm's default (bistro) hooks; its reloc mode already hangs ugdr's own UCX start-up.
    run_scenario(scenario("ucm", &[]), "ucm");
}

#[test]
fn a_peer_write_after_the_target_remaps_is_rem_access_err_across_processes() {
    let port = free_port();
    let p = port.to_string();
    let (target, requester) = run_pingpong(
        scenario("remap_target", &[&p]),
        scenario("remap_requester", &[&p]),
        port,
        Duration::from_secs(90),
    );
    finish(target, "remap_target");
    finish(requester, "remap_requester");
}
