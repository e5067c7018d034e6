//! The shipped library is part of the contract: what it exports, what it links.

mod harness;

use harness::*;
use std::collections::BTreeSet;
use std::process::Command;

fn symbols(args: &[&str], file: &str) -> BTreeSet<String> {
    let out = Command::new(require("nm"))
        .args(args)
        .arg(file)
        .output()
        .expect("nm");
    assert!(out.status.success(), "nm {file}\n{}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(|s| s.split('@').next().unwrap_or(s).to_string())
        .collect()
}

/// Functions of libibverbs that never touch provider state (verbs-abi.md §1.8): the real
/// library's are right for ugdr's objects too.
const LEFT_TO_LIBIBVERBS: &[&str] = &[
    "ibv_wc_status_str",
    "ibv_event_type_str",
    "ibv_node_type_str",
    "ibv_port_state_str",
    "ibv_read_sysfs_file",
    "ibv_get_sysfs_path",
    "ibv_fork_init",
    "ibv_is_fork_initialized",
];

/// librdmacm's functions that are not rsockets: every one an acceptance program imports must
/// be ugdr's (the real librdmacm needs the kernel's rdma_cm device).
fn is_rdma_cm_function(sym: &str) -> bool {
    sym.starts_with("rdma_")
}

#[test]
fn every_rdma_cm_function_the_acceptance_programs_import_is_exported() {
    let lib = lib_path().display().to_string();
    let ours = symbols(&["-D", "--defined-only"], &lib);
    let mut checked = 0;
    for app in [
        "rping",
        "ucmatose",
        "udaddy",
        "rdma_server",
        "rdma_client",
        "ib_send_bw",
        "ib_write_lat",
        "ib_read_bw",
    ] {
        let path = require(app);
        for sym in symbols(&["-D", "--undefined-only"], &path) {
            if is_rdma_cm_function(&sym) {
                checked += 1;
                assert!(
                    ours.contains(&sym),
                    "{app} imports {sym}, which libugdr.so does not export"
                );
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} rdma_* imports found: wrong binaries?"
    );
    // And the whole RDMACM_1.0-1.3 surface outside rsockets.
    for sym in [
        "rdma_create_srq",
        "rdma_create_srq_ex",
        "rdma_destroy_srq",
        "rdma_create_qp_ex",
        "rdma_get_request",
        "rdma_notify",
        "rdma_join_multicast",
        "rdma_join_multicast_ex",
        "rdma_leave_multicast",
        "rdma_establish",
        "rdma_init_qp_attr",
        "rdma_get_remote_ece",
        "rdma_reject_ece",
        "rdma_set_local_ece",
        "rdma_get_devices",
        "rdma_free_devices",
        "rdma_migrate_id",
        "rdma_get_src_port",
        "rdma_get_dst_port",
    ] {
        assert!(ours.contains(sym), "libugdr.so does not export {sym}");
    }
}

#[test]
fn every_verb_the_acceptance_programs_import_is_exported() {
    let lib = lib_path().display().to_string();
    let ours = symbols(&["-D", "--defined-only"], &lib);
    for app in [
        "ibv_devices",
        "ibv_devinfo",
        "ibv_rc_pingpong",
        "ib_send_bw",
        "ib_write_lat",
        "ib_read_bw",
        "ib_atomic_lat",
    ] {
        let path = require(app);
        for sym in symbols(&["-D", "--undefined-only"], &path) {
            if (sym.starts_with("ibv_") || sym.starts_with("_ibv_"))
                && !LEFT_TO_LIBIBVERBS.contains(&sym.as_str())
            {
                assert!(
                    ours.contains(&sym),
                    "{app} imports {sym}, which libugdr.so does not export"
                );
            }
        }
    }
}

#[test]
fn the_library_links_neither_libibverbs_nor_ucx() {
    let out = Command::new(require("readelf"))
        .args(["-d"])
        .arg(lib_path())
        .output()
        .expect("readelf");
    let dynamic = String::from_utf8_lossy(&out.stdout);
    for banned in ["libibverbs", "librdmacm", "libucp", "libucs", "libuct"] {
        assert!(
            !dynamic.contains(banned),
            "libugdr.so must not link {banned} (UCX is opened on first use)\n{dynamic}"
        );
    }
}

#[test]
fn a_preloaded_process_that_never_calls_verbs_loads_no_ucx() {
    // LD_PRELOAD reaches every child of `ugdr run`: a shell must not get UCX (and libucs's
    // signal handlers) loaded into it.
    let out = run(
        preloaded("sh", &["-c", "cat /proc/self/maps"]),
        "sh under ugdr",
        std::time::Duration::from_secs(10),
    );
    assert_success(&out, "sh");
    let maps = String::from_utf8_lossy(&out.stdout);
    assert!(
        maps.contains("libugdr.so"),
        "the library was not preloaded\n{maps}"
    );
    assert!(
        !maps.contains("libucp") && !maps.contains("libucs"),
        "UCX loaded without a verbs call\n{maps}"
    );
}
