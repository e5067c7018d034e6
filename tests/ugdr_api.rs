//! The `ugdr_*` C API (include/ugdr.h) as C programs use it: the header compiles as C11 and
//! C++, pkg-config finds it, the example runs a two-process ping-pong with RDMA WRITE/READ,
//! and tests/c/ugdr_checks.c covers every error path, the state machine, flush on ERR, the
//! data path's completions, GPU memory refusal, and GPU discovery on fake sysfs trees.

mod harness;

use harness::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tmp() -> PathBuf {
    PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
}

/// `pkg-config --cflags --libs ugdr` with the `ugdr.pc` the build wrote next to the library.
fn pkg_config_flags() -> Vec<String> {
    let pc_dir = lib_path().parent().expect("lib dir").join("pkgconfig");
    let out = Command::new(require("pkg-config"))
        .args(["--cflags", "--libs", "ugdr"])
        .env("PKG_CONFIG_PATH", &pc_dir)
        .output()
        .expect("pkg-config");
    assert!(out.status.success(), "pkg-config failed\n{}", text(&out));
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// Compiles `src` with `cc -std=c11 -Wall -Wextra -Werror` against the header and library.
fn build_c(src: &Path, exe_name: &str) -> PathBuf {
    let exe = tmp().join(exe_name);
    let out = Command::new(require("cc"))
        .args(["-std=c11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(src)
        .args(pkg_config_flags())
        .output()
        .expect("cc");
    assert!(
        out.status.success(),
        "cc {} failed\n{}",
        src.display(),
        text(&out)
    );
    exe
}

fn checks_exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c(&root().join("tests/c/ugdr_checks.c"), "ugdr_checks"))
}

/// Runs one scenario of ugdr_checks and returns its stdout; fails on any failed check.
fn run_checks(scenario: &str, env: &[(&str, &Path)]) -> String {
    let mut cmd = Command::new(checks_exe());
    cmd.arg(scenario);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = run(cmd, scenario, Duration::from_secs(90));
    assert_success(&out, scenario);
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        stdout.contains(&format!("{scenario}: ")) && stdout.contains(" checks ok"),
        "{}",
        text(&out)
    );
    stdout
}

#[test]
fn header_compiles_as_strict_c11_and_as_cxx() {
    let probe = tmp().join("ugdr_header_probe.c");
    std::fs::write(
        &probe,
        "#include <ugdr.h>\n\
         int main(void) {\n\
           struct ugdr_qp_init_attr a = {0};\n\
           a.max_send_wr = 1; a.max_recv_wr = 1; a.max_sge = 2; a.qp_type = UGDR_QPT_RC;\n\
           struct ugdr_qp_attr q = {UGDR_QPS_RESET, UGDR_QPS_RESET, 0, {{0}}};\n\
           q.qp_state = UGDR_QPS_RTR; q.dest_addr.raw[UGDR_ADDR_LEN - 1] = 0;\n\
           return (int)a.max_sge + (int)q.qp_state - 4;\n\
         }\n",
    )
    .unwrap();
    let include = format!("-I{}", root().join("include").display());
    for (compiler, std, lang) in [
        ("cc", "-std=c11", "c"),
        ("c++", "-std=c++11", "c++"),
        ("c++", "-std=c++17", "c++"),
    ] {
        let out = Command::new(require(compiler))
            .args([std, "-Wall", "-Wextra", "-Werror", "-Wpedantic", "-x", lang])
            // `= {0}` is C's idiom; C++ warns that the other members are not named.
            .arg("-Wno-missing-field-initializers")
            .args(["-fsyntax-only", &include])
            .arg(&probe)
            .output()
            .expect(compiler);
        assert!(
            out.status.success(),
            "{compiler} {std} rejects ugdr.h\n{}",
            text(&out)
        );
    }
}

#[test]
fn pkg_config_names_the_header_and_the_library() {
    let flags = pkg_config_flags();
    let include = root().join("include");
    let libdir = lib_path().parent().unwrap().to_path_buf();
    assert!(
        flags.contains(&format!("-I{}", include.display())),
        "{flags:?}"
    );
    assert!(
        flags.contains(&format!("-L{}", libdir.display())),
        "{flags:?}"
    );
    assert!(flags.contains(&"-lugdr".to_string()), "{flags:?}");
    assert!(include.join("ugdr.h").is_file());
    // Every function the header declares is exported by the library.
    let header = std::fs::read_to_string(include.join("ugdr.h")).unwrap();
    let nm = Command::new(require("nm"))
        .args(["-D", "--defined-only"])
        .arg(lib_path())
        .output()
        .expect("nm");
    let exported = String::from_utf8_lossy(&nm.stdout);
    let declared: Vec<&str> = header
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| w.starts_with("ugdr_"))
        .filter(|w| header.contains(&format!("{w}(")))
        .collect();
    assert!(declared.len() >= 18, "{declared:?}");
    for f in declared {
        assert!(
            exported.lines().any(|l| l.ends_with(&format!(" T {f}"))),
            "{f} is declared in ugdr.h but libugdr.so does not export it"
        );
    }
}

#[test]
fn example_ping_pong_and_rdma_between_two_processes() {
    let exe = build_c(&root().join("examples/ugdr_pingpong.c"), "ugdr_pingpong");
    let port = free_port().to_string();
    let server = Guarded::spawn(
        {
            let mut c = Command::new(&exe);
            c.args(["-p", &port, "-n", "300", "-s", "4096"]);
            c
        },
        "ugdr_pingpong server",
    );
    let client = Guarded::spawn(
        {
            let mut c = Command::new(&exe);
            c.args(["-p", &port, "-n", "300", "-s", "4096", "127.0.0.1"]);
            c
        },
        "ugdr_pingpong client",
    );
    let deadline = Instant::now() + Duration::from_secs(120);
    let c = client.wait(deadline);
    let s = server.wait(deadline);
    assert_success(&c, "client");
    assert_success(&s, "server");
    let (c, s) = (
        String::from_utf8_lossy(&c.stdout),
        String::from_utf8_lossy(&s.stdout),
    );
    for (out, me) in [(&c, "client"), (&s, "server")] {
        assert!(
            out.contains(&format!("{me}: 300 round trips of 4096 bytes (2 SGEs)")),
            "{out}"
        );
        assert!(out.contains(&format!("{me}: ok")), "{out}");
    }
    assert!(
        s.contains("server: RDMA WRITE of 4096 bytes checked"),
        "{s}"
    );
    assert!(c.contains("client: RDMA READ of 4096 bytes checked"), "{c}");
}

#[test]
fn every_error_path_returns_its_errno() {
    run_checks("errors", &[]);
}

#[test]
fn state_machine_is_all_or_nothing_and_err_flushes() {
    run_checks("states", &[]);
}

#[test]
fn loopback_sends_writes_reads_and_error_completions() {
    run_checks("loopback", &[]);
}

#[test]
fn gpu_pointer_is_refused_with_eopnotsupp_and_left_untouched() {
    let lib = tmp().join("fake_libcuda.so");
    let out = Command::new(require("cc"))
        .args(["-shared", "-fPIC", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&lib)
        .arg(root().join("tests/c/fake_libcuda.c"))
        .output()
        .expect("cc");
    assert!(out.status.success(), "{}", text(&out));
    run_checks("gpu", &[("UGDR_CUDA_LIBRARY", &lib)]);
}

// ------------------------------------------------------------------ GPU discovery

/// A fake sysfs tree: NUMA nodes and PCI functions (address, vendor, class, numa_node).
fn fake_sysfs(tag: &str, nodes: &[i32], pci: &[(&str, &str, &str, i32)]) -> PathBuf {
    let dir = tmp().join(format!("sysfs-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("bus/pci/devices")).unwrap();
    for n in nodes {
        std::fs::create_dir_all(dir.join(format!("devices/system/node/node{n}"))).unwrap();
    }
    for (addr, vendor, class, numa) in pci {
        let d = dir.join("bus/pci/devices").join(addr);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("vendor"), format!("{vendor}\n")).unwrap();
        std::fs::write(d.join("class"), format!("{class}\n")).unwrap();
        std::fs::write(d.join("numa_node"), format!("{numa}\n")).unwrap();
    }
    dir
}

/// The device lines ugdr_checks prints: "name numa_node gpus".
fn device_lines(sysfs: &Path) -> Vec<String> {
    run_checks("devices", &[("UGDR_SYSFS_ROOT", sysfs)])
        .lines()
        .filter(|l| l.starts_with("ugdr"))
        .map(str::to_string)
        .collect()
}

#[test]
fn discovery_without_gpus_lists_each_numa_node_with_none() {
    let one = fake_sysfs(
        "none",
        &[0],
        &[
            ("0000:00:02.0", "0x8086", "0x030000", -1), // Intel integrated graphics
            ("0000:00:1f.3", "0x8086", "0x040300", -1),
        ],
    );
    assert_eq!(device_lines(&one), ["ugdr0 0 -"]);
    let no_numa = fake_sysfs("no-numa", &[], &[]);
    assert_eq!(device_lines(&no_numa), ["ugdr0 0 -"]);
}

#[test]
fn discovery_two_gpus_on_two_numa_nodes_in_pci_bus_order() {
    let tree = fake_sysfs(
        "two",
        &[0, 1],
        &[
            ("0000:af:00.0", "0x10de", "0x030200", 0), // H100 (3D controller) on node 0
            ("0000:3b:00.0", "0x10de", "0x030000", 1), // VGA-class NVIDIA GPU on node 1
            ("0000:3b:00.1", "0x10de", "0x040300", 1), // its HDMI audio function
            ("0000:03:00.0", "0x1a03", "0x030000", 0), // ASPEED BMC VGA: not NVIDIA
            ("0000:c1:00.0", "0x10de", "0x068000", 1), // NVSwitch: not a display class
            ("0000:d8:00.0", "0x15b3", "0x020700", 1), // a ConnectX NIC
        ],
    );
    // CUDA_DEVICE_ORDER=PCI_BUS_ID: bus 0x3b is GPU 0, bus 0xaf is GPU 1.
    assert_eq!(device_lines(&tree), ["ugdr0 0 1", "ugdr1 1 0"]);
}

#[test]
fn discovery_puts_gpus_of_unknown_node_on_the_first_device() {
    let tree = fake_sysfs(
        "vm",
        &[0, 1],
        &[
            ("0000:00:05.0", "0x10de", "0x030200", -1),
            ("0000:00:04.0", "0x10de", "0x030200", 1),
        ],
    );
    assert_eq!(device_lines(&tree), ["ugdr0 0 1", "ugdr1 1 0"]);
}

#[test]
fn discovery_with_a_missing_sysfs_root_fails_cleanly() {
    let mut cmd = Command::new(checks_exe());
    cmd.arg("devices")
        .env("UGDR_SYSFS_ROOT", tmp().join("no-such-sysfs"));
    let out = run(cmd, "devices", Duration::from_secs(30));
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("ugdr_get_device_list"),
        "{}",
        text(&out)
    );
}

#[test]
fn discovery_on_this_host_lists_every_numa_node() {
    let lines = device_lines(Path::new("/sys"));
    let nodes = std::fs::read_dir("/sys/devices/system/node")
        .map(|d| {
            d.filter_map(|e| e.ok())
                .filter(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("node"))
                        .is_some_and(|n| n.parse::<u32>().is_ok())
                })
                .count()
        })
        .unwrap_or(0)
        .max(1);
    assert_eq!(lines.len(), nodes, "{lines:?}");
}
