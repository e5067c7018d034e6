//! A peer killed while it writes a message into this process's shared-memory receive FIFO
//! (UCX's `posix`/`sysv` transports) must not silence this process for everyone else.
//!
//! A UCX sender takes a FIFO slot (moves the head on), writes its message, then marks the slot
//! written; the receiver reads slots in order. SIGKILL between the two leaves a slot nobody
//! will write, and UCX's receiver waits for it forever: SPDK's target under ugdr answered no
//! initiator again after one was killed mid-I/O. The test leaves exactly that state behind,
//! without depending on the luck of a kill's timing: with the receiver and its sender
//! stopped, it takes a slot in the receiver's FIFO as a sender does, then kills the sender.
//! A fresh client must then be served.

mod harness;

use harness::*;
use std::io::{Read, Seek, SeekFrom, Write};
use std::time::{Duration, Instant};

/// `uct_mm_fifo_ctl_t` (UCX 1.13–1.18): the head at 0 (bit 63: "event armed"), the owner's
/// pid at 136; a FIFO of 64 slots of 256 bytes (what ugdr sets) maps 5 pages.
const HEAD_ARMED: u64 = 1 << 63;
const CTL_PID: u64 = 136;
const FIFO_MAPPING: u64 = 0x5000;

/// The receive FIFOs of `pid` (address of each, and its head now), read through /proc.
fn receive_fifos(pid: i32) -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).expect("maps");
    let mut mem = std::fs::File::open(format!("/proc/{pid}/mem")).expect("/proc/PID/mem");
    maps.lines()
        .filter(|l| l.contains("/ucx_shm_posix_") || l.contains(" /SYSV"))
        .filter_map(|l| {
            let (start, end) = l.split_whitespace().next()?.split_once('-')?;
            let (start, end) = (
                u64::from_str_radix(start, 16).ok()?,
                u64::from_str_radix(end, 16).ok()?,
            );
            (end - start == FIFO_MAPPING).then_some(start)
        })
        .filter_map(|base| {
            let mut ctl = [0u8; 140];
            mem.seek(SeekFrom::Start(base)).ok()?;
            mem.read_exact(&mut ctl).ok()?;
            let owner = i32::from_le_bytes(ctl[CTL_PID as usize..][..4].try_into().unwrap());
            let head = u64::from_le_bytes(ctl[..8].try_into().unwrap());
            (owner == pid).then_some((base, head))
        })
        .collect()
}

/// Takes the next slot of the FIFO at `base` in (stopped) process `pid`, as a sender does
/// before it writes: the head moves on (clearing "event armed", as UCX's compare-and-swap
/// does; the sender would signal the receiver only after writing), the slot stays unwritten.
fn take_slot(pid: i32, base: u64, head: u64) {
    let mut mem = std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{pid}/mem"))
        .expect("/proc/PID/mem for writing");
    let next = (head & !HEAD_ARMED) + 1;
    mem.seek(SeekFrom::Start(base)).unwrap();
    mem.write_all(&next.to_le_bytes()).unwrap();
}

fn signal(pid: i32, sig: i32) {
    // SAFETY: kill has no memory preconditions; `pid` is a child of this test.
    assert_eq!(unsafe { libc::kill(pid, sig) }, 0, "kill({pid}, {sig})");
}

/// Waits until every thread of `pid` is stopped (state T in /proc/PID/task/*/stat).
fn wait_stopped(pid: i32) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let all_stopped = std::fs::read_dir(format!("/proc/{pid}/task"))
            .expect("tasks")
            .filter_map(Result::ok)
            .all(|t| {
                std::fs::read_to_string(t.path().join("stat"))
                    .ok()
                    .and_then(|s| s.rsplit_once(") ").map(|(_, r)| r.starts_with('T')))
                    .unwrap_or(true)
            });
        if all_stopped {
            return;
        }
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn rping_client(port: &str, count: &str) -> std::process::Command {
    preloaded(
        "rping",
        &[
            "-c",
            "-a",
            "127.0.0.1",
            "-p",
            port,
            "-C",
            count,
            "-S",
            "100",
            "-V",
            "-v",
        ],
    )
}

/// rping's persistent server (every client in turn, on one ugdr worker), listening, and its
/// port. Its receive CQ has a completion channel, so the clients' SENDs come through UCX's
/// FIFO, not the same-host SEND path.
fn persistent_rping_server(log: &str) -> (Guarded, String) {
    let port = free_port();
    let p = port.to_string();
    let mut server = preloaded(
        "rping",
        &["-s", "-P", "-a", "127.0.0.1", "-p", &p, "-S", "100"],
    );
    server.env("UGDR_LOG", log);
    let mut server = Guarded::spawn(server, "rping -s -P");
    let deadline = Instant::now() + Duration::from_secs(30);
    while !listening_here(port) {
        server.assert_running();
        assert!(Instant::now() < deadline, "rping -s -P never listened");
        std::thread::sleep(Duration::from_millis(20));
    }
    (server, p)
}

#[test]
fn a_peer_killed_while_writing_into_this_processs_shared_memory_fifo_does_not_silence_it() {
    let (mut server, p) = persistent_rping_server("warn");
    // A first client is served, then one that pings until it is killed.
    let first = run(
        rping_client(&p, "5"),
        "first rping client",
        Duration::from_secs(60),
    );
    assert_success(&first, "first rping client");
    let mut doomed = Guarded::spawn(rping_client(&p, "100000000"), "rping client to kill");
    std::thread::sleep(Duration::from_millis(1500));
    doomed.assert_running();

    // Stop both, take a slot in the server's FIFO on the client's behalf, kill the client:
    // what SIGKILL between taking and writing a slot leaves.
    let (s, d) = (server.pid(), doomed.pid());
    signal(s, libc::SIGSTOP);
    signal(d, libc::SIGSTOP);
    wait_stopped(s);
    wait_stopped(d);
    let fifos = receive_fifos(s);
    assert!(
        !fifos.is_empty(),
        "no shared-memory receive FIFO of the server found"
    );
    let used: Vec<_> = fifos
        .iter()
        .filter(|(_, head)| head & !HEAD_ARMED > 0)
        .collect();
    assert!(
        !used.is_empty(),
        "none of the server's FIFOs carried the client's messages: {fifos:x?}"
    );
    for (base, head) in &used {
        take_slot(s, *base, *head);
    }
    drop(doomed); // SIGKILL to its group
    signal(s, libc::SIGCONT);

    // A new client must be served in full, and so must one after it.
    for n in ["10", "3"] {
        let out = run(
            rping_client(&p, n),
            "rping client after the kill",
            Duration::from_secs(60),
        );
        assert_success(&out, "rping client after the kill");
        let pings = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| l.contains("ping data: rdma-ping-"))
            .count();
        assert_eq!(
            pings.to_string(),
            n,
            "pings of a client after the kill\n{}",
            text(&out)
        );
    }
    server.assert_running();
    let out = server
        .wait_until(Instant::now())
        .expect_err("the persistent server runs until killed");
    let log = text(&out);
    assert!(
        log.contains("completed it as an empty message")
            && log.contains("a peer process on this host exited"),
        "the server did not say it completed the abandoned slot\n{log}"
    );
}

/// The shared-memory mappings of other processes in `pid`: what UCX attached of its peers
/// (their FIFOs and receive buffers), as opposed to its own.
fn peers_mappings(pid: i32) -> usize {
    let own: Vec<u64> = receive_fifos(pid).iter().map(|(base, _)| *base).collect();
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("maps")
        .lines()
        .filter(|l| l.contains("/ucx_shm_posix_") || l.contains(" /SYSV"))
        .filter(|l| {
            let start = l
                .split('-')
                .next()
                .and_then(|s| u64::from_str_radix(s, 16).ok());
            !start.is_some_and(|s| own.contains(&s))
        })
        .count()
}

/// How many ugdr tables (its own, and peers' it maps for the same-host direct path) `pid`
/// maps.
fn ugdr_tables(pid: i32) -> usize {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .expect("maps")
        .lines()
        .filter(|l| l.contains("/memfd:ugdr-table"))
        .count()
}

/// UCX keeps what it attached of a peer (its shared-memory FIFOs) until the endpoint is
/// closed, and ugdr maps each same-host peer's table for the direct path: a long-running
/// server kept both for every client that ever came and went. (UCX 1.13 itself keeps an ep
/// that the peer's UCX connected back to until the worker goes, whatever ugdr does: SPDK's
/// initiators leave their FIFOs so; rping's do not.)
#[test]
fn what_ucx_attached_of_peers_that_exited_is_let_go() {
    let (mut server, p) = persistent_rping_server("debug");
    let s = server.pid();
    let before = peers_mappings(s);
    let tables_before = ugdr_tables(s);
    // Each client's FIFO and receive buffers are attached while it runs; a killed client's
    // too. Six clients come and go, every other one killed.
    for i in 0..6 {
        if i % 2 == 0 {
            let out = run(
                rping_client(&p, "5"),
                "rping client",
                Duration::from_secs(60),
            );
            assert_success(&out, "rping client");
        } else {
            let mut c = Guarded::spawn(rping_client(&p, "100000000"), "rping client to kill");
            std::thread::sleep(Duration::from_millis(700));
            c.assert_running();
            drop(c); // SIGKILL
        }
    }
    // The server notices an exited peer within ~200 ms (it checks their pids).
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut attached = peers_mappings(s);
    let mut tables = ugdr_tables(s);
    while (attached > before || tables > tables_before) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        attached = peers_mappings(s);
        tables = ugdr_tables(s);
    }
    server.assert_running();
    let out = server
        .wait_until(Instant::now())
        .expect_err("the persistent server runs until killed");
    assert_eq!(
        attached,
        before,
        "mappings of gone peers still attached in the server (6 clients came and went)\n{}",
        text(&out)
    );
    assert_eq!(
        tables,
        tables_before,
        "the direct-path tables of gone peers are still mapped in the server\n{}",
        text(&out)
    );
    let closed = String::from_utf8_lossy(&out.stderr)
        .matches("closing the endpoint of a peer that is gone")
        .count();
    assert_eq!(closed, 6, "endpoints closed\n{}", text(&out));
}
