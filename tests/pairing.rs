//! A connection is a pairing, not a number: an RC QP takes requests only from the LID and QP
//! its RTR attributes name, in PSN order from `rq_psn`; a QP not yet in RTR keeps nothing (the
//! requester's transport timer sends it again); what waits for a receive is bounded; QP
//! numbers are random. Victims, peers and strangers are separate processes (`tests/c/qp_peer.c`),
//! on one host and in two network namespaces.

mod harness;

use harness::*;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const WC_SUCCESS: u32 = 0;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;
const WC_OP_SEND: u32 = 0;
const WC_OP_RECV: u32 = 128;
/// Where qp_peer's receive slots start in its buffer (half of its 16 MiB).
/// qp_peer's buffer (`BUF_LEN`) and its receive half.
const BUF_LEN: u64 = 16 << 20;
const RECV_HALF: u64 = 8 << 20;
/// ibv_rc_pingpong's local ACK timeout (4.096 µs × 2^14 ≈ 67 ms).
const TIMEOUT_14: Duration = Duration::from_nanos(4096 << 14);

fn qp_peer_exe() -> PathBuf {
    static EXE: Mutex<Option<PathBuf>> = Mutex::new(None);
    EXE.lock()
        .unwrap()
        .get_or_insert_with(|| build_c("qp_peer", &["-libverbs"]))
        .clone()
}

/// One completion as qp_peer prints it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Wc {
    wr_id: u64,
    status: u32,
    opcode: u32,
    byte_len: u32,
    qp_num: u32,
    src_qp: u32,
    slid: u32,
}

fn field<T: std::str::FromStr>(line: &str, name: &str) -> T {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{name}=")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {name}= in {line:?}"))
}

impl Wc {
    fn parse(line: &str) -> Wc {
        Wc {
            wr_id: field(line, "wr_id"),
            status: field(line, "status"),
            opcode: field(line, "opcode"),
            byte_len: field(line, "byte_len"),
            qp_num: field(line, "qp_num"),
            src_qp: field(line, "src_qp"),
            slid: field(line, "slid"),
        }
    }
}

/// A qp_peer process: one RC QP, driven by commands.
struct QpPeer {
    name: String,
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    stderr: Arc<Mutex<Vec<u8>>>,
    lid: u16,
    qpn: u32,
    rkey: u32,
    addr: u64,
    pid: i32,
}

impl QpPeer {
    /// qp_peer on this host, its buffer filled with `fill`.
    fn local(name: &str, fill: u8) -> QpPeer {
        QpPeer::local_with(name, fill, &[])
    }

    /// qp_peer on this host with `env` added to its environment.
    fn local_with(name: &str, fill: u8, env: &[(&str, &str)]) -> QpPeer {
        let mut cmd = Command::new(qp_peer_exe());
        cmd.arg(fill.to_string())
            .env("LD_PRELOAD", lib_path())
            .envs(env.iter().copied());
        QpPeer::start(cmd, name)
    }

    /// qp_peer in namespace `ns` of `pair`.
    fn in_namespace(pair: &NetnsPair, ns: &str, name: &str, fill: u8) -> QpPeer {
        let staged = pair.stage_dir().join("qp_peer");
        let exe = if staged.is_file() {
            staged
        } else {
            pair.stage(&qp_peer_exe())
        };
        let cmd = pair.command(ns, exe.to_str().unwrap(), &[&fill.to_string()]);
        QpPeer::start(cmd, name)
    }

    fn start(mut cmd: Command, name: &str) -> QpPeer {
        cmd.stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        let (tx, lines) = channel();
        let out = BufReader::new(child.stdout.take().unwrap());
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&stderr);
        let mut err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            let mut chunk = [0u8; 8192];
            while let Ok(n) = std::io::Read::read(&mut err, &mut chunk) {
                if n == 0 {
                    break;
                }
                sink.lock().unwrap().extend_from_slice(&chunk[..n]);
            }
        });
        let stdin = child.stdin.take().unwrap();
        let mut peer = QpPeer {
            name: name.to_string(),
            child,
            stdin,
            lines,
            stderr,
            lid: 0,
            qpn: 0,
            rkey: 0,
            addr: 0,
            pid: 0,
        };
        let ready = peer.next_line(Duration::from_secs(30));
        assert!(ready.starts_with("ready "), "{name}: {ready}");
        peer.lid = field(&ready, "lid");
        peer.qpn = field(&ready, "qpn");
        peer.rkey = field(&ready, "rkey");
        peer.addr = field(&ready, "addr");
        peer.pid = field(&ready, "pid");
        peer
    }

    fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr.lock().unwrap()).into_owned()
    }

    fn next_line(&mut self, within: Duration) -> String {
        match self.lines.recv_timeout(within) {
            Ok(l) => l,
            Err(RecvTimeoutError::Timeout) => {
                panic!(
                    "{}: no answer within {within:?}\n{}",
                    self.name,
                    self.stderr()
                )
            }
            Err(RecvTimeoutError::Disconnected) => {
                std::thread::sleep(Duration::from_millis(100));
                panic!("{}: exited\n{}", self.name, self.stderr())
            }
        }
    }

    /// Runs one command; its answer lines (a verb that failed fails the test).
    fn cmd(&mut self, command: &str) -> Vec<String> {
        self.start_cmd(command);
        self.answer(command)
    }

    /// Sends one command without waiting for its answer ([`QpPeer::answer`]).
    fn start_cmd(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("qp_peer stdin");
    }

    /// The answer lines of the command sent last (a verb that failed fails the test).
    fn answer(&mut self, command: &str) -> Vec<String> {
        let mut answer = Vec::new();
        loop {
            let line = self.next_line(Duration::from_secs(60));
            if line == "done" {
                break;
            }
            answer.push(line);
        }
        assert!(
            !answer.iter().any(|l| l.starts_with("err ")),
            "{}: {command}: {answer:?}\n{}",
            self.name,
            self.stderr()
        );
        answer
    }

    /// INIT → RTR towards `peer` (expecting its PSNs from `rq_psn`) → RTS (numbering from
    /// `sq_psn`), with `retry_cnt` and `rnr_retry` (timeout 14, as ibv_rc_pingpong).
    fn connect(&mut self, lid: u16, qpn: u32, rq_psn: u32, sq_psn: u32, retry: u8, rnr: u8) {
        self.cmd("init");
        self.cmd(&format!("rtr {lid} {qpn} {rq_psn}"));
        self.cmd(&format!("rts {sq_psn} 14 {retry} {rnr}"));
    }

    /// The following commands act on the process's QP `index` (0: the first).
    fn use_qp(&mut self, index: usize) {
        let answer = self.cmd(&format!("use {index}"));
        self.qpn = answer[0].strip_prefix("qpn ").unwrap().parse().unwrap();
    }

    fn poll(&mut self, n: usize, within: Duration) -> Vec<Wc> {
        let answer = self.cmd(&format!("poll {n} {}", within.as_millis()));
        answer
            .iter()
            .filter(|l| l.starts_with("wc "))
            .map(|l| Wc::parse(l))
            .collect()
    }

    /// Polls one completion: the receive `wr_id` of `len` bytes from QP `src_qp` at `slid`.
    fn expect_receive(&mut self, wr_id: u64, len: u32, src_qp: u32, slid: u16) {
        let got = self.poll(1, Duration::from_secs(10));
        let expected = Wc {
            wr_id,
            status: WC_SUCCESS,
            opcode: WC_OP_RECV,
            byte_len: len,
            qp_num: self.qpn,
            src_qp,
            slid: u32::from(slid),
        };
        assert_eq!(got, [expected], "{}: {len} bytes", self.name);
    }

    /// Polls `n` completions (within 30 s); the first one and the count of each status.
    fn drain(&mut self, n: usize) -> (Option<Wc>, Vec<(u32, usize)>) {
        let answer = self.cmd(&format!("drain {n} 30000"));
        let first = answer
            .iter()
            .find(|l| l.starts_with("first "))
            .map(|l| Wc::parse(l));
        let counts = answer
            .iter()
            .filter_map(|l| l.strip_prefix("count "))
            .map(|c| {
                let mut it = c.split_whitespace().map(|v| v.parse::<usize>().unwrap());
                (it.next().unwrap() as u32, it.next().unwrap())
            })
            .collect();
        (first, counts)
    }

    /// The byte all of `[off, off + len)` of the buffer holds (None: not all the same).
    fn uniform_bytes(&mut self, off: u64, len: u64) -> Option<u8> {
        let answer = self.cmd(&format!("bytes {off} {len}"));
        answer[0]
            .strip_prefix("bytes uniform ")
            .map(|v| v.parse().unwrap())
    }

    fn rss_kib(&mut self) -> u64 {
        self.cmd("rss")[0]
            .strip_prefix("rss ")
            .unwrap()
            .parse()
            .unwrap()
    }
}

impl Drop for QpPeer {
    fn drop(&mut self) {
        // SAFETY: killpg has no memory preconditions; the child leads its own group.
        unsafe { libc::killpg(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A victim connected to its real peer (PSNs 0x123456 one way, 0xabcdef the other, as a CM
/// or ibv_rc_pingpong exchanges them), one receive posted on the victim.
fn victim_and_peer(victim: &mut QpPeer, peer: &mut QpPeer) {
    victim.connect(peer.lid, peer.qpn, 0x123456, 0xabcdef, 7, 7);
    peer.connect(victim.lid, victim.qpn, 0xabcdef, 0x123456, 7, 7);
    victim.cmd("recv 7 4096 1");
}

/// The stranger's WRITE into the victim's buffer and SEND: both end in RETRY_EXC_ERR (the
/// victim never answers a stranger) and flush, within the timeout with one retry.
fn stranger_writes_and_sends(stranger: &mut QpPeer, victim: &QpPeer) {
    stranger.cmd(&format!("write 1 {} {} 4096", victim.rkey, victim.addr));
    stranger.cmd("send 2 64 1");
    let started = Instant::now();
    let wcs = stranger.poll(2, Duration::from_secs(10));
    let took = started.elapsed();
    assert_eq!(wcs.len(), 2, "{wcs:?}\n{}", stranger.stderr());
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WC_RETRY_EXC_ERR));
    assert_eq!((wcs[1].wr_id, wcs[1].status), (2, WC_WR_FLUSH_ERR));
    assert!(wcs.iter().all(|w| w.qp_num == stranger.qpn), "{wcs:?}");
    // Two tries of 67 ms each, ticked every 10 ms; far less than a second.
    assert!(took < Duration::from_secs(3), "{took:?}");
}

/// The victim's memory and receive are untouched; its real peer's SEND gets the receive.
fn victim_untouched_then_served_by_its_peer(victim: &mut QpPeer, peer: &mut QpPeer) {
    assert_eq!(victim.uniform_bytes(0, 4096), Some(0x11), "a WRITE landed");
    assert!(
        victim.poll(1, Duration::from_millis(300)).is_empty(),
        "the stranger's SEND consumed the receive"
    );
    peer.cmd("send 10 64 1");
    let sent = peer.poll(1, Duration::from_secs(10));
    assert_eq!(sent.len(), 1);
    assert_eq!(
        (
            sent[0].wr_id,
            sent[0].status,
            sent[0].opcode,
            sent[0].byte_len
        ),
        (10, WC_SUCCESS, WC_OP_SEND, 64)
    );
    victim.expect_receive(7, 64, peer.qpn, peer.lid);
    // Message 0 starts with its index (0), then the peer's bytes.
    assert_eq!(victim.uniform_bytes(RECV_HALF, 4), Some(0));
    assert_eq!(victim.uniform_bytes(RECV_HALF + 4, 60), Some(0x22));
}

#[test]
fn a_stranger_connected_to_a_victim_qp_lands_no_write_and_consumes_no_receive() {
    let mut victim = QpPeer::local("victim", 0x11);
    let mut peer = QpPeer::local("peer", 0x22);
    let mut stranger = QpPeer::local("stranger", 0x33);
    victim_and_peer(&mut victim, &mut peer);
    // The stranger even uses the PSN the victim expects from its peer.
    stranger.connect(victim.lid, victim.qpn, 0, 0x123456, 1, 7);
    stranger_writes_and_sends(&mut stranger, &victim);
    victim_untouched_then_served_by_its_peer(&mut victim, &mut peer);
}

/// Across hosts: the stranger is another QP of the peer's own process (same LID, same UCX
/// endpoint to the victim; each namespace holds one ugdr process, which is a host's view).
#[test]
fn a_stranger_on_another_host_lands_no_write_and_consumes_no_receive() {
    let ns = NetnsPair::new("pv");
    let (a, b) = (ns.a.clone(), ns.b.clone());
    let mut victim = QpPeer::in_namespace(&ns, &a, "victim", 0x11);
    let mut there = QpPeer::in_namespace(&ns, &b, "peer and stranger", 0x22);
    there.cmd("qpns 1");
    victim_and_peer(&mut victim, &mut there);
    there.use_qp(1);
    there.connect(victim.lid, victim.qpn, 0, 0x123456, 1, 7);
    stranger_writes_and_sends(&mut there, &victim);
    there.use_qp(0);
    victim_untouched_then_served_by_its_peer(&mut victim, &mut there);
}

/// The victim's configured peer has the stranger's QP number (guessed, or re-created) but
/// another LID: the stranger's requests carry its own LID and are dropped.
#[test]
fn a_stranger_with_the_peers_qp_number_but_another_lid_lands_nothing() {
    let mut victim = QpPeer::local("victim", 0x11);
    let peer = QpPeer::local("peer", 0x22);
    let mut stranger = QpPeer::local("stranger", 0x33);
    assert_ne!(peer.lid, stranger.lid);
    victim.connect(peer.lid, stranger.qpn, 0x123456, 0xabcdef, 7, 7);
    victim.cmd("recv 7 4096 1");
    stranger.connect(victim.lid, victim.qpn, 0xabcdef, 0x123456, 1, 7);
    stranger_writes_and_sends(&mut stranger, &victim);
    assert_eq!(victim.uniform_bytes(0, 4096), Some(0x11), "a WRITE landed");
    assert!(victim.poll(1, Duration::from_millis(300)).is_empty());
    // The receive is still there: entering ERR flushes it.
    victim.cmd("error");
    let flushed = victim.poll(1, Duration::from_secs(5));
    assert_eq!(flushed.len(), 1);
    assert_eq!(
        (flushed[0].wr_id, flushed[0].status, flushed[0].qp_num),
        (7, WC_WR_FLUSH_ERR, victim.qpn)
    );
}

/// Two qp_peer processes connected to each other: `a` numbers its messages from `a_psn` and
/// expects `b`'s from `b_psn` (and `b` the other way round); `a` with `rnr_retry` `a_rnr`.
fn connected_pair(a_psn: u32, b_psn: u32, a_rnr: u8) -> (QpPeer, QpPeer) {
    let mut a = QpPeer::local("a", 0x11);
    let mut b = QpPeer::local("b", 0x22);
    a.connect(b.lid, b.qpn, b_psn, a_psn, 7, a_rnr);
    b.connect(a.lid, a.qpn, a_psn, b_psn, 7, 7);
    (a, b)
}

#[test]
fn requests_with_a_psn_other_than_the_expected_one_never_deliver() {
    let mut a = QpPeer::local("a", 0x11);
    let mut b = QpPeer::local("b", 0x22);
    // b expects 0x200 where a numbers from 0x100.
    a.connect(b.lid, b.qpn, 0x300, 0x100, 1, 7);
    b.connect(a.lid, a.qpn, 0x200, 0x300, 7, 7);
    b.cmd("recv 7 64 1");
    a.cmd("send 1 64 1");
    let wcs = a.poll(1, Duration::from_secs(10));
    assert_eq!(wcs.len(), 1);
    assert_eq!((wcs[0].wr_id, wcs[0].status), (1, WC_RETRY_EXC_ERR));
    assert!(b.poll(1, Duration::from_millis(300)).is_empty());
}

#[test]
fn psns_wrap_at_24_bits_in_order() {
    // Both directions start two PSNs before the wrap to 0.
    let (mut a, mut b) = connected_pair(0xff_fffe, 0xff_fffe, 7);
    b.cmd("recv 100 64 8");
    a.cmd("send 1 64 8");
    let got = b.poll(8, Duration::from_secs(10));
    assert_eq!(
        got.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        (100..108).map(|i| (i, WC_SUCCESS)).collect::<Vec<_>>()
    );
    assert_eq!(b.cmd("seq 64 8"), ["seq ok"]);
    assert_eq!(a.drain(8).1, [(WC_SUCCESS, 8)]);
    // And back, through the same wrap.
    a.cmd("recv 200 64 3");
    b.cmd("send 20 64 3");
    assert_eq!(b.drain(3).1, [(WC_SUCCESS, 3)]);
    assert_eq!(a.drain(3).1, [(WC_SUCCESS, 3)]);
}

/// A flood of 32 MiB of SENDs to a QP that never left INIT: nothing is kept (before, up to
/// 65,536 messages were, and executed at RTR), and the drops show with UGDR_LOG=debug.
#[test]
fn an_init_qp_keeps_nothing_of_a_flood() {
    let mut cmd = Command::new(qp_peer_exe());
    cmd.arg("17")
        .env("LD_PRELOAD", lib_path())
        .env("UGDR_LOG", "debug");
    let mut victim = QpPeer::start(cmd, "victim");
    victim.cmd("init");
    let before = victim.rss_kib();
    let mut flood = QpPeer::local("flood", 0x33);
    flood.connect(victim.lid, victim.qpn, 0, 0, 1, 7);
    flood.cmd("send 1 4096 8192");
    let (first, counts) = flood.drain(8192);
    let first = first.expect("completions");
    assert_eq!((first.wr_id, first.status), (1, WC_RETRY_EXC_ERR));
    assert_eq!(counts, [(WC_WR_FLUSH_ERR, 8191), (WC_RETRY_EXC_ERR, 1)]);
    let after = victim.rss_kib();
    assert!(
        after < before + 8 * 1024,
        "the victim grew from {before} KiB to {after} KiB"
    );
    let log = victim.stderr();
    assert!(
        log.contains("the QP is not in RTR") && log.contains("dropped so far"),
        "{log}"
    );
    // Nothing arrives later either: at RTR the QP starts empty.
    victim.cmd("recv 7 4096 1");
    victim.cmd(&format!("rtr {} {} 0", flood.lid, flood.qpn));
    assert!(victim.poll(1, Duration::from_millis(300)).is_empty());
}

/// A SEND that reaches a QP still in INIT is dropped; the sender's retransmission delivers
/// it once the QP is in RTR (for an eager and a rendezvous size).
#[test]
fn a_send_before_rtr_arrives_through_the_senders_retransmission() {
    for len in [64u32, 1 << 20] {
        let mut victim = QpPeer::local("victim", 0x11);
        let mut sender = QpPeer::local("sender", 0x22);
        victim.cmd("init");
        victim.cmd(&format!("recv 7 {len} 1"));
        sender.connect(victim.lid, victim.qpn, 0x20, 0x10, 7, 7);
        sender.cmd(&format!("send 1 {len} 1"));
        std::thread::sleep(Duration::from_millis(150));
        assert!(sender.poll(1, Duration::from_millis(0)).is_empty());
        victim.cmd(&format!("rtr {} {} 16", sender.lid, sender.qpn));
        victim.expect_receive(7, len, sender.qpn, sender.lid);
        assert_eq!(
            victim.uniform_bytes(RECV_HALF + 4, u64::from(len) - 4),
            Some(0x22)
        );
        let sent = sender.poll(1, Duration::from_secs(10));
        assert_eq!(
            sent.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
            [(1, WC_SUCCESS)]
        );
    }
}

/// Without retries, the SEND that reached a QP in INIT is lost for good: it fails at the
/// sender, and the QP, once in RTR, has nothing of it (its receive is still posted).
#[test]
fn a_send_before_rtr_is_not_kept_for_later() {
    let mut victim = QpPeer::local("victim", 0x11);
    let mut sender = QpPeer::local("sender", 0x22);
    victim.cmd("init");
    victim.cmd("recv 7 64 1");
    sender.connect(victim.lid, victim.qpn, 0x20, 0x10, 0, 7);
    // Timed from before the post: the answer to the command may reach this process some
    // milliseconds after the post on a loaded machine, and the timeout runs from the post.
    let started = Instant::now();
    sender.cmd("send 1 64 1");
    let wcs = sender.poll(1, Duration::from_secs(10));
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WC_RETRY_EXC_ERR)]
    );
    assert!(started.elapsed() >= TIMEOUT_14, "{:?}", started.elapsed());
    victim.cmd(&format!("rtr {} {} 16", sender.lid, sender.qpn));
    assert!(victim.poll(1, Duration::from_millis(300)).is_empty());
    victim.cmd("error");
    let flushed = victim.poll(1, Duration::from_secs(5));
    assert_eq!(
        flushed
            .iter()
            .map(|w| (w.wr_id, w.status))
            .collect::<Vec<_>>(),
        [(7, WC_WR_FLUSH_ERR)]
    );
}

/// 600 SENDs (more than a QP keeps: 256) to a receiver that posts its receives only later:
/// the excess is dropped and sent again, and every message arrives once, in order.
#[test]
fn receives_posted_late_get_every_message_in_order() {
    let (mut a, mut b) = connected_pair(0x66, 0x55, 7);
    a.cmd("send 1 64 600");
    std::thread::sleep(Duration::from_millis(300));
    b.cmd("recv 1000 64 600");
    let (first, counts) = b.drain(600);
    assert_eq!(first.map(|w| (w.wr_id, w.status)), Some((1000, WC_SUCCESS)));
    assert_eq!(counts, [(WC_SUCCESS, 600)]);
    assert_eq!(b.cmd("seq 64 600"), ["seq ok"]);
    assert_eq!(a.drain(600).1, [(WC_SUCCESS, 600)]);
    // Exactly once: nothing more arrives.
    assert!(b.poll(1, Duration::from_millis(200)).is_empty());
}

/// `rnr_retry` below 7 bounds how long a SEND waits for a receive WR.
#[test]
fn a_receiver_that_never_posts_ends_in_rnr_retry_exc_err() {
    let (mut a, _b) = connected_pair(0x66, 0x55, 1);
    a.cmd("send 1 64 2");
    let wcs = a.poll(2, Duration::from_secs(10));
    assert_eq!(
        wcs.iter().map(|w| (w.wr_id, w.status)).collect::<Vec<_>>(),
        [(1, WC_RNR_RETRY_EXC_ERR), (2, WC_WR_FLUSH_ERR)]
    );
}

/// `a` (with `a_env`) connected to `b`: `a` numbers from 0x100 with an ACK timeout of 4.3 s
/// (`timeout` 20) and retries forever, `b` from 0x200 with `min_rnr_timer` 12 (0.64 ms).
fn pair_with_a_long_ack_timeout(a_env: &[(&str, &str)]) -> (QpPeer, QpPeer) {
    let mut a = QpPeer::local_with("a", 0x11, a_env);
    let mut b = QpPeer::local("b", 0x22);
    a.cmd("init");
    a.cmd(&format!("rtr {} {} {}", b.lid, b.qpn, 0x200));
    a.cmd(&format!("rts {} 20 7 7", 0x100));
    b.connect(a.lid, a.qpn, 0x100, 0x200, 7, 7);
    (a, b)
}

/// More SENDs than the responder keeps while it has no receive WRs (256): the first one it
/// cannot keep is RNR-NAKed, and the requester sends it (and what followed) again once the
/// responder's RNR timer (`min_rnr_timer` 12: 0.64 ms) ran out, as a HCA does: everything is
/// delivered, in order, soon after the receives are posted. Before, the requester waited for
/// its ACK timeout (here 4.3 s, `timeout` 20) to send them again.
#[test]
fn sends_beyond_what_the_responder_keeps_go_again_after_its_rnr_timer() {
    let (mut a, mut b) = pair_with_a_long_ack_timeout(&[]);
    a.cmd("send 1 64 400");
    std::thread::sleep(Duration::from_millis(300));
    let start = Instant::now();
    b.cmd("recv 1000 64 400");
    let (first, counts) = b.drain(400);
    let took = start.elapsed();
    assert_eq!(counts, [(WC_SUCCESS, 400)]);
    assert_eq!(
        first.map(|w| (w.wr_id, w.byte_len, w.qp_num, w.src_qp)),
        Some((1000, 64, b.qpn, a.qpn))
    );
    assert_eq!(b.cmd("seq 64 400"), ["seq ok"]);
    assert!(
        took < Duration::from_secs(3),
        "the last 144 SENDs took {took:?}: sent again after the ACK timeout, not the RNR timer"
    );
    assert_eq!(a.drain(400).1, [(WC_SUCCESS, 400)]);
}

/// The requester sends again when the responder's RNR timer runs out (`min_rnr_timer` 12:
/// 0.64 ms), as a HCA does, not at its own next timer tick (10 ms): while the responder has
/// no receive WR for 300 ms, the SEND it RNR-NAKs goes again every millisecond or so. Before,
/// about 30 times (once per tick), which a stream of SENDs outrunning its receiver's reposts
/// felt as 10 ms stalls.
#[test]
fn an_rnr_naked_send_goes_again_when_the_rnr_timer_runs_out() {
    let (mut a, mut b) = pair_with_a_long_ack_timeout(&[("UGDR_LOG", "debug")]);
    // More than the responder keeps without receive WRs (256): the rest are RNR-NAKed.
    a.cmd("send 1 64 300");
    std::thread::sleep(Duration::from_millis(300));
    b.cmd("recv 1000 64 300");
    assert_eq!(b.drain(300).1, [(WC_SUCCESS, 300)]);
    assert_eq!(b.cmd("seq 64 300"), ["seq ok"]);
    assert_eq!(a.drain(300).1, [(WC_SUCCESS, 300)]);
    let log = a.stderr();
    let resends = log.matches("RNR NAK for psn").count();
    // ~300 when each wait takes its 0.64 ms and a wake-up (134–284 with both CPUs busy);
    // one per tick, as before, is at most ~31.
    assert!(
        resends >= 60,
        "{resends} resends after RNR NAKs in 300 ms:\n{log}"
    );
    // All answered: nothing is left for the timers, and the progress thread sleeps (an early
    // run asked for and never taken once no timer ran kept it polling without a pause).
    let before = cpu_ticks(a.pid);
    std::thread::sleep(Duration::from_millis(500));
    let used = cpu_ticks(a.pid) - before;
    assert!(used <= 10, "{used} ticks of CPU in 500 ms idle");
}

/// QP numbers are random: neither the process id nor the previous number predicts them.
#[test]
fn qp_numbers_are_not_derived_from_the_pid_nor_consecutive() {
    let mut numbers = Vec::new();
    for name in ["one", "two"] {
        let mut p = QpPeer::local(name, 0);
        let answer = p.cmd("qpns 15");
        let mut qpns: Vec<u32> = vec![p.qpn];
        qpns.extend(
            answer[0]
                .strip_prefix("qpns ")
                .unwrap()
                .split_whitespace()
                .map(|v| v.parse::<u32>().unwrap()),
        );
        // Before, a process's QP numbers were (pid & 0xffff) << 8 and on.
        let old_base = (p.pid as u32 & 0xffff) << 8;
        assert!(
            qpns.iter().all(|&n| n.wrapping_sub(old_base) >= 512),
            "{qpns:x?} (pid {})",
            p.pid
        );
        let consecutive = qpns.windows(2).filter(|w| w[1] == w[0] + 1).count();
        assert!(consecutive <= 1, "{qpns:x?}");
        assert!(qpns.iter().all(|&n| n > 1 && n < 1 << 24), "{qpns:x?}");
        numbers.extend(qpns);
    }
    let mut unique = numbers.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), numbers.len(), "{numbers:x?}");
}

/// The QP number the hostile peer process claims to answer from.
const HOSTILE_QPN: u32 = 0x00ab_cdef;

/// Not a test: the body of a hostile peer process that other tests start (this test binary
/// run again with `--ignored --exact hostile_peer_process`). It runs ugdr's engine itself (it
/// knows the user's secret, so its endpoints authenticate) and sends what a ugdr peer never
/// sends, as told on stdin:
///   `connect LID QPN`           opens an endpoint to port LID's process, for QP QPN
///   `response PSN LEN`          a READ response of LEN bytes of 0xab with PSN PSN, as
///                               QP [`HOSTILE_QPN`] of its own port
///   `fetch_add PSN ADDR RKEY`   an atomic fetch-and-add of 1 at ADDR with PSN PSN (a
///                               request, as QP [`HOSTILE_QPN`]); ADDR may be misaligned
///   `send_as LID QPN PSN LEN`   a SEND of LEN bytes of 0xab with PSN PSN that claims to come
///                               from QP QPN of port LID (not its own)
///   `fuzz SEED COUNT ADDR RKEY` COUNT messages made at random (seeded) as QP [`HOSTILE_QPN`]:
///                               every op, flag bit and NAK syndrome, PSNs in and far out of
///                               the window, lengths that lie about the payload, addresses in
///                               and around the victim's buffer at ADDR with its RKEY or not,
///                               payloads up to rendezvous size, bundles whose frames lie,
///                               headers that do not decode, and some with a forged sender
/// Prints `hostile lid=L` at start and `ok` after each command.
#[test]
#[ignore = "the hostile peer process of other tests"]
fn hostile_peer_process() {
    use ugdr::engine::Engine;
    use ugdr::engine::wire::{AM_ID, Header, Op};
    use ugdr::ucp::{OwnedBytes, SendPayload};
    let engine = Engine::get().expect("the engine");
    println!("hostile lid={}", engine.lid);
    let mut peer = None;
    let mut qpn = 0;
    for line in std::io::stdin().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { w[i].parse().expect("a number") };
        match w[0] {
            "connect" => {
                let resolved = engine.resolve(num(1) as u16, None).expect("resolve");
                qpn = num(2) as u32;
                let locked = engine.worker.lock();
                peer = Some(engine.connect(&locked, &resolved, qpn).expect("connect"));
            }
            "response" | "fetch_add" | "send_as" => {
                let peer = peer.as_ref().expect("connected first");
                let atomic = w[0] == "fetch_add";
                let mut h = match w[0] {
                    "fetch_add" => Header::new(Op::Atomic, qpn, HOSTILE_QPN, engine.lid, 0),
                    "response" => Header::new(Op::ReadResponse, qpn, HOSTILE_QPN, engine.lid, 0),
                    _ => Header::new(Op::Send, qpn, num(2) as u32, num(1) as u16, 0),
                };
                h.seq = num(if w[0] == "send_as" { 3 } else { 1 }) as u32;
                let payload = if w[0] == "send_as" {
                    h.length = num(4) as u32;
                    SendPayload::Owned(OwnedBytes::from_elem(0xab, num(4) as usize))
                } else if atomic {
                    h.status = ugdr::engine::wire::ATOMIC_FETCH_ADD;
                    h.remote_addr = num(2);
                    h.rkey = num(3) as u32;
                    h.length = 8;
                    let mut operands = 1u64.to_le_bytes().to_vec();
                    operands.extend_from_slice(&0u64.to_le_bytes());
                    SendPayload::Owned(OwnedBytes::from_vec(operands))
                } else {
                    SendPayload::Owned(OwnedBytes::from_elem(0xab, num(2) as usize))
                };
                let sent = Arc::new(std::sync::atomic::AtomicBool::new(false));
                let done = Arc::clone(&sent);
                let locked = engine.worker.lock();
                peer.endpoint
                    .am_send(&locked, AM_ID, &h.encode(), payload, move |_, _| {
                        done.store(true, std::sync::atomic::Ordering::Release)
                    })
                    .expect("am_send");
                let until = Instant::now() + Duration::from_secs(10);
                while !sent.load(std::sync::atomic::Ordering::Acquire) && Instant::now() < until {
                    locked.progress();
                }
            }
            "fuzz" => {
                let peer = peer.as_ref().expect("connected first");
                let mut fuzz = Fuzz {
                    qpn,
                    lid: engine.lid,
                    addr: num(3),
                    rkey: num(4) as u32,
                    next_psn: 0,
                };
                let mut rng = XorShift(num(1) | 1);
                for _ in 0..num(2) {
                    let (header, payload) = fuzz.message(&mut rng);
                    let locked = engine.worker.lock();
                    // Sent eager or by rendezvous as UCX likes; not waited for one by one
                    // (a victim that stops reading leaves them pending, as a real flood).
                    let _ = peer.endpoint.am_send(
                        &locked,
                        AM_ID,
                        &header,
                        SendPayload::Owned(OwnedBytes::from_vec(payload)),
                        |_, _| {},
                    );
                    locked.progress();
                }
                // What UCX still holds goes out (the victim answers, or refuses, meanwhile).
                let locked = engine.worker.lock();
                let until = Instant::now() + Duration::from_millis(200);
                while Instant::now() < until {
                    locked.progress();
                }
            }
            other => panic!("unknown command {other}"),
        }
        println!("ok");
    }
}

/// A small deterministic generator (xorshift64): the same seed, the same messages.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, choices: &[T]) -> T {
        choices[self.below(choices.len() as u64) as usize]
    }
}

/// What the hostile peer's `fuzz` sends to QP `qpn` of a victim whose buffer is at `addr`.
struct Fuzz {
    qpn: u32,
    lid: u16,
    addr: u64,
    rkey: u32,
    /// The PSN the victim expects next if everything so far was taken: half the messages
    /// carry it, so that they get past the sequence check.
    next_psn: u32,
}

impl Fuzz {
    /// One message: the AM header (the endpoint adds its token) and the payload.
    fn message(&mut self, rng: &mut XorShift) -> (Vec<u8>, Vec<u8>) {
        use ugdr::engine::wire;
        match rng.below(10) {
            // Headers that do not decode: an unknown op or version, or the wrong length.
            0 => {
                let mut h = self.header(rng).encode().to_vec();
                match rng.below(3) {
                    0 => h[1] = rng.pick(&[0u8, 8, 0x7f, 0xff]),
                    1 => h[0] = wire::VERSION.wrapping_add(1 + rng.below(200) as u8),
                    _ => h.truncate(rng.below(wire::HEADER_LEN as u64) as usize),
                }
                (h, self.payload(rng))
            }
            // A bundle of frames, some of them lying about their length or cut short.
            1 => {
                let mut body = ugdr::ucp::OwnedBytes::new();
                for _ in 0..1 + rng.below(6) {
                    let payload = vec![0xab; rng.pick(&[0usize, 1, 8, 16, 64, 4096])];
                    let claimed = match rng.below(4) {
                        0 => rng.next() as usize,
                        _ => payload.len(),
                    };
                    body.extend_from_slice(&wire::bundle_frame(&self.header(rng), claimed));
                    body.extend_from_slice(&payload);
                }
                if rng.below(4) == 0 {
                    let cut = rng.below(body.len() as u64 + 1) as usize;
                    body.truncate(cut);
                }
                (wire::bundle_header().to_vec(), body.to_vec())
            }
            _ => (self.header(rng).encode().to_vec(), self.payload(rng)),
        }
    }

    fn header(&mut self, rng: &mut XorShift) -> ugdr::engine::wire::Header {
        use ugdr::engine::wire::{Header, Op};
        let op = rng.pick(&[
            Op::Send,
            Op::Ack,
            Op::Write,
            Op::ReadRequest,
            Op::ReadResponse,
            Op::Atomic,
            Op::AtomicResponse,
        ]);
        let seq = match rng.below(4) {
            0 => rng.next() as u32 & 0x00ff_ffff,
            1 => rng.below(64) as u32,
            _ => {
                self.next_psn += 1;
                self.next_psn - 1
            }
        };
        let mut h = Header::new(op, self.qpn, HOSTILE_QPN, self.lid, seq);
        if rng.below(16) == 0 {
            // Forged: another QP or another port.
            h.src_qpn = rng.next() as u32 & 0x00ff_ffff;
            h.src_lid = rng.next() as u16;
        }
        // Any flag bits; the multicast one rarely (it takes a path of its own, away from
        // the QP).
        h.flags = rng.next() as u8;
        if rng.below(16) != 0 {
            h.flags &= !ugdr::engine::wire::FLAG_MULTICAST;
        }
        let any = rng.next() as u8;
        h.status = rng.pick(&[0u8, 1, 2, 3, 4, any]);
        h.imm_data = rng.next() as u32;
        h.ack_seq = rng.below(64) as u32;
        h.rkey = if rng.below(2) == 0 {
            self.rkey
        } else {
            rng.next() as u32
        };
        h.remote_addr = match rng.below(5) {
            0 => rng.next(),
            1 => self.addr.wrapping_sub(rng.below(64)),
            2 => self.addr + BUF_LEN - rng.below(64),
            _ => self.addr + rng.below(BUF_LEN),
        };
        let any = rng.next() as u32;
        h.length = rng.pick(&[0u32, 1, 8, 16, 4096, 65536, 1 << 20, u32::MAX, any]);
        h
    }

    fn payload(&self, rng: &mut XorShift) -> Vec<u8> {
        let len = rng.pick(&[0usize, 1, 8, 16, 64, 4096, 20000, 300_000]);
        vec![0xab; len]
    }
}

/// The hostile peer process ([`hostile_peer_process`]): its LID and its command channel.
struct Hostile {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
    lid: u16,
}

impl Hostile {
    fn start() -> Hostile {
        let mut cmd = Command::new(std::env::current_exe().expect("this test binary"));
        cmd.args([
            "--ignored",
            "--exact",
            "hostile_peer_process",
            "--nocapture",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .process_group(0);
        let mut child = cmd.spawn().expect("the hostile peer");
        let stdin = child.stdin.take().unwrap();
        let out = BufReader::new(child.stdout.take().unwrap());
        let (tx, lines) = channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut h = Hostile {
            child,
            stdin,
            lines,
            lid: 0,
        };
        let ready = h.wait_for("hostile lid=");
        h.lid = field(&ready, "lid");
        h
    }

    fn wait_for(&mut self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(Duration::from_secs(30)) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(e) => panic!("hostile peer: no {prefix:?}: {e}"),
            }
        }
    }

    fn cmd(&mut self, command: &str) {
        writeln!(self.stdin, "{command}").expect("hostile peer stdin");
        self.wait_for("ok");
    }
}

impl Drop for Hostile {
    fn drop(&mut self) {
        // SAFETY: killpg has no memory preconditions; the child leads its own group.
        unsafe { libc::killpg(self.child.id() as i32, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// A peer that knows the secret and is the victim QPs' connected peer sends, 6,000 times, what
/// no ugdr peer sends (`fuzz`: every op and flag, PSNs in and out of the window, lengths that
/// lie, keys and addresses right and wrong, bundles whose frames lie, headers that do not
/// decode, forged senders). The victim process neither dies, hangs nor panics, and its engine
/// then carries an honest pair's SEND as before, data and completion checked.
#[test]
fn a_connected_peer_sending_random_messages_crashes_nothing_and_the_engine_still_works() {
    // With its log on: what it prints of a hostile message is formatted too.
    let mut victim = QpPeer::local_with("victim", 0x11, &[("UGDR_LOG", "debug")]);
    let mut hostile = Hostile::start();
    // A fresh QP for every 100 messages: the first refused request puts a QP in ERR, where
    // it drops the rest, and the paths before that are the ones worth trying.
    const QPS: u64 = 60;
    victim.cmd(&format!("qpns {QPS}"));
    for seed in 1..=QPS {
        victim.use_qp(seed as usize);
        victim.connect(hostile.lid, HOSTILE_QPN, 0, 0, 7, 7);
        victim.cmd("recv 1 4096 16"); // SENDs find receives (and then none: RNR)
        hostile.cmd(&format!("connect {} {}", victim.lid, victim.qpn));
        hostile.cmd(&format!("fuzz {seed} 100 {} {}", victim.addr, victim.rkey));
        let state = victim.cmd("state");
        assert!(
            state.first().is_some_and(|l| l.starts_with("state ")),
            "seed {seed}: {state:?}\n{}",
            victim.stderr()
        );
    }
    victim.use_qp(0);
    let mut a = QpPeer::local("a", 0x22);
    victim.connect(a.lid, a.qpn, 0x30, 0x40, 7, 7);
    a.connect(victim.lid, victim.qpn, 0x40, 0x30, 7, 7);
    victim.cmd("recv 7 64 1");
    a.cmd("send 8 64 1");
    assert_64_bytes_received_from(&mut victim, &mut a, 7);
    assert_eq!(
        victim.cmd("seq 64 1"),
        ["seq ok"],
        "message 0 landed in slot 0"
    );
    assert!(!victim.stderr().contains("panicked"), "{}", victim.stderr());
}

/// `victim`'s receive `wr_id` completes with a's 64-byte SEND (every WC field), its bytes after
/// the sequence word are a's fill (0x22), and a's send completes too.
fn assert_64_bytes_received_from(victim: &mut QpPeer, a: &mut QpPeer, wr_id: u64) {
    let got = victim.poll(1, Duration::from_secs(10));
    assert_eq!(
        got,
        [Wc {
            wr_id,
            status: WC_SUCCESS,
            opcode: WC_OP_RECV,
            byte_len: 64,
            qp_num: victim.qpn,
            src_qp: a.qpn,
            slid: u32::from(a.lid),
        }],
        "{}",
        victim.stderr()
    );
    assert_eq!(victim.uniform_bytes(RECV_HALF + 4, 60), Some(0x22));
    assert_eq!(
        a.poll(1, Duration::from_secs(10))[0].status,
        WC_SUCCESS,
        "a's send completes"
    );
}

#[test]
fn a_read_response_longer_than_the_read_is_a_bad_response_and_writes_nothing() {
    const WC_BAD_RESP_ERR: u32 = 7;
    const WC_OP_RDMA_READ: u32 = 2;
    let mut victim = QpPeer::local("victim", 0x11);
    let mut hostile = Hostile::start();
    victim.connect(hostile.lid, HOSTILE_QPN, 0, 100, 7, 7);
    hostile.cmd(&format!("connect {} {}", victim.lid, victim.qpn));
    // An 8-byte READ, answered (with its PSN, from the connected peer) by 4 KiB.
    victim.cmd("read 1 1234 4096 8");
    hostile.cmd("response 100 4096");
    let got = victim.poll(1, Duration::from_secs(10));
    let expected = Wc {
        wr_id: 1,
        status: WC_BAD_RESP_ERR,
        opcode: WC_OP_RDMA_READ,
        byte_len: 0,
        qp_num: victim.qpn,
        src_qp: 0,
        slid: 0,
    };
    assert_eq!(got, [expected], "{}", victim.stderr());
    assert_eq!(
        victim.uniform_bytes(RECV_HALF, 4096),
        Some(0x11),
        "the victim's memory"
    );
    assert_eq!(victim.cmd("state"), ["state 6"], "the QP is in ERR");
    // The same with 4 MiB, which UCX carries by rendezvous: fetching it into the 8 bytes
    // asked for, UCX would abort the victim ("rx buffer too small").
    let answer = victim.cmd("qpns 1");
    let second: u32 = answer[0]
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    victim.use_qp(1);
    victim.connect(hostile.lid, HOSTILE_QPN, 0, 200, 7, 7);
    hostile.cmd(&format!("connect {} {second}", victim.lid));
    victim.cmd("read 2 1234 4096 8");
    hostile.cmd("response 200 4194304");
    let got = victim.poll(1, Duration::from_secs(10));
    let expected = Wc {
        wr_id: 2,
        qp_num: second,
        ..expected
    };
    assert_eq!(got, [expected], "{}", victim.stderr());
    assert_eq!(
        victim.uniform_bytes(RECV_HALF, 4096),
        Some(0x11),
        "the victim's memory"
    );
}

#[test]
fn a_read_response_shorter_than_the_read_is_a_bad_response_and_writes_nothing() {
    const WC_BAD_RESP_ERR: u32 = 7;
    const WC_OP_RDMA_READ: u32 = 2;
    let mut victim = QpPeer::local("victim", 0x11);
    let mut hostile = Hostile::start();
    victim.connect(hostile.lid, HOSTILE_QPN, 0, 300, 7, 7);
    hostile.cmd(&format!("connect {} {}", victim.lid, victim.qpn));
    // A 4 KiB READ, answered (with its PSN, from the connected peer) by 8 bytes: a
    // successful completion would leave the rest of the buffer as it was.
    victim.cmd("read 1 1234 4096 4096");
    hostile.cmd("response 300 8");
    let got = victim.poll(1, Duration::from_secs(10));
    let expected = Wc {
        wr_id: 1,
        status: WC_BAD_RESP_ERR,
        opcode: WC_OP_RDMA_READ,
        byte_len: 0,
        qp_num: victim.qpn,
        src_qp: 0,
        slid: 0,
    };
    assert_eq!(got, [expected], "{}", victim.stderr());
    assert_eq!(
        victim.uniform_bytes(RECV_HALF, 4096),
        Some(0x11),
        "the victim's memory"
    );
    assert_eq!(victim.cmd("state"), ["state 6"], "the QP is in ERR");
}

#[test]
fn a_misaligned_atomic_from_the_peer_is_an_invalid_request_not_a_silent_drop() {
    let mut victim = QpPeer::local("victim", 0x11);
    let mut hostile = Hostile::start();
    victim.connect(hostile.lid, HOSTILE_QPN, 40, 0, 7, 7);
    hostile.cmd(&format!("connect {} {}", victim.lid, victim.qpn));
    // An aligned fetch-and-add with the victim's rkey takes effect (the path is open)...
    hostile.cmd(&format!(
        "fetch_add 40 {} {}",
        victim.addr + 64,
        victim.rkey
    ));
    let until = Instant::now() + Duration::from_secs(10);
    while victim.uniform_bytes(64, 1) != Some(0x12) {
        assert!(Instant::now() < until, "the aligned atomic never landed");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(victim.uniform_bytes(65, 7), Some(0x11));
    assert_eq!(victim.cmd("state"), ["state 3"], "the QP is still in RTS");
    // ...a misaligned one (inside the same MR, key and access fine) is refused: the QP goes
    // to ERR (the requester would see REM_INV_REQ_ERR) and the memory stays as it was. Before,
    // the responder dropped it unanswered, and the QP stayed in RTS.
    hostile.cmd(&format!(
        "fetch_add 41 {} {}",
        victim.addr + 132,
        victim.rkey
    ));
    let until = Instant::now() + Duration::from_secs(10);
    while victim.cmd("state") != ["state 6"] {
        assert!(Instant::now() < until, "the QP never left RTS");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        victim.uniform_bytes(128, 16),
        Some(0x11),
        "the victim's memory"
    );
}

#[test]
fn a_process_that_knows_the_secret_cannot_pass_itself_off_as_the_connected_peer() {
    // The victim numbers from 0x20 and expects a's SENDs from 0x10.
    let (mut victim, mut a) = connected_pair(0x20, 0x10, 7);
    victim.cmd("recv 1 64 1");
    let mut hostile = Hostile::start();
    hostile.cmd(&format!("connect {} {}", victim.lid, victim.qpn));
    // Its endpoint authenticated (it holds the user's secret), but its SEND claims a's LID
    // and QP number, with the PSN the victim expects from a: dropped, not delivered.
    hostile.cmd(&format!("send_as {} {} {} 64", a.lid, a.qpn, 0x10));
    assert_eq!(
        victim.poll(1, Duration::from_millis(500)),
        [],
        "{}",
        victim.stderr()
    );
    assert_eq!(
        victim.uniform_bytes(RECV_HALF, 64),
        Some(0x11),
        "nothing landed"
    );
    // The real peer's SEND with that PSN takes the receive.
    a.cmd("send 2 64 1");
    assert_64_bytes_received_from(&mut victim, &mut a, 1);
}

/// Two processes fetch-and-add on one counter of a third: one on the same-host direct path
/// (it runs the atomic in the target's memory itself) and one whose atomics the target's
/// responder executes (`UGDR_DIRECT=off`). As with a HCA's atomics, the two are atomic with
/// each other: every value the counter held is returned exactly once (sum and sum of squares
/// of all returned values), and it ends at their total.
#[test]
fn atomics_on_the_direct_path_and_as_messages_are_atomic_with_each_other() {
    let mut target = QpPeer::local("target", 0);
    target.cmd("qpns 1");
    let mut direct = QpPeer::local_with("direct", 0x11, &[("UGDR_LOG", "debug")]);
    let mut messages = QpPeer::local_with("messages", 0x22, &[("UGDR_DIRECT", "off")]);
    for (index, peer) in [(0, &mut direct), (1, &mut messages)] {
        target.use_qp(index);
        target.connect(peer.lid, peer.qpn, 0, 0, 7, 7);
        peer.connect(target.lid, target.qpn, 0, 0, 7, 7);
    }
    let fadd = |count: u64| format!("fadd {} {} {count}", target.rkey, target.addr);
    // "fadd sum S sumsq Q max M" -> (S, Q)
    let totals = |answer: Vec<String>| -> (u64, u64) {
        let line = answer
            .iter()
            .find_map(|l| l.strip_prefix("fadd "))
            .unwrap_or_else(|| panic!("no fadd line in {answer:?}"));
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .step_by(2)
            .map(|x| x.parse().unwrap())
            .collect();
        (v[0], v[1])
    };
    // Both paths warmed up first (the first message sets its endpoint up), then run at once,
    // the direct one longer so that the other's atomics all fall among its own.
    let (mut sum, mut sumsq) = (0, 0);
    for peer in [&mut direct, &mut messages] {
        let (s, q) = totals(peer.cmd(&fadd(10)));
        (sum, sumsq) = (sum + s, sumsq + q);
    }
    let (d, m) = (fadd(100_000), fadd(20_000));
    direct.start_cmd(&d);
    messages.start_cmd(&m);
    for (peer, command) in [(&mut direct, &d), (&mut messages, &m)] {
        let (s, q) = totals(peer.answer(command));
        (sum, sumsq) = (sum + s, sumsq + q);
    }
    let n: u64 = 20 + 120_000;
    assert_eq!(sum, n * (n - 1) / 2, "sum of the values returned");
    assert_eq!(sumsq, (n - 1) * n * (2 * n - 1) / 6, "sum of their squares");
    let last = direct.cmd(&fadd(1));
    assert!(
        last.iter()
            .any(|l| l == &format!("fadd sum {n} sumsq {} max {n}", n * n)),
        "the counter ends at {n}: {last:?}"
    );
    let log = direct.stderr();
    assert!(
        log.lines()
            .any(|l| l.contains("direct path to pid") && !l.contains(" 0 atomics")),
        "the direct peer's atomics did not take the direct path:\n{log}"
    );
}
