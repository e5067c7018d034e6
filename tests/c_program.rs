//! A C verbs program (the real verbs.h inlines, linked with -libverbs) built with `cc` and
//! run with libugdr.so preloaded.

mod harness;

use harness::*;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// Runs `exe` under ugdr; it must exit 0 and print "<name>: ok".
fn run_under_ugdr(exe: &Path, name: &str) {
    run_checked_under_ugdr(exe, &[], name, &format!("{name}: ok"));
}

#[test]
fn c_program_with_verbs_inlines_runs_under_ugdr() {
    let exe = build_c("rc_loopback", &["-libverbs"]);
    run_under_ugdr(&exe, "rc_loopback");
    // Without ugdr the same program finds no device (there is no RDMA hardware): the test
    // above really ran over ugdr.
    let bare = run(
        Command::new(&exe),
        "rc_loopback without ugdr",
        Duration::from_secs(30),
    );
    assert!(
        !bare.status.success(),
        "expected no RDMA device without ugdr\n{}",
        text(&bare)
    );
}

/// A program that starts no thread of its own: UCX's threads (started through the libc of
/// UCX's own namespace) must never run its libc's `malloc` while that libc believes the
/// process single-threaded and so takes no locks (tests/c/malloc_guard.c counts such calls).
/// They did: the dynamic linker allocates UCX's thread-locals with the application's
/// `malloc`, and the heap was sometimes corrupted at engine start (once in some hundred runs
/// under load; the guard counted such a call in 9 runs of 10).
#[test]
fn ucxs_threads_never_run_the_applications_malloc_unlocked() {
    let exe = build_c("rc_loopback", &["-libverbs"]);
    let guard = build_c("malloc_guard", &["-shared", "-fPIC"]);
    for transports in [None, Some("sysv,self,tcp"), None] {
        let mut cmd = Command::new(&exe);
        cmd.env(
            "LD_PRELOAD",
            format!("{} {}", lib_path().display(), guard.display()),
        );
        if let Some(tls) = transports {
            cmd.env("UCX_TLS", tls);
        }
        let out = run(
            cmd,
            "rc_loopback with malloc_guard",
            Duration::from_secs(60),
        );
        assert_success(&out, "rc_loopback with malloc_guard");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("malloc_guard: 0 unlocked calls"),
            "UCX_TLS={transports:?}\n{}",
            text(&out)
        );
    }
}

/// The rarely used entry points (`ibv_query_qp_data_in_order`, `ibv_import_*`,
/// `ibv_unimport_*`, `ibv_import_device`, `ibv_resolve_eth_l2_from_gid`, every rsocket) with
/// ugdr's objects: each answers as rdma-core does (for a device without the feature where
/// ugdr has none; importing shares a context's objects). Before ugdr exported them, the first
/// of them went to the real library and crashed (SIGSEGV).
#[test]
fn rare_entry_points_answer_for_ugdr_objects_as_for_a_device_without_the_feature() {
    let exe = build_c("rare_exports", &["-libverbs", "-lrdmacm"]);
    run_under_ugdr(&exe, "rare_exports");
}

/// XRC (`tests/c/xrc.c`): domains and their open flags, XRC SRQs and their numbers, XRC_SEND to
/// XRC_RECV with `remote_srqn` and `ibv_wr_set_xrc_srqn`, `ibv_open_qp`, every completion
/// field, and the error cases (an SRQ of another domain or none: IBV_WC_REM_INV_REQ_ERR and
/// IBV_EVENT_QP_REQ_ERR; EBUSY for an xrcd or CQ in use).
#[test]
fn xrc_domains_srqs_and_queue_pairs() {
    let exe = build_c("xrc", &["-libverbs"]);
    run_under_ugdr(&exe, "xrc");
}

/// RDMA WRITE, WRITE_WITH_IMM, READ and atomics over XRC (`tests/c/xrc_rdma.c`): the rkey is
/// checked in the PD of the XRC SRQ each WR names (a region of another PD is written only
/// through an SRQ of that PD); WRITE_WITH_IMM completes a WR of that SRQ on its CQ; a bad
/// rkey, an MR of another PD, missing access (MR or target QP) and a range past the MR are
/// IBV_WC_REM_ACCESS_ERR with the target QP to ERR (IBV_EVENT_QP_ACCESS_ERR), every field
/// and byte checked.
#[test]
fn xrc_rdma_and_atomics_check_the_named_srqs_pd() {
    let exe = build_c("xrc_rdma", &["-libverbs"]);
    run_under_ugdr(&exe, "xrc_rdma");
}

/// RDMA ATOMIC WRITE through `ibv_wr_atomic_write` (`tests/c/atomic_write.c`): the 8 bytes
/// land whole, after the WRITE posted before them, and complete as IBV_WC_ATOMIC_WRITE with
/// every field checked; a misaligned address or a NULL operand is EINVAL at `ibv_wr_complete`;
/// an MR without REMOTE_WRITE is IBV_WC_REM_ACCESS_ERR with nothing written; a UC QP cannot
/// ask for it.
#[test]
fn atomic_write_lands_whole_and_in_order() {
    let exe = build_c("atomic_write", &["-libverbs"]);
    run_under_ugdr(&exe, "atomic_write");
}

/// An application thread pinned to one CPU (a DPDK/SPDK reactor) that opens the device
/// starts ugdr's progress thread, which must not inherit that pinning: it runs on every CPU
/// the process's threads may use; a process bound as a whole keeps it within the binding
/// (tests/c/pinned_app.c). The application's own pinning is left alone in both.
#[test]
fn the_progress_thread_runs_on_the_processs_cpus_not_its_pinned_creators() {
    let exe = build_c("pinned_app", &["-libverbs", "-lpthread"]);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if cpus < 2 {
        eprintln!("skipped: this process may run on one CPU only, nothing to tell apart");
        return;
    }
    for mode in ["reactor", "bound"] {
        run_checked_under_ugdr(&exe, &[mode], mode, "pinned_app: ok");
    }
}

/// A UC sender that sleeps in `ibv_get_cq_event` between windows of 128 SENDs, twice the
/// shared-memory FIFO UCX keeps towards its peer, to a receiver that sleeps on events too
/// (tests/c/uc_window.c, which checks every completion and message). The SENDs that find the
/// FIFO full wait inside UCX for a progress call of the sender's process, and no ACK comes
/// back over UC to wake one: they waited for the progress thread's 100 ms timer, and 96
/// windows took 1.6–2.9 s (`ib_send_bw -e -c UC -s 64`: ~0.5 MB/s). Now 11–19 ms, 43–90 ms
/// beside two busy loops.
#[test]
fn a_sleeping_uc_sender_does_not_wait_for_a_timer_when_its_peers_fifo_was_full() {
    let exe = build_c("uc_window", &["-libverbs"]);
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", lib_path());
    let out = run(cmd, "uc_window", Duration::from_secs(60));
    assert_success(&out, "uc_window");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let ms: f64 = stdout
        .lines()
        .find_map(|l| l.strip_prefix("uc_window: ok 12288 messages, sender "))
        .and_then(|rest| rest.strip_suffix(" ms"))
        .and_then(|ms| ms.parse().ok())
        .unwrap_or_else(|| panic!("no result line\n{}", text(&out)));
    assert!(ms < 600.0, "96 windows took {ms} ms\n{}", text(&out));
}

/// `ibv_get_cq_event`, `ibv_get_async_event` and `rdma_get_cm_event` block as rdma-core's and
/// librdmacm's `read()`: a signal whose handler was installed without `SA_RESTART` ends them
/// with -1/EINTR, one with `SA_RESTART` does not (they return the event that comes later);
/// tests/c/eintr.c checks both for each, and that a signal sent to the process while the main
/// thread blocks it reaches the program's waiting thread. ugdr went on waiting after any signal
/// (the first scenario waited until the program made the event come, 3 s later), and the
/// process-directed signal ran its handler on a thread of UCX's (every run of three).
#[test]
fn blocking_event_calls_end_with_eintr_only_for_handlers_without_sa_restart() {
    let exe = build_c("eintr", &["-libverbs", "-lrdmacm", "-lpthread"]);
    run_under_ugdr(&exe, "eintr");
}

/// Completion events of a CQ re-armed while it still holds completions (tests/c/stale_cq_event.c):
/// an event fired on such an arming whose completion the application polled before asking is
/// not handed out to a blocking `ibv_get_cq_event`, which returns for the next completion
/// instead; an event fired on an arming of an empty CQ always is. `ibv_rc_pingpong -t -e`
/// failed ("poll CQ failed 2": an event, then an empty CQ) about one run in twenty beside
/// two busy loops; this program failed every run.
#[test]
fn an_event_for_completions_polled_since_a_rearming_over_completions_is_not_handed_out() {
    let exe = build_c("stale_cq_event", &["-libverbs", "-lpthread"]);
    run_under_ugdr(&exe, "stale_cq_event");
}

/// Solicited events (tests/c/solicited_event.c): a CQ armed with `solicited_only` raises no
/// event for unsolicited SENDs, SEND_WITH_IMMs and WRITE_WITH_IMMs, one for each sent with
/// `IBV_SEND_SOLICITED` and one for flushed receives; armed for any completion, one for an
/// unsolicited SEND. Every receive completion's fields and bytes are checked.
#[test]
fn a_cq_armed_for_solicited_completions_fires_for_solicited_messages_and_errors_only() {
    let exe = build_c("solicited_event", &["-libverbs"]);
    run_under_ugdr(&exe, "solicited_event");
}

/// `IBV_SEND_FENCE` between two processes on the message path (tests/c/fence.c): a fenced
/// WRITE after a READ of the same memory never lands before the READ read it (20 rounds of
/// 1 MiB; the READ returned the WRITE's bytes in most of them before the fence was kept), a
/// fenced WRITE after a FETCH_AND_ADD waits for its answer, and a fenced WRITE held behind a
/// READ the stopped responder never answers is flushed unsent, the retransmission timer
/// included. Every completion's fields are checked. `UGDR_DIRECT=off`: on one host the
/// direct path completes a READ at post time, with no fence to keep.
#[test]
fn a_fenced_wr_waits_for_the_reads_and_atomics_posted_before_it() {
    let exe = build_c("fence", &["-libverbs"]);
    run_checked_under_ugdr_with(&exe, &[], &[("UGDR_DIRECT", "off")], "fence", "fence: ok");
}

/// `max_rd_atomic` between two processes on the message path (tests/c/initiator_depth.c): at
/// depth 1, and at depth 0 (one, as mlx4 and mlx5 allow), a READ or atomic behind an
/// unanswered READ waits for its answer, and a WRITE posted behind it waits too, so the first
/// READ never returns the WRITE's bytes (20 rounds of 1 MiB each; it returned them in the
/// first round before the depth was kept); a READ held behind a 128 MiB READ whose answer the
/// stopped responder leaves half-landed for 600 ms is not timed out (it was never sent; it
/// expired before the timer passed over held WRs); a READ and a WRITE held behind a READ the
/// stopped responder never answers are flushed unsent, the retransmission timer included.
/// Every completion's fields are checked. `UGDR_DIRECT=off`: on one host the direct path
/// completes a READ at post time; `UCX_TLS=tcp`: over shared memory the requester pulls a big
/// answer itself, stopped responder or not.
#[test]
fn a_read_or_atomic_beyond_max_rd_atomic_waits_for_one_in_flight_to_complete() {
    let exe = build_c("initiator_depth", &["-libverbs"]);
    run_checked_under_ugdr_with(
        &exe,
        &[],
        &[("UGDR_DIRECT", "off"), ("UCX_TLS", "tcp")],
        "initiator_depth",
        "initiator_depth: ok",
    );
}

/// The most SENDs the debug log of `out` says were placed in a peer's receive ring (0: none),
/// the most of them it says were written in place into the receive WR's buffer, and the most
/// RDMA WRITEs with immediate data it says were placed.
fn sends_placed(out: &std::process::Output) -> (u64, u64, u64) {
    let counts: Vec<(u64, u64, u64)> = String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter_map(|l| {
            let (placed, rest) = l
                .split_once("direct path to pid ")?
                .1
                .split_once(": ")?
                .1
                .split_once(" sends placed, ")?;
            let (in_place, rest) = rest.split_once(" of them written in place")?;
            let (_, rest) = rest.split_once(" writes, ")?;
            let (with_imm, _) = rest.split_once(" of them with immediate data")?;
            Some((
                placed.parse().ok()?,
                in_place.parse().ok()?,
                with_imm.parse().ok()?,
            ))
        })
        .collect();
    (
        counts.iter().map(|c| c.0).max().unwrap_or(0),
        counts.iter().map(|c| c.1).max().unwrap_or(0),
        counts.iter().map(|c| c.2).max().unwrap_or(0),
    )
}

/// The same-host SEND path: tests/c/direct_send.c (two processes) checks data, order and every
/// completion field of SENDs up to 256 bytes (placed in the receive ring, copied by the
/// receiver into its posted buffers), above (written in place by the sender into a receive WR
/// of one SGE: 257 bytes to 1 MiB, with and without immediate data, nothing written past
/// them) and messages (above 256 bytes into a WR of two SGEs), in one stream of 20,000 (the
/// three mixed), and the message
/// path's errors and flush order: a receive WR too short, one whose MR was deregistered before
/// the SEND (also after the sender saw it posted), a message's completion still queued when
/// the placed SEND after it is polled (it comes first), one whose MR was deregistered after
/// the SEND arrived (it completes), a QP moved to ERR with placed receives not yet polled;
/// and that a sender polling only its send CQ gets the ACK a placed SEND carries back (it
/// waited for its transport timer, ~4.3 s, when only a poll of the receive CQ read the ring);
/// that a direct WRITE and placed SENDs complete at post once the receiver delivered the
/// messages before them, even when their ACK has not come back (the receiver stops itself);
/// that a SEND behind a WRITE the responder refuses is flushed and reaches nothing; that a
/// 2000-byte SEND to a one-SGE WR of 1000 bytes fails as on the message path (LOC_LEN_ERR,
/// REM_INV_REQ_ERR), the WR's buffer untouched; and that an MR deregistered in the middle of
/// a stream of 16 KiB SENDs written in place into its receive WRs takes no byte once
/// `ibv_dereg_mr` returned (earlier receives complete with their data, then one LOC_PROT_ERR
/// and flushes; REM_OP_ERR at the sender); and that RDMA WRITE_WITH_IMM of 8 bytes to 1 MiB
/// lands at its address and completes the next receive WR (RECV_RDMA_WITH_IMM, its length and
/// immediate data, the WR's buffer untouched), while one whose key grants no remote writing
/// gets the responder's outcome (REM_ACCESS_ERR at both ends, the receiver's QP to ERR).
/// Run with the path on, where the debug log must count placed SENDs, SENDs written in place
/// and placed WRITEs with immediate data, and off, where it must count none; the program's
/// checks are the same.
#[test]
fn small_sends_on_one_host_are_placed_in_posted_receives_with_the_message_paths_outcomes() {
    let exe = build_c("direct_send", &["-libverbs"]);
    for direct in ["on", "off"] {
        let mut cmd = Command::new(&exe);
        cmd.env("LD_PRELOAD", lib_path())
            .env("UGDR_LOG", "debug")
            .env("UGDR_DIRECT", direct);
        let what = format!("direct_send, UGDR_DIRECT={direct}");
        let out = run(cmd, &what, Duration::from_secs(120));
        assert_success(&out, &what);
        assert!(
            String::from_utf8_lossy(&out.stdout)
                .lines()
                .any(|l| l == "direct_send: ok"),
            "{what}: no ok line\n{}",
            text(&out)
        );
        let (placed, in_place, writes_with_imm) = sends_placed(&out);
        if direct == "on" {
            // The four of `write_imm` that may succeed (the receiver keeps its WRs posted
            // before the sender starts): the log counts at powers of two.
            assert!(
                writes_with_imm >= 4,
                "{what}: {writes_with_imm} WRITEs with immediate data placed\n{}",
                tail_of(&out)
            );
            // The five of `inplace` and most of `race` (its receiver keeps 32 WRs posted
            // ahead of 300 SENDs) and of the stream's ~1,800 of 700 bytes; one that never
            // wrote in place counts 0.
            assert!(
                in_place >= 64,
                "{what}: {in_place} SENDs written in place\n{}",
                tail_of(&out)
            );
            // 5 of the shapes, most of the stream (after a message, SENDs go as messages until
            // the receiver delivered it), 40 of catchup: logged at powers of two. A receiver
            // starved of CPU leaves no receive posted more often, and those SENDs go as
            // messages: beside a busy loop on each of 2 CPUs, at least 6,390 were placed in 15
            // runs. A path that stopped after the first message would place ~10 (one that
            // waited for ACKs instead placed 373 once; catchup shows that one at every run).
            assert!(
                placed >= 1024,
                "{what}: {placed} SENDs placed\n{}",
                tail_of(&out)
            );
        } else {
            assert_eq!(
                (placed, in_place, writes_with_imm),
                (0, 0, 0),
                "{what}: SENDs placed with the path off"
            );
        }
    }
}

fn tail_of(out: &std::process::Output) -> String {
    let t = text(out);
    let start = t.len().saturating_sub(6000);
    t[t.char_indices()
        .find(|(i, _)| *i >= start)
        .map_or(0, |(i, _)| i)..]
        .to_string()
}
