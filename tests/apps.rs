//! The acceptance programs, unmodified (Debian's ibverbs-utils and ucx-utils), under
//! LD_PRELOAD of the built libugdr.so and nothing else: on one host, and across two network
//! namespaces that stand for two hosts.

mod harness;

use harness::*;
use std::process::Output;
use std::time::Duration;

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn ibv_devices_lists_ugdr0() {
    let out = run(
        preloaded("ibv_devices", &[]),
        "ibv_devices",
        Duration::from_secs(30),
    );
    assert_success(&out, "ibv_devices");
    assert!(
        stdout(&out)
            .lines()
            .any(|l| l.trim_start().starts_with("ugdr0")),
        "{}",
        text(&out)
    );
}

#[test]
fn ibv_devinfo_shows_an_active_infiniband_port() {
    let out = run(
        preloaded("ibv_devinfo", &[]),
        "ibv_devinfo",
        Duration::from_secs(30),
    );
    assert_success(&out, "ibv_devinfo");
    let s = stdout(&out);
    for needle in [
        "hca_id:\tugdr0",
        "state:\t\t\tPORT_ACTIVE (4)",
        "link_layer:\t\tInfiniBand",
    ] {
        assert!(s.contains(needle), "missing {needle:?}\n{}", text(&out));
    }
    let lid = s
        .lines()
        .find_map(|l| l.trim().strip_prefix("port_lid:"))
        .map(|v| v.trim().parse::<u16>().expect("a decimal LID"))
        .unwrap_or_else(|| panic!("no port_lid line\n{}", text(&out)));
    assert_ne!(lid, 0, "the LID must be non-zero");
}

#[test]
fn ibv_devinfo_verbose_shows_an_active_infiniband_port() {
    let out = run(
        preloaded("ibv_devinfo", &["-v"]),
        "ibv_devinfo -v",
        Duration::from_secs(30),
    );
    assert_success(&out, "ibv_devinfo -v");
    let s = stdout(&out);
    for needle in [
        "hca_id:\tugdr0",
        "PORT_ACTIVE (4)",
        "link_layer:\t\tInfiniBand",
        "active_mtu:\t\t4096 (5)",
        "GID[  0]:\t\tfe80:0000:0000:0000:0255",
    ] {
        assert!(s.contains(needle), "missing {needle:?}\n{}", text(&out));
    }
    let lid = s
        .lines()
        .find_map(|l| l.trim().strip_prefix("port_lid:"))
        .map(|v| v.trim().to_string())
        .expect("port_lid line");
    assert_ne!(lid, "0", "the LID must be non-zero");
}

/// `ibv_devinfo -v`'s device block (everything before the port) under a device profile, as
/// (field, value) pairs; a flag list's lines are appended to their field's value.
fn device_block(profile: &str) -> Vec<(String, String)> {
    let mut cmd = preloaded("ibv_devinfo", &["-v"]);
    cmd.env("UGDR_DEVICE_PROFILE", profile);
    let out = run(cmd, "ibv_devinfo -v", Duration::from_secs(30));
    assert_success(&out, &format!("ibv_devinfo -v, profile {profile}"));
    let mut fields: Vec<(String, String)> = Vec::new();
    for line in stdout(&out).lines().skip(1) {
        let l = line.trim();
        if l.starts_with("port:") {
            break;
        }
        match l.split_once(':') {
            Some((k, v)) if !k.contains(' ') => fields.push((k.to_string(), v.trim().to_string())),
            _ => match fields.last_mut() {
                Some((_, v)) => *v = format!("{v} {l}"),
                None => fields.push((l.to_string(), String::new())),
            },
        }
    }
    assert!(fields.len() > 30, "{}", text(&out));
    fields
}

fn field<'a>(fields: &'a [(String, String)], name: &str) -> &'a str {
    fields
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
        .unwrap_or_else(|| panic!("no {name} in {fields:?}"))
}

/// Real devices never report vendor 0 (SPDK warns and assumes rxe; test suites assert
/// non-zero). ugdr's own identity is rxe's software vendor id with ugdr's part id, never
/// Mellanox's; the ConnectX-6 profile changes the identity and nothing else.
#[test]
fn the_device_has_a_vendor_identity_in_both_profiles_and_nothing_else_differs() {
    let own = device_block("ugdr");
    let cx6 = device_block("connectx6");
    assert_eq!(field(&own, "vendor_id"), "0xffffff");
    assert_eq!(field(&own, "vendor_part_id"), "30055");
    assert_eq!(field(&cx6, "vendor_id"), "0x02c9");
    assert_eq!(field(&cx6, "vendor_part_id"), "4123");
    let identity = |k: &str| k == "vendor_id" || k == "vendor_part_id";
    let rest = |f: &[(String, String)]| -> Vec<(String, String)> {
        f.iter().filter(|(k, _)| !identity(k)).cloned().collect()
    };
    assert_eq!(
        rest(&own),
        rest(&cx6),
        "the profiles differ beyond the identity"
    );
    // Limits that say what ugdr has: address handles, memory windows and multicast.
    assert_ne!(field(&own, "max_ah"), "0");
    assert_ne!(field(&own, "max_mw"), "0");
    assert_eq!(field(&own, "max_mcast_grp"), "1024");
    assert_eq!(field(&own, "max_mcast_qp_attach"), "56");
    // Memory windows, LOCAL_INV and SEND_WITH_INV: IBV_DEVICE_MEM_MGT_EXTENSIONS (bit 21), so
    // SPDK no longer warns that the device lacks SEND_WITH_INVALIDATE.
    let flags = field(&own, "device_cap_flags");
    let bits = u32::from_str_radix(
        flags
            .split_whitespace()
            .next()
            .unwrap()
            .trim_start_matches("0x"),
        16,
    )
    .expect("hex device_cap_flags");
    assert_ne!(
        bits & (1 << 21),
        0,
        "MEM_MGT_EXTENSIONS not advertised: {flags}"
    );
    assert!(flags.contains("MEM_MGT_EXTENSIONS"), "{flags}");
    assert!(flags.contains("MEM_WINDOW_TYPE_2B"), "{flags}");
    // XRC is carried: IBV_DEVICE_XRC (bit 20).
    assert_ne!(
        bits & (1 << 20),
        0,
        "IBV_DEVICE_XRC not advertised: {flags}"
    );
}

fn rc_pingpong(opts: &[&str], timeout_s: u64) -> (Output, Output) {
    pingpong("ibv_rc_pingpong", opts, timeout_s)
}

/// `ibv_rc_pingpong -t` (completions read through `ibv_start_poll`/`ibv_next_poll` with their
/// timestamps) with `opts`: both sides report the receive completions' clock deltas, whose
/// smallest is positive (the device clock moved between two receives) and below the average.
fn rc_pingpong_with_timestamps(opts: &[&str]) {
    let mut all = vec!["-t", "-c"];
    all.extend_from_slice(opts);
    let (s, c) = rc_pingpong(&all, 90);
    for o in [&s, &c] {
        let out = String::from_utf8_lossy(&o.stdout);
        let figure = |name: &str| -> f64 {
            let line = out
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no \"{name}\" line: {}", text(o)));
            line.rsplit('=').next().unwrap().trim().parse().unwrap()
        };
        let (min, avg) = (
            figure("Min receive completion clock cycles"),
            figure("Average receive completion clock cycles"),
        );
        assert!(
            min > 0.0 && min <= avg,
            "min {min}, average {avg}: {}",
            text(o)
        );
    }
}

#[test]
fn rc_pingpong_default() {
    rc_pingpong(&[], 60);
}

#[test]
fn rc_pingpong_validated() {
    rc_pingpong(&["-c"], 60);
}

#[test]
fn rc_pingpong_one_byte() {
    rc_pingpong(&["-s", "1", "-c"], 60);
}

#[test]
fn rc_pingpong_64k() {
    rc_pingpong(&["-s", "65536", "-c"], 90);
}

#[test]
fn rc_pingpong_1m_200_iters() {
    rc_pingpong(&["-s", "1048576", "-n", "200", "-c"], 120);
}

#[test]
fn rc_pingpong_20000_iters_of_64_bytes() {
    rc_pingpong(&["-n", "20000", "-s", "64"], 120);
}

#[test]
fn rc_pingpong_events() {
    rc_pingpong(&["-e", "-c"], 90);
}

/// Blocking on events and reading completions with `ibv_start_poll`: after each event the
/// program polls at most twice and fails on an event that finds the CQ empty. Failed every
/// time before ("poll CQ failed 2"): the ACK of a SEND went alone just before the answer
/// that could carry it, so at the peer the send's completion and the answer's arrival came
/// apart, the first woke it, and the second, added while it polled, raised a second event
/// whose completion it had already taken.
#[test]
fn rc_pingpong_timestamps_with_events() {
    rc_pingpong_with_timestamps(&["-e"]);
}

#[test]
fn rc_pingpong_timestamps() {
    rc_pingpong_with_timestamps(&[]);
}

#[test]
fn rc_pingpong_on_demand_paging() {
    rc_pingpong(&["-o", "-c"], 60);
}

#[test]
fn rc_pingpong_implicit_on_demand_paging_prefetched() {
    rc_pingpong(&["-O", "-P", "-c"], 60);
}

#[test]
fn rc_pingpong_device_memory() {
    rc_pingpong(&["-j", "-c"], 60);
}

#[test]
fn rc_pingpong_gid_index_0() {
    rc_pingpong(&["-g", "0", "-c"], 60);
}

#[test]
fn rc_pingpong_new_send_api() {
    rc_pingpong(&["-N", "-c"], 60);
}

#[test]
fn rc_pingpong_mtu_4096() {
    rc_pingpong(&["-m", "4096", "-c"], 60);
}

#[test]
fn rc_pingpong_rx_depth_1() {
    rc_pingpong(&["-r", "1", "-n", "2000", "-c"], 90);
}

fn rc_pingpong_across_namespaces(tag: &str, opts: &[&str]) {
    let ns = NetnsPair::new(tag);
    let c = pingpong_across_namespaces(&ns, "ibv_rc_pingpong", opts, 120);
    // The two sides got LIDs of two different hosts (the host tag is the LID's high byte).
    let lids: Vec<String> = stdout(&c)
        .lines()
        .filter_map(|l| l.split("LID 0x").nth(1).map(|r| r[..2].to_string()))
        .collect();
    assert_eq!(lids.len(), 2, "{}", text(&c));
    assert_ne!(
        lids[0],
        lids[1],
        "local and remote LIDs should name different hosts\n{}",
        text(&c)
    );
}

#[test]
fn rc_pingpong_across_hosts_by_lid() {
    rc_pingpong_across_namespaces("l", &["-c"]);
}

#[test]
fn rc_pingpong_across_hosts_by_gid() {
    rc_pingpong_across_namespaces("g", &["-g", "0", "-c"]);
}

#[test]
fn a_process_that_runs_ucx_itself_neither_recurses_nor_crashes() {
    let out = run(
        preloaded("ucx_info", &["-d"]),
        "ucx_info -d",
        Duration::from_secs(60),
    );
    assert_success(&out, "ucx_info -d under ugdr");
    assert!(stdout(&out).contains("Transport: tcp"), "{}", text(&out));
}

#[test]
fn launcher_runs_a_program_with_the_library_preloaded() {
    let mut c = std::process::Command::new(ugdr_bin());
    c.args(["run", "--", &require("ibv_devices")])
        .env_remove("LD_PRELOAD");
    let out = run(c, "ugdr run -- ibv_devices", Duration::from_secs(30));
    assert_success(&out, "ugdr run");
    assert!(stdout(&out).contains("ugdr0"), "{}", text(&out));
}

#[test]
fn launcher_without_a_command_prints_usage_and_fails() {
    let mut c = std::process::Command::new(ugdr_bin());
    c.arg("run");
    let out = run(c, "ugdr run", Duration::from_secs(10));
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("usage: ugdr run"),
        "{}",
        text(&out)
    );
}

#[test]
fn ugdr_info_shows_the_port() {
    let mut c = std::process::Command::new(ugdr_bin());
    c.arg("info");
    let out = run(c, "ugdr info", Duration::from_secs(30));
    assert_success(&out, "ugdr info");
    let s = stdout(&out);
    assert!(
        s.contains("ugdr0") && s.contains("lid:") && s.contains("gid[0]:") && s.contains("ucx:"),
        "{}",
        text(&out)
    );
    assert!(s.contains("direct path:   on:"), "{}", text(&out));
    assert!(
        s.contains("peers:         must prove the secret in /") && s.contains("ugdr/secret"),
        "{}",
        text(&out)
    );
    assert!(
        s.contains("progress:      adaptive (UGDR_PROGRESS)"),
        "{}",
        text(&out)
    );
    let mut busy = std::process::Command::new(ugdr_bin());
    busy.arg("info").env("UGDR_PROGRESS", "busy");
    let out = run(busy, "ugdr info (busy progress)", Duration::from_secs(30));
    assert!(
        stdout(&out).contains("progress:      busy (UGDR_PROGRESS)"),
        "{}",
        text(&out)
    );
    let mut off = std::process::Command::new(ugdr_bin());
    off.arg("info")
        .env("UGDR_DIRECT", "off")
        .env("UGDR_SECRET", "s");
    let out = run(off, "ugdr info (direct off)", Duration::from_secs(30));
    assert!(
        stdout(&out).contains("direct path:   off (UGDR_DIRECT=off)")
            && stdout(&out).contains("must prove the secret in UGDR_SECRET"),
        "{}",
        text(&out)
    );
}

/// An idle process (a pingpong server waiting for its client, its device open) spends no CPU
/// in the `event` and `adaptive` progress modes (the adaptive window is bounded), and a core
/// in `busy`; the mode in effect is the one UGDR_PROGRESS names.
#[test]
fn progress_modes_idle_cpu() {
    let idle = Duration::from_secs(2);
    for (mode, burns) in [("event", false), ("adaptive", false), ("busy", true)] {
        let port = free_port();
        let mut c = preloaded("ibv_rc_pingpong", &["-p", &port.to_string()]);
        c.env("UGDR_PROGRESS", mode).env("UGDR_LOG", "debug");
        let mut server = Guarded::spawn(c, &format!("ibv_rc_pingpong server ({mode})"));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !listening_here(port) {
            server.assert_running();
            assert!(
                std::time::Instant::now() < deadline,
                "{mode}: server never listened"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let before = cpu_ticks(server.pid());
        std::thread::sleep(idle);
        let used = cpu_ticks(server.pid()) - before;
        let out = server
            .wait_until(std::time::Instant::now())
            .unwrap_or_else(|o| o);
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(&format!("progress {mode}")),
            "{mode}: the engine did not report the mode\n{}",
            text(&out)
        );
        // Ticks are 10 ms. Idle: the progress thread's 100 ms poll timeout and the peer
        // checks, well under 40 ms in 2 s. Busy: a spinning thread gets at least its share of
        // a loaded 2-core machine (load 20: 200 ms in 2 s).
        if burns {
            assert!(used >= 10, "{mode}: only {used} ticks in {idle:?}");
        } else {
            assert!(used <= 4, "{mode}: {used} ticks in {idle:?} while idle");
        }
    }
}

/// A UGDR_PROGRESS or UGDR_PROGRESS_SPIN_US that ugdr does not know is refused (README): the
/// device does not open, and the reason is printed even with logging off.
#[test]
fn unknown_progress_settings_are_refused() {
    for (var, value, says) in [
        (
            "UGDR_PROGRESS",
            "poll",
            "UGDR_PROGRESS=\"poll\" is not one of event, adaptive, busy",
        ),
        (
            "UGDR_PROGRESS_SPIN_US",
            "5ms",
            "UGDR_PROGRESS_SPIN_US=\"5ms\" is not a whole number of microseconds",
        ),
    ] {
        let mut c = std::process::Command::new(ugdr_bin());
        c.arg("info").env(var, value);
        let out = run(c, "ugdr info (bad setting)", Duration::from_secs(30));
        assert!(!out.status.success(), "{var}={value}: {}", text(&out));
        assert!(
            String::from_utf8_lossy(&out.stderr).contains(says),
            "{var}={value}: {}",
            text(&out)
        );
        // A real program: its device does not open.
        let mut p = preloaded("ibv_devinfo", &[]);
        p.env(var, value);
        let out = run(p, "ibv_devinfo (bad setting)", Duration::from_secs(30));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(says) && err.contains("ugdr0 does not open"),
            "{var}={value}: {}",
            text(&out)
        );
    }
}

/// ibv_rc_pingpong with its data check, SENDs and completion events, both sides under each
/// UGDR_PROGRESS mode.
#[test]
fn rc_pingpong_under_each_progress_mode() {
    for mode in ["event", "adaptive", "busy"] {
        for opts in [&["-c", "-n", "2000"][..], &["-e", "-c", "-n", "500"][..]] {
            pingpong_with_env("ibv_rc_pingpong", opts, &[("UGDR_PROGRESS", mode)], 90);
        }
    }
}

#[test]
fn srq_pingpong_validated() {
    pingpong("ibv_srq_pingpong", &["-c"], 60);
}

#[test]
fn srq_pingpong_64_qps() {
    pingpong("ibv_srq_pingpong", &["-q", "64", "-c"], 90);
}

#[test]
fn srq_pingpong_events() {
    pingpong("ibv_srq_pingpong", &["-e", "-c"], 90);
}
