//! Memory windows between two processes on one host (`tests/c/memory_windows.c`, built
//! against the real `<infiniband/verbs.h>`, whose `ibv_alloc_mw`, `ibv_bind_mw`,
//! `ibv_dealloc_mw` and `ibv_wr_*` are inline and reach ugdr through its function tables):
//! type 1 and type 2 binds (on RC and UC), RDMA WRITE/READ/atomics through a window inside and outside its
//! range and without its access, LOCAL_INV and SEND_WITH_INV (`IBV_WC_WITH_INV`,
//! `invalidated_rkey`) and accesses after them, remote invalidation of a type 1 window or of
//! a region's key, the bind errors (`IBV_WC_MW_BIND_ERR`), `ibv_dereg_mr`/`ibv_rereg_mr` of a
//! region with bound windows, deallocation of a bound window. With the same-host direct path
//! on (windows always take the message path; the region's own key takes the direct one) and,
//! for the data sections, with `UGDR_DIRECT=off`.

mod harness;

use harness::*;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn memory_windows() -> &'static PathBuf {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("memory_windows", &["-libverbs"]))
}

/// Runs the target and the initiator of `section` as two processes under ugdr.
fn section(name: &str, direct: bool) {
    let exe = memory_windows();
    let port = free_port().to_string();
    let command = |args: &[&str]| {
        let mut c = Command::new(exe);
        c.args(args).env("LD_PRELOAD", lib_path());
        if !direct {
            c.env("UGDR_DIRECT", "off");
        }
        c
    };
    let target = Guarded::spawn(command(&["target", &port]), "memory_windows target");
    let initiator = Guarded::spawn(
        command(&["initiator", &port, name]),
        "memory_windows initiator",
    );
    let deadline = Instant::now() + Duration::from_secs(60);
    let i = initiator.wait(deadline);
    let t = target.wait(deadline);
    let both = format!("initiator:\n{}\ntarget:\n{}", text(&i), text(&t));
    assert!(i.status.success() && t.status.success(), "{both}");
    let said = |out: &std::process::Output, line: &str| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == line)
    };
    assert!(said(&i, &format!("memory_windows {name}: ok")), "{both}");
    assert!(said(&t, "memory_windows target: ok"), "{both}");
}

#[test]
fn type_1_windows_grant_their_range_and_access_until_rebound_unbound_or_deallocated() {
    section("type1", true);
}

#[test]
fn type_2_windows_are_invalidated_locally_and_by_send_with_invalidate() {
    section("type2", true);
}

#[test]
fn bind_errors_and_invalid_invalidations_complete_with_the_errors_rxe_gives() {
    section("errors", true);
}

#[test]
fn uc_binds_and_send_with_invalidate_and_drops_what_a_dead_key_refuses() {
    section("uc", true);
}

#[test]
fn windows_on_the_message_path_alone() {
    section("type1", false);
    section("type2", false);
}
