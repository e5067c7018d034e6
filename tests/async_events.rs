//! Asynchronous events where hardware raises them: COMM_EST (first message in RTR),
//! SQ_DRAINED (SQD with notification), QP_ACCESS_ERR and QP_REQ_ERR (responder class C
//! errors), QP_FATAL (the peer's process is gone). Each event names its QP, and none comes
//! twice. As with the kernel: destroying a QP or CQ drops its unread events (and only its),
//! and waits while the application holds one it has not acknowledged.

mod fixture;
mod harness;

use fixture::*;
use std::io::{Read, Write};
use std::os::raw::c_int;
use std::time::{Duration, Instant};

/// The next event, waited for at most 10 s (a missing event fails, never hangs).
fn next_event(ctx: *mut ibv_context) -> ibv_async_event {
    let mut pfd = libc::pollfd {
        fd: unsafe { (*ctx).async_fd },
        events: libc::POLLIN,
        revents: 0,
    };
    assert_eq!(
        unsafe { libc::poll(&mut pfd, 1, 10_000) },
        1,
        "no async event within 10 s"
    );
    let mut ev = ibv_async_event::default();
    assert_eq!(unsafe { ibv_get_async_event(ctx, &mut ev) }, 0);
    ev
}

fn assert_qp_event(ev: &mut ibv_async_event, event_type: ibv_event_type, qp: *mut ibv_qp) {
    assert_eq!(ev.event_type, event_type);
    assert_eq!(unsafe { ev.element.qp }, qp);
    unsafe { ibv_ack_async_event(ev) };
}

#[test]
fn the_first_message_in_rtr_raises_comm_est_once() {
    let dev = Device::open();
    let cq_a = dev.cq(16);
    let cq_b = dev.cq(16);
    let a = dev.rc_qp(cq_a, cq_a, 8);
    let b = dev.rc_qp(cq_b, cq_b, 8);
    connect(a, dev.lid, qp_num(b));
    to_rtr(b, dev.lid, qp_num(a));
    let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
    assert_eq!(post_one_recv(b, 1, &mut [buf.sge(0, 32)]), 0);
    assert_eq!(post_one_recv(b, 2, &mut [buf.sge(32, 32)]), 0);
    let mut sge = [buf.sge(0, 8)];
    for id in [10, 11] {
        assert_eq!(
            post_one_send(
                a,
                &mut send_wr(
                    id,
                    &mut sge,
                    ibv_wr_opcode::IBV_WR_SEND,
                    ibv_send_flags::IBV_SEND_SIGNALED.0
                )
            ),
            0
        );
    }
    let wcs = poll_n(cq_b, 2);
    assert_eq!((wcs[0].wr_id, wcs[1].wr_id), (1, 2));
    assert!(
        wcs.iter()
            .all(|w| w.status == ibv_wc_status::IBV_WC_SUCCESS)
    );
    assert_eq!(qp_state(b), ibv_qp_state::IBV_QPS_RTR.0);
    assert_qp_event(
        &mut next_event(dev.ctx),
        ibv_event_type::IBV_EVENT_COMM_EST,
        b,
    );
    assert_no_async_event(dev.ctx);
}

#[test]
fn sqd_with_notification_raises_sq_drained() {
    let lb = Loopback::rc(8);
    queue_sq_drained(lb.a);
    assert_eq!(qp_state(lb.a), ibv_qp_state::IBV_QPS_SQD.0);
    assert_qp_event(
        &mut next_event(lb.dev.ctx),
        ibv_event_type::IBV_EVENT_SQ_DRAINED,
        lb.a,
    );
    // Without notification, SQD raises nothing.
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_SQD,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(lb.b, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int,) },
        0
    );
    assert_no_async_event(lb.dev.ctx);
}

/// SQD drains what the send queue began and begins nothing new: a WRITE and a SEND posted in
/// SQD wait (no completion, no byte at the target, SQ_DRAINED meanwhile) until the QP is back
/// in RTS, then both land and complete in post order with every completion field.
#[test]
fn wrs_posted_in_sqd_wait_for_rts() {
    let lb = Loopback::rc(8);
    let mut src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    src.data.iter_mut().for_each(|b| *b = 0xAB);
    let dst = Buffer::new(&lb.dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    let recv = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 30, &mut [recv.sge(0, 64)]), 0);
    queue_sq_drained(lb.a);
    let mut sge = [src.sge(0, 64)];
    let mut write = rdma_wr(
        20,
        &mut sge,
        ibv_wr_opcode::IBV_WR_RDMA_WRITE,
        dst.addr(),
        dst.rkey(),
    );
    assert_eq!(post_one_send(lb.a, &mut write), 0);
    let mut sge = [src.sge(0, 16)];
    let mut send = send_wr(
        21,
        &mut sge,
        ibv_wr_opcode::IBV_WR_SEND,
        ibv_send_flags::IBV_SEND_SIGNALED.0,
    );
    assert_eq!(post_one_send(lb.a, &mut send), 0);
    // Nothing was begun: the queue is drained at once, with both WRs posted.
    assert_qp_event(
        &mut next_event(lb.dev.ctx),
        ibv_event_type::IBV_EVENT_SQ_DRAINED,
        lb.a,
    );
    assert_no_completion(lb.cq_a, Duration::from_millis(300));
    assert_no_completion(lb.cq_b, Duration::ZERO);
    let landed = |buf: &Buffer| {
        (0..buf.data.len())
            .filter(|&i| unsafe { std::ptr::read_volatile(buf.data.as_ptr().add(i)) } == 0xAB)
            .count()
    };
    assert_eq!(landed(&dst), 0, "a WRITE posted in SQD landed");
    let mut rts = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_RTS,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(lb.a, &mut rts, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) },
        0
    );
    let wcs = poll_n(lb.cq_a, 2);
    for (wc, (id, opcode)) in wcs.iter().zip([
        (20, ibv_wc_opcode::IBV_WC_RDMA_WRITE),
        (21, ibv_wc_opcode::IBV_WC_SEND),
    ]) {
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.qp_num),
            (id, ibv_wc_status::IBV_WC_SUCCESS, opcode, qp_num(lb.a))
        );
    }
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num),
        (
            30,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV,
            16,
            qp_num(lb.b)
        )
    );
    assert_eq!(landed(&dst), 64);
    assert_eq!(landed(&recv), 16);
    assert_no_async_event(lb.dev.ctx);
}

#[test]
fn a_remote_access_violation_raises_qp_access_err_at_the_responder() {
    let lb = Loopback::rc(8);
    let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let remote = Buffer::new(&lb.dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(
            lb.a,
            &mut rdma_wr(
                3,
                &mut sge,
                ibv_wr_opcode::IBV_WR_RDMA_WRITE,
                remote.addr(),
                remote.rkey() ^ 0x0001_0000
            )
        ),
        0
    );
    let wc = poll_n(lb.cq_a, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (3, ibv_wc_status::IBV_WC_REM_ACCESS_ERR)
    );
    assert_qp_event(
        &mut next_event(lb.dev.ctx),
        ibv_event_type::IBV_EVENT_QP_ACCESS_ERR,
        lb.b,
    );
    assert_eq!(qp_state(lb.b), ibv_qp_state::IBV_QPS_ERR.0);
    assert_no_async_event(lb.dev.ctx);
}

#[test]
fn a_send_longer_than_the_receive_raises_qp_req_err_at_the_responder() {
    let lb = Loopback::rc(8);
    let buf = Buffer::new(&lb.dev, 128, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 4, &mut [buf.sge(0, 8)]), 0);
    let mut sge = [buf.sge(64, 64)];
    assert_eq!(
        post_one_send(
            lb.a,
            &mut send_wr(
                5,
                &mut sge,
                ibv_wr_opcode::IBV_WR_SEND,
                ibv_send_flags::IBV_SEND_SIGNALED.0
            )
        ),
        0
    );
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (4, ibv_wc_status::IBV_WC_LOC_LEN_ERR)
    );
    let wc = poll_n(lb.cq_a, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (5, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR)
    );
    assert_qp_event(
        &mut next_event(lb.dev.ctx),
        ibv_event_type::IBV_EVENT_QP_REQ_ERR,
        lb.b,
    );
    assert_no_async_event(lb.dev.ctx);
}

/// The client half of ibv_rc_pingpong's address exchange: "LID:QPN:PSN:GID" both ways.
fn exchange(port: u16, lid: u16, qpn: u32) -> (u16, u32) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut sock = loop {
        match std::net::TcpStream::connect(("127.0.0.1", port)) {
            Ok(s) => break s,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("cannot reach ibv_rc_pingpong on port {port}: {e}"),
        }
    };
    let mut msg = format!("{lid:04x}:{qpn:06x}:{:06x}:{}", 0, "0".repeat(32)).into_bytes();
    msg.push(0);
    sock.write_all(&msg).unwrap();
    let mut theirs = [0u8; 52];
    sock.read_exact(&mut theirs).unwrap();
    let text = std::str::from_utf8(&theirs[..51]).unwrap();
    let mut parts = text.split(':');
    let rlid = u16::from_str_radix(parts.next().unwrap(), 16).unwrap();
    let rqpn = u32::from_str_radix(parts.next().unwrap(), 16).unwrap();
    sock.write_all(b"done\0").unwrap();
    std::mem::forget(sock); // the server reads "done" after it connected
    (rlid, rqpn)
}

/// An RC QP connected to an ibv_rc_pingpong server process, and that process (dropping it
/// kills it).
fn connected_to_a_peer_process() -> (Device, *mut ibv_qp, harness::Guarded) {
    let port = harness::free_port();
    let mut server = harness::Guarded::spawn(
        harness::preloaded(
            "ibv_rc_pingpong",
            &["-p", &port.to_string(), "-n", "1000000"],
        ),
        "ibv_rc_pingpong server",
    );
    let dev = Device::open();
    let cq = dev.cq(16);
    let qp = dev.rc_qp(cq, cq, 8);
    let (rlid, rqpn) = exchange(port, dev.lid, qp_num(qp));
    connect(qp, rlid, rqpn);
    server.assert_running();
    (dev, qp, server)
}

#[test]
fn a_peer_process_that_dies_raises_qp_fatal() {
    let (dev, qp, server) = connected_to_a_peer_process();
    drop(server); // kills the server's process group
    let mut ev = next_event(dev.ctx);
    assert_qp_event(&mut ev, ibv_event_type::IBV_EVENT_QP_FATAL, qp);
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_ERR.0);
}

/// Whether the async fd polls readable right now.
fn async_fd_readable(ctx: *mut ibv_context) -> bool {
    let mut pfd = libc::pollfd {
        fd: unsafe { (*ctx).async_fd },
        events: libc::POLLIN,
        revents: 0,
    };
    unsafe { libc::poll(&mut pfd, 1, 0) == 1 }
}

/// Waits (at most 10 s) until an event is queued, without reading it.
fn wait_readable(ctx: *mut ibv_context) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !async_fd_readable(ctx) {
        assert!(Instant::now() < deadline, "no async event within 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SQD with notification: queues IBV_EVENT_SQ_DRAINED for an idle `qp` at once.
fn queue_sq_drained(qp: *mut ibv_qp) {
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_SQD,
        en_sqd_async_notify: 1,
        ..Default::default()
    };
    let mask = ibv_qp_attr_mask::IBV_QP_STATE.0 | ibv_qp_attr_mask::IBV_QP_EN_SQD_ASYNC_NOTIFY.0;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, mask as c_int) }, 0);
}

/// Two idle RC QPs connected to each other on one CQ.
fn idle_pair(dev: &Device) -> (*mut ibv_cq, *mut ibv_qp, *mut ibv_qp) {
    let cq = dev.cq(16);
    let a = dev.rc_qp(cq, cq, 8);
    let b = dev.rc_qp(cq, cq, 8);
    connect(a, dev.lid, qp_num(b));
    connect(b, dev.lid, qp_num(a));
    (cq, a, b)
}

#[test]
fn destroying_a_qp_drops_its_unread_events_and_no_others() {
    let dev = Device::open();
    let (cq, a, b) = idle_pair(&dev);
    queue_sq_drained(a);
    queue_sq_drained(b);
    assert!(async_fd_readable(dev.ctx));
    assert_eq!(unsafe { ibv_destroy_qp(a) }, 0);
    // Only b's event is left, and after it the fd is not readable: no byte without an event.
    assert_qp_event(
        &mut next_event(dev.ctx),
        ibv_event_type::IBV_EVENT_SQ_DRAINED,
        b,
    );
    assert!(!async_fd_readable(dev.ctx));
    assert_no_async_event(dev.ctx);
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
}

#[test]
fn destroying_a_qp_waits_until_its_events_are_acknowledged() {
    let dev = Device::open();
    let (cq, a, b) = idle_pair(&dev);
    queue_sq_drained(a);
    let mut ev = next_event(dev.ctx);
    assert_eq!(ev.event_type, ibv_event_type::IBV_EVENT_SQ_DRAINED);
    let qp = a as usize;
    let destroyer = std::thread::spawn(move || unsafe { ibv_destroy_qp(qp as *mut ibv_qp) });
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        !destroyer.is_finished(),
        "ibv_destroy_qp returned while the application held an unacknowledged event about it"
    );
    unsafe { ibv_ack_async_event(&mut ev) };
    assert_eq!(destroyer.join().unwrap(), 0);
    // Another QP's events are not waited for: b is destroyed while nothing about it is held.
    assert_eq!(unsafe { ibv_destroy_qp(b) }, 0);
    assert_eq!(unsafe { ibv_destroy_cq(cq) }, 0);
    assert_no_async_event(dev.ctx);
}

#[test]
fn a_qp_destroyed_before_its_qp_fatal_was_read_leaves_no_event() {
    let (dev, qp, server) = connected_to_a_peer_process();
    drop(server);
    wait_readable(dev.ctx); // QP_FATAL is queued, not read
    assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    assert!(!async_fd_readable(dev.ctx));
    assert_no_async_event(dev.ctx);
}

#[test]
fn destroying_a_cq_drops_its_unread_cq_err() {
    let dev = Device::open();
    let (small, cq_b, a, b) = connected_pair(&dev, 1, 16);
    let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
    signaled_sends(a, b, &buf, 4);
    poll_n(cq_b, 4);
    wait_readable(dev.ctx); // the overrun's CQ_ERR, not read
    unsafe {
        assert_eq!(ibv_destroy_qp(a), 0);
        assert_eq!(ibv_destroy_qp(b), 0);
        assert_eq!(ibv_destroy_cq(small), 0);
        assert_eq!(ibv_destroy_cq(cq_b), 0);
    }
    assert!(!async_fd_readable(dev.ctx));
    assert_no_async_event(dev.ctx);
}
