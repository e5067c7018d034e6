//! Shared receive queues through the exported ABI: many RC QPs on one SRQ, completions carrying
//! the receiving QP's number, the limit event, the last-WQE event, EBUSY while in use.

mod fixture;

use fixture::*;
use std::os::raw::c_int;
use std::ptr::null_mut;

unsafe extern "C" {
    fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq;
    fn ibv_modify_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr, mask: c_int) -> c_int;
    fn ibv_query_srq(srq: *mut ibv_srq, attr: *mut ibv_srq_attr) -> c_int;
    fn ibv_destroy_srq(srq: *mut ibv_srq) -> c_int;
}

fn post_srq(srq: *mut ibv_srq, wr_id: u64, sge: ibv_sge) -> c_int {
    let mut sges = [sge];
    let mut wr = ibv_recv_wr {
        wr_id,
        next: null_mut(),
        sg_list: sges.as_mut_ptr(),
        num_sge: 1,
    };
    let mut bad = null_mut();
    unsafe { (*(*srq).context).ops.post_srq_recv.unwrap()(srq, &mut wr, &mut bad) }
}

fn create_srq(dev: &Device, max_wr: u32) -> *mut ibv_srq {
    let mut attr = ibv_srq_init_attr {
        srq_context: null_mut(),
        attr: ibv_srq_attr {
            max_wr,
            max_sge: 1,
            srq_limit: 0,
        },
    };
    let srq = unsafe { ibv_create_srq(dev.pd, &mut attr) };
    assert!(!srq.is_null(), "ibv_create_srq: errno {}", errno());
    srq
}

fn srq_qp(dev: &Device, cq: *mut ibv_cq, srq: *mut ibv_srq) -> *mut ibv_qp {
    let mut attr = ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        srq,
        cap: ibv_qp_cap {
            max_send_wr: 4,
            max_recv_wr: 0,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ibv_qp_type::IBV_QPT_RC,
        ..Default::default()
    };
    let qp = unsafe { ibv_create_qp(dev.pd, &mut attr) };
    assert!(!qp.is_null(), "ibv_create_qp with srq: errno {}", errno());
    qp
}

#[test]
fn sixty_four_qps_share_one_srq_and_completions_name_the_receiving_qp() {
    let dev = Device::open();
    let srq = create_srq(&dev, 128);
    let rcq = dev.cq(256);
    let scq = dev.cq(256);
    let buf = Buffer::new(&dev, 64 * 64, LOCAL_WRITE);
    let src = Buffer::new(&dev, 64, LOCAL_WRITE);
    let mut pairs = Vec::new();
    for _ in 0..64 {
        let r = srq_qp(&dev, rcq, srq);
        let s = dev.rc_qp(scq, scq, 4);
        connect(r, dev.lid, qp_num(s));
        connect(s, dev.lid, qp_num(r));
        pairs.push((s, r));
    }
    for i in 0..64 {
        assert_eq!(post_srq(srq, i, buf.sge(i as usize * 64, 64)), 0);
    }
    // A QP on an SRQ does not take its own receives.
    assert_eq!(
        post_one_recv(pairs[0].1, 1, &mut [buf.sge(0, 8)]),
        libc::EINVAL
    );
    for (i, (s, _)) in pairs.iter().enumerate() {
        let mut sge = [src.sge(0, 16)];
        assert_eq!(
            post_one_send(
                *s,
                &mut send_wr(
                    i as u64,
                    &mut sge,
                    ibv_wr_opcode::IBV_WR_SEND,
                    ibv_send_flags::IBV_SEND_SIGNALED.0
                )
            ),
            0
        );
        let wc = poll_n(rcq, 1)[0];
        assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!(
            wc.qp_num,
            qp_num(pairs[i].1),
            "the completion names the QP that received"
        );
        assert_eq!(wc.src_qp, qp_num(*s));
        assert_eq!(wc.byte_len, 16);
    }
    assert_eq!(poll_n(scq, 64).len(), 64);
    assert_eq!(
        unsafe { ibv_destroy_srq(srq) },
        libc::EBUSY,
        "QPs still use it"
    );
    unsafe {
        for (s, r) in pairs {
            ibv_destroy_qp(s);
            ibv_destroy_qp(r);
        }
        assert_eq!(ibv_destroy_srq(srq), 0);
    }
}

#[test]
fn messages_wait_for_srq_receives() {
    let dev = Device::open();
    let srq = create_srq(&dev, 16);
    let cq = dev.cq(64);
    let r = srq_qp(&dev, cq, srq);
    let s = dev.rc_qp(cq, cq, 8);
    connect(r, dev.lid, qp_num(s));
    connect(s, dev.lid, qp_num(r));
    let buf = Buffer::new(&dev, 256, LOCAL_WRITE);
    let mut sge = [buf.sge(128, 8)];
    assert_eq!(
        post_one_send(s, &mut send_wr(9, &mut sge, ibv_wr_opcode::IBV_WR_SEND, 0)),
        0
    );
    assert_no_completion(cq, std::time::Duration::from_millis(30));
    assert_eq!(post_srq(srq, 5, buf.sge(0, 64)), 0);
    let wc = poll_n(cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.qp_num, wc.status),
        (5, qp_num(r), ibv_wc_status::IBV_WC_SUCCESS)
    );
}

/// An SRQ (16 WRs) holding 4 receives with its limit armed at 3, an RC QP `r` on it and its
/// peer `s`, both on `cq`: (srq, cq, r, s, buffer).
fn limit_armed(dev: &Device) -> (*mut ibv_srq, *mut ibv_cq, *mut ibv_qp, *mut ibv_qp, Buffer) {
    let srq = create_srq(dev, 16);
    let cq = dev.cq(64);
    let r = srq_qp(dev, cq, srq);
    let s = dev.rc_qp(cq, cq, 8);
    connect(r, dev.lid, qp_num(s));
    connect(s, dev.lid, qp_num(r));
    let buf = Buffer::new(dev, 512, LOCAL_WRITE);
    for i in 0..4 {
        assert_eq!(post_srq(srq, i, buf.sge(i as usize * 64, 64)), 0);
    }
    let mut a = ibv_srq_attr {
        max_wr: 0,
        max_sge: 0,
        srq_limit: 3,
    };
    assert_eq!(
        unsafe { ibv_modify_srq(srq, &mut a, ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as c_int) },
        0
    );
    (srq, cq, r, s, buf)
}

/// Two unsignaled SENDs from `s`, received (through the SRQ) and polled on `cq`.
fn two_messages(s: *mut ibv_qp, cq: *mut ibv_cq, buf: &Buffer) {
    let mut sge = [buf.sge(300, 8)];
    for i in 0..2 {
        assert_eq!(
            post_one_send(s, &mut send_wr(i, &mut sge, ibv_wr_opcode::IBV_WR_SEND, 0)),
            0
        );
    }
    poll_n(cq, 2);
}

#[test]
fn srq_limit_event_fires_once_when_armed() {
    let dev = Device::open();
    let (srq, cq, _r, s, buf) = limit_armed(&dev);
    let mut q = ibv_srq_attr::default();
    assert_eq!(unsafe { ibv_query_srq(srq, &mut q) }, 0);
    assert_eq!((q.max_wr, q.srq_limit), (16, 3));
    let mut too_big = ibv_srq_attr {
        max_wr: 0,
        max_sge: 0,
        srq_limit: 100,
    };
    assert_eq!(
        unsafe {
            ibv_modify_srq(
                srq,
                &mut too_big,
                ibv_srq_attr_mask::IBV_SRQ_LIMIT.0 as c_int,
            )
        },
        libc::EINVAL
    );
    two_messages(s, cq, &buf);
    let mut ev = ibv_async_event::default();
    assert_eq!(unsafe { ibv_get_async_event(dev.ctx, &mut ev) }, 0);
    assert_eq!(ev.event_type, ibv_event_type::IBV_EVENT_SRQ_LIMIT_REACHED);
    assert_eq!(unsafe { ev.element.srq }, srq);
    unsafe { ibv_ack_async_event(&mut ev) };
    // Disarmed: a further drop raises nothing (the async fd stays empty).
    let fd = unsafe { (*dev.ctx).async_fd };
    unsafe {
        libc::fcntl(
            fd,
            libc::F_SETFL,
            libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
        )
    };
    assert_eq!(unsafe { ibv_get_async_event(dev.ctx, &mut ev) }, -1);
    assert_eq!(errno(), libc::EAGAIN);
}

fn last_wqe_event(ctx: *mut ibv_context, qp: *mut ibv_qp) {
    let mut ev = ibv_async_event::default();
    assert_eq!(unsafe { ibv_get_async_event(ctx, &mut ev) }, 0);
    assert_eq!(ev.event_type, ibv_event_type::IBV_EVENT_QP_LAST_WQE_REACHED);
    assert_eq!(unsafe { ev.element.qp }, qp);
    unsafe { ibv_ack_async_event(&mut ev) };
}

/// SPDK's teardown: the peer's disconnect moves the QP to ERR, then its own rdma_disconnect
/// moves it to ERR again. The kernel raises LAST_WQE_REACHED once (on the transition); a
/// second one, read after the QP was freed, was SPDK's use-after-free.
#[test]
fn a_qp_on_an_srq_raises_last_wqe_reached_once_per_entry_into_err() {
    let dev = Device::open();
    let srq = create_srq(&dev, 4);
    let cq = dev.cq(16);
    let r = srq_qp(&dev, cq, srq);
    connect(r, dev.lid, 0x123);
    to_error(r);
    last_wqe_event(dev.ctx, r);
    to_error(r);
    assert_no_async_event(dev.ctx);
    // After RESET the QP may be used again, and entering ERR again is a new cause.
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_RESET,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(r, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) },
        0
    );
    connect(r, dev.lid, 0x123);
    to_error(r);
    last_wqe_event(dev.ctx, r);
    assert_no_async_event(dev.ctx);
    unsafe {
        assert_eq!(ibv_destroy_qp(r), 0);
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
    }
}

#[test]
fn destroying_a_qp_or_srq_drops_its_unread_events() {
    let dev = Device::open();
    let (srq, cq, r, s, buf) = limit_armed(&dev);
    two_messages(s, cq, &buf); // SRQ_LIMIT_REACHED is queued now
    to_error(r); // and LAST_WQE_REACHED
    unsafe {
        assert_eq!(ibv_destroy_qp(r), 0);
        assert_eq!(ibv_destroy_qp(s), 0);
        assert_eq!(ibv_destroy_srq(srq), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
    }
    assert_no_async_event(dev.ctx);
}
