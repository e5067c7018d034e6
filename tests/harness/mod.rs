//! Runs real programs under ugdr: LD_PRELOAD of the built libugdr.so, each process in its
//! own process group with a deadline (the whole group is killed and the test fails when it
//! passes), server/client pairs, and two network namespaces joined by a veth pair that stand
//! for two hosts (each side also gets its own IPC namespace and private /dev/shm, /tmp and
//! /run, so only the network joins them).
#![allow(dead_code)]

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// `target/<profile>/libugdr.so`, next to the `ugdr` binary cargo built for this test.
pub fn lib_path() -> PathBuf {
    let bin = PathBuf::from(env!("CARGO_BIN_EXE_ugdr"));
    let lib = bin.parent().expect("bin dir").join("libugdr.so");
    assert!(
        lib.is_file(),
        "{} is missing: build the cdylib (cargo build) first",
        lib.display()
    );
    lib
}

pub fn ugdr_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_ugdr"))
}

/// Fails the test (never skips) when a program the test needs is not installed.
pub fn require(program: &str) -> String {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(program))
        .find(|p| p.is_file());
    match found {
        Some(p) => p.display().to_string(),
        None => panic!("{program} is not installed (scripts/setup installs it)"),
    }
}

/// A command with only libugdr.so preloaded.
pub fn preloaded(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(require(program));
    c.args(args).env("LD_PRELOAD", lib_path());
    c
}

/// A TCP port no test of this run uses (the pingpongs' own out-of-band socket).
pub fn free_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    let base = 20000 + (std::process::id() % 2000) as u16 * 10;
    loop {
        let p = base + NEXT.fetch_add(1, Ordering::Relaxed) % 9000;
        if std::net::TcpListener::bind(("0.0.0.0", p)).is_ok() {
            return p;
        }
    }
}

/// A child in its own process group; dropping it kills the group.
pub struct Guarded {
    child: Option<Child>,
    what: String,
}

impl Guarded {
    pub fn spawn(mut cmd: Command, what: &str) -> Guarded {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .process_group(0);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what}: {e}"));
        Guarded {
            child: Some(child),
            what: what.to_string(),
        }
    }

    fn kill_group(&mut self) {
        if let Some(c) = &self.child {
            // SAFETY: killpg with the child's pid, which leads its own process group.
            unsafe { libc::killpg(c.id() as i32, libc::SIGKILL) };
        }
    }

    /// Waits until `deadline`; past it, kills the group and panics with what it printed.
    pub fn wait(mut self, deadline: Instant) -> Output {
        let mut child = self.child.take().expect("child");
        loop {
            match child.try_wait() {
                Ok(Some(_)) => return child.wait_with_output().expect("output"),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    // SAFETY: as in kill_group.
                    unsafe { libc::killpg(child.id() as i32, libc::SIGKILL) };
                    let out = child.wait_with_output().expect("output");
                    panic!(
                        "{} timed out\n--- stdout\n{}\n--- stderr\n{}",
                        self.what,
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
            }
        }
    }

    /// Panics with the process's output if it already ended (a server that died before it
    /// listened).
    pub fn assert_running(&mut self) {
        if matches!(self.child.as_mut().map(|c| c.try_wait()), Some(Ok(Some(_)))) {
            let out = self
                .child
                .take()
                .expect("child")
                .wait_with_output()
                .expect("output");
            panic!(
                "{} exited early ({})\n{}",
                self.what,
                out.status,
                text(&out)
            );
        }
    }
}

impl Drop for Guarded {
    fn drop(&mut self) {
        self.kill_group();
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

pub fn run(cmd: Command, what: &str, timeout: Duration) -> Output {
    Guarded::spawn(cmd, what).wait(Instant::now() + timeout)
}

pub fn text(out: &Output) -> String {
    format!(
        "--- stdout\n{}\n--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

pub fn assert_success(out: &Output, what: &str) {
    assert!(
        out.status.success(),
        "{what} failed ({})\n{}",
        out.status,
        text(out)
    );
}

/// Whether a TCP socket listens on `port` (any address), read from /proc: no connection is
/// made, so servers that accept exactly one client are not disturbed.
pub fn listening(port: u16, proc_net_tcp: &str) -> bool {
    proc_net_tcp.lines().skip(1).any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        f.len() > 3
            && f[3] == "0A"
            && f[1]
                .rsplit(':')
                .next()
                .and_then(|p| u16::from_str_radix(p, 16).ok())
                == Some(port)
    })
}

/// Starts `server`, waits until `listening(port)` (read from /proc, without connecting, so
/// servers that accept exactly one client are not disturbed), then runs `client`.
fn run_server_client(
    server: Command,
    client: Command,
    port: u16,
    timeout: Duration,
    listening: impl Fn(u16) -> bool,
) -> (Output, Output) {
    let deadline = Instant::now() + timeout;
    let mut srv = Guarded::spawn(server, "server");
    while !listening(port) {
        srv.assert_running();
        assert!(
            Instant::now() < deadline,
            "server never listened on port {port}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = Guarded::spawn(client, "client").wait(deadline);
    let s = srv.wait(deadline);
    (s, c)
}

/// Server and client on this host.
pub fn run_pingpong(
    server: Command,
    client: Command,
    port: u16,
    timeout: Duration,
) -> (Output, Output) {
    run_server_client(server, client, port, timeout, |p| {
        let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default()
            + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
        listening(p, &tcp)
    })
}

/// Two network namespaces joined by veth (10.199.0.1/24 and 10.199.0.2/24), removed on drop.
pub struct NetnsPair {
    pub a: String,
    pub b: String,
    /// A copy of libugdr.so outside /tmp, /dev/shm and /run, which the sides mount over
    /// (the checkout itself may live under /tmp).
    lib_dir: PathBuf,
}

pub const ADDR_A: &str = "10.199.0.1";
pub const ADDR_B: &str = "10.199.0.2";

fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/netns")
}

impl NetnsPair {
    pub fn new(tag: &str) -> NetnsPair {
        assert!(
            nix_is_root(),
            "the two-namespace tests need root (ip netns, unshare)"
        );
        require("ip");
        require("unshare");
        let id = format!("{}{}", tag, std::process::id() % 100_000);
        let lib_dir = PathBuf::from(format!("/var/tmp/ugdr-netns-{id}"));
        std::fs::create_dir_all(&lib_dir).expect("create /var/tmp dir");
        std::fs::copy(lib_path(), lib_dir.join("libugdr.so")).expect("copy libugdr.so");
        let pair = NetnsPair {
            a: format!("ugdrA{id}"),
            b: format!("ugdrB{id}"),
            lib_dir,
        };
        let out = Command::new("bash")
            .arg(script())
            .args(["up", &pair.a, &pair.b])
            .output()
            .expect("scripts/netns");
        assert!(
            out.status.success(),
            "scripts/netns up failed\n{}",
            text(&out)
        );
        pair
    }

    /// `program args` inside namespace `ns`, in its own IPC and mount namespace with private
    /// /dev/shm, /tmp and /run, with only libugdr.so preloaded.
    pub fn command(&self, ns: &str, program: &str, args: &[&str]) -> Command {
        let mut c = Command::new("bash");
        c.arg(script())
            .args([
                "exec",
                ns,
                "env",
                &format!("LD_PRELOAD={}", self.lib_dir.join("libugdr.so").display()),
                &require(program),
            ])
            .args(args);
        c.env_remove("LD_PRELOAD");
        c
    }

    /// Whether `port` listens inside namespace `ns`.
    pub fn listening(&self, ns: &str, port: u16) -> bool {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                ns,
                "cat",
                "/proc/net/tcp",
                "/proc/net/tcp6",
            ])
            .output()
            .expect("ip netns exec");
        listening(port, &String::from_utf8_lossy(&out.stdout))
    }

    /// Server in A, client in B.
    pub fn run_pingpong(
        &self,
        server: Command,
        client: Command,
        port: u16,
        timeout: Duration,
    ) -> (Output, Output) {
        run_server_client(server, client, port, timeout, |p| {
            self.listening(&self.a, p)
        })
    }
}

impl Drop for NetnsPair {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", &self.a, &self.b])
            .output();
        let _ = std::fs::remove_dir_all(&self.lib_dir);
    }
}

fn nix_is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}
