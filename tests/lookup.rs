//! Trust and robustness of how ugdr finds a port: the LID lookup service (`UGDR_PORT`) under
//! slow, endless and many clients, and against questions that do not prove the user's
//! secret; the client against peers that answer garbage or forge answers; the per-host
//! directory (`UGDR_RUNDIR`) against unsafe directories and stale entries; the secret file
//! against unsafe modes and owners; and the lookup port against another user's sockets. Real
//! processes under ugdr, real sockets.

mod harness;

use harness::*;
use hmac::{Hmac, Mac};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The service's limits (src/engine/address/lookup.rs).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
const MAX_CONNECTIONS: usize = 64;
const NOBODY: u32 = 65534;

/// The secret of the processes these tests start (`UGDR_SECRET`).
const SECRET: &str = "the lookup tests' secret";
/// The nonce of the questions these tests ask (a service keeps none: any nonce will do).
const NONCE: &str = "000102030405060708090a0b0c0d0e0f";

/// Lowercase hex.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The MAC of the lookup protocol (src/engine/address/lookup.rs): HMAC-SHA-256 with the
/// secret over `parts`, each prefixed with its length (32 bits, little endian), in hex.
fn mac(key: &str, parts: &[&str]) -> String {
    let mut m = Hmac::<sha2::Sha256>::new_from_slice(key.as_bytes()).unwrap();
    for p in parts {
        m.update(&(p.len() as u32).to_le_bytes());
        m.update(p.as_bytes());
    }
    hex(&m.finalize().into_bytes())
}

/// `UGDR/3 LOOKUP <lid> <nonce> <mac>\n` made with `key`.
fn question(key: &str, lid: u16, nonce: &str) -> String {
    let text = format!("UGDR/3 LOOKUP {lid:04x} {nonce}");
    format!("{text} {}\n", mac(key, &[&text]))
}

/// The answer `text` with the MAC that makes it the answer to the question with `nonce`.
fn signed(key: &str, text: &str, nonce: &str) -> String {
    format!("{text} {}\n", mac(key, &[text, nonce]))
}

/// tests/c/lookup_helper.c, built once.
fn helper() -> &'static Path {
    static EXE: OnceLock<PathBuf> = OnceLock::new();
    EXE.get_or_init(|| build_c("lookup_helper", &["-libverbs"]))
}

/// Creates directory `p` with exactly `mode`.
fn make_dir(p: PathBuf, mode: u32) -> PathBuf {
    std::fs::create_dir(&p).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
    p
}

/// A scratch directory (for UGDR_RUNDIRs, and a copy of the helper that every user may run:
/// the checkout may be out of `nobody`'s reach), removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(what: &str) -> Scratch {
        let p = PathBuf::from(format!(
            "/var/tmp/ugdr-lookup-{what}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        Scratch(p)
    }

    /// The helper, copied here.
    fn helper(&self) -> PathBuf {
        let to = self.0.join("lookup_helper");
        if !to.exists() {
            copy_executable(helper(), &to);
        }
        to
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `lookup_helper args` under ugdr with this lookup port and directory.
fn under_ugdr(args: &[&str], port: u16, rundir: &Path) -> Command {
    let mut c = Command::new(helper());
    c.args(args)
        .env("LD_PRELOAD", lib_path())
        .env("UGDR_PORT", port.to_string())
        .env("UGDR_RUNDIR", rundir)
        .env("UGDR_SECRET", SECRET)
        .env("UGDR_LOG", "warn");
    c
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A process under ugdr holding the device open: its port's LID, pid and worker address (as
/// its directory entry says), and its lookup service listening.
struct Holder {
    process: Guarded,
    lid: u16,
    pid: i32,
    address_hex: String,
}

impl Holder {
    fn start(port: u16, rundir: &Path) -> Holder {
        Holder::start_logging(port, rundir, "warn")
    }

    /// With `UGDR_LOG=log`.
    fn start_logging(port: u16, rundir: &Path, log: &str) -> Holder {
        let mut cmd = under_ugdr(&["open", "hold"], port, rundir);
        cmd.env("UGDR_LOG", log);
        let mut process = Guarded::spawn(cmd, "holder");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            process.assert_running();
            let entry = std::fs::read_dir(rundir).ok().and_then(|names| {
                names
                    .filter_map(|n| n.ok())
                    .find(|n| n.file_name().to_string_lossy().starts_with("lid-"))
            });
            let tcp = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
            if let (Some(entry), true) = (entry, listening(port, &tcp)) {
                let name = entry.file_name().to_string_lossy().into_owned();
                let text = std::fs::read_to_string(entry.path()).unwrap();
                let fields: Vec<&str> = text.trim_end().split(' ').collect();
                assert_eq!(fields.len(), 4, "entry {text:?}");
                return Holder {
                    process,
                    lid: u16::from_str_radix(&name[4..], 16).unwrap(),
                    pid: fields[1].parse().unwrap(),
                    address_hex: fields[2].to_string(),
                };
            }
            assert!(
                Instant::now() < deadline,
                "the holder never published its port"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The answer to a question for its LID with [`NONCE`].
    fn answer(&self) -> String {
        let text = format!("UGDR/3 OK {:04x} {}", self.lid, self.address_hex);
        signed(SECRET, &text, NONCE)
    }

    /// Stops it; what it wrote.
    fn stop(self) -> Output {
        self.process
            .wait_until(Instant::now())
            .unwrap_or_else(|o| o)
    }
}

/// Asks the lookup service at `addr` for `lid` as a peer with the secret does; the answer
/// and how long it took.
fn ask(addr: SocketAddr, lid: u16) -> (String, Duration) {
    ask_with(addr, &question(SECRET, lid, NONCE))
}

/// Sends `question` to the lookup service at `addr`; the answer and how long it took.
fn ask_with(addr: SocketAddr, question: &str) -> (String, Duration) {
    let t = Instant::now();
    let mut out = String::new();
    if let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let _ = s.write_all(question.as_bytes());
        let _ = s.read_to_string(&mut out);
    }
    (out, t.elapsed())
}

#[test]
fn slow_endless_and_many_clients_do_not_hold_up_lookups() {
    let scratch = Scratch::new("service");
    let port = free_port();
    let holder = Holder::start(port, &scratch.0);
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let expected = holder.answer();
    assert_eq!(ask(addr, holder.lid).0, expected, "the service answers");
    let (hwm0, fds0) = (proc_status(holder.pid, "VmHWM"), open_fds(holder.pid));

    // Megabytes without a newline, as fast as the socket takes them.
    const ENDLESS_CAP: usize = 128 << 20;
    let endless = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
        let chunk = vec![b'a'; 1 << 20];
        let (t, mut sent) = (Instant::now(), 0);
        while sent < ENDLESS_CAP && t.elapsed() < Duration::from_secs(4) {
            match s.write(&chunk) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                Err(_) => return (sent, true),
            }
        }
        (sent, false)
    });
    // Let it run first (a service that reads it all would grow by up to ENDLESS_CAP here).
    let t = Instant::now();
    while !endless.is_finished() && t.elapsed() < Duration::from_secs(1) {
        std::thread::sleep(Duration::from_millis(10));
    }
    // Many connections that never ask.
    let flood: Vec<TcpStream> = (0..3 * MAX_CONNECTIONS)
        .filter_map(|_| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok())
        .collect();
    // All accepted by now; the service keeps at most MAX_CONNECTIONS of them.
    std::thread::sleep(Duration::from_millis(100));
    let fds = open_fds(holder.pid);
    assert!(
        fds <= fds0 + MAX_CONNECTIONS + 4,
        "{} flood connections: the service holds {fds} descriptors, {fds0} before",
        flood.len()
    );
    // A question, one byte a second, after the flood (which would push it out first): when
    // does the service hang up?
    let slow = std::thread::spawn(move || {
        let mut s = TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
        let t = Instant::now();
        for b in question(SECRET, 0x0101, NONCE).as_bytes() {
            if s.write_all(&[*b]).is_err() {
                return Some(t.elapsed());
            }
            let mut buf = [0u8; 64];
            match s.read(&mut buf) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) => {}
                _ => return Some(t.elapsed()), // closed (or answered: it must not)
            }
            if t.elapsed() > Duration::from_secs(6) {
                break;
            }
        }
        None
    });
    for i in 0..5 {
        let (answer, took) = ask(addr, holder.lid);
        assert_eq!(answer, expected, "lookup {i} during the attack ({took:?})");
        assert!(
            took < Duration::from_millis(500),
            "lookup {i} took {took:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    let (sent, cut_off) = endless.join().unwrap();
    assert!(
        cut_off && sent < ENDLESS_CAP,
        "the endless client was not cut off ({sent} bytes sent)"
    );
    let closed_after = slow.join().unwrap();
    assert!(
        closed_after.is_some_and(|t| t > REQUEST_TIMEOUT - Duration::from_millis(300)
            && t < REQUEST_TIMEOUT + Duration::from_millis(1500)),
        "the slow client was not dropped at its deadline ({REQUEST_TIMEOUT:?}): {closed_after:?}"
    );
    let hwm = proc_status(holder.pid, "VmHWM");
    assert!(
        hwm < hwm0 + 16 * 1024,
        "the service grew: peak RSS {hwm} kB, {hwm0} kB before"
    );
    drop(flood);
    assert_eq!(
        ask(addr, holder.lid).0,
        expected,
        "the service still answers"
    );
}

/// Runs `f` in a thread that has entered network namespace `ns`: sockets it creates live
/// there.
fn in_namespace<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let fd = std::fs::File::open(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        use std::os::fd::AsRawFd;
        // SAFETY: setns on a namespace file we hold open; it only changes this thread's
        // network namespace, and the thread ends after `f`.
        let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .unwrap()
}

fn accept_within(l: &TcpListener, deadline: Instant) -> Result<TcpStream, String> {
    l.set_nonblocking(true).unwrap();
    loop {
        match l.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(format!("accept: {e}")),
        }
        if Instant::now() >= deadline {
            return Err(format!("nobody connected to {:?}", l.local_addr()));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// What a fake lookup service answers.
#[derive(Clone)]
enum Answer {
    /// These bytes, whatever the question.
    Raw(Vec<u8>),
    /// This answer text with a MAC made with `key` for the question's nonce.
    Signed { text: String, key: &'static str },
}

/// What the fake peer in namespace A does for one client run: stands in for an
/// ibv_rc_pingpong server (hands out LID 0x0101, which names A from B), then answers the
/// client's lookup with `answer`. Returns the question the client asked.
fn fake_peer(oob: &TcpListener, lookup: &TcpListener, answer: &Answer) -> Result<String, String> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut pp = accept_within(oob, deadline)?;
    pp.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut msg = [0u8; 52]; // "LLLL:QQQQQQ:PPPPPP:<32 hex gid>\0"
    pp.read_exact(&mut msg)
        .map_err(|e| format!("pingpong message: {e}"))?;
    let mine = format!(
        "{:04x}:{:06x}:{:06x}:{}\0",
        0x0101,
        0xabc,
        0,
        "0".repeat(32)
    );
    pp.write_all(mine.as_bytes()).map_err(|e| e.to_string())?;
    let mut q = accept_within(lookup, deadline)?;
    q.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut question = [0u8; 256];
    let n = q.read(&mut question).unwrap_or(0);
    let question = String::from_utf8_lossy(&question[..n]).into_owned();
    let bytes = match answer {
        Answer::Raw(b) => b.clone(),
        Answer::Signed { text, key } => {
            let nonce = question.split(' ').nth(3).unwrap_or_default();
            signed(key, text, nonce).into_bytes()
        }
    };
    let _ = q.write_all(&bytes);
    // Wait for the client to hang up the pingpong connection (it has sent "done" by then).
    let mut rest = Vec::new();
    let _ = pp.read_to_end(&mut rest);
    Ok(question)
}

#[test]
fn garbage_and_forged_answers_fail_the_connect_cleanly_and_a_real_peer_still_connects() {
    let ns = NetnsPair::new("lkg");
    let oob_port = free_port();
    let (oob, lookup) = in_namespace(&ns.a, move || {
        (
            TcpListener::bind(("0.0.0.0", oob_port)).unwrap(),
            TcpListener::bind("0.0.0.0:18517").unwrap(),
        )
    });
    let ucx_v15 = format!("0f{}", "20".repeat(200)); // an address format UCX aborts on
    let good_address = format!("01{}", "20".repeat(100)); // passes every check but the MAC
    let signed = |text: String| Answer::Signed { text, key: SECRET };
    let refused = "answered what ugdr refuses";
    let forged = "does not prove this user's secret";
    let cases: Vec<(&str, Answer, &str)> = vec![
        (
            "the protocol before version 2, with an address UCX asserts on",
            Answer::Raw(format!("OK {ucx_v15}\n").into_bytes()),
            refused,
        ),
        (
            "version 2, with an address UCX asserts on",
            Answer::Raw(format!("UGDR/2 OK 0101 {ucx_v15}\n").into_bytes()),
            refused,
        ),
        (
            "authentic, with an address UCX asserts on",
            signed(format!("UGDR/3 OK 0101 {ucx_v15}")),
            refused,
        ),
        (
            "authentic, with an empty address",
            signed("UGDR/3 OK 0101 ".into()),
            refused,
        ),
        (
            "an answer about another LID",
            signed(format!("UGDR/3 OK 0202 {good_address}")),
            refused,
        ),
        (
            "a megabyte without a newline",
            Answer::Raw(vec![b'7'; 1 << 20]),
            refused,
        ),
        (
            "binary",
            Answer::Raw(b"\x00\xff\x01UGDR\n".to_vec()),
            refused,
        ),
        (
            "a good address without a MAC",
            Answer::Raw(
                format!("UGDR/3 OK 0101 {good_address} {}\n", "00".repeat(32)).into_bytes(),
            ),
            forged,
        ),
        (
            "a good address under another user's secret",
            Answer::Signed {
                text: format!("UGDR/3 OK 0101 {good_address}"),
                key: "another user's secret",
            },
            forged,
        ),
    ];
    for (what, answer, complaint) in &cases {
        let mut client = ns.command(
            &ns.b,
            "ibv_rc_pingpong",
            &["-p", &oob_port.to_string(), ADDR_A],
        );
        client.env("UGDR_LOG", "warn").env("UGDR_SECRET", SECRET);
        let client = Guarded::spawn(client, "ibv_rc_pingpong client");
        let (o, l, a) = (
            oob.try_clone().unwrap(),
            lookup.try_clone().unwrap(),
            answer.clone(),
        );
        let peer = std::thread::spawn(move || fake_peer(&o, &l, &a));
        let out = client.wait(Instant::now() + Duration::from_secs(30));
        let question = peer
            .join()
            .unwrap()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let fields: Vec<&str> = question.trim_end_matches('\n').split(' ').collect();
        assert!(
            fields.len() == 5
                && question == self::question(SECRET, 0x0101, fields[3])
                && fields[3].len() == 32,
            "{what}: the client's question {question:?}\n{}",
            text(&out)
        );
        assert_eq!(
            (out.status.code(), out.status.signal()),
            (Some(1), None),
            "{what}: the client must fail cleanly, not crash\n{}",
            text(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("Failed to modify QP to RTR") && err.contains(complaint),
            "{what}: expected {complaint:?}\n{}",
            text(&out)
        );
        if *complaint == forged {
            assert!(err.contains("UGDR_SECRET"), "{what}\n{}", text(&out));
        }
    }
    drop((oob, lookup));
    // The same two hosts, now with ugdr on both sides.
    pingpong_across_namespaces(&ns, "ibv_rc_pingpong", &[], 60);
}

/// `lookup_helper open` under ugdr with `rundir`: its output (the engine's warnings included).
fn open_with_rundir(rundir: &Path) -> Output {
    run(
        under_ugdr(&["open"], free_port(), rundir),
        "lookup_helper open",
        Duration::from_secs(30),
    )
}

fn assert_refused(rundir: &Path, why: &str) {
    let out = open_with_rundir(rundir);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert_eq!(stdout(&out), "open failed: errno 13\n", "{}", text(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ERROR")
            && err.contains(&format!("{} (UGDR_RUNDIR)", rundir.display()))
            && err.contains(why),
        "the error names the path, UGDR_RUNDIR and {why:?}\n{}",
        text(&out)
    );
}

#[test]
fn an_unsafe_rundir_is_refused_and_the_device_does_not_open() {
    let scratch = Scratch::new("unsafe");
    let shared = make_dir(scratch.0.join("shared"), 0o777);
    assert_refused(&shared, "mode 0777");

    let foreign = make_dir(scratch.0.join("foreign"), 0o700);
    std::os::unix::fs::chown(&foreign, Some(NOBODY), Some(NOBODY)).unwrap();
    assert_refused(&foreign, &format!("belongs to uid {NOBODY}"));

    let good = make_dir(scratch.0.join("good"), 0o700);
    let link = scratch.0.join("link");
    std::os::unix::fs::symlink(&good, &link).unwrap();
    assert_refused(&link, "symbolic link");

    let out = open_with_rundir(&good);
    assert_success(&out, "lookup_helper open with a private directory");
    assert!(
        stdout(&out).starts_with("open ok: lid 0x"),
        "{}",
        text(&out)
    );
}

#[test]
fn a_new_rundir_and_its_entries_are_private_whatever_the_umask() {
    let scratch = Scratch::new("umask");
    let rundir = scratch.0.join("new");
    let port = free_port();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "umask 000 && exec \"$0\" open hold"])
        .arg(helper())
        .env("LD_PRELOAD", lib_path())
        .env("UGDR_PORT", port.to_string())
        .env("UGDR_RUNDIR", &rundir);
    let mut holder = Guarded::spawn(cmd, "holder under umask 000");
    let deadline = Instant::now() + Duration::from_secs(20);
    let entry = loop {
        holder.assert_running();
        let found = std::fs::read_dir(&rundir).ok().and_then(|names| {
            names
                .filter_map(|n| n.ok())
                .find(|n| n.file_name().to_string_lossy().starts_with("lid-"))
        });
        if let Some(e) = found {
            break e.path();
        }
        assert!(
            Instant::now() < deadline,
            "no entry in {}",
            rundir.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    assert_eq!(mode(&rundir), 0o700, "the directory");
    assert_eq!(mode(&entry), 0o600, "{}", entry.display());
}

#[test]
fn stale_entries_are_swept_when_the_engine_starts() {
    let scratch = Scratch::new("sweep");
    let rundir = make_dir(scratch.0.join("dir"), 0o700);
    let mut exited = Command::new("true").spawn().unwrap();
    exited.wait().unwrap();
    let dead = exited.id();
    let me = std::process::id();
    let write = |name: &str, pid: u32| {
        let p = rundir.join(name);
        std::fs::write(&p, format!("ugdr2 {pid} 0120 abcd\n")).unwrap();
        p
    };
    let stale = [
        write("lid-01fe", dead),
        write("lid-07fd", 2147483646),
        write(&format!(".claim-{dead}-d7"), dead),
    ];
    let live = write("lid-01fc", me);
    let out = open_with_rundir(&rundir);
    assert_success(&out, "lookup_helper open");
    for p in &stale {
        assert!(!p.exists(), "{} was not swept", p.display());
    }
    assert!(live.exists(), "the entry of a live process stays");
    let left: Vec<String> = std::fs::read_dir(&rundir)
        .unwrap()
        .map(|n| n.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != ".lock")
        .collect();
    assert_eq!(left, vec!["lid-01fc".to_string()], "what is left");
}

/// `lookup_helper bind PORT [hold]` as `uid`.
fn bind_as(scratch: &Scratch, uid: u32, port: u16, hold: bool) -> Command {
    let mut c = Command::new(scratch.helper());
    c.args(["bind", &port.to_string()]);
    if hold {
        c.arg("hold");
    }
    c.uid(uid).gid(uid);
    c
}

#[test]
fn another_user_cannot_join_the_lookup_port() {
    let scratch = Scratch::new("reuseport");
    let port = free_port();
    let holder = Holder::start(port, &scratch.0);
    let other = run(
        bind_as(&scratch, NOBODY, port, false),
        "bind as nobody",
        Duration::from_secs(10),
    );
    assert_eq!(
        stdout(&other),
        format!("bind failed: errno {}\n", libc::EADDRINUSE),
        "{}",
        text(&other)
    );
    // The same uid can join (that is how ugdr processes share the port): the refusal above
    // is about the uid, not about the port being taken.
    let same = run(
        bind_as(&scratch, 0, port, false),
        "bind as root",
        Duration::from_secs(10),
    );
    assert_eq!(stdout(&same), "bind ok\n", "{}", text(&same));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let expected = holder.answer();
    assert_eq!(ask(addr, holder.lid).0, expected);
}

#[test]
fn a_lookup_port_another_user_holds_is_reported_and_not_shared() {
    let scratch = Scratch::new("taken");
    let port = free_port();
    let mut squatter = Guarded::spawn(bind_as(&scratch, NOBODY, port, true), "squatter");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !listening(port, &std::fs::read_to_string("/proc/net/tcp").unwrap()) {
        squatter.assert_running();
        assert!(Instant::now() < deadline, "the squatter never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = run(
        under_ugdr(&["open"], port, &scratch.0),
        "lookup_helper open",
        Duration::from_secs(30),
    );
    // The device works; only peers on other hosts cannot find it, and the log says why.
    assert_success(&out, "lookup_helper open");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("UGDR_PORT {port} is held by a socket")),
        "{}",
        text(&out)
    );
}

#[test]
fn a_question_without_the_secret_gets_no_worker_address() {
    let scratch = Scratch::new("unauthenticated");
    let port = free_port();
    let holder = Holder::start_logging(port, &scratch.0, "debug");
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let lid = holder.lid;
    let good = question(SECRET, lid, NONCE);
    let refused = "UGDR/3 ERR unauthenticated\n";
    let strangers = [
        (format!("UGDR/3 LOOKUP {lid:04x}\n"), "no nonce, no MAC"),
        (format!("UGDR/3 LOOKUP {lid:04x} {NONCE}\n"), "no MAC"),
        (
            question("another user's secret", lid, NONCE),
            "another secret",
        ),
        (
            good.replace(NONCE, "ff0102030405060708090a0b0c0d0e0f"),
            "a MAC for another nonce",
        ),
        (
            good.replacen(&format!("{lid:04x}"), &format!("{:04x}", lid ^ 0x80), 1),
            "another LID under this LID's MAC",
        ),
    ];
    for (q, what) in &strangers {
        assert_ne!(q, &good, "{what}");
        assert_eq!(ask_with(addr, q).0, refused, "{what}: {q:?}");
    }
    // With the secret: the address, under a MAC for this nonce that another nonce does not
    // verify.
    let answer = ask(addr, lid).0;
    assert_eq!(answer, holder.answer());
    assert_ne!(
        answer,
        signed(
            SECRET,
            &format!("UGDR/3 OK {lid:04x} {}", holder.address_hex),
            "ff0102030405060708090a0b0c0d0e0f"
        )
    );
    let out = holder.stop();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("refused unauthenticated question #5 from 127.0.0.1:"),
        "each refusal is counted and logged at debug\n{log}"
    );
}

/// `lookup_helper open` under ugdr, with the secret in `$XDG_CONFIG_HOME/ugdr/secret`.
fn open_with_config_home(scratch: &Scratch, config: &Path) -> Output {
    let mut cmd = under_ugdr(&["open"], free_port(), &scratch.0.join("run"));
    cmd.env_remove("UGDR_SECRET").env("XDG_CONFIG_HOME", config);
    run(cmd, "lookup_helper open", Duration::from_secs(30))
}

#[test]
fn a_missing_secret_file_is_created_private_and_an_unsafe_one_refused() {
    let scratch = Scratch::new("secret");
    let config = scratch.0.join("config");
    let file = config.join("ugdr/secret");
    let first = open_with_config_home(&scratch, &config);
    assert_success(&first, "lookup_helper open without a secret file");
    let mode = |p: &Path| std::fs::symlink_metadata(p).unwrap().mode() & 0o7777;
    assert_eq!(mode(file.parent().unwrap()), 0o700, "the directory");
    assert_eq!(mode(&file), 0o600, "the file");
    let secret = std::fs::read_to_string(&file).unwrap();
    assert!(
        secret.len() == 65 && secret.trim_end().bytes().all(|b| b.is_ascii_hexdigit()),
        "32 random bytes in hex: {secret:?}"
    );
    assert_success(
        &open_with_config_home(&scratch, &config),
        "lookup_helper open with the file",
    );
    assert_eq!(std::fs::read_to_string(&file).unwrap(), secret, "kept");

    let refused = |why: &str| {
        let out = open_with_config_home(&scratch, &config);
        assert_eq!(
            stdout(&out),
            "open failed: errno 13\n",
            "{why}\n{}",
            text(&out)
        );
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("ERROR")
                && err.contains(&format!("secret file {}", file.display()))
                && err.contains("UGDR_SECRET")
                && err.contains(why),
            "the error names the file, UGDR_SECRET and {why:?}\n{}",
            text(&out)
        );
    };
    let chmod =
        |p: &Path, m: u32| std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap();
    chmod(&file, 0o644);
    refused("mode 0644");
    chmod(&file, 0o600);
    std::os::unix::fs::chown(&file, Some(NOBODY), Some(NOBODY)).unwrap();
    refused(&format!("belongs to uid {NOBODY}"));
    std::os::unix::fs::chown(&file, Some(0), Some(0)).unwrap();
    chmod(file.parent().unwrap(), 0o777);
    refused("may write to its directory");
    chmod(file.parent().unwrap(), 0o700);
    assert_success(
        &open_with_config_home(&scratch, &config),
        "lookup_helper open once the file is private again",
    );
}
