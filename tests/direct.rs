//! The same-host direct path for RDMA WRITE and READ (docs/design.md), between two real
//! processes: a target that registers memory and a requester that writes and reads it. The
//! test process only relays their lines and stops or continues the target (SIGSTOP): a WRITE
//! or READ that completes while the target is stopped needed none of its CPU, so it took the
//! direct path; one that must wait for SIGCONT went through messages.
//!
//! Every check the responder makes holds on the direct path too (unknown rkey, missing
//! access, out of range, deregistered memory, racing a deregistration or a re-registration
//! that takes remote write away; after `ibv_rereg_mr` the path serves the new access and the
//! new pages), RC ordering holds
//! (a SEND after a WRITE finds the WRITE's data in place, 100,000 times, every fourth SEND one
//! of 600 bytes, which the requester writes in place into the receive WR), and where the path
//! is off (`UGDR_DIRECT=off`) or not permitted (a non-dumpable target, a requester without
//! CAP_SYS_PTRACE) the same operations complete through messages.
//!
//! On the message path, UCX may still read an application buffer after the WR that named it
//! went to ERR, or after `ibv_destroy_qp`, while the peer has not pulled a rendezvous message
//! yet: two cases stop the peer at that moment and check that the buffer, overwritten once the
//! application may reuse it, never reaches the peer as data of a successful completion.
//!
//! Runs without libtest's harness (the binary is also the two roles); prints libtest-style
//! lines and the closing "N passed, M failed".

mod fixture;
mod harness;

use fixture::*;
use std::io::{BufRead, BufReader, Write};
use std::os::raw::c_int;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::ptr::null_mut;
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PAGE: usize = 4096;
/// The target's read-write region: 1 MiB + 2 pages.
const RW_LEN: usize = (1 << 20) + 2 * PAGE;
const RO_LEN: usize = 4 * PAGE;
const RECV_SLOTS: usize = 8;
/// The bytes of a receive slot, and the length of the `i`-th SEND of the ordering scenario:
/// every fourth is above the 256 bytes a receive ring entry holds (on the direct path, the
/// requester writes it in place into the receive WR's buffer).
const RECV_SLOT: usize = 1024;
fn order_send_len(i: u64) -> usize {
    if i % 4 == 3 { 600 } else { 8 }
}

fn main() {
    match std::env::var("UGDR_DIRECT_ROLE").as_deref() {
        Ok("target") => return target_role(),
        Ok(scenario) => return requester_role(scenario),
        Err(_) => {}
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let cases: [(&str, fn()); 19] = [
        (
            "writes_and_reads_complete_while_the_target_is_stopped",
            while_stopped,
        ),
        (
            "shared_file_memory_is_direct_too_while_the_target_is_stopped",
            shared_memfd_while_stopped,
        ),
        (
            "part_pages_are_reached_through_the_kernel_while_the_target_is_stopped",
            part_pages_while_stopped,
        ),
        ("refused_accesses_go_to_the_responder_and_fail", refusals),
        ("nothing_lands_after_deregistration_returns", dereg_race),
        (
            "nothing_lands_in_part_pages_after_deregistration_returns",
            part_pages_dereg_race,
        ),
        (
            "memory_registered_again_after_deregistration_is_direct_again",
            reregistered,
        ),
        (
            "rereg_fences_the_old_registration_and_publishes_the_new_one",
            rereg,
        ),
        ("a_send_after_a_direct_write_finds_its_data", ordering),
        ("ugdr_direct_off_uses_messages", direct_off),
        (
            "a_requester_not_permitted_falls_back_to_messages",
            not_permitted,
        ),
        (
            "a_flushed_send_completes_only_once_ucx_is_done_with_its_buffer",
            flushed_send,
        ),
        (
            "a_flushed_uc_send_completes_only_once_ucx_is_done_with_its_buffer",
            flushed_uc_send,
        ),
        (
            "destroy_qp_returns_only_once_ucx_is_done_with_a_read_answer",
            destroyed_responder,
        ),
        (
            "dereg_mr_returns_only_once_ucx_is_done_with_a_read_answer",
            deregistered_responder,
        ),
        (
            "destroy_qp_does_not_wait_for_a_peer_that_died",
            destroy_after_peer_died,
        ),
        ("messages_in_order_under_event_progress", || {
            messages_in_order("event")
        }),
        ("messages_in_order_under_adaptive_progress", || {
            messages_in_order("adaptive")
        }),
        ("messages_in_order_under_busy_progress", || {
            messages_in_order("busy")
        }),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, case) in cases {
        if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
            continue;
        }
        match std::panic::catch_unwind(case) {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(_) => {
                println!("test {name} ... FAILED");
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    std::process::exit(if failed == 0 { 0 } else { 1 });
}

// ------------------------------------------------------------------ the test process

fn while_stopped() {
    run("while_stopped", &[], Requester::Privileged);
}
/// The target's memory is a shared memfd mapping at a file offset (SPDK's `--no-huge`
/// memory): ugdr adopts the file instead of moving the pages, and WRITE/READ still complete
/// while the target is stopped, landing where the target sees them.
fn shared_memfd_while_stopped() {
    run(
        "while_stopped",
        &[("UGDR_TEST_SHARED_MEMFD", "1")],
        Requester::Privileged,
    );
}
/// The target's region starts and ends inside a page: its whole pages move onto a memfd as
/// usual, and accesses reaching into the pages it shares with other memory are copied by the
/// kernel straight into the target's address space (`process_vm_writev`/`readv`), still
/// while it is stopped, landing nowhere outside the region (atomics on the whole pages stay
/// CPU atomics on the shared pages).
fn part_pages_while_stopped() {
    run_part_pages("while_stopped");
}
fn refusals() {
    run("refusals", &[], Requester::Privileged);
}
/// `scenario` on a target whose region starts and ends inside a page; skipped (and said so)
/// where this host forbids the cross-memory attach it needs.
fn run_part_pages(scenario: &str) {
    if let Some(why) = harness::cross_memory_attach_refused() {
        println!("skipped: {why}");
        return;
    }
    run(
        scenario,
        &[("UGDR_TEST_PART_PAGES", "1")],
        Requester::Privileged,
    );
}
fn dereg_race() {
    run("dereg_race", &[], Requester::Privileged);
}
/// As `dereg_race`, the WRITEs landing in a page the region shares with other memory (by
/// cross-memory attach).
fn part_pages_dereg_race() {
    run_part_pages("dereg_race");
}
fn rereg() {
    run("rereg", &[], Requester::Privileged);
}
fn ordering() {
    run("ordering", &[], Requester::Privileged);
}
fn reregistered() {
    run("reregistered", &[], Requester::Privileged);
}
fn direct_off() {
    run("fallback", &[("UGDR_DIRECT", "off")], Requester::Privileged);
}
/// WRITE+SEND pairs on the message path (the target publishes nothing), the data checked at
/// the target, with both processes' progress threads in `mode` (UGDR_PROGRESS).
fn messages_in_order(mode: &str) {
    run(
        "ordering_messages",
        &[("UGDR_DIRECT", "off"), ("UGDR_PROGRESS", mode)],
        Requester::Privileged,
    );
}
/// A 1 MiB SEND (a rendezvous message: the target's receive WR has two SGEs, so it is not
/// written in place) to a stopped target, the requester's QP moved to ERR:
/// the flushed WR completes, the application overwrites its buffer, and the target, continued,
/// must receive the bytes posted, not the new ones.
fn flushed_send() {
    run("flushed_send", &[], Requester::Privileged);
}
/// As `flushed_send`, between UC QPs.
fn flushed_uc_send() {
    run(
        "flushed_send",
        &[("UGDR_TEST_QP_TYPE", "uc")],
        Requester::Privileged,
    );
}
/// The target READs 1 MiB from the requester and stops before the answer is pulled; the
/// requester destroys its QP, then overwrites the buffer: the target's READ must not complete
/// with the new bytes (on the message path: the target is not allowed the direct one).
fn destroyed_responder() {
    run_on_messages("destroyed_responder");
}
/// The target READs and stops, then is killed (and not reaped: a zombie) while the answer
/// waits for it in UCX: `ibv_destroy_qp` finds the peer dead and returns at once, instead of
/// waiting the 2 s it gives a live peer.
fn destroy_after_peer_died() {
    run_on_messages("destroy_after_peer_died");
}
/// As `destroyed_responder`, the requester deregistering the MR the READ reads instead.
fn deregistered_responder() {
    run_on_messages("deregistered_responder");
}
/// `scenario` with the target kept off the direct path (its READs go as messages, which the
/// requester's responder answers).
fn run_on_messages(scenario: &str) {
    run(scenario, &[("UGDR_DIRECT", "off")], Requester::Privileged);
}
fn not_permitted() {
    // A non-dumpable target (as a setuid or execute-only program is) may only be opened by a
    // process with CAP_SYS_PTRACE: the requester runs as root without capabilities. UCX's own
    // posix and cma transports need the same permission, so both sides keep UCX to SysV
    // shared memory (and TCP), as a user in that situation would.
    run(
        "fallback",
        &[
            ("UGDR_TEST_NONDUMPABLE", "1"),
            ("UCX_TLS", UCX_WITHOUT_PTRACE),
        ],
        Requester::WithoutCapabilities,
    );
}

const UCX_WITHOUT_PTRACE: &str = "sysv,self,tcp";

#[derive(PartialEq)]
enum Requester {
    Privileged,
    WithoutCapabilities,
}

fn spawn(role: &str, env: &[(&str, &str)], how: &Requester) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut cmd = if *how == Requester::WithoutCapabilities {
        let mut c = Command::new("setpriv");
        c.args(["--inh-caps=-all", "--bounding-set=-all", "--"]);
        c.arg(&exe);
        c
    } else {
        Command::new(&exe)
    };
    cmd.env("UGDR_DIRECT_ROLE", role)
        .env("UGDR_LOG", "debug")
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {role}: {e}"))
}

/// Lines from a child's stdout, on a channel (so the relay can wait with a deadline).
fn lines_of(child: &mut Child, tag: &'static str) -> mpsc::Receiver<String> {
    let out = BufReader::new(child.stdout.take().unwrap());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in out.lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
        let _ = tx.send(format!("{tag} exited"));
    });
    rx
}

fn stderr_of(child: &mut Child) -> std::thread::JoinHandle<String> {
    let mut err = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut err, &mut s);
        s
    })
}

/// Writes a line to a child. A child that has exited (the pipe is broken) is not an error
/// here: the relay notices it ("exited") and the verdict says why, with both logs.
fn say(to: &mut ChildStdin, line: &str) {
    let _ = writeln!(to, "{line}").and_then(|()| to.flush());
}

/// Runs requester `scenario` against a target (the target's environment gets `target_env`),
/// relaying lines and signalling the target as the requester asks, for at most 150 s.
fn run(scenario: &str, target_env: &[(&str, &str)], how: Requester) {
    let mut target = spawn("target", target_env, &Requester::Privileged);
    let requester_env: Vec<(&str, &str)> = target_env
        .iter()
        .copied()
        .filter(|(k, _)| matches!(*k, "UCX_TLS" | "UGDR_PROGRESS" | "UGDR_TEST_QP_TYPE"))
        .collect();
    let mut requester = spawn(scenario, &requester_env, &how);
    let target_err = stderr_of(&mut target);
    let requester_err = stderr_of(&mut requester);
    let from_target = lines_of(&mut target, "target");
    let from_requester = lines_of(&mut requester, "requester");
    let mut to_target = target.stdin.take().unwrap();
    let mut to_requester = requester.stdin.take().unwrap();
    let tpid = nix::unistd::Pid::from_raw(target.id() as i32);
    let deadline = Instant::now() + Duration::from_secs(150);
    let mut verdict: Result<(), String> = Err("timed out".into());
    'relay: while Instant::now() < deadline {
        while let Ok(line) = from_target.try_recv() {
            say(&mut to_requester, &format!("T {line}"));
        }
        match from_requester.recv_timeout(Duration::from_millis(5)) {
            Ok(line) => {
                if let Some(cmd) = line.strip_prefix("to-target ") {
                    say(&mut to_target, cmd);
                } else if line == "kill-target" {
                    // Killed, and left unreaped until the end.
                    nix::sys::signal::kill(tpid, nix::sys::signal::Signal::SIGKILL).unwrap();
                    say(&mut to_requester, "P ok");
                } else if line == "target-stopped" {
                    // The target stops itself (SIGSTOP) after a command.
                    wait_stopped(target.id());
                    say(&mut to_requester, "P ok");
                } else if line == "stop-target" || line == "cont-target" {
                    let sig = if line == "stop-target" {
                        nix::sys::signal::Signal::SIGSTOP
                    } else {
                        nix::sys::signal::Signal::SIGCONT
                    };
                    nix::sys::signal::kill(tpid, sig).unwrap();
                    if sig == nix::sys::signal::Signal::SIGSTOP {
                        wait_stopped(target.id());
                    }
                    say(&mut to_requester, "P ok");
                } else if line == "pass" {
                    verdict = Ok(());
                    break 'relay;
                } else if let Some(why) = line.strip_prefix("fail ") {
                    verdict = Err(why.to_string());
                    break 'relay;
                } else if line.ends_with("exited") {
                    verdict = Err("requester exited early".into());
                    break 'relay;
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    let _ = nix::sys::signal::kill(tpid, nix::sys::signal::Signal::SIGCONT);
    say(&mut to_target, "quit");
    drop(to_requester);
    let _ = requester.kill();
    let _ = requester.wait();
    let end = Instant::now() + Duration::from_secs(5);
    while Instant::now() < end && target.try_wait().ok().flatten().is_none() {
        std::thread::sleep(Duration::from_millis(10));
    }
    let _ = target.kill();
    let _ = target.wait();
    if let Err(why) = verdict {
        let (r, t) = (
            requester_err.join().unwrap_or_default(),
            target_err.join().unwrap_or_default(),
        );
        let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"));
        let _ = std::fs::write(dir.join(format!("direct-{scenario}-requester.log")), &r);
        let _ = std::fs::write(dir.join(format!("direct-{scenario}-target.log")), &t);
        panic!(
            "{scenario}: {why} (full logs in {})\n--- requester stderr:\n{}\n--- target stderr:\n{}",
            dir.display(),
            tail(&r),
            tail(&t)
        );
    }
}

fn tail(s: &str) -> String {
    let lines: Vec<&str> = s.lines().collect();
    let keep: Vec<&str> = lines
        .iter()
        .copied()
        .filter(|l| {
            !l.contains("DEBUG") && !l.trim_start().starts_with("at ") && !l.contains(": 0x")
        })
        .collect();
    keep[keep.len().saturating_sub(40)..].join("\n")
}

/// Waits until `/proc/<pid>/stat` shows the process stopped.
fn wait_stopped(pid: u32) {
    for _ in 0..1000 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        if let Some(state) = stat
            .rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            && (state == "T" || state == "t")
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    panic!("target {pid} did not stop");
}

// ------------------------------------------------------------------ memory for the roles

/// A private anonymous mapping (page-aligned, zeroed), as applications get from mmap/malloc.
struct Region {
    ptr: *mut u8,
    len: usize,
}

impl Region {
    fn new(len: usize) -> Region {
        let p = unsafe {
            libc::mmap(
                null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Region { ptr: p.cast(), len }
    }
    /// A shared mapping of a memfd, two pages into the file (as DPDK's `--no-huge` memory is
    /// a memfd mapped MAP_SHARED); the descriptor stays open, as DPDK keeps it.
    fn shared_memfd(len: usize) -> Region {
        let fd = unsafe { libc::memfd_create(c"test-shared".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0, "memfd_create: errno {}", errno());
        let offset = 2 * PAGE;
        assert_eq!(
            unsafe { libc::ftruncate(fd, (offset + len + PAGE) as libc::off_t) },
            0
        );
        let p = unsafe {
            libc::mmap(
                null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                offset as libc::off_t,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Region { ptr: p.cast(), len }
    }
    fn addr(&self) -> u64 {
        self.ptr as u64
    }
    fn bytes(&self) -> &[u8] {
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
    fn bytes_mut(&mut self) -> &mut [u8] {
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
    fn reg(&self, dev: &Device, access: c_int) -> *mut ibv_mr {
        self.reg_part(dev, 0, self.len, access)
    }
    fn reg_part(&self, dev: &Device, offset: usize, len: usize, access: c_int) -> *mut ibv_mr {
        assert!(offset + len <= self.len);
        let mr = unsafe { ibv_reg_mr(dev.pd, self.ptr.add(offset).cast(), len, access) };
        assert!(!mr.is_null(), "ibv_reg_mr: errno {}", errno());
        mr
    }
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
    })
}

fn stdin_lines() -> impl Iterator<Item = String> {
    std::io::stdin().lines().map_while(Result::ok)
}

fn out(line: &str) {
    let mut o = std::io::stdout().lock();
    writeln!(o, "{line}").unwrap();
    o.flush().unwrap();
}

fn fields(line: &str) -> Vec<u64> {
    line.split_whitespace()
        .skip(1)
        .map(|f| {
            f.parse()
                .unwrap_or_else(|_| panic!("bad field in {line:?}"))
        })
        .collect()
}

// ------------------------------------------------------------------ the target

fn target_role() {
    if std::env::var_os("UGDR_TEST_NONDUMPABLE").is_some() {
        assert_eq!(unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) }, 0);
    }
    let dev = Device::open();
    let cq = dev.cq(256);
    let rw = if std::env::var_os("UGDR_TEST_SHARED_MEMFD").is_some() {
        Region::shared_memfd(RW_LEN)
    } else {
        Region::new(RW_LEN)
    };
    let ro = Region::new(RO_LEN);
    let recv = Region::new(RECV_SLOTS * RECV_SLOT);
    let rw_access = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC;
    let mut rw_mr = if std::env::var_os("UGDR_TEST_PART_PAGES").is_some() {
        // From byte 8 to 8 bytes before the end: the first and last pages are only partly
        // registered.
        rw.reg_part(&dev, 8, RW_LEN - 16, rw_access)
    } else {
        rw.reg(&dev, rw_access)
    };
    let ro_mr = ro.reg(&dev, LOCAL_WRITE | REMOTE_READ);
    let recv_mr = recv.reg(&dev, LOCAL_WRITE);
    let mut qp = test_qp(&dev, cq);
    let mut moved: Option<Region> = None;
    // Where "recv-big" and "read-stop" land.
    let mut landing: Option<(Region, *mut ibv_mr)> = None;
    unsafe {
        out(&format!(
            "ready {} {} {} {} {} {}",
            dev.lid,
            qp_num(qp),
            rw.addr(),
            (*rw_mr).rkey,
            ro.addr(),
            (*ro_mr).rkey
        ));
    }
    for line in stdin_lines() {
        let cmd = line.split_whitespace().next().unwrap_or("");
        match cmd {
            "peer" => {
                let f = fields(&line);
                connect(qp, f[0] as u16, f[1] as u32);
                out("connected");
            }
            "newqp" => {
                unsafe { ibv_destroy_qp(qp) };
                while unsafe { poll_cq(cq, 1, &mut ibv_wc::default()) } > 0 {}
                qp = test_qp(&dev, cq);
                out(&format!("qp {}", qp_num(qp)));
            }
            "hash" => {
                let f = fields(&line);
                let (off, len) = (f[0] as usize, f[1] as usize);
                out(&format!("hash {}", fnv(&rw.bytes()[off..off + len])));
            }
            "dereg" => {
                assert_eq!(unsafe { ibv_dereg_mr(rw_mr) }, 0);
                rw_mr = null_mut();
                out(stable_after(&rw));
            }
            "rereg-ro" => {
                // Remote write taken away, remote read kept: nothing may land afterwards.
                let access = LOCAL_WRITE | REMOTE_READ;
                assert_eq!(
                    unsafe { ibv_rereg_mr(rw_mr, REREG_ACCESS, null_mut(), null_mut(), 0, access) },
                    0
                );
                out(stable_after(&rw));
            }
            "rkey" => out(&format!("rkey {}", unsafe { (*rw_mr).rkey })),
            "rereg-move" => {
                // The same MR moves to fresh pages with remote write again.
                let to = moved.insert(Region::new(RW_LEN));
                let access = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;
                let flags = REREG_TRANSLATION | REREG_ACCESS;
                let rc = unsafe {
                    ibv_rereg_mr(rw_mr, flags, null_mut(), to.ptr.cast(), RW_LEN, access)
                };
                assert_eq!(rc, 0);
                unsafe {
                    assert_eq!(((*rw_mr).addr as u64, (*rw_mr).length), (to.addr(), RW_LEN));
                    out(&format!("moved {} {}", to.addr(), (*rw_mr).rkey));
                }
            }
            "hash-moved" => {
                let f = fields(&line);
                let (off, len) = (f[0] as usize, f[1] as usize);
                let to = moved.as_ref().expect("moved");
                out(&format!("hash {}", fnv(&to.bytes()[off..off + len])));
            }
            "reg" => {
                rw_mr = rw.reg(&dev, LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ);
                out(&format!("rkey {}", unsafe { (*rw_mr).rkey }));
            }
            "order" => {
                let n = fields(&line)[0] as usize;
                let verdict = check_order(qp, cq, &recv, recv_mr, &rw, n);
                eprintln!("order: {verdict}");
                out(&verdict);
            }
            "recv-big" => {
                let len = fields(&line)[0] as usize;
                let (into, mr) = landing.insert(land(&dev, len));
                // Two SGEs: a SEND is written in place only into a WR of one, and this one
                // must come as a (rendezvous) message.
                let lkey = unsafe { (**mr).lkey };
                let mut sges = [
                    ibv_sge {
                        addr: into.addr(),
                        length: 4096,
                        lkey,
                    },
                    ibv_sge {
                        addr: into.addr() + 4096,
                        length: len as u32 - 4096,
                        lkey,
                    },
                ];
                assert_eq!(post_one_recv(qp, 41, &mut sges), 0);
                out("posted");
            }
            "read-stop" => {
                // READ the requester's memory, then stop before its answer can be pulled.
                let f = fields(&line);
                let len = f[2] as usize;
                let (into, mr) = landing.insert(land(&dev, len));
                let mut sge = [ibv_sge {
                    addr: into.addr(),
                    length: len as u32,
                    lkey: unsafe { (**mr).lkey },
                }];
                let read = ibv_wr_opcode::IBV_WR_RDMA_READ;
                assert_eq!(
                    post_one_send(qp, &mut rdma_wr(42, &mut sge, read, f[0], f[1] as u32)),
                    0
                );
                out("posted");
                unsafe { libc::raise(libc::SIGSTOP) };
            }
            "landed" => {
                // The completion of what "recv-big" or "read-stop" posted, and what landed.
                let wc = poll_n(cq, 1)[0];
                let (into, _) = landing.as_ref().expect("something posted");
                out(&format!(
                    "landed {} {} {} {} {} {}",
                    wc.wr_id,
                    wc.status.0,
                    wc.opcode.0,
                    wc.byte_len,
                    wc.qp_num,
                    fnv(into.bytes())
                ));
            }
            "quit" => break,
            _ => out(&format!("unknown {line}")),
        }
    }
    let _ = rw_mr;
}

/// The QP both roles connect: RC, or UC under `UGDR_TEST_QP_TYPE=uc`.
fn test_qp(dev: &Device, cq: *mut ibv_cq) -> *mut ibv_qp {
    let qp_type = match std::env::var("UGDR_TEST_QP_TYPE").as_deref() {
        Ok("uc") => ibv_qp_type::IBV_QPT_UC,
        _ => ibv_qp_type::IBV_QPT_RC,
    };
    dev.qp(cq, cq, 64, qp_type)
}

/// A zeroed region of `len` bytes registered for local write (what a receive or READ fills).
fn land(dev: &Device, len: usize) -> (Region, *mut ibv_mr) {
    let r = Region::new(len);
    let mr = r.reg(dev, LOCAL_WRITE);
    (r, mr)
}

/// `ibv_rereg_mr` flags.
const REREG_TRANSLATION: c_int = 1;
const REREG_ACCESS: c_int = 1 << 2;

unsafe extern "C" {
    fn ibv_rereg_mr(
        mr: *mut ibv_mr,
        flags: c_int,
        pd: *mut ibv_pd,
        addr: *mut std::ffi::c_void,
        length: usize,
        access: c_int,
    ) -> c_int;
}

/// Whether `region` stays unchanged for 200 ms (after its MR lost remote write).
fn stable_after(region: &Region) -> &'static str {
    let snapshot = region.bytes().to_vec();
    std::thread::sleep(Duration::from_millis(200));
    if snapshot == region.bytes() {
        "stable"
    } else {
        "changed"
    }
}

/// Receives `n` SENDs, each carrying the value the requester wrote just before it at offset
/// PAGE of the read-write region: that value (or a later one: the requester moves on once
/// the SEND is acknowledged) must already be there.
fn check_order(
    qp: *mut ibv_qp,
    cq: *mut ibv_cq,
    recv: &Region,
    recv_mr: *mut ibv_mr,
    rw: &Region,
    n: usize,
) -> String {
    let lkey = unsafe { (*recv_mr).lkey };
    let post = |i: usize| {
        let mut sge = [ibv_sge {
            addr: recv.addr() + (i % RECV_SLOTS * RECV_SLOT) as u64,
            length: RECV_SLOT as u32,
            lkey,
        }];
        assert_eq!(post_one_recv(qp, i as u64, &mut sge), 0);
    };
    for i in 0..RECV_SLOTS.min(n) {
        post(i);
    }
    let mut pending = std::collections::VecDeque::new();
    for i in 0..n {
        if pending.is_empty() {
            pending.extend(poll_n(cq, 1));
        }
        let wc = pending.pop_front().expect("polled");
        let len = order_send_len(i as u64);
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS
            || wc.wr_id != i as u64
            || wc.byte_len as usize != len
        {
            return format!(
                "bad-completion {i} status {} wr_id {} len {}",
                wc.status.0, wc.wr_id, wc.byte_len
            );
        }
        let slot = &recv.bytes()[i % RECV_SLOTS * RECV_SLOT..][..len];
        let sent = u64::from_ne_bytes(slot[..8].try_into().unwrap());
        let written = u64::from_ne_bytes(rw.bytes()[PAGE..PAGE + 8].try_into().unwrap());
        if sent != i as u64 || written < i as u64 || slot[8..].iter().any(|&b| b != i as u8) {
            return format!("disorder {i} sent {sent} written {written}");
        }
        if i + RECV_SLOTS < n {
            post(i + RECV_SLOTS);
        }
    }
    "ordered".to_string()
}

// ------------------------------------------------------------------ the requester

/// The requester's side of the relay: the test process's lines on stdin.
struct Relay {
    lines: Box<dyn Iterator<Item = String>>,
}

impl Relay {
    fn next(&mut self) -> String {
        self.lines.next().unwrap_or_else(|| panic!("relay closed"))
    }
    /// The target's next line.
    fn target(&mut self) -> String {
        let l = self.next();
        l.strip_prefix("T ")
            .unwrap_or_else(|| panic!("expected a target line, got {l:?}"))
            .to_string()
    }
    fn ask(&mut self, cmd: &str) -> String {
        out(&format!("to-target {cmd}"));
        self.target()
    }
    fn signal(&mut self, what: &str) {
        out(what);
        assert_eq!(self.next(), "P ok");
    }
}

struct Link {
    dev: Device,
    peer_lid: u16,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    rw_addr: u64,
    rw_rkey: u32,
    ro_addr: u64,
    ro_rkey: u32,
    local: Region,
    local_mr: *mut ibv_mr,
}

impl Link {
    fn establish(relay: &mut Relay) -> Link {
        let ready = relay.target();
        assert!(ready.starts_with("ready "), "{ready}");
        let f = fields(&ready);
        let dev = Device::open();
        let cq = dev.cq(256);
        let qp = test_qp(&dev, cq);
        connect(qp, f[0] as u16, f[1] as u32);
        assert_eq!(
            relay.ask(&format!("peer {} {}", dev.lid, qp_num(qp))),
            "connected"
        );
        let local = Region::new(RW_LEN);
        let local_mr = local.reg(&dev, LOCAL_WRITE);
        Link {
            dev,
            peer_lid: f[0] as u16,
            cq,
            qp,
            rw_addr: f[2],
            rw_rkey: f[3] as u32,
            ro_addr: f[4],
            ro_rkey: f[5] as u32,
            local,
            local_mr,
        }
    }

    /// A fresh pair of QPs (after one went to ERR).
    fn reconnect(&mut self, relay: &mut Relay) {
        let theirs = fields(&relay.ask("newqp"))[0] as u32;
        unsafe { ibv_destroy_qp(self.qp) };
        while unsafe { poll_cq(self.cq, 1, &mut ibv_wc::default()) } > 0 {}
        self.qp = test_qp(&self.dev, self.cq);
        connect(self.qp, self.peer_lid, theirs);
        assert_eq!(
            relay.ask(&format!("peer {} {}", self.dev.lid, qp_num(self.qp))),
            "connected"
        );
    }

    fn sge(&self, off: usize, len: usize) -> ibv_sge {
        ibv_sge {
            addr: self.local.addr() + off as u64,
            length: len as u32,
            lkey: unsafe { (*self.local_mr).lkey },
        }
    }

    fn post(&self, wr_id: u64, op: ibv_wr_opcode, sges: &mut [ibv_sge], addr: u64, rkey: u32) {
        assert_eq!(
            post_one_send(self.qp, &mut rdma_wr(wr_id, sges, op, addr, rkey)),
            0
        );
    }

    /// The next completion within `wait`, if any.
    fn completion(&self, wait: Duration) -> Option<ibv_wc> {
        let end = Instant::now() + wait;
        loop {
            let mut wc = ibv_wc::default();
            if unsafe { poll_cq(self.cq, 1, &mut wc) } == 1 {
                return Some(wc);
            }
            if Instant::now() >= end {
                return None;
            }
        }
    }

    fn expect(&self, wr_id: u64, status: ibv_wc_status, opcode: ibv_wc_opcode, what: &str) {
        let wc = self
            .completion(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{what}: no completion"));
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.qp_num),
            (wr_id, status, opcode, qp_num(self.qp)),
            "{what}"
        );
        if status == ibv_wc_status::IBV_WC_SUCCESS {
            assert_eq!(wc.wc_flags, 0, "{what}: no flags on a send-side completion");
        }
    }
}

fn requester_role(scenario: &str) {
    let mut relay = Relay {
        lines: Box::new(stdin_lines()),
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut link = Link::establish(&mut relay);
        match scenario {
            "while_stopped" => scenario_while_stopped(&mut relay, &mut link),
            "refusals" => scenario_refusals(&mut relay, &mut link),
            "dereg_race" => scenario_dereg_race(&mut relay, &mut link, "dereg"),
            "rereg" => scenario_rereg(&mut relay, &mut link),
            "ordering" => scenario_ordering(&mut relay, &mut link, 100_000),
            "ordering_messages" => scenario_ordering(&mut relay, &mut link, 5_000),
            "fallback" => scenario_fallback(&mut relay, &mut link),
            "reregistered" => scenario_reregistered(&mut relay, &mut link),
            "flushed_send" => scenario_flushed_send(&mut relay, &mut link),
            "destroyed_responder" => scenario_fenced_responder(&mut relay, &mut link, false),
            "deregistered_responder" => scenario_fenced_responder(&mut relay, &mut link, true),
            "destroy_after_peer_died" => scenario_destroy_after_peer_died(&mut relay, &mut link),
            other => panic!("unknown scenario {other}"),
        }
    }));
    match result {
        Ok(()) => out("pass"),
        Err(e) => {
            let msg = e
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            out(&format!("fail {}", msg.replace('\n', " | ")));
        }
    }
}

fn fill(link: &mut Link, len: usize, seed: u8) {
    for (i, b) in link.local.bytes_mut()[..len].iter_mut().enumerate() {
        *b = (i % 253) as u8 ^ seed;
    }
}

fn scenario_while_stopped(relay: &mut Relay, link: &mut Link) {
    const LEN: usize = 1 << 20;
    fill(link, LEN, 0x5a);
    relay.signal("stop-target");
    // One WRITE of 1 MiB in two SGEs, at an offset inside the region.
    let mut sges = [link.sge(0, 4000), link.sge(4000, LEN - 4000)];
    let (write, read) = (
        ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        ibv_wr_opcode::IBV_WR_RDMA_READ,
    );
    link.post(1, write, &mut sges, link.rw_addr + 8, link.rw_rkey);
    link.expect(
        1,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        "write",
    );
    // Read it back into the second half of the local buffer... of a fresh region.
    let back = Region::new(LEN);
    let back_mr = back.reg(&link.dev, LOCAL_WRITE);
    let mut rsge = [ibv_sge {
        addr: back.addr(),
        length: LEN as u32,
        lkey: unsafe { (*back_mr).lkey },
    }];
    link.post(2, read, &mut rsge, link.rw_addr + 8, link.rw_rkey);
    link.expect(
        2,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_READ,
        "read",
    );
    assert!(
        back.bytes() == &link.local.bytes()[..LEN],
        "read back what was written"
    );
    // READ from the read-only region (zeros).
    let mut rsge = [ibv_sge {
        addr: back.addr(),
        length: 100,
        lkey: unsafe { (*back_mr).lkey },
    }];
    link.post(3, read, &mut rsge, link.ro_addr + 5, link.ro_rkey);
    link.expect(
        3,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_READ,
        "read ro",
    );
    assert!(back.bytes()[..100].iter().all(|b| *b == 0));
    // Atomics on 8 bytes past what was written (zeros so far), each returning the value before.
    const AT: usize = LEN + 64;
    let (fetch_add, cmp_swap) = (
        ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
        ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP,
    );
    let steps: [(ibv_wr_opcode, u64, u64, u64); 4] = [
        (fetch_add, 5, 0, 0),
        (fetch_add, 7, 0, 5),
        (cmp_swap, 12, 100, 12),
        (cmp_swap, 1, 2, 100), // no match: unchanged
    ];
    for (i, (op, compare_add, swap, before)) in steps.into_iter().enumerate() {
        let id = 20 + i as u64;
        let mut sge = [ibv_sge {
            addr: back.addr() + 128,
            length: 8,
            lkey: unsafe { (*back_mr).lkey },
        }];
        let mut wr = atomic_wr(
            id,
            &mut sge,
            op,
            link.rw_addr + AT as u64,
            link.rw_rkey,
            compare_add,
            swap,
        );
        assert_eq!(post_one_send(link.qp, &mut wr), 0);
        let opcode = if op == fetch_add {
            ibv_wc_opcode::IBV_WC_FETCH_ADD
        } else {
            ibv_wc_opcode::IBV_WC_COMP_SWAP
        };
        link.expect(id, ibv_wc_status::IBV_WC_SUCCESS, opcode, "atomic");
        assert_eq!(
            back.bytes()[128..136],
            before.to_le_bytes(),
            "atomic step {i}: the value before"
        );
    }
    relay.signal("cont-target");
    assert_eq!(
        relay.ask(&format!("hash {AT} 8")),
        format!("hash {}", fnv(&100u64.to_le_bytes())),
        "the atomics' result in the target's memory"
    );
    let want = fnv(&link.local.bytes()[..LEN]);
    assert_eq!(relay.ask(&format!("hash 8 {LEN}")), format!("hash {want}"));
    assert_eq!(
        relay.ask("hash 0 8"),
        format!("hash {}", fnv(&[0u8; 8])),
        "bytes before"
    );
}

fn scenario_refusals(relay: &mut Relay, link: &mut Link) {
    type Target = fn(&Link) -> (ibv_wr_opcode, u64, u32);
    const WRITE: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    const FETCH_ADD: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
    let cases: [(&str, Target); 6] = [
        ("unknown rkey", |l| {
            (WRITE, l.rw_addr, l.rw_rkey ^ 0x0010_0000)
        }),
        ("another slot's rkey", |l| (WRITE, l.rw_addr, l.ro_rkey)),
        ("no remote write", |l| (WRITE, l.ro_addr, l.ro_rkey)),
        ("past the end", |l| {
            (WRITE, l.rw_addr + RW_LEN as u64 - 8, l.rw_rkey)
        }),
        ("before the start", |l| (WRITE, l.rw_addr - 8, l.rw_rkey)),
        ("no remote atomic", |l| (FETCH_ADD, l.ro_addr, l.ro_rkey)),
    ];
    fill(link, 64, 0xc3);
    let zeros = fnv(&vec![0u8; RW_LEN]);
    for (i, (what, target)) in cases.iter().enumerate() {
        if i > 0 {
            link.reconnect(relay);
        }
        let (op, addr, rkey) = target(link);
        relay.signal("stop-target");
        if op == FETCH_ADD {
            let mut sge = [link.sge(0, 8)];
            let mut wr = atomic_wr(10 + i as u64, &mut sge, op, addr, rkey, 1, 0);
            assert_eq!(post_one_send(link.qp, &mut wr), 0);
        } else {
            let mut sge = [link.sge(0, 64)];
            link.post(10 + i as u64, op, &mut sge, addr, rkey);
        }
        assert!(
            link.completion(Duration::from_millis(300)).is_none(),
            "{what}: completed without the target: the direct path accepted it"
        );
        relay.signal("cont-target");
        let wc = link
            .completion(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("{what}: no completion"));
        assert_eq!(
            (wc.wr_id, wc.status, wc.qp_num),
            (
                10 + i as u64,
                ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
                qp_num(link.qp)
            ),
            "{what}"
        );
        assert_eq!(qp_state(link.qp), ibv_qp_state::IBV_QPS_ERR.0, "{what}");
        assert_eq!(
            relay.ask(&format!("hash 0 {RW_LEN}")),
            format!("hash {zeros}"),
            "{what}: nothing written"
        );
    }
}

fn scenario_dereg_race(relay: &mut Relay, link: &mut Link, command: &str) {
    // A stream of 8-byte WRITEs (every 16th signaled) until one fails; meanwhile the target
    // deregisters (or re-registers without remote write: `command`) and checks that its
    // memory no longer changes.
    let qp = link.qp as usize;
    let cq = link.cq as usize;
    let (sge_addr, lkey) = (link.local.addr(), unsafe { (*link.local_mr).lkey });
    // 8 bytes into the region's first page (of the part the region holds, in the variant
    // whose region starts inside that page).
    let (addr, rkey) = (link.rw_addr + 8, link.rw_rkey);
    let local = link.local.ptr as usize;
    let writer = std::thread::spawn(move || {
        let (qp, cq) = (qp as *mut ibv_qp, cq as *mut ibv_cq);
        let mut outstanding = 0u32;
        for v in 1u64.. {
            unsafe { (local as *mut u64).write_volatile(v) };
            let mut sge = [ibv_sge {
                addr: sge_addr,
                length: 8,
                lkey,
            }];
            let mut wr = rdma_wr(v, &mut sge, ibv_wr_opcode::IBV_WR_RDMA_WRITE, addr, rkey);
            wr.send_flags = if v % 16 == 0 {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            let mut bad = null_mut();
            if unsafe { post_send(qp, &mut wr, &mut bad) } != 0 {
                // The queue is full: collect completions.
            } else if v % 16 == 0 {
                outstanding += 1;
            }
            while outstanding > 2 {
                let mut wc = ibv_wc::default();
                if unsafe { poll_cq(cq, 1, &mut wc) } == 1 {
                    if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                        return (v, wc.status);
                    }
                    outstanding -= 1;
                }
            }
            if v > 50_000_000 {
                break;
            }
        }
        (0, ibv_wc_status::IBV_WC_SUCCESS)
    });
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(
        relay.ask(command),
        "stable",
        "bytes changed after {command} returned"
    );
    let (after, status) = writer.join().unwrap();
    assert!(after > 0, "the writes never failed");
    assert_eq!(status, ibv_wc_status::IBV_WC_REM_ACCESS_ERR);
}

/// `n` WRITE+SEND pairs, each SEND waited for; the target checks every SEND finds its WRITE.
fn scenario_ordering(relay: &mut Relay, link: &mut Link, n: u64) {
    out(&format!("to-target order {n}"));
    let (laddr, lkey) = (link.local.addr(), unsafe { (*link.local_mr).lkey });
    for i in 0..n {
        unsafe { (link.local.ptr as *mut u64).write_volatile(i) };
        let mut wsge = [ibv_sge {
            addr: laddr,
            length: 8,
            lkey,
        }];
        let mut w = rdma_wr(
            i,
            &mut wsge,
            ibv_wr_opcode::IBV_WR_RDMA_WRITE,
            link.rw_addr + PAGE as u64,
            link.rw_rkey,
        );
        w.send_flags = 0;
        // The SEND: its number, then its number's low byte (inline when 8 bytes; else from
        // the registered buffer, behind the WRITE's 8 bytes).
        let len = order_send_len(i);
        let mut msg = [i as u8; 600];
        msg[..8].copy_from_slice(&i.to_ne_bytes());
        let mut ssge = [ibv_sge {
            addr: msg.as_mut_ptr() as u64,
            length: len as u32,
            lkey: 0,
        }];
        let mut flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        if len == 8 {
            flags |= ibv_send_flags::IBV_SEND_INLINE.0;
        } else {
            link.local.bytes_mut()[8..8 + len].copy_from_slice(&msg[..len]);
            ssge[0] = ibv_sge {
                addr: laddr + 8,
                length: len as u32,
                lkey,
            };
        }
        let mut s = send_wr(i, &mut ssge, ibv_wr_opcode::IBV_WR_SEND, flags);
        w.next = &mut s;
        let mut bad = null_mut();
        assert_eq!(unsafe { post_send(link.qp, &mut w, &mut bad) }, 0);
        let wc = link
            .completion(Duration::from_secs(10))
            .unwrap_or_else(|| panic!("send {i}: no completion"));
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (i, ibv_wc_status::IBV_WC_SUCCESS, ibv_wc_opcode::IBV_WC_SEND),
            "send {i}"
        );
    }
    assert_eq!(relay.target(), "ordered");
}

/// Has the test process continue the target after `after` (this thread may be blocked in a
/// verb by then); the relay's answer is read with [`Relay::signal`]'s "P ok" afterwards.
fn continue_target_after(after: Duration) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(after);
        out("cont-target");
    })
}

fn scenario_flushed_send(relay: &mut Relay, link: &mut Link) {
    const LEN: usize = 1 << 20;
    fill(link, LEN, 0x11);
    let posted = fnv(&link.local.bytes()[..LEN]);
    assert_eq!(relay.ask(&format!("recv-big {LEN}")), "posted");
    relay.signal("stop-target");
    let mut sge = [link.sge(0, LEN)];
    let signaled = ibv_send_flags::IBV_SEND_SIGNALED.0;
    let mut wr = send_wr(5, &mut sge, ibv_wr_opcode::IBV_WR_SEND, signaled);
    assert_eq!(post_one_send(link.qp, &mut wr), 0);
    to_error(link.qp);
    let cont = continue_target_after(Duration::from_millis(300));
    let wc = link
        .completion(Duration::from_secs(10))
        .expect("the flushed SEND completes");
    assert_eq!(
        (wc.wr_id, wc.status, wc.qp_num, wc.byte_len),
        (5, ibv_wc_status::IBV_WC_WR_FLUSH_ERR, qp_num(link.qp), 0),
        "the SEND is flushed"
    );
    // The buffer is the application's again: it reuses it.
    fill(link, LEN, 0x22);
    cont.join().unwrap();
    assert_eq!(relay.next(), "P ok");
    // The target pulled it once continued: what it received is what was posted.
    let received = landed(relay, 41, ibv_wc_opcode::IBV_WC_RECV, LEN);
    assert_eq!(
        received, posted,
        "the target received the bytes the SEND was posted with"
    );
}

/// The READ's answer waits for the stopped target while this process destroys its QP (or,
/// `dereg`, deregisters the MR the READ reads) and then reuses the buffer.
fn scenario_fenced_responder(relay: &mut Relay, link: &mut Link, dereg: bool) {
    const LEN: usize = 1 << 20;
    fill(link, LEN, 0x33);
    let answered = fnv(&link.local.bytes()[..LEN]);
    let mr = read_answer_waiting_for_stopped_target(relay, link, LEN);
    let cont = continue_target_after(Duration::from_millis(300));
    if dereg {
        assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    } else {
        assert_eq!(unsafe { ibv_destroy_qp(link.qp) }, 0);
    }
    // Nothing reads the buffer on the QP's (the MR's) behalf any more: the application
    // reuses it.
    fill(link, LEN, 0x44);
    cont.join().unwrap();
    assert_eq!(relay.next(), "P ok");
    // The target pulled the answer once continued (ugdr's destroy or dereg waited): it
    // carries the bytes of the time the READ was answered.
    let read = landed(relay, 42, ibv_wc_opcode::IBV_WC_RDMA_READ, LEN);
    assert_eq!(read, answered, "the READ's bytes");
}

fn scenario_destroy_after_peer_died(relay: &mut Relay, link: &mut Link) {
    read_answer_waiting_for_stopped_target(relay, link, 1 << 20);
    relay.signal("kill-target");
    let started = Instant::now();
    assert_eq!(unsafe { ibv_destroy_qp(link.qp) }, 0);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(1),
        "ibv_destroy_qp took {took:?} with its peer dead"
    );
}

/// Registers `len` bytes of this side's buffer for remote reading, has the target READ them
/// and stop, and gives this process's progress thread time to answer: the answer then waits
/// in UCX for the stopped target to pull it. The MR.
fn read_answer_waiting_for_stopped_target(
    relay: &mut Relay,
    link: &mut Link,
    len: usize,
) -> *mut ibv_mr {
    let mr = link.local.reg(&link.dev, LOCAL_WRITE | REMOTE_READ);
    let rkey = unsafe { (*mr).rkey };
    assert_eq!(
        relay.ask(&format!("read-stop {} {rkey} {len}", link.local.addr())),
        "posted"
    );
    relay.signal("target-stopped");
    std::thread::sleep(Duration::from_millis(100));
    mr
}

/// The target's successful completion of what "recv-big" or "read-stop" posted; the hash of
/// what landed.
fn landed(relay: &mut Relay, wr_id: u64, opcode: ibv_wc_opcode, len: usize) -> u64 {
    let f = fields(&relay.ask("landed"));
    let success = ibv_wc_status::IBV_WC_SUCCESS.0;
    assert_eq!(
        &f[..4],
        &[wr_id, success.into(), opcode.0.into(), len as u64],
        "the target's completion"
    );
    f[5]
}

fn scenario_fallback(relay: &mut Relay, link: &mut Link) {
    fill(link, 8192, 0x11);
    relay.signal("stop-target");
    let mut sge = [link.sge(0, 8192)];
    link.post(
        7,
        ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        &mut sge,
        link.rw_addr,
        link.rw_rkey,
    );
    assert!(
        link.completion(Duration::from_millis(300)).is_none(),
        "the WRITE completed while the target was stopped: the direct path was taken"
    );
    relay.signal("cont-target");
    link.expect(
        7,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        "write",
    );
    let want = fnv(&link.local.bytes()[..8192]);
    assert_eq!(relay.ask("hash 0 8192"), format!("hash {want}"));
}

fn scenario_reregistered(relay: &mut Relay, link: &mut Link) {
    assert_eq!(relay.ask("dereg"), "stable");
    let rkey = fields(&relay.ask("reg"))[0] as u32;
    assert_ne!(rkey, link.rw_rkey, "a new registration gets a new rkey");
    fill(link, 3 * PAGE, 0x77);
    relay.signal("stop-target");
    let mut sge = [link.sge(0, 3 * PAGE)];
    link.post(
        8,
        ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        &mut sge,
        link.rw_addr,
        rkey,
    );
    link.expect(
        8,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        "write to the memory registered again, target stopped",
    );
    relay.signal("cont-target");
    let want = fnv(&link.local.bytes()[..3 * PAGE]);
    assert_eq!(
        relay.ask(&format!("hash 0 {}", 3 * PAGE)),
        format!("hash {want}")
    );
}

fn scenario_rereg(relay: &mut Relay, link: &mut Link) {
    const WRITE: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
    const READ: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
    // Remote write taken away under a stream of WRITEs: nothing lands once rereg returns.
    scenario_dereg_race(relay, link, "rereg-ro");
    link.reconnect(relay);
    // Published anew in the same slot: the rkey stays (as rxe's and mlx5's do).
    let rkey = fields(&relay.ask("rkey"))[0] as u32;
    assert_eq!(rkey, link.rw_rkey, "the new registration's rkey");
    // The new registration is published: a READ completes while the target is stopped...
    let before = relay.ask(&format!("hash 0 {RW_LEN}"));
    relay.signal("stop-target");
    let mut sge = [link.sge(0, 4096)];
    link.post(20, READ, &mut sge, link.rw_addr, rkey);
    link.expect(
        20,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_READ,
        "read after rereg",
    );
    // ...and a WRITE does not: the responder refuses it once the target runs.
    fill(link, 64, 0x3c);
    let mut sge = [link.sge(0, 64)];
    link.post(21, WRITE, &mut sge, link.rw_addr, rkey);
    assert!(
        link.completion(Duration::from_millis(300)).is_none(),
        "a WRITE completed without the target after remote write was taken away"
    );
    relay.signal("cont-target");
    link.expect(
        21,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        "write after rereg",
    );
    assert_eq!(
        relay.ask(&format!("hash 0 {RW_LEN}")),
        before,
        "nothing written"
    );
    // Moved to new pages with remote write: WRITEs land there, directly, and not in the old.
    link.reconnect(relay);
    let moved = fields(&relay.ask("rereg-move"));
    let (addr, rkey) = (moved[0], moved[1] as u32);
    const LEN: usize = 1 << 20;
    fill(link, LEN, 0x6d);
    relay.signal("stop-target");
    let mut sges = [link.sge(0, LEN)];
    link.post(22, WRITE, &mut sges, addr + 16, rkey);
    link.expect(
        22,
        ibv_wc_status::IBV_WC_SUCCESS,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE,
        "write to the moved MR",
    );
    relay.signal("cont-target");
    let want = fnv(&link.local.bytes()[..LEN]);
    assert_eq!(
        relay.ask(&format!("hash-moved 16 {LEN}")),
        format!("hash {want}")
    );
    assert_eq!(
        relay.ask(&format!("hash 0 {RW_LEN}")),
        before,
        "the old pages changed"
    );
}
