//! The shipped library is part of the contract: what it exports, what it links.

mod harness;

use harness::*;
use std::collections::{BTreeMap, BTreeSet};
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

/// The system's `libibverbs.so.1` and `librdmacm.so.1` (Debian 12: rdma-core 44), as the
/// dynamic linker finds them.
fn system_library(soname: &str) -> String {
    // Not on a non-root user's PATH on Debian.
    let ldconfig = ["/sbin/ldconfig", "/usr/sbin/ldconfig"]
        .into_iter()
        .find(|p| std::path::Path::new(p).is_file())
        .map(String::from)
        .unwrap_or_else(|| require("ldconfig"));
    let out = Command::new(ldconfig)
        .arg("-p")
        .output()
        .expect("ldconfig -p");
    let list = String::from_utf8_lossy(&out.stdout);
    list.lines()
        .filter(|l| l.trim_start().starts_with(&format!("{soname} (")))
        .filter_map(|l| l.rsplit("=> ").next())
        .map(|p| p.trim().to_string())
        .next()
        .unwrap_or_else(|| panic!("{soname} is not installed (scripts/setup installs it)\n{list}"))
}

/// The functions a library defines, each with its version nodes (`IBVERBS_1.1`, …).
fn defined_functions(file: &str) -> BTreeMap<String, BTreeSet<String>> {
    let out = Command::new(require("nm"))
        .args(["-D", "--defined-only", "--with-symbol-versions"])
        .arg(file)
        .output()
        .expect("nm");
    assert!(out.status.success(), "nm {file}\n{}", text(&out));
    let mut functions: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // "ADDR T name@@VERSION"; version-node markers are absolute ("A"), data is D/B/R.
        let [_, kind, sym] = f[..] else { continue };
        if !matches!(kind, "T" | "W" | "i") {
            continue;
        }
        let (name, version) = match sym.split_once('@') {
            Some((n, v)) => (n, v.trim_start_matches('@')),
            None => (sym, ""),
        };
        functions
            .entry(name.to_string())
            .or_default()
            .insert(version.to_string());
    }
    functions
}

/// Takes no verbs object (numbers, strings, kernel-ABI structs, memory ranges, sysfs paths).
const PURE: &str = "a pure helper: it takes no verbs object, so the real library's answer is right for ugdr's device too";
/// Provider ABI.
const PROVIDER: &str = "provider ABI (IBVERBS_PRIVATE_*; ibv_register_driver is its old compat stub): only provider libraries call it, on the devices and contexts they created; ugdr's objects never reach a provider, their function tables point into ugdr";

/// The system libraries' functions ugdr does not export, by family (a trailing `*` is a
/// prefix), each with the reason the real library's function is right. Everything else an
/// application can call is ugdr's: implemented for ugdr's objects, or failing as rdma-core
/// fails for a device without the feature, and forwarding other libraries' objects.
const LEFT_TO_THE_REAL_LIBRARY: &[(&str, &str)] = &[
    ("ibv_wc_status_str", PURE),
    ("ibv_event_type_str", PURE),
    ("ibv_node_type_str", PURE),
    ("ibv_port_state_str", PURE),
    ("ibv_rate_to_mbps", PURE),
    ("mbps_to_ibv_rate", PURE),
    ("ibv_rate_to_mult", PURE),
    ("mult_to_ibv_rate", PURE),
    ("ibv_copy_ah_attr_from_kern", PURE),
    ("ibv_copy_path_rec_from_kern", PURE),
    ("ibv_copy_path_rec_to_kern", PURE),
    ("ibv_copy_qp_attr_from_kern", PURE),
    ("ibv_get_sysfs_path", PURE),
    ("ibv_read_sysfs_file", PURE),
    ("ibv_read_ibdev_sysfs_file", PURE),
    // Fork protection madvises the real library's own registrations; ugdr's memory regions
    // are host memory UCX copies from, which a forked child may share copy-on-write.
    ("ibv_fork_init", PURE),
    ("ibv_is_fork_initialized", PURE),
    ("ibv_dofork_range", PURE),
    ("ibv_dontfork_range", PURE),
    ("ibv_cmd_*", PROVIDER),
    ("verbs_*", PROVIDER),
    ("_verbs_init_and_alloc_context", PROVIDER),
    ("__verbs_log", PROVIDER),
    ("execute_ioctl", PROVIDER),
    ("__ioctl_final_num_attrs", PROVIDER),
    ("ibv_register_driver", PROVIDER),
];

/// librdmacm's rsockets: ugdr carries its own (src/rsocket; the real ones would run
/// librdmacm's private state over ugdr's ids). tests/rsocket.rs runs them; the C program
/// checks that a descriptor that is no rsocket is EBADF for every one of them.
const RSOCKETS: (&[&str], &str) = (
    &[
        "rsocket",
        "rbind",
        "rlisten",
        "raccept",
        "rconnect",
        "rshutdown",
        "rclose",
        "rrecv",
        "rrecvfrom",
        "rrecvmsg",
        "rsend",
        "rsendto",
        "rsendmsg",
        "rread",
        "rreadv",
        "rwrite",
        "rwritev",
        "rpoll",
        "rselect",
        "rgetpeername",
        "rgetsockname",
        "rsetsockopt",
        "rgetsockopt",
        "rfcntl",
        "riomap",
        "riounmap",
        "riowrite",
    ],
    "rsockets are ugdr's own",
);

fn exception(name: &str) -> Option<(&'static str, &'static str)> {
    LEFT_TO_THE_REAL_LIBRARY
        .iter()
        .copied()
        .find(|(p, _)| match p.strip_suffix('*') {
            Some(prefix) => name.starts_with(prefix),
            None => name == *p,
        })
}

/// No real-library function ever gets a ugdr object: every function the system's libibverbs
/// and librdmacm define is ugdr's, or in a family above whose reason says why it need not be.
/// A new rdma-core that adds a function fails here until it is exported or classified.
#[test]
fn every_function_of_the_system_verbs_libraries_is_exported_or_a_named_exception() {
    let ours = symbols(&["-D", "--defined-only"], &lib_path().display().to_string());
    let verbs = defined_functions(&system_library("libibverbs.so.1"));
    let cm = defined_functions(&system_library("librdmacm.so.1"));
    assert!(
        verbs.len() > 120 && cm.len() > 50,
        "{} libibverbs and {} librdmacm functions: wrong libraries?",
        verbs.len(),
        cm.len()
    );
    let system: BTreeMap<&String, &BTreeSet<String>> = verbs.iter().chain(cm.iter()).collect();
    let missing: Vec<String> = system
        .iter()
        .filter(|(name, _)| !ours.contains(name.as_str()) && exception(name).is_none())
        .map(|(name, versions)| format!("{name} {versions:?}"))
        .collect();
    assert!(
        missing.is_empty(),
        "libugdr.so neither exports nor classifies: {missing:#?}\nexport each (implemented for \
         ugdr's objects, or failing as rdma-core does for a device without the feature, other \
         objects forwarded), or add it to LEFT_TO_THE_REAL_LIBRARY with the reason"
    );
    for (name, versions) in &system {
        let Some((pattern, reason)) = exception(name) else {
            continue;
        };
        assert!(
            !ours.contains(name.as_str()),
            "{name} is exported by ugdr but listed as left to the real library ({pattern})"
        );
        if reason == PROVIDER {
            assert!(
                versions.iter().all(|v| v.starts_with("IBVERBS_PRIVATE_"))
                    || *name == "ibv_register_driver",
                "{name} {versions:?} is public API, not provider ABI: export it"
            );
        }
    }
    for (pattern, _) in LEFT_TO_THE_REAL_LIBRARY {
        assert!(
            system
                .keys()
                .any(|n| exception(n).is_some_and(|(p, _)| p == *pattern)),
            "the exception {pattern} matches no function of the system libraries: remove it"
        );
    }
    // librdmacm beyond rdma_*: exactly the rsockets, all exported.
    let (rsockets, why) = RSOCKETS;
    for name in cm.keys().filter(|n| !n.starts_with("rdma_")) {
        assert!(
            rsockets.contains(&name.as_str()),
            "librdmacm's {name} is neither rdma_* nor a known rsocket"
        );
    }
    for name in rsockets {
        assert!(cm.contains_key(*name), "{name} is not librdmacm's");
        assert!(ours.contains(*name), "{name} ({why}) must be exported");
    }
}

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
            if (sym.starts_with("ibv_") || sym.starts_with("_ibv_")) && exception(&sym).is_none() {
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
