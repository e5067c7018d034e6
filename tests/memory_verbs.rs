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
use std::sync::OnceLock;

fn memory_verbs() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("memory_verbs", &["-libverbs"]))
}

/// Runs one section of `memory_verbs` under ugdr; it must print "<section>: ok".
fn section(name: &str) {
    let what = format!("memory_verbs {name}");
    run_checked_under_ugdr(memory_verbs(), &[name], &what, &format!("{name}: ok"));
}

#[test]
fn rereg_changes_translation_pd_and_access_and_fails_as_rdma_core_does() {
    section("rereg");
}

#[test]
fn odp_explicit_and_implicit_and_unmapped_pages_are_remote_access_errors() {
    section("odp");
}

#[test]
fn device_memory_copies_are_bounds_checked_and_a_dm_mr_carries_rdma() {
    section("dm");
}

#[test]
fn parent_domains_place_qps_and_cqs_in_the_applications_allocator() {
    section("parent");
}

#[test]
fn completion_timestamps_are_monotonic_and_agree_with_clock_gettime() {
    let exe = build_c("completion_timestamps", &["-libverbs"]);
    let name = "completion_timestamps";
    run_checked_under_ugdr(&exe, &[], name, &format!("{name}: ok"));
}
