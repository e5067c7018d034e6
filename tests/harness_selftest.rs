//! The test harness (tests/harness) checked against ordinary programs, without ugdr: output is
//! captured whole, a deadline kills the whole process group and fails the test, a missing
//! program fails instead of skipping, a server/client pair starts its client only once the
//! server listens, and the two namespaces of the "across hosts" tests share the network and
//! nothing else (not /dev/shm, /tmp, /run or System V IPC).

mod harness;

use harness::*;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// tests/c/tcp_once.c, built once per run of this test binary.
fn tcp_once() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/tcp_once.c");
        let exe =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("tcp_once-{}", std::process::id()));
        let cc = Command::new(require("cc"))
            .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
            .arg(&exe)
            .arg(&src)
            .output()
            .expect("cc");
        assert_success(&cc, "cc tests/c/tcp_once.c");
        exe
    })
}

fn tcp_once_cmd(exe: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(exe);
    c.args(args);
    c
}

fn sh(script: &str) -> Command {
    let mut c = Command::new(require("sh"));
    c.args(["-c", script]);
    c
}

fn stdout(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// The message `f` panicked with; fails the test if it did not panic.
fn panic_message(f: impl FnOnce()) -> String {
    let err = catch_unwind(AssertUnwindSafe(f)).expect_err("expected a panic (a test failure)");
    err.downcast_ref::<String>()
        .cloned()
        .or_else(|| err.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// `pid` has exited (gone, or a zombie nobody has reaped yet), waiting up to 5 s.
fn assert_gone(pid: u32) {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // The state follows the parenthesised command name.
        let state = stat.rsplit(") ").next().and_then(|r| r.chars().next());
        if stat.is_empty() || state == Some('Z') {
            return;
        }
        assert!(
            Instant::now() < until,
            "process {pid} survived its group's kill: {stat}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The number after `key ` in `text` (e.g. "pid 1234").
fn number_after(text: &str, key: &str) -> u32 {
    text.lines()
        .find_map(|l| l.trim().strip_prefix(key)?.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {key:?} line in\n{text}"))
}

#[test]
fn output_larger_than_a_pipe_buffer_is_captured_whole() {
    let out = run(
        sh("head -c 1000000 /dev/zero | tr '\\0' o; head -c 300000 /dev/zero | tr '\\0' e >&2"),
        "a chatty program",
        Duration::from_secs(30),
    );
    assert_success(&out, "a chatty program");
    assert_eq!(out.stdout.len(), 1_000_000);
    assert!(out.stdout.iter().all(|&b| b == b'o'));
    assert_eq!(out.stderr.len(), 300_000);
    assert!(out.stderr.iter().all(|&b| b == b'e'));
}

#[test]
fn a_failing_program_fails_assert_success_with_its_output() {
    let out = run(
        sh("echo out-marker; echo err-marker >&2; exit 3"),
        "exit 3",
        Duration::from_secs(30),
    );
    assert_eq!(out.status.code(), Some(3));
    let msg = panic_message(|| assert_success(&out, "the exit-3 program"));
    for needle in [
        "the exit-3 program failed",
        "exit status: 3",
        "out-marker",
        "err-marker",
    ] {
        assert!(msg.contains(needle), "missing {needle:?} in {msg}");
    }
}

#[test]
fn a_timeout_kills_the_whole_process_group_and_fails_the_test() {
    let started = Instant::now();
    // The shell starts a grandchild (`sleep`), reports both pids, and waits forever.
    let msg = panic_message(|| {
        run(
            sh("sleep 600 & echo grandchild $!; echo shell $$; echo started-marker >&2; wait"),
            "a hanging program",
            Duration::from_secs(1),
        );
    });
    let elapsed = started.elapsed();
    assert!(
        msg.contains("a hanging program timed out"),
        "unexpected failure: {msg}"
    );
    assert!(
        msg.contains("started-marker"),
        "what it wrote before the deadline is shown: {msg}"
    );
    assert!(
        elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(10),
        "{elapsed:?}"
    );
    assert_gone(number_after(&msg, "shell"));
    assert_gone(number_after(&msg, "grandchild"));
}

#[test]
fn a_missing_program_fails_the_test_instead_of_skipping_it() {
    let msg = panic_message(|| {
        require("ugdr-selftest-no-such-program");
    });
    assert!(msg.contains("is not installed"), "{msg}");
    let msg = panic_message(|| {
        preloaded("ugdr-selftest-no-such-program", &[]);
    });
    assert!(msg.contains("is not installed"), "{msg}");
    let msg = panic_message(|| {
        require("/nonexistent/ugdr-selftest");
    });
    assert!(msg.contains("does not exist"), "{msg}");
    let msg = panic_message(|| {
        run(
            Command::new("/nonexistent/ugdr-selftest"),
            "a program that is not there",
            Duration::from_secs(5),
        );
    });
    assert!(
        msg.contains("cannot start a program that is not there"),
        "{msg}"
    );
}

#[test]
fn free_ports_are_distinct_and_bindable() {
    let ports: Vec<u16> = (0..5).map(|_| free_port()).collect();
    for (i, p) in ports.iter().enumerate() {
        assert!(!ports[..i].contains(p), "{p} handed out twice: {ports:?}");
        std::net::TcpListener::bind(("127.0.0.1", *p))
            .unwrap_or_else(|e| panic!("port {p} is not free: {e}"));
    }
}

#[test]
fn listening_reads_proc_net_tcp() {
    let table = "  sl  local_address rem_address   st tx_queue rx_queue\n   \
                 0: 0100007F:4E21 00000000:0000 0A 00000000:00000000\n   \
                 1: 0100007F:4E22 0100007F:9C40 01 00000000:00000000\n";
    assert!(listening(0x4E21, table));
    assert!(
        !listening(0x4E22, table),
        "an established socket is not listening"
    );
    assert!(!listening(0x4E23, table));
}

#[test]
fn the_client_starts_only_once_the_server_listens() {
    let exe = tcp_once();
    let port = free_port();
    let p = port.to_string();
    // Without a listener the client fails at once: the pair below passes only if it waited.
    let alone = run(
        tcp_once_cmd(exe, &["connect", "127.0.0.1", &p, "x"]),
        "client without a server",
        Duration::from_secs(10),
    );
    assert!(!alone.status.success(), "{}", text(&alone));
    // The server listens only after 1 s.
    let (s, c) = run_pingpong(
        tcp_once_cmd(exe, &["listen", "127.0.0.1", &p, "1000"]),
        tcp_once_cmd(exe, &["connect", "127.0.0.1", &p, "hello-from-the-client"]),
        port,
        Duration::from_secs(30),
    );
    assert_success(&s, "server");
    assert_success(&c, "client");
    assert!(
        stdout(&s).contains("got: hello-from-the-client\n"),
        "{}",
        text(&s)
    );
    assert_eq!(stdout(&c), "sent\n");
}

#[test]
fn a_server_that_dies_before_listening_fails_the_pair() {
    let port = free_port();
    let msg = panic_message(|| {
        run_pingpong(
            sh("echo dying-marker; exit 4"),
            sh("echo the client must not run; exit 0"),
            port,
            Duration::from_secs(30),
        );
    });
    assert!(msg.contains("server exited early"), "{msg}");
    assert!(msg.contains("dying-marker"), "{msg}");
}

#[test]
fn a_hanging_pair_is_killed_at_the_deadline_and_fails_showing_both_sides() {
    let exe = tcp_once();
    let port = free_port();
    let p = port.to_string();
    let started = Instant::now();
    let msg = panic_message(|| {
        run_pingpong(
            tcp_once_cmd(exe, &["listen", "127.0.0.1", &p, "0", "hang"]),
            tcp_once_cmd(exe, &["connect", "127.0.0.1", &p, "x"]),
            port,
            Duration::from_secs(3),
        );
    });
    assert!(started.elapsed() < Duration::from_secs(15));
    assert!(
        msg.contains("server timed out, client exited"),
        "unexpected failure: {msg}"
    );
    assert!(
        msg.contains("=== server") && msg.contains("=== client"),
        "{msg}"
    );
    assert!(msg.contains("sent"), "the client's output is shown: {msg}");
    assert_gone(number_after(&msg, "pid"));
}

#[test]
fn two_namespaces_are_joined_by_the_network_only() {
    let marker = format!("ugdr-selftest-{}", std::process::id());
    let (a, b);
    {
        let ns = NetnsPair::new("t");
        (a, b) = (ns.a.clone(), ns.b.clone());
        let in_ns = |side: &str, script: &str| {
            let out = run(
                ns.command_without_ugdr(side, "sh", &["-c", script]),
                &format!("`{script}` in {side}"),
                Duration::from_secs(30),
            );
            assert_success(&out, &format!("`{script}` in {side}"));
            stdout(&out)
        };

        // Addresses: A has 10.199.0.1/24, B has 10.199.0.2/24, each with lo up.
        let addrs_a = in_ns(&ns.a, "ip -4 -o addr show");
        let addrs_b = in_ns(&ns.b, "ip -4 -o addr show");
        assert!(
            addrs_a.contains("inet 10.199.0.1/24") && !addrs_a.contains("10.199.0.2"),
            "{addrs_a}"
        );
        assert!(
            addrs_b.contains("inet 10.199.0.2/24") && !addrs_b.contains("10.199.0.1"),
            "{addrs_b}"
        );
        assert!(addrs_a.contains("inet 127.0.0.1/8"), "{addrs_a}");
        assert!(addrs_b.contains("inet 127.0.0.1/8"), "{addrs_b}");

        // The network joins them: a server in A, a client in B.
        let exe = ns.stage(tcp_once());
        let exe = exe.to_str().unwrap();
        let port = free_port();
        let p = port.to_string();
        let (s, c) = ns.run_pingpong(
            ns.command_without_ugdr(&ns.a, exe, &["listen", ADDR_A, &p, "500"]),
            ns.command_without_ugdr(&ns.b, exe, &["connect", ADDR_A, &p, "over-the-veth"]),
            port,
            Duration::from_secs(30),
        );
        assert_success(&s, "server in A");
        assert_success(&c, "client in B");
        assert!(stdout(&s).contains("got: over-the-veth"), "{}", text(&s));

        // Nothing else does. A side keeps its namespaces while it runs, so A stays up (holding
        // a file in each private directory and a System V segment) while B and the host look.
        let dirs = ["/dev/shm", "/tmp", "/run"];
        let files: Vec<String> = dirs.iter().map(|d| format!("{d}/{marker}")).collect();
        let ids = "readlink /proc/self/ns/ipc /proc/self/ns/mnt /proc/self/ns/net";
        let report_a = ns.stage_dir().join("a-report");
        let script_a = format!(
            "touch {files} && ipcmk -M 4096 && {{ {ids}; ls -a {dirs}; ipcs -m; }} > {report}.part \
             && mv {report}.part {report} && exec sleep 600",
            files = files.join(" "),
            dirs = dirs.join(" "),
            report = report_a.display(),
        );
        let holder = Guarded::spawn(
            ns.command_without_ugdr(&ns.a, "sh", &["-c", &script_a]),
            "namespace A holder",
        );
        let until = Instant::now() + Duration::from_secs(30);
        while !report_a.exists() {
            assert!(Instant::now() < until, "A never reported");
            std::thread::sleep(Duration::from_millis(20));
        }
        let seen_a = std::fs::read_to_string(&report_a).unwrap();
        assert_eq!(seen_a.matches(&marker).count(), 3, "{seen_a}");
        let segments = |ipcs: &str| ipcs.lines().filter(|l| l.starts_with("0x")).count();
        assert_eq!(segments(&seen_a), 1, "A's own segment\n{seen_a}");

        let seen_b = in_ns(&ns.b, &format!("{ids}; ls -a {}; ipcs -m", dirs.join(" ")));
        assert!(!seen_b.contains(&marker), "B sees A's files:\n{seen_b}");
        assert_eq!(segments(&seen_b), 0, "B sees A's segment:\n{seen_b}");
        for f in &files {
            assert!(!Path::new(f).exists(), "the host sees A's {f}");
        }
        let host = stdout(&run(sh(ids), "namespace ids", Duration::from_secs(10)));
        for (i, kind) in ["ipc", "mnt", "net"].iter().enumerate() {
            let line = |s: &str| s.lines().nth(i).unwrap_or_default().to_string();
            let (h, x, y) = (line(&host), line(&seen_a), line(&seen_b));
            assert!(
                x.starts_with(kind) && y.starts_with(kind),
                "{seen_a}\n{seen_b}"
            );
            assert!(h != x && h != y && x != y, "{kind}: host {h}, A {x}, B {y}");
        }
        drop(holder);

        // The preloaded library is reachable inside, though the sides mount over /tmp.
        let lib = ns.preload_path();
        in_ns(&ns.b, &format!("test -r {}", lib.display()));
    }
    // Dropped: both namespaces are gone.
    let list = Command::new(require("ip"))
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    let list = stdout(&list);
    assert!(
        !list
            .lines()
            .any(|l| l.split_whitespace().next() == Some(a.as_str())
                || l.split_whitespace().next() == Some(b.as_str())),
        "namespaces left behind:\n{list}"
    );
}
