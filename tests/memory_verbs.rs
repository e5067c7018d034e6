//! The memory verbs beyond `ibv_reg_mr` and completion timestamps, from C programs built
//! against the real `<infiniband/verbs.h>` (most of these verbs are inline there and reach
//! ugdr through its function tables) and run under ugdr: `ibv_rereg_mr` (translation, PD,
//! access, and its errors), on-demand paging (explicit and implicit, an unmapped or
//! read-only page as a remote access error, `ibv_advise_mr`), device memory (copies in and
//! out of bounds, a DM MR used for RDMA), thread and parent domains with the application's
//! allocator, and `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP(_WALLCLOCK)` with
//! `ibv_query_rt_values_ex`. The same-host direct path after a re-registration is in
//! `tests/direct.rs`.

mod harness;

use harness::*;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

fn memory_verbs() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("memory_verbs", &["-libverbs"]))
}

/// Runs `exe section` under ugdr; it must exit 0 and print "<section>: ok" (with no
/// section: the whole program, "<what>: ok").
fn run_section(exe: &PathBuf, section: &str, what: &str) {
    let mut cmd = Command::new(exe);
    if !section.is_empty() {
        cmd.arg(section);
    }
    cmd.env("LD_PRELOAD", lib_path());
    let out = run(cmd, what, Duration::from_secs(60));
    assert_success(&out, what);
    let done = if section.is_empty() { what } else { section };
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("{done}: ok")),
        "{}",
        text(&out)
    );
}

#[test]
fn rereg_changes_translation_pd_and_access_and_fails_as_rdma_core_does() {
    run_section(memory_verbs(), "rereg", "memory_verbs rereg");
}

#[test]
fn odp_explicit_and_implicit_and_unmapped_pages_are_remote_access_errors() {
    run_section(memory_verbs(), "odp", "memory_verbs odp");
}

#[test]
fn device_memory_copies_are_bounds_checked_and_a_dm_mr_carries_rdma() {
    run_section(memory_verbs(), "dm", "memory_verbs dm");
}

#[test]
fn parent_domains_place_qps_and_cqs_in_the_applications_allocator() {
    run_section(memory_verbs(), "parent", "memory_verbs parent");
}

#[test]
fn completion_timestamps_are_monotonic_and_agree_with_clock_gettime() {
    let exe = build_c("completion_timestamps", &["-libverbs"]);
    run_section(&exe, "", "completion_timestamps");
}
