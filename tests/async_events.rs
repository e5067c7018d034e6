//! Asynchronous events where hardware raises them: COMM_EST (first message in RTR),
//! SQ_DRAINED (SQD with notification), QP_ACCESS_ERR and QP_REQ_ERR (responder class C
//! errors), QP_FATAL (the peer's process is gone). Each event names its QP, and none comes
//! twice.

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

/// Asserts that no further event is queued (the async fd made non-blocking).
fn assert_no_event(ctx: *mut ibv_context) {
    let fd = unsafe { (*ctx).async_fd };
    unsafe {
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        )
    };
    let mut ev = ibv_async_event::default();
    let got = unsafe { ibv_get_async_event(ctx, &mut ev) };
    assert_eq!(
        (got, errno()),
        (-1, libc::EAGAIN),
        "unexpected event {}",
        ev.event_type.0
    );
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
    assert_no_event(dev.ctx);
}

#[test]
fn sqd_with_notification_raises_sq_drained() {
    let lb = Loopback::rc(8);
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_SQD,
        en_sqd_async_notify: 1,
        ..Default::default()
    };
    let mask = ibv_qp_attr_mask::IBV_QP_STATE.0 | ibv_qp_attr_mask::IBV_QP_EN_SQD_ASYNC_NOTIFY.0;
    assert_eq!(unsafe { ibv_modify_qp(lb.a, &mut a, mask as c_int) }, 0);
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
    assert_no_event(lb.dev.ctx);
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
    assert_no_event(lb.dev.ctx);
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
    assert_no_event(lb.dev.ctx);
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

#[test]
fn a_peer_process_that_dies_raises_qp_fatal() {
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
    drop(server); // kills the server's process group
    let mut ev = next_event(dev.ctx);
    assert_qp_event(&mut ev, ibv_event_type::IBV_EVENT_QP_FATAL, qp);
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_ERR.0);
}
