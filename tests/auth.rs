//! Who may talk to a ugdr process (src/engine/auth.rs): only peers that know the user's
//! secret. A stranger with its own UCX worker and the victim's worker address lands no WRITE
//! and consumes no receive; a host (or a process on the same host) with another secret gets
//! no worker address and `ibv_modify_qp` to RTR fails with EINVAL and an error naming
//! `UGDR_SECRET`; the same secret, given as `UGDR_SECRET` on both hosts, connects. Real
//! processes, real UCX, two network namespaces for two hosts.

mod harness;

use harness::*;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::OnceLock;
use std::sync::mpsc::{Receiver, channel};
use std::time::{Duration, Instant};

fn victim_exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("auth_victim", &["-libverbs"]))
}

fn stranger_exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("ucx_stranger", &["-lucp", "-lucs"]))
}

fn helper_exe() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("lookup_helper", &["-libverbs"]))
}

/// A private directory under /var/tmp (reachable from the namespaces too), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        let p = PathBuf::from(format!("/var/tmp/ugdr-auth-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Scratch(p)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The worker address (hex) that port `lid` published in directory `rundir`.
fn published_address(rundir: &Path, lid: u16) -> String {
    let entry = std::fs::read_to_string(rundir.join(format!("lid-{lid:04x}"))).unwrap();
    let fields: Vec<&str> = entry.trim_end().split(' ').collect();
    assert_eq!(fields.len(), 4, "entry {entry:?}");
    fields[2].to_string()
}

/// A child we talk to line by line: its stdout lines arrive on a channel, its stderr is
/// collected; killed on drop.
struct Conversation {
    child: Child,
    lines: Receiver<String>,
    stderr: std::thread::JoinHandle<String>,
}

impl Conversation {
    fn start(mut cmd: Command) -> Conversation {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn");
        let (tx, lines) = channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for l in out.lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut err, &mut s);
            s
        });
        Conversation {
            child,
            lines,
            stderr,
        }
    }

    /// The next line it prints, within `timeout`.
    fn line(&mut self, timeout: Duration) -> String {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => l,
            Err(e) => {
                let _ = self.child.kill();
                panic!("no line within {timeout:?} ({e})");
            }
        }
    }

    fn say(&mut self, line: &str) {
        let stdin = self.child.stdin.as_mut().unwrap();
        stdin.write_all(line.as_bytes()).unwrap();
        stdin.flush().unwrap();
    }

    /// Waits for it to exit (killing it after `timeout`): exit status, the lines it printed
    /// since the last [`Conversation::line`], its stderr.
    fn finish(mut self, timeout: Duration) -> (Option<i32>, Vec<String>, String) {
        let deadline = Instant::now() + timeout;
        let status = loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                break s.code();
            }
            if Instant::now() >= deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut lines = Vec::new();
        while let Ok(l) = self.lines.recv_timeout(Duration::from_millis(200)) {
            lines.push(l);
        }
        let stderr = std::mem::replace(&mut self.stderr, std::thread::spawn(String::new));
        (status, lines, stderr.join().unwrap_or_default())
    }
}

impl Drop for Conversation {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `0x…` value after `key` in `line`.
fn field(line: &str, key: &str) -> String {
    let mut words = line.split(' ');
    words.find(|w| *w == key);
    words
        .next()
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
        .to_string()
}

fn number(line: &str, key: &str) -> u64 {
    u64::from_str_radix(field(line, key).trim_start_matches("0x"), 16).unwrap()
}

#[test]
fn a_stranger_with_the_worker_address_lands_no_write_and_consumes_no_receive() {
    let scratch = Scratch::new("stranger");
    let rundir = scratch.0.join("run");
    let mut cmd = Command::new(victim_exe());
    cmd.env("LD_PRELOAD", lib_path())
        .env("UGDR_RUNDIR", &rundir)
        .env("UGDR_PORT", free_port().to_string())
        .env("UGDR_LOG", "debug");
    let mut victim = Conversation::start(cmd);
    let hello = victim.line(Duration::from_secs(20));
    assert!(hello.starts_with("victim "), "{hello}");
    let lid = number(&hello, "lid") as u16;
    // What an attacker of the same uid can read; the directory is all it takes to connect.
    let address = published_address(&rundir, lid);
    let target = number(&hello, "addr") + 1024;
    let stranger = run(
        {
            let mut c = Command::new(stranger_exe());
            c.args([
                address.as_str(),
                &field(&hello, "qpn_a"),
                &field(&hello, "qpn_b"),
                &format!("{lid:#x}"),
                &format!("{target:#x}"),
                &field(&hello, "rkey"),
            ])
            .env_remove("LD_PRELOAD")
            // A stranger that means to reach the worker sizes its shared-memory FIFO
            // elements as ugdr does (`Ucx::context_options`); with UCX's default 128 bytes
            // its UCX cannot even attach ugdr's FIFO, which would prove nothing.
            .env("UCX_MM_FIFO_ELEM_SIZE", "256");
            c
        },
        "ucx_stranger",
        Duration::from_secs(30),
    );
    assert_success(&stranger, "ucx_stranger");
    assert_eq!(
        String::from_utf8_lossy(&stranger.stdout),
        "sent 7 messages\n",
        "{}",
        text(&stranger)
    );
    victim.say("go\n");
    let (status, lines, log) = victim.finish(Duration::from_secs(30));
    assert_eq!(
        (status, lines.as_slice()),
        (
            Some(0),
            ["untouched".to_string(), "legit ok".to_string()].as_slice()
        ),
        "the victim\n{log}"
    );
    // Every message of the stranger reached the victim's engine and was dropped there.
    for n in 1..=6 {
        assert!(
            log.contains(&format!("auth: dropped message #{n} ")),
            "message {n} was not seen and dropped\n{log}"
        );
    }
    assert!(
        log.contains("its endpoint has not authenticated")
            && log.contains("auth: refused hello #1 (claims lid"),
        "{log}"
    );
    assert!(!log.contains("dropped message #7"), "{log}");
}

/// `lookup_helper args` (staged for the namespaces) in namespace `side` of `ns` with this
/// secret and directory.
fn helper_in(
    ns: &NetnsPair,
    helper: &Path,
    side: &str,
    args: &[&str],
    secret: &str,
    rundir: &Path,
) -> Command {
    let mut c = ns.command(side, helper.to_str().unwrap(), args);
    c.env("UGDR_SECRET", secret)
        .env("UGDR_RUNDIR", rundir)
        .env("UGDR_LOG", "warn");
    c
}

/// Waits for the first `lid-` entry in `rundir`; its LID.
fn wait_for_entry(rundir: &Path, process: &mut Guarded) -> u16 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        process.assert_running();
        let found = std::fs::read_dir(rundir).ok().and_then(|names| {
            names
                .filter_map(|n| n.ok())
                .map(|n| n.file_name().to_string_lossy().into_owned())
                .find(|n| n.starts_with("lid-"))
        });
        if let Some(name) = found {
            return u16::from_str_radix(&name[4..], 16).unwrap();
        }
        assert!(
            Instant::now() < deadline,
            "no entry in {}",
            rundir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// `lookup_helper connect` failed to move its QP to RTR with EINVAL, and warned with every
/// one of `words`.
fn assert_refused_with_a_warning(out: &Output, words: &[&str]) {
    assert_eq!(
        stdout(out),
        format!("rtr failed: errno {}\n", libc::EINVAL),
        "{}",
        text(out)
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("WARN") && words.iter().all(|w| err.contains(w)),
        "a warning with {words:?}\n{}",
        text(out)
    );
}

#[test]
fn a_host_with_another_secret_gets_no_address_and_the_same_secret_connects() {
    let ns = NetnsPair::new("sec");
    // A port in A (its directory where the test can read it), with secret "alpha".
    let helper = ns.stage(helper_exe());
    let rundir_a = ns.stage_dir().join("run-a");
    let mut holder = Guarded::spawn(
        helper_in(&ns, &helper, &ns.a, &["open", "hold"], "alpha", &rundir_a),
        "holder in A",
    );
    let lid = wait_for_entry(&rundir_a, &mut holder);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !ns.listening(&ns.a, 18517) {
        holder.assert_running();
        assert!(
            Instant::now() < deadline,
            "A's lookup service never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let connect = |secret: &str| {
        let rundir_b = ns.stage_dir().join(format!("run-b-{secret}"));
        run(
            helper_in(
                &ns,
                &helper,
                &ns.b,
                &["connect", &format!("{lid:#x}")],
                secret,
                &rundir_b,
            ),
            "lookup_helper connect in B",
            Duration::from_secs(30),
        )
    };
    assert_refused_with_a_warning(
        &connect("other"),
        &[
            &format!("lid {lid:#06x} at {ADDR_A}"),
            "refused our question as unauthenticated",
            "UGDR_SECRET",
        ],
    );
    let same = connect("alpha");
    assert_eq!(stdout(&same), "rtr ok\n", "{}", text(&same));
    drop(holder);

    // Whole programs: a pingpong whose client has another secret fails (the server, which
    // resolves the client first, says why); with UGDR_SECRET the same on both hosts and no
    // secret file involved, it runs.
    let port = free_port().to_string();
    let side = |ns_name: &str, secret: &str, server: bool| {
        let mut args = vec!["-p", port.as_str()];
        if !server {
            args.push(ADDR_A);
        }
        let mut c = ns.command(ns_name, "ibv_rc_pingpong", &args);
        c.env("UGDR_SECRET", secret).env("UGDR_LOG", "warn");
        c
    };
    let (s, c) = ns.run_pingpong(
        side(&ns.a, "alpha", true),
        side(&ns.b, "other", false),
        port.parse().unwrap(),
        Duration::from_secs(60),
    );
    assert!(
        !s.status.success() && !c.status.success(),
        "server\n{}\nclient\n{}",
        text(&s),
        text(&c)
    );
    let err = String::from_utf8_lossy(&s.stderr);
    assert!(
        err.contains("Failed to modify QP to RTR")
            && err.contains("refused our question as unauthenticated")
            && err.contains("UGDR_SECRET"),
        "{}",
        text(&s)
    );
    let (s, c) = ns.run_pingpong(
        side(&ns.a, "alpha", true),
        side(&ns.b, "alpha", false),
        port.parse().unwrap(),
        Duration::from_secs(60),
    );
    for (o, what) in [(&s, "server"), (&c, "client")] {
        assert_success(o, what);
        assert!(stdout(o).contains("bytes in"), "{what}\n{}", text(o));
    }
}

#[test]
fn a_process_on_this_host_with_another_secret_is_told_so() {
    let scratch = Scratch::new("local");
    let rundir = scratch.0.join("run");
    let with = |args: &[&str], secret: &str| {
        let mut c = Command::new(helper_exe());
        c.args(args)
            .env("LD_PRELOAD", lib_path())
            .env("UGDR_RUNDIR", &rundir)
            .env("UGDR_PORT", free_port().to_string())
            .env("UGDR_SECRET", secret)
            .env("UGDR_LOG", "warn");
        c
    };
    let mut holder = Guarded::spawn(with(&["open", "hold"], "alpha"), "holder");
    let lid = wait_for_entry(&rundir, &mut holder);
    let lid_arg = format!("{lid:#x}");
    let other = run(
        with(&["connect", &lid_arg], "other"),
        "connect",
        Duration::from_secs(30),
    );
    assert_refused_with_a_warning(
        &other,
        &[
            "uses another ugdr secret than this one (UGDR_SECRET)",
            "give both the same UGDR_SECRET",
        ],
    );
    let same = run(
        with(&["connect", &lid_arg], "alpha"),
        "connect",
        Duration::from_secs(30),
    );
    assert_eq!(stdout(&same), "rtr ok\n", "{}", text(&same));
}
