//! ugdr beside real RDMA hardware: programs that use UCX themselves run under the preload
//! with UCX's InfiniBand and rdmacm modules on the real libibverbs and librdmacm (ugdr's
//! engine never starts for them), ugdr's own UCX loads those modules in its own link-map
//! namespace (`UGDR_UCX_RDMA=auto`, or not with `off`), the device lists are ugdr0 then
//! whatever the real libraries list (nothing on this machine), and one process can run UCX
//! traffic of its own and ugdr verbs traffic together (docs/design.md, "UCX beside real RDMA
//! hardware").

mod harness;

use harness::*;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::Duration;

const ENGINE_UP: &str = "engine up";

/// A fresh UGDR_RUNDIR for one test (the engine claims a LID file there when it starts).
fn rundir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("beside-{tag}"));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `cmd` under ugdr with its debug log on stderr and its own rundir.
fn logged(mut cmd: Command, dir: &PathBuf) -> Command {
    cmd.env("LD_PRELOAD", lib_path())
        .env("UGDR_LOG", "debug")
        .env("UGDR_RUNDIR", dir)
        .env_remove("UGDR_UCX_RDMA");
    cmd
}

/// `tests/c/ucx_beside_ugdr.c`, built once per test binary.
fn program() -> PathBuf {
    static EXE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    EXE.get_or_init(|| {
        build_c(
            "ucx_beside_ugdr",
            &["-lucp", "-lucs", "-libverbs", "-lrdmacm"],
        )
    })
    .clone()
}

/// Runs `cmd` under ugdr (debug log, rundir `tag`) to success; its output and rundir.
fn run_logged(cmd: Command, tag: &str, what: &str) -> (Output, PathBuf) {
    let dir = rundir(tag);
    let out = run(logged(cmd, &dir), what, Duration::from_secs(60));
    assert_success(&out, what);
    (out, dir)
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The engine never started: no log line says so, and it claimed no LID in its rundir.
fn assert_engine_never_started(out: &Output, dir: &PathBuf, what: &str) {
    assert!(
        !stderr(out).contains(ENGINE_UP),
        "{what} started ugdr's engine\n{}",
        text(out)
    );
    let claimed: Vec<_> = std::fs::read_dir(dir)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        claimed.is_empty(),
        "{what} claimed {claimed:?} in {}",
        dir.display()
    );
}

/// The log shows UCX's InfiniBand module listing devices with the real libibverbs, and its
/// rdmacm module creating its channel with the real librdmacm.
fn assert_ucx_modules_reached_the_real_libraries(out: &Output, what: &str) {
    let log = stderr(out);
    let ib = log.lines().any(|l| {
        l.contains("ibv_get_device_list from ")
            && l.contains("/libuct_ib.so")
            && l.contains("the real libibverbs (/")
            && l.contains("libibverbs.so.1) answers")
    });
    assert!(
        ib,
        "{what}: UCX's ib module did not reach the real libibverbs\n{log}"
    );
    let cm = log.lines().any(|l| {
        l.contains("rdma_create_event_channel from ")
            && l.contains("/libuct_rdmacm.so")
            && l.contains("the real librdmacm's")
    });
    assert!(
        cm,
        "{what}: UCX's rdmacm module did not reach the real librdmacm\n{log}"
    );
}

/// The transports and devices `ucx_info -d` lists.
fn transports(out: &Output) -> Vec<String> {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("Transport:") || l.contains("Device:"))
        .map(|l| l.trim().to_string())
        .collect()
}

/// The RDMA devices the system's libibverbs lists, without ugdr (`ibv_devices`).
fn real_devices() -> Vec<String> {
    let out = run(
        Command::new(require("ibv_devices")),
        "ibv_devices",
        Duration::from_secs(30),
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(2) // "device  node GUID" and its underline
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .collect()
}

#[test]
fn ucx_info_under_ugdr_keeps_its_modules_on_the_real_libraries() {
    let mut cmd = Command::new(require("ucx_info"));
    cmd.arg("-d");
    let (out, dir) = run_logged(cmd, "ucx-info", "ucx_info -d under ugdr");
    assert_engine_never_started(&out, &dir, "ucx_info -d");
    assert_ucx_modules_reached_the_real_libraries(&out, "ucx_info -d");

    let mut bare = Command::new(require("ucx_info"));
    bare.arg("-d");
    let bare = run(bare, "ucx_info -d", Duration::from_secs(60));
    assert_success(&bare, "ucx_info -d");
    assert!(!transports(&bare).is_empty(), "{}", text(&bare));
    assert_eq!(
        transports(&out),
        transports(&bare),
        "the same transports with and without ugdr"
    );
}

#[test]
fn ucx_perftest_pair_under_ugdr_keeps_its_modules_on_the_real_libraries() {
    let port = free_port();
    let (sdir, cdir) = (rundir("perftest-server"), rundir("perftest-client"));
    let args = ["-t", "tag_lat", "-n", "2000", "-s", "64", "-p"];
    let mut server = Command::new(require("ucx_perftest"));
    server.args(args).arg(port.to_string());
    let mut client = Command::new(require("ucx_perftest"));
    client.args(args).arg(port.to_string()).arg("127.0.0.1");
    let (s, c) = run_pingpong(
        logged(server, &sdir),
        logged(client, &cdir),
        port,
        Duration::from_secs(60),
    );
    assert_success(&s, "ucx_perftest server under ugdr");
    assert_success(&c, "ucx_perftest client under ugdr");
    assert!(
        String::from_utf8_lossy(&c.stdout).contains("Final:"),
        "no result\n{}",
        text(&c)
    );
    for (out, dir, what) in [(&s, &sdir, "server"), (&c, &cdir, "client")] {
        assert_engine_never_started(out, dir, what);
        assert_ucx_modules_reached_the_real_libraries(out, what);
    }
}

#[test]
fn one_process_runs_ucx_traffic_and_ugdr_verbs_together() {
    let (out, _) = run_logged(Command::new(program()), "together", "ucx_beside_ugdr");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("rc_loopback: ok") && stdout.contains("ucx_beside_ugdr: ok"),
        "{}",
        text(&out)
    );

    let log = stderr(&out);
    let verbs_at = log
        .find("verbs:\n")
        .expect("the program reached its verbs phase");
    let (ucx_phase, verbs_phase) = log.split_at(verbs_at);
    assert!(ucx_phase.contains("ucx: tag traffic ok"), "{log}");
    assert!(
        !ucx_phase.contains(ENGINE_UP),
        "the program's own UCX started ugdr's engine\n{log}"
    );
    let ucx_only = Output {
        stderr: ucx_phase.as_bytes().to_vec(),
        ..out.clone()
    };
    assert_ucx_modules_reached_the_real_libraries(&ucx_only, "the program's own UCX");
    assert!(verbs_phase.contains(ENGINE_UP), "{log}");
    assert!(
        verbs_phase.contains("ucx: tag traffic beside ugdr ok"),
        "{log}"
    );

    let real = real_devices().len();
    assert!(
        log.contains(&format!(
            "ibv devices: {} (ugdr0 and {real} real)",
            real + 1
        )),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "rdma devices: {} (ugdr0 and {real} real)",
            real + 1
        )),
        "{log}"
    );
}

#[test]
fn without_a_namespace_of_its_own_ugdrs_ucx_shares_the_applications() {
    let mut cmd = Command::new(program());
    cmd.arg("exhaust");
    let (out, _) = run_logged(cmd, "exhausted", "ucx_beside_ugdr exhaust");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("ucx_beside_ugdr: ok"),
        "{}",
        text(&out)
    );
    let log = stderr(&out);
    assert!(
        log.contains("ucx: no link-map namespace of its own"),
        "{log}"
    );
    // ugdr's own UCX now loads its modules where ugdr's exports interpose them: they still
    // reach the real libraries, by their caller.
    assert_ucx_modules_reached_the_real_libraries(
        &out,
        "ugdr's UCX in the application's namespace",
    );
}

fn ugdr_info(rdma: Option<&str>) -> String {
    let mut cmd = Command::new(ugdr_bin());
    cmd.arg("info").env(
        "UGDR_RUNDIR",
        rundir(&format!("info-{}", rdma.unwrap_or("default"))),
    );
    match rdma {
        Some(v) => cmd.env("UGDR_UCX_RDMA", v),
        None => cmd.env_remove("UGDR_UCX_RDMA"),
    };
    let out = run(cmd, "ugdr info", Duration::from_secs(60));
    assert_success(&out, "ugdr info");
    assert!(
        stderr(&out).is_empty(),
        "ugdr info wrote to stderr\n{}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn line<'a>(info: &'a str, prefix: &str) -> &'a str {
    info.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no '{prefix}' line\n{info}"))
}

#[test]
fn ugdr_info_shows_ucxs_rdma_modules_and_the_devices_they_find() {
    let real = real_devices();
    let expected = if real.is_empty() {
        "none".to_string()
    } else {
        real.join(" ")
    };
    for rdma in [None, Some("auto")] {
        let info = ugdr_info(rdma);
        assert!(
            line(&info, "ucx namespace:").contains("own (link-map namespace "),
            "{info}"
        );
        let l = line(&info, "ucx rdma:");
        assert!(
            l.contains("auto: UCX's ib and rdmacm modules loaded ("),
            "{info}"
        );
        for module in [
            "libuct_ib.so.0",
            "libuct_rdmacm.so.0",
            "libibverbs.so.1",
            "librdmacm.so.1",
        ] {
            assert!(l.contains(module), "{module}: {l}");
        }
        assert!(
            l.ends_with(&format!(
                "RDMA devices the real libibverbs lists: {expected}"
            )),
            "{l}"
        );
    }
    let info = ugdr_info(Some("off"));
    let l = line(&info, "ucx rdma:");
    assert_eq!(
        l,
        "ucx rdma:      off (UGDR_UCX_RDMA=off): UCX's ib and rdmacm modules not loaded"
    );
}
