//! Runs real programs under ugdr: LD_PRELOAD of the built libugdr.so, each process in its
//! own process group with a deadline (the whole group is killed and the test fails when it
//! passes), server/client pairs, and two network namespaces joined by a veth pair that stand
//! for two hosts (each side also gets its own IPC namespace and private /dev/shm, /tmp and
//! /run, so only the network joins them).
#![allow(dead_code)]

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// A number field of /proc/PID/status (`VmRSS`, `VmHWM` in kB; `Threads`).
pub fn proc_status(pid: i32, field: &str) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status"))
}

/// The descriptors process `pid` has open.
pub fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count()
}

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
/// A `program` containing a `/` is a path and must exist as given.
/// Copies `from` to `to` in a child process (`cp`), not in this one: while
/// this process held the copy open for writing, a child that another test
/// thread forked meanwhile would inherit that descriptor until it execs, and
/// running the copy in that window fails with ETXTBSY ("Text file busy").
pub fn copy_executable(from: &std::path::Path, to: &std::path::Path) {
    let status = Command::new("cp")
        .arg("--")
        .arg(from)
        .arg(to)
        .status()
        .unwrap_or_else(|e| panic!("cannot run cp: {e}"));
    assert!(
        status.success(),
        "cp {} {} failed ({status})",
        from.display(),
        to.display()
    );
}

pub fn require(program: &str) -> String {
    if program.contains('/') {
        assert!(
            std::path::Path::new(program).is_file(),
            "{program} does not exist"
        );
        return program.to_string();
    }
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

/// Compiles `tests/c/<name>.c` with `cc -std=gnu11 -O2 -Wall -Wextra -Werror` and `libs`
/// into the test target's scratch directory; the executable's path. The compiler writes a
/// file of its own that is then renamed into place, so a test running the previous build
/// (tests of one binary run in parallel) never meets a half-written file ("text file busy").
pub fn build_c(name: &str, libs: &[&str]) -> PathBuf {
    static BUILDS: AtomicU16 = AtomicU16::new(0);
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/c/{name}.c"));
    let exe = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let scratch = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        ".{name}-{}-{}",
        std::process::id(),
        BUILDS.fetch_add(1, Ordering::Relaxed)
    ));
    let cc = Command::new(require("cc"))
        .args(["-std=gnu11", "-O2", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&scratch)
        .arg(&src)
        .args(libs)
        .output()
        .expect("cc");
    assert_success(&cc, &format!("cc {}", src.display()));
    std::fs::rename(&scratch, &exe).expect("rename the built program into place");
    exe
}

/// Runs the test program `exe` with `args` under ugdr (as `what`, for at most 60 s): it must
/// exit 0 and print the line `done`.
pub fn run_checked_under_ugdr(exe: &std::path::Path, args: &[&str], what: &str, done: &str) {
    run_checked_under_ugdr_with(exe, args, &[], what, done);
}

/// As [`run_checked_under_ugdr`], with the environment variables `env` set too.
pub fn run_checked_under_ugdr_with(
    exe: &std::path::Path,
    args: &[&str],
    env: &[(&str, &str)],
    what: &str,
    done: &str,
) {
    let mut cmd = Command::new(exe);
    cmd.args(args)
        .env("LD_PRELOAD", lib_path())
        .envs(env.iter().copied());
    let out = run(cmd, what, Duration::from_secs(60));
    assert_success(&out, what);
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .any(|l| l == done),
        "{what}: no line {done:?}\n{}",
        text(&out)
    );
}

/// A command with only libugdr.so preloaded.
/// Why this process's children may not reach each other by cross-memory attach
/// (`process_vm_writev`/`readv`), if they may not: Yama's `ptrace_scope` 1 or more keeps
/// attaching to a sibling to holders of CAP_SYS_PTRACE (and 3 to nobody). ugdr's same-host
/// path then takes messages for memory on pages shared with other data; tests that need the
/// attach say they were skipped, and why.
pub fn cross_memory_attach_refused() -> Option<String> {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())?;
    if scope == 0 {
        return None;
    }
    const CAP_SYS_PTRACE: u32 = 19;
    let has_ptrace = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|st| {
            st.lines()
                .find_map(|l| l.strip_prefix("CapEff:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|caps| caps & (1 << CAP_SYS_PTRACE) != 0);
    (scope >= 3 || !has_ptrace).then(|| {
        format!("kernel.yama.ptrace_scope = {scope} without CAP_SYS_PTRACE: no cross-memory attach")
    })
}

pub fn preloaded(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(require(program));
    c.args(args).env("LD_PRELOAD", lib_path());
    c
}

/// Clock ticks of CPU (user + system) process `pid` has used, from `/proc/<pid>/stat`.
pub fn cpu_ticks(pid: i32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("/proc/<pid>/stat");
    // Fields after the command name (which may hold spaces): state is field 3, utime 14.
    let after = &stat[stat.rfind(')').expect("comm") + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap()
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

/// What a child wrote to one of its pipes, read by a thread as it arrives, so that a child
/// writing more than a pipe buffer (64 KiB; e.g. with `UGDR_LOG=trace`) never blocks on it.
struct Capture {
    bytes: Arc<Mutex<Vec<u8>>>,
    reader: JoinHandle<()>,
}

impl Capture {
    fn start(mut pipe: impl Read + Send + 'static) -> Capture {
        let bytes = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&bytes);
        let reader = std::thread::spawn(move || {
            let mut chunk = [0u8; 65536];
            loop {
                match pipe.read(&mut chunk) {
                    Ok(0) => break,
                    Ok(n) => sink.lock().unwrap().extend_from_slice(&chunk[..n]),
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => break,
                }
            }
        });
        Capture { bytes, reader }
    }

    /// Everything read so far; waits up to `grace` for the writer side to close first.
    fn take(self, grace: Duration) -> Vec<u8> {
        let until = Instant::now() + grace;
        while !self.reader.is_finished() && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        std::mem::take(&mut *self.bytes.lock().unwrap())
    }
}

/// A child in its own process group (so that everything it starts can be killed with it),
/// with its stdout and stderr captured; dropping it kills the group.
pub struct Guarded {
    child: Option<Child>,
    /// The group's id: the child's pid, kept after the child is reaped.
    pgid: i32,
    stdout: Option<Capture>,
    stderr: Option<Capture>,
    what: String,
}

impl Guarded {
    pub fn spawn(mut cmd: Command, what: &str) -> Guarded {
        cmd.stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .stdin(Stdio::null())
            .process_group(0);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what} ({cmd:?}): {e}"));
        let stdout = child.stdout.take().map(Capture::start);
        let stderr = child.stderr.take().map(Capture::start);
        Guarded {
            pgid: child.id() as i32,
            child: Some(child),
            stdout,
            stderr,
            what: what.to_string(),
        }
    }

    fn kill_group(&self) {
        // SAFETY: killpg has no memory preconditions; `pgid` is the group this child leads
        // (process_group(0)), so only the child and what it started receive the signal.
        unsafe { libc::killpg(self.pgid, libc::SIGKILL) };
    }

    /// Reaps the child, kills what is left of its group, and collects its output.
    fn finish(&mut self, status: ExitStatus) -> Output {
        // Anything the child left behind in its group (a background helper) would keep the
        // pipes open; the test is over for it.
        self.kill_group();
        let grace = Duration::from_secs(5);
        Output {
            status,
            stdout: self
                .stdout
                .take()
                .map(|c| c.take(grace))
                .unwrap_or_default(),
            stderr: self
                .stderr
                .take()
                .map(|c| c.take(grace))
                .unwrap_or_default(),
        }
    }

    /// Waits until `deadline`. `Ok`: the child exited. `Err`: the deadline passed; the whole
    /// group was killed and the output is what it wrote until then.
    pub fn wait_until(mut self, deadline: Instant) -> Result<Output, Output> {
        let mut child = self.child.take().expect("child");
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Ok(self.finish(status)),
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10))
                }
                Ok(None) => {
                    self.kill_group();
                    let status = child.wait().expect("wait for a killed child");
                    return Err(self.finish(status));
                }
                Err(e) => {
                    self.kill_group();
                    panic!("cannot wait for {}: {e}", self.what)
                }
            }
        }
    }

    /// Waits until `deadline`; past it, kills the group and panics with what it printed.
    pub fn wait(self, deadline: Instant) -> Output {
        let what = self.what.clone();
        match self.wait_until(deadline) {
            Ok(out) => out,
            Err(out) => panic!("{what} timed out (process group killed)\n{}", text(&out)),
        }
    }

    /// The child's process id (also its process group's).
    pub fn pid(&self) -> i32 {
        self.pgid
    }

    /// The child's output if it exited (it is reaped, and its group killed), else None.
    pub fn exited(&mut self) -> Option<Output> {
        let status = self.child.as_mut()?.try_wait().ok()??;
        self.child = None;
        Some(self.finish(status))
    }

    /// Panics with the process's output if it already ended (a server that died before it
    /// listened).
    pub fn assert_running(&mut self) {
        if let Some(out) = self.exited() {
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
        if let Some(mut c) = self.child.take() {
            self.kill_group();
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
/// servers that accept exactly one client are not disturbed), then runs `client`. Both share
/// one deadline; past it both groups are killed and the test fails showing both outputs.
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
        if Instant::now() >= deadline {
            let out = srv.wait_until(Instant::now()).unwrap_or_else(|o| o);
            panic!(
                "server never listened on port {port} within {timeout:?}\n{}",
                text(&out)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let c = Guarded::spawn(client, "client").wait_until(deadline);
    // A client that timed out leaves the server waiting for it: stop the server now.
    let s = srv.wait_until(if c.is_ok() { deadline } else { Instant::now() });
    match (s, c) {
        (Ok(s), Ok(c)) => (s, c),
        (s, c) => {
            let state = |r: &Result<Output, Output>| if r.is_ok() { "exited" } else { "timed out" };
            panic!(
                "server/client pair did not finish within {timeout:?}: server {}, client {}\n\
                 === server\n{}\n=== client\n{}",
                state(&s),
                state(&c),
                text(s.as_ref().unwrap_or_else(|o| o)),
                text(c.as_ref().unwrap_or_else(|o| o)),
            );
        }
    }
}

/// Server and client on this host.
pub fn run_pingpong(
    server: Command,
    client: Command,
    port: u16,
    timeout: Duration,
) -> (Output, Output) {
    run_server_client(server, client, port, timeout, listening_here)
}

/// Whether `port` listens on this host (in this test's network namespace).
pub fn listening_here(port: u16) -> bool {
    let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default()
        + &std::fs::read_to_string("/proc/net/tcp6").unwrap_or_default();
    listening(port, &tcp)
}

/// Server and client arguments of an ibverbs-utils pingpong: `-p port opts` and the same
/// plus the server's address.
fn pingpong_args<'a>(
    port: &'a str,
    opts: &[&'a str],
    server: &'a str,
) -> (Vec<&'a str>, Vec<&'a str>) {
    let mut sargs = vec!["-p", port];
    sargs.extend_from_slice(opts);
    let mut cargs = sargs.clone();
    cargs.push(server);
    (sargs, cargs)
}

/// Both sides of a pingpong exited 0 and reported the transfer.
fn assert_pingpong_passed(program: &str, opts: &[&str], s: &Output, c: &Output) {
    assert_success(s, &format!("{program} server {opts:?}"));
    assert_success(c, &format!("{program} client {opts:?}"));
    for o in [s, c] {
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("bytes in") && out.contains("iters in"),
            "{program} {opts:?}: no transfer report\n{}",
            text(o)
        );
    }
}

/// `program` (an ibverbs-utils pingpong) as server and client with `opts` on this host: both
/// must exit 0 and report the transfer.
/// Returns the server's and the client's output.
pub fn pingpong(program: &str, opts: &[&str], timeout_s: u64) -> (Output, Output) {
    pingpong_with_env(program, opts, &[], timeout_s)
}

/// [`pingpong`] with `env` set for both sides.
pub fn pingpong_with_env(
    program: &str,
    opts: &[&str],
    env: &[(&str, &str)],
    timeout_s: u64,
) -> (Output, Output) {
    let port = free_port().to_string();
    let (sargs, cargs) = pingpong_args(&port, opts, "127.0.0.1");
    let (mut server, mut client) = (preloaded(program, &sargs), preloaded(program, &cargs));
    server.envs(env.iter().copied());
    client.envs(env.iter().copied());
    let (s, c) = run_pingpong(
        server,
        client,
        port.parse().unwrap(),
        Duration::from_secs(timeout_s),
    );
    assert_pingpong_passed(program, opts, &s, &c);
    (s, c)
}

/// `program` with `opts`, server in namespace A and client in B; both must exit 0 and report
/// the transfer. Returns the client's output.
pub fn pingpong_across_namespaces(
    ns: &NetnsPair,
    program: &str,
    opts: &[&str],
    timeout_s: u64,
) -> Output {
    let port = free_port().to_string();
    let (sargs, cargs) = pingpong_args(&port, opts, ADDR_A);
    let (s, c) = ns.run_pingpong(
        ns.command(&ns.a, program, &sargs),
        ns.command(&ns.b, program, &cargs),
        port.parse().unwrap(),
        Duration::from_secs(timeout_s),
    );
    assert_pingpong_passed(program, opts, &s, &c);
    c
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
        // Unique among parallel tests (the counter) and parallel runs (the pid).
        static PAIRS: AtomicU16 = AtomicU16::new(0);
        let id = format!(
            "{tag}-{}-{}",
            std::process::id(),
            PAIRS.fetch_add(1, Ordering::Relaxed)
        );
        let lib = lib_path();
        // From here on, Drop removes whatever was set up, also when a step below fails.
        let pair = NetnsPair {
            a: format!("ugdrA{id}"),
            b: format!("ugdrB{id}"),
            lib_dir: PathBuf::from(format!("/var/tmp/ugdr-netns-{id}")),
        };
        std::fs::create_dir_all(&pair.lib_dir)
            .unwrap_or_else(|e| panic!("cannot create {}: {e}", pair.lib_dir.display()));
        pair.stage(&lib);
        // The names carry this process's pid: namespaces left with them by a run that was
        // killed before its Drop are stale, and are replaced.
        let _ = Command::new("bash")
            .arg(script())
            .args(["down", &pair.a, &pair.b])
            .output();
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

    /// The libugdr.so that commands in the namespaces preload (reachable inside them).
    pub fn preload_path(&self) -> PathBuf {
        self.lib_dir.join("libugdr.so")
    }

    /// A directory on the host's file system that the commands in both namespaces can
    /// reach (and write to); removed with the pair.
    pub fn stage_dir(&self) -> &std::path::Path {
        &self.lib_dir
    }

    /// A copy of `file` (e.g. a helper program built under target/) at a path that is
    /// reachable inside the namespaces, which mount their own /tmp, /dev/shm and /run.
    pub fn stage(&self, file: &std::path::Path) -> PathBuf {
        let to = self
            .lib_dir
            .join(file.file_name().expect("a file name to stage"));
        copy_executable(file, &to);
        to
    }

    /// `program args` inside namespace `ns`, in its own IPC and mount namespace with private
    /// /dev/shm, /tmp and /run, with only libugdr.so preloaded.
    pub fn command(&self, ns: &str, program: &str, args: &[&str]) -> Command {
        let preload = format!("LD_PRELOAD={}", self.preload_path().display());
        let mut c = self.command_without_ugdr(ns, "env", &[&preload, &require(program)]);
        c.args(args);
        c
    }

    /// `program args` inside namespace `ns`, isolated as in [`NetnsPair::command`], with no
    /// preload at all (for checking the namespaces themselves).
    pub fn command_without_ugdr(&self, ns: &str, program: &str, args: &[&str]) -> Command {
        assert!(
            ns == self.a || ns == self.b,
            "{ns} is not one of this pair's namespaces ({}, {})",
            self.a,
            self.b
        );
        let mut c = Command::new("bash");
        c.arg(script())
            .args(["exec", ns, &require(program)])
            .args(args)
            .env_remove("LD_PRELOAD");
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
