//! rdma-core's own conformance suite, the pyverbs tests (Debian's python3-pyverbs ships them in
//! /usr/share/doc/rdma-core/tests, partly gzipped), run against ugdr0 under LD_PRELOAD of the
//! built libugdr.so, as rdma-core's `run_tests.py --dev ugdr0` runs them
//! (`tests/pyverbs_runner.py` copies and decompresses them, and records every outcome).
//!
//! Asserts: no failure and no error; every test of [`EXPECTED_PASSES`] passed; every skip
//! gives a reason of [`HARDWARE_SKIPS`] (what ugdr0 is not: an mlx5 or EFA device, an
//! Ethernet port, a GPU, a netdev) or is one of [`KNOWN_GAPS`] (what ugdr could do and does
//! not yet). The test fails (never skips) when python3-pyverbs is not installed.

mod harness;

use harness::*;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const SUITE: &str = "/usr/share/doc/rdma-core/tests";
const PYVERBS: &str = "/usr/lib/python3/dist-packages/pyverbs";

/// Tests that pass on ugdr0 (ids without the leading `tests.`).
const EXPECTED_PASSES: &[&str] = &[
    "test_addr.AHTest.test_create_ah",
    "test_addr.AHTest.test_destroy_ah",
    "test_atomic.AtomicTest.test_atomic_cmp_and_swap",
    "test_atomic.AtomicTest.test_atomic_fetch_and_add",
    "test_atomic.AtomicTest.test_xrc_atomic_cmp_and_swap",
    "test_atomic.AtomicTest.test_xrc_atomic_fetch_and_add",
    "test_atomic.AtomicTest.test_atomic_invalid_lkey",
    "test_atomic.AtomicTest.test_atomic_invalid_mr_access",
    "test_atomic.AtomicTest.test_atomic_invalid_qp_access",
    "test_atomic.AtomicTest.test_atomic_invalid_rkey",
    "test_atomic.AtomicTest.test_atomic_non_aligned_addr",
    "test_cq.CQAPITest.test_create_cq",
    "test_cq.CQAPITest.test_create_cq_bad_flow",
    "test_cq.CQAPITest.test_create_cq_with_comp_channel",
    "test_cq.CQTest.test_resize_cq",
    "test_cq_events.CqEventsTestCase.test_cq_events_rc",
    "test_cq_events.CqEventsTestCase.test_cq_events_ud",
    "test_cqex.CQEXAPITest.test_create_cq_ex",
    "test_cqex.CQEXAPITest.test_create_cq_ex_bad_flow",
    "test_cqex.CqExTestCase.test_rc_traffic_cq_ex",
    "test_cqex.CqExTestCase.test_ud_traffic_cq_ex",
    "test_cqex.CqExTestCase.test_xrc_traffic_cq_ex",
    "test_device.DMTest.test_create_dm",
    "test_device.DMTest.test_create_dm_bad_flow",
    "test_device.DMTest.test_destroy_dm",
    "test_device.DMTest.test_destroy_dm_bad_flow",
    "test_device.DMTest.test_dm_read",
    "test_device.DMTest.test_dm_write",
    "test_device.DMTest.test_dm_write_bad_flow",
    "test_device.DMTest.test_multi_process_alloc_dm",
    "test_device.DeviceTest.test_dev_list",
    "test_device.DeviceTest.test_open_dev",
    "test_device.DeviceTest.test_phys_port_cnt_ex",
    "test_device.DeviceTest.test_query_device",
    "test_device.DeviceTest.test_query_device_ex",
    "test_device.DeviceTest.test_query_gid",
    "test_device.DeviceTest.test_query_gid_ex",
    "test_device.DeviceTest.test_query_gid_table",
    "test_device.DeviceTest.test_query_gid_table_bad_flow",
    "test_device.DeviceTest.test_query_pkey",
    "test_device.DeviceTest.test_query_port",
    "test_device.DeviceTest.test_query_port_bad_flow",
    "test_device.SharedDMTest.test_import_dm",
    "test_fork.ForkAPITest.test_is_fork_initialized",
    "test_mlx5_timestamp.TimeStampTest.test_timestamp_real_time_rc_traffic",
    "test_mr.DeviceMemoryAPITest.test_create_dm_mr",
    "test_mr.DeviceMemoryAPITest.test_dm_bad_access",
    "test_mr.DeviceMemoryAPITest.test_dm_bad_registration",
    "test_mr.DeviceMemoryTest.test_dm_remote_traffic",
    "test_mr.DeviceMemoryTest.test_dm_traffic",
    "test_mr.MRTest.test_mr_rereg_access",
    "test_mr.MRTest.test_mr_rereg_access_bad_flow",
    "test_mr.MRTest.test_mr_rereg_addr",
    "test_mr.MRTest.test_mr_rereg_pd",
    "test_mr.MRTest.test_reg_mr_bad_flags",
    "test_mr.MWTest.test_invalidate_mw_type1",
    "test_mr.MWTest.test_mw_type1",
    "test_mr.MWTest.test_mw_type2",
    "test_mr.MWTest.test_mw_type2_invalidate_dealloc",
    "test_mr.MWTest.test_mw_type2_invalidate_local",
    "test_mr.MWTest.test_mw_type2_invalidate_remote",
    "test_mr.MWTest.test_reg_mw_wrong_type",
    "test_odp.OdpTestCase.test_odp_async_prefetch_rc_traffic",
    "test_odp.OdpTestCase.test_odp_implicit_async_prefetch_rc_traffic",
    "test_odp.OdpTestCase.test_odp_implicit_rc_traffic",
    "test_odp.OdpTestCase.test_odp_implicit_sync_prefetch_rc_traffic",
    "test_odp.OdpTestCase.test_odp_prefetch_async_no_page_fault_rc_traffic",
    "test_odp.OdpTestCase.test_odp_prefetch_sync_no_page_fault_rc_traffic",
    "test_odp.OdpTestCase.test_odp_rc_atomic_cmp_and_swp",
    "test_odp.OdpTestCase.test_odp_rc_atomic_fetch_and_add",
    "test_odp.OdpTestCase.test_odp_rc_rdma_read",
    "test_odp.OdpTestCase.test_odp_rc_rdma_write",
    "test_odp.OdpTestCase.test_odp_rc_srq_traffic",
    "test_odp.OdpTestCase.test_odp_rc_traffic",
    "test_odp.OdpTestCase.test_odp_sync_prefetch_rc_traffic",
    "test_odp.OdpTestCase.test_odp_ud_traffic",
    "test_odp.OdpTestCase.test_odp_xrc_traffic",
    "test_parent_domain.ParentDomainTrafficTest.test_default_allocators_rc_traffic",
    "test_parent_domain.ParentDomainTrafficTest.test_mem_align_rc_traffic",
    "test_parent_domain.ParentDomainTrafficTest.test_mem_align_srq_excq_rc_traffic",
    "test_parent_domain.ParentDomainTrafficTest.test_mem_align_ud_traffic",
    "test_parent_domain.ParentDomainTrafficTest.test_without_allocators_rc_traffic",
    "test_pd.PDTest.test_alloc_pd",
    "test_pd.PDTest.test_dealloc_pd",
    "test_pd.PDTest.test_destroy_pd_twice",
    "test_pd.PDTest.test_multiple_pd_creation",
    "test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_recv_sge",
    "test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_recv_wr",
    "test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_send_sge",
    "test_qp.QPTest.test_create_raw_qp_ex_with_illegal_caps_max_send_wr",
    "test_qp.QPTest.test_create_rc_qp_ex_no_attr",
    "test_qp.QPTest.test_create_rc_qp_ex_with_attr",
    "test_qp.QPTest.test_create_rc_qp_no_attr",
    "test_qp.QPTest.test_create_rc_qp_with_attr",
    "test_qp.QPTest.test_create_uc_qp_ex_no_attr",
    "test_qp.QPTest.test_create_uc_qp_ex_with_attr",
    "test_qp.QPTest.test_create_uc_qp_no_attr",
    "test_qp.QPTest.test_create_uc_qp_with_attr",
    "test_qp.QPTest.test_create_ud_qp_ex_no_attr",
    "test_qp.QPTest.test_create_ud_qp_ex_with_attr",
    "test_qp.QPTest.test_create_ud_qp_no_attr",
    "test_qp.QPTest.test_create_ud_qp_with_attr",
    "test_qp.QPTest.test_modify_ud_qp",
    "test_qp.QPTest.test_query_data_in_order",
    "test_qp.QPTest.test_query_rc_qp",
    "test_qp.QPTest.test_query_uc_qp",
    "test_qp.QPTest.test_query_ud_qp",
    "test_qpex.QpExTestCase.test_full_rq_bad_flow",
    "test_qpex.QpExTestCase.test_post_receive_qp_state_bad_flow",
    "test_qpex.QpExTestCase.test_post_send_qp_state_bad_flow",
    "test_qpex.QpExTestCase.test_qp_ex_rc_atomic_cmp_swp",
    "test_qpex.QpExTestCase.test_qp_ex_rc_atomic_fetch_add",
    "test_qpex.QpExTestCase.test_qp_ex_rc_atomic_write",
    "test_qpex.QpExTestCase.test_qp_ex_rc_bind_mw",
    "test_qpex.QpExTestCase.test_qp_ex_rc_rdma_read",
    "test_qpex.QpExTestCase.test_qp_ex_rc_rdma_read_zero_size",
    "test_qpex.QpExTestCase.test_qp_ex_rc_rdma_write",
    "test_qpex.QpExTestCase.test_qp_ex_rc_rdma_write_imm",
    "test_qpex.QpExTestCase.test_qp_ex_rc_rdma_write_zero_length",
    "test_qpex.QpExTestCase.test_qp_ex_rc_send",
    "test_qpex.QpExTestCase.test_qp_ex_rc_send_imm",
    "test_qpex.QpExTestCase.test_qp_ex_ud_send",
    "test_qpex.QpExTestCase.test_qp_ex_ud_send_imm",
    "test_qpex.QpExTestCase.test_qp_ex_ud_zero_size",
    "test_qpex.QpExTestCase.test_qp_ex_xrc_send",
    "test_qpex.QpExTestCase.test_qp_ex_xrc_send_imm",
    "test_qpex.QpExTestCase.test_rq_with_larger_sgl_bad_flow",
    "test_relaxed_ordering.RoTestCase.test_ro_rc_traffic",
    "test_relaxed_ordering.RoTestCase.test_ro_ud_traffic",
    "test_relaxed_ordering.RoTestCase.test_ro_xrc_traffic",
    "test_shared_pd.SharedPDTestCase.test_imported_rc_ex_rdma_write",
];

/// Skips that say what ugdr0 is not, as (test module, the reason's start). ugdr0 is an
/// InfiniBand port of no vendor's make, without a netdev (so rdma_cm's tests, which look for
/// one, skip: `/sys/class/infiniband/ugdr0/device/net` does not exist), GPU or tag matching.
const HARDWARE_SKIPS: &[(&str, &str)] = &[
    ("", "Can not run the test over non MLX5 device"),
    ("", "Could not open mlx5 context"),
    ("", "Can not run the test over non EFA device"),
    ("", "cuda-python"),
    ("", "Device ugdr0 doesn't have net interface"),
    ("", "Allocating dmabuf is not supported"),
    ("", "Device /dev/dri/renderD"),
    ("", "Lack of permission to access /dev/dri/renderD"),
    ("", "Must be run by root on Ethernet link layer"),
    (
        "",
        "To Create RAW QP must be done by root on Ethernet link layer",
    ),
    ("", "There are no huge pages of size"),
    ("", "PCI device must be passed by the user"),
    (
        "test_addr",
        "Link layer of port=1 is InfiniBand , skip RoCE test",
    ),
    // mlx5dv's clock conversion.
    (
        "test_mlx5_timestamp",
        "Converting timestamp to nanoseconds is not supported",
    ),
    // Needs a RoCEv2 GID: an InfiniBand port has none.
    ("test_mlx5_udp_sport", "No supported port is up"),
    // Tag matching is a hardware offload (mlx5): tm_caps are 0 and IBV_WC_EX_WITH_TM_INFO
    // is EOPNOTSUPP, as on any device without it.
    ("test_tag_matching", "Extended CQ is not supported"),
    // ugdr0's GID table has one entry, which is populated (a valid table; the test needs an
    // empty one).
    ("test_device", "All gid indices populated"),
];

/// Skips ugdr could remove: (test id, reason). None today.
const KNOWN_GAPS: &[(&str, &str)] = &[];

/// One outcome per test: id (without `tests.`) → (outcome, skip reason).
fn run_suite() -> BTreeMap<String, (String, String)> {
    assert!(
        Path::new(PYVERBS).is_dir() && Path::new(SUITE).join("run_tests.py").is_file(),
        "python3-pyverbs is not installed (scripts/setup installs it): no {PYVERBS} or {SUITE}"
    );
    let python = require("/usr/bin/python3");
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("pyverbs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let out = dir.join("outcomes.tsv");
    let runner = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/pyverbs_runner.py");
    let mut cmd = Command::new(python);
    cmd.arg(&runner)
        .arg(SUITE)
        .arg(&dir)
        .arg(&out)
        .args(["--dev", "ugdr0", "-v"])
        .current_dir(&dir)
        .env("LD_PRELOAD", lib_path());
    let output = run(cmd, "pyverbs tests", Duration::from_secs(300));
    let table = std::fs::read_to_string(&out)
        .unwrap_or_else(|e| panic!("no outcomes ({e})\n{}", text(&output)));
    let outcomes: BTreeMap<String, (String, String)> = table
        .lines()
        .map(|l| {
            let mut f = l.splitn(3, '\t');
            let id = f.next().unwrap_or_default();
            let id = id.strip_prefix("tests.").unwrap_or(id).to_string();
            let outcome = f.next().unwrap_or_default().to_string();
            (id, (outcome, f.next().unwrap_or_default().to_string()))
        })
        .collect();
    let bad: Vec<_> = outcomes
        .iter()
        .filter(|(_, (o, _))| o != "ok" && o != "skipped")
        .map(|(id, (o, _))| format!("{id}: {o}"))
        .collect();
    assert!(
        bad.is_empty(),
        "pyverbs tests that did not pass or skip: {bad:#?}\n{}",
        text(&output)
    );
    let _ = std::fs::remove_dir_all(&dir);
    outcomes
}

fn allowed_skip(id: &str, reason: &str) -> bool {
    let module = id.split('.').next().unwrap_or_default();
    HARDWARE_SKIPS
        .iter()
        .any(|(m, r)| (m.is_empty() || *m == module) && reason.starts_with(r))
        || KNOWN_GAPS
            .iter()
            .any(|(t, r)| *t == id && reason.starts_with(r))
}

#[test]
fn rdma_cores_pyverbs_suite_passes_on_ugdr0_but_for_what_the_hardware_lacks() {
    let outcomes = run_suite();
    let missed: Vec<_> = EXPECTED_PASSES
        .iter()
        .filter(|t| outcomes.get(**t).is_none_or(|(o, _)| o != "ok"))
        .map(|t| format!("{t}: {:?}", outcomes.get(*t)))
        .collect();
    assert!(missed.is_empty(), "expected to pass: {missed:#?}");
    let unexplained: Vec<_> = outcomes
        .iter()
        .filter(|(id, (o, reason))| o == "skipped" && !allowed_skip(id, reason))
        .map(|(id, (_, reason))| format!("{id}: {reason}"))
        .collect();
    assert!(
        unexplained.is_empty(),
        "skipped for a reason that is not the hardware's: {unexplained:#?}"
    );
}
