//! The exported ABI called as C calls it, with every work-completion field and the bytes
//! checked. Two RC QPs of one process talk to each other through the real engine (UCX).

mod fixture;

use fixture::*;
use std::os::raw::c_int;
use std::ptr::null_mut;
use std::time::Duration;

const SEND: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_SEND;
const SEND_IMM: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_SEND_WITH_IMM;
const SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
const INLINE: u32 = ibv_send_flags::IBV_SEND_INLINE.0;

#[test]
fn rc_send_recv_completes_with_every_field() {
    let lb = Loopback::rc(16);
    let mut src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let mut dst = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    src.data[..5].copy_from_slice(b"hello");
    dst.data.fill(0xee);
    assert_eq!(post_one_recv(lb.b, 7, &mut [dst.sge(0, 64)]), 0);
    let mut sge = [src.sge(0, 5)];
    assert_eq!(
        post_one_send(lb.a, &mut send_wr(9, &mut sge, SEND, SIGNALED)),
        0
    );

    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!(wc.wr_id, 7);
    assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(wc.opcode, ibv_wc_opcode::IBV_WC_RECV);
    assert_eq!(wc.byte_len, 5);
    assert_eq!(wc.qp_num, qp_num(lb.b));
    assert_eq!(wc.src_qp, qp_num(lb.a));
    assert_eq!(wc.wc_flags, 0, "no immediate, no GRH on RC");
    assert_eq!(wc.slid, lb.dev.lid);
    assert_eq!(
        (wc.sl, wc.dlid_path_bits, wc.pkey_index, wc.vendor_err),
        (0, 0, 0, 0)
    );
    assert_eq!(&dst.data[..5], b"hello");
    assert!(
        dst.data[5..].iter().all(|b| *b == 0xee),
        "bytes past the message are untouched"
    );

    let wc = poll_n(lb.cq_a, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (9, ibv_wc_status::IBV_WC_SUCCESS, ibv_wc_opcode::IBV_WC_SEND)
    );
    assert_eq!(wc.qp_num, qp_num(lb.a));
    assert_eq!(wc.byte_len, 5);
}

#[test]
fn send_with_imm_carries_imm_in_network_order() {
    let lb = Loopback::rc(16);
    let src = Buffer::new(&lb.dev, 16, LOCAL_WRITE);
    let dst = Buffer::new(&lb.dev, 16, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 1, &mut [dst.sge(0, 16)]), 0);
    let mut sge = [src.sge(0, 8)];
    let mut wr = send_wr(2, &mut sge, SEND_IMM, SIGNALED);
    wr.__bindgen_anon_1.imm_data = 0x1234_5678u32.to_be();
    assert_eq!(post_one_send(lb.a, &mut wr), 0);
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(wc.opcode, ibv_wc_opcode::IBV_WC_RECV);
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_WITH_IMM.0);
    assert_eq!(u32::from_be(imm(&wc)), 0x1234_5678);
    assert_eq!(wc.byte_len, 8);
    assert_eq!(poll_n(lb.cq_a, 1)[0].opcode, ibv_wc_opcode::IBV_WC_SEND);
}

#[test]
fn zero_length_send_completes_with_byte_len_zero() {
    let lb = Loopback::rc(4);
    let dst = Buffer::new(&lb.dev, 16, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 1, &mut [dst.sge(0, 16)]), 0);
    assert_eq!(
        post_one_send(lb.a, &mut send_wr(2, &mut [], SEND, SIGNALED)),
        0
    );
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!((wc.status, wc.byte_len), (ibv_wc_status::IBV_WC_SUCCESS, 0));
    assert_eq!(poll_n(lb.cq_a, 1)[0].status, ibv_wc_status::IBV_WC_SUCCESS);
}

#[test]
fn gather_and_scatter_with_different_sge_boundaries() {
    let lb = Loopback::rc(16);
    for &len in &[1usize, 7, 4096, 65_536, 1 << 20] {
        let mut src = Buffer::new(&lb.dev, len + 64, LOCAL_WRITE);
        for (i, b) in src.data.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        let dst = Buffer::new(&lb.dev, len + 64, LOCAL_WRITE);
        // sender: 3 SGEs (first, middle, last third); receiver: 2 SGEs split elsewhere.
        let (s1, s2) = (len / 3, len / 3 + len / 5);
        let mut send_sges = [
            src.sge(0, s1 as u32),
            src.sge(s1, (s2 - s1) as u32),
            src.sge(s2, (len - s2) as u32),
        ];
        let r1 = len / 2 + 1;
        let mut recv_sges = [
            dst.sge(0, r1.min(len) as u32),
            dst.sge(r1.min(len), (len + 64 - r1.min(len)) as u32),
        ];
        assert_eq!(post_one_recv(lb.b, len as u64, &mut recv_sges), 0);
        assert_eq!(
            post_one_send(
                lb.a,
                &mut send_wr(len as u64, &mut send_sges, SEND, SIGNALED)
            ),
            0
        );
        let wc = poll_n(lb.cq_b, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len),
            (len as u64, ibv_wc_status::IBV_WC_SUCCESS, len as u32),
            "len {len}"
        );
        assert_eq!(&dst.data[..len], &src.data[..len], "len {len}");
        let wc = poll_n(lb.cq_a, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status),
            (len as u64, ibv_wc_status::IBV_WC_SUCCESS)
        );
    }
}

#[test]
fn inline_send_needs_no_lkey_and_buffer_is_reusable_at_once() {
    let lb = Loopback::rc(16);
    let dst = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 1, &mut [dst.sge(0, 64)]), 0);
    let mut local = *b"inline!!";
    let mut sge = [ibv_sge {
        addr: local.as_mut_ptr() as u64,
        length: 8,
        lkey: 0,
    }];
    assert_eq!(
        post_one_send(lb.a, &mut send_wr(5, &mut sge, SEND, SIGNALED | INLINE)),
        0
    );
    local.copy_from_slice(b"XXXXXXXX"); // allowed right after post_send returns
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!((wc.status, wc.byte_len), (ibv_wc_status::IBV_WC_SUCCESS, 8));
    assert_eq!(&dst.data[..8], b"inline!!");
    assert_eq!(poll_n(lb.cq_a, 1)[0].wr_id, 5);
}

#[test]
fn inline_above_max_inline_data_is_refused_with_bad_wr() {
    let lb = Loopback::rc(16);
    let mut big = vec![0u8; 4096];
    let mut sge = [ibv_sge {
        addr: big.as_mut_ptr() as u64,
        length: 4096,
        lkey: 0,
    }];
    let mut wr = send_wr(1, &mut sge, SEND, SIGNALED | INLINE);
    let mut bad = null_mut();
    assert_eq!(unsafe { post_send(lb.a, &mut wr, &mut bad) }, libc::EINVAL);
    assert_eq!(bad, &mut wr as *mut _);
}

#[test]
fn send_completions_come_in_post_order_and_unsignaled_ones_stay_silent() {
    let lb = Loopback::rc(64);
    let src = Buffer::new(&lb.dev, 64 * 1024, LOCAL_WRITE);
    let dst = Buffer::new(&lb.dev, 64 * 64 * 1024, LOCAL_WRITE);
    for i in 0..32u64 {
        assert_eq!(
            post_one_recv(lb.b, 100 + i, &mut [dst.sge(i as usize * 65536, 65536)]),
            0
        );
    }
    // Mix rendezvous-sized and small messages so UCX completes them out of order internally.
    for i in 0..32u64 {
        let len = if i % 3 == 0 { 60_000 } else { 16 };
        let flags = if i % 2 == 0 { SIGNALED } else { 0 };
        let mut sge = [src.sge(0, len)];
        assert_eq!(
            post_one_send(lb.a, &mut send_wr(i, &mut sge, SEND, flags)),
            0
        );
    }
    let recvs = poll_n(lb.cq_b, 32);
    assert_eq!(
        recvs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (100..132).collect::<Vec<_>>(),
        "receives in order"
    );
    let sends = poll_n(lb.cq_a, 16);
    assert_eq!(
        sends.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..32).step_by(2).collect::<Vec<_>>()
    );
    assert!(
        sends
            .iter()
            .all(|w| w.status == ibv_wc_status::IBV_WC_SUCCESS)
    );
    assert_no_completion(lb.cq_a, Duration::from_millis(100));
}

#[test]
fn receive_buffer_too_small_fails_both_sides_and_flushes() {
    let lb = Loopback::rc(16);
    let src = Buffer::new(&lb.dev, 128, LOCAL_WRITE);
    let dst = Buffer::new(&lb.dev, 128, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 1, &mut [dst.sge(0, 8)]), 0);
    assert_eq!(post_one_recv(lb.b, 2, &mut [dst.sge(8, 64)]), 0);
    let mut sge = [src.sge(0, 16)];
    assert_eq!(
        post_one_send(lb.a, &mut send_wr(10, &mut sge, SEND, SIGNALED)),
        0
    );
    let mut sge2 = [src.sge(0, 4)];
    assert_eq!(post_one_send(lb.a, &mut send_wr(11, &mut sge2, SEND, 0)), 0);

    let rb = poll_n(lb.cq_b, 2);
    assert_eq!(
        (rb[0].wr_id, rb[0].status),
        (1, ibv_wc_status::IBV_WC_LOC_LEN_ERR)
    );
    assert_eq!(rb[0].qp_num, qp_num(lb.b));
    assert_eq!(
        (rb[1].wr_id, rb[1].status),
        (2, ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
    );
    let sa = poll_n(lb.cq_a, 2);
    assert_eq!(
        (sa[0].wr_id, sa[0].status),
        (10, ibv_wc_status::IBV_WC_REM_INV_REQ_ERR)
    );
    assert_eq!(
        (sa[1].wr_id, sa[1].status),
        (11, ibv_wc_status::IBV_WC_WR_FLUSH_ERR),
        "unsignaled WRs are flushed with a completion"
    );
    assert_eq!(qp_state(lb.a), ibv_qp_state::IBV_QPS_ERR.0);
    assert_eq!(qp_state(lb.b), ibv_qp_state::IBV_QPS_ERR.0);
    assert_eq!(&dst.data[..8], &[0u8; 8], "nothing was written");
}

#[test]
fn bad_lkey_and_out_of_range_sge_complete_with_loc_prot_err() {
    for case in 0..3 {
        let lb = Loopback::rc(8);
        let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
        let mut sge = match case {
            0 => [ibv_sge {
                addr: src.addr(),
                length: 8,
                lkey: src.lkey() ^ 0x5a5a_0000,
            }],
            1 => [src.sge(60, 8)], // runs past the end of the MR
            _ => [ibv_sge {
                addr: u64::MAX - 2,
                length: 8,
                lkey: src.lkey(),
            }], // addr + len overflows
        };
        assert_eq!(
            post_one_send(lb.a, &mut send_wr(3, &mut sge, SEND, SIGNALED)),
            0,
            "case {case}: an execution error, not a post error"
        );
        let wc = poll_n(lb.cq_a, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status),
            (3, ibv_wc_status::IBV_WC_LOC_PROT_ERR),
            "case {case}"
        );
        assert_eq!(qp_state(lb.a), ibv_qp_state::IBV_QPS_ERR.0);
    }
}

#[test]
fn receive_into_mr_without_local_write_is_a_protection_error() {
    let lb = Loopback::rc(8);
    let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let ro = Buffer::new(&lb.dev, 64, 0);
    assert_eq!(post_one_recv(lb.b, 1, &mut [ro.sge(0, 64)]), 0);
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(lb.a, &mut send_wr(2, &mut sge, SEND, SIGNALED)),
        0
    );
    assert_eq!(
        poll_n(lb.cq_b, 1)[0].status,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR
    );
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_REM_OP_ERR
    );
}

#[test]
fn full_send_queue_is_enomem_with_bad_wr_at_first_failing_wr() {
    let lb = Loopback::rc(4);
    let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    // No receives posted at the peer: nothing completes, so the 5th WR finds the SQ full.
    let mut sges: Vec<[ibv_sge; 1]> = (0..6).map(|_| [src.sge(0, 8)]).collect();
    let mut wrs: Vec<ibv_send_wr> = sges
        .iter_mut()
        .enumerate()
        .map(|(i, s)| send_wr(i as u64, s, SEND, SIGNALED))
        .collect();
    for i in 0..5 {
        wrs[i].next = &mut wrs[i + 1] as *mut _;
    }
    let mut bad = null_mut();
    assert_eq!(
        unsafe { post_send(lb.a, wrs.as_mut_ptr(), &mut bad) },
        libc::ENOMEM
    );
    assert_eq!(
        bad, &mut wrs[4] as *mut _,
        "bad_wr is the first WR that did not fit"
    );
}

#[test]
fn full_receive_queue_is_enomem() {
    let lb = Loopback::rc(2);
    let dst = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    assert_eq!(post_one_recv(lb.b, 1, &mut [dst.sge(0, 8)]), 0);
    assert_eq!(post_one_recv(lb.b, 2, &mut [dst.sge(0, 8)]), 0);
    assert_eq!(post_one_recv(lb.b, 3, &mut [dst.sge(0, 8)]), libc::ENOMEM);
}

#[test]
fn posting_in_the_wrong_state_is_einval() {
    let dev = Device::open();
    let cq = dev.cq(8);
    let qp = dev.rc_qp(cq, cq, 4);
    let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
    let mut sge = [buf.sge(0, 8)];
    assert_eq!(
        post_one_send(qp, &mut send_wr(1, &mut sge, SEND, SIGNALED)),
        libc::EINVAL,
        "send in RESET"
    );
    assert_eq!(
        post_one_recv(qp, 1, &mut [buf.sge(0, 8)]),
        libc::EINVAL,
        "recv in RESET"
    );
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_INIT,
        port_num: 1,
        ..Default::default()
    };
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
        | ibv_qp_attr_mask::IBV_QP_PORT.0
        | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, m as c_int) }, 0);
    assert_eq!(
        post_one_send(qp, &mut send_wr(1, &mut sge, SEND, SIGNALED)),
        libc::EINVAL,
        "send in INIT"
    );
    assert_eq!(
        post_one_recv(qp, 1, &mut [buf.sge(0, 8)]),
        0,
        "recv in INIT is allowed"
    );
    unsafe {
        ibv_destroy_qp(qp);
        ibv_destroy_cq(cq);
    }
}

#[test]
fn invalid_transition_or_mask_changes_nothing() {
    let dev = Device::open();
    let cq = dev.cq(8);
    let qp = dev.rc_qp(cq, cq, 4);
    // RESET -> RTR is not a transition.
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_RTR,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) },
        libc::EINVAL
    );
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_RESET.0);
    // RESET -> INIT without the required PORT.
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_INIT,
        port_num: 1,
        qp_access_flags: 6,
        ..Default::default()
    };
    let m = ibv_qp_attr_mask::IBV_QP_STATE.0
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
        | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0;
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, m as c_int) },
        libc::EINVAL
    );
    // ... or with an attribute this transition does not take (SQ_PSN).
    let m2 = m | ibv_qp_attr_mask::IBV_QP_PORT.0 | ibv_qp_attr_mask::IBV_QP_SQ_PSN.0;
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, m2 as c_int) },
        libc::EINVAL
    );
    // ... or a bad port number.
    let mut bad_port = ibv_qp_attr { port_num: 7, ..a };
    assert_eq!(
        unsafe {
            ibv_modify_qp(
                qp,
                &mut bad_port,
                (m | ibv_qp_attr_mask::IBV_QP_PORT.0) as c_int,
            )
        },
        libc::EINVAL
    );
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_RESET.0);
    let mut qa = ibv_qp_attr::default();
    let mut qi = ibv_qp_init_attr::default();
    assert_eq!(unsafe { ibv_query_qp(qp, &mut qa, 0, &mut qi) }, 0);
    assert_eq!(qa.qp_state, ibv_qp_state::IBV_QPS_RESET);
    assert_eq!(qa.qp_access_flags, 0, "a refused modify sets no attribute");
    // The valid one goes through, and query reports what was set.
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, (m | ibv_qp_attr_mask::IBV_QP_PORT.0) as c_int) },
        0
    );
    assert_eq!(unsafe { ibv_query_qp(qp, &mut qa, 0, &mut qi) }, 0);
    assert_eq!(
        (qa.qp_state, qa.qp_access_flags, qa.port_num),
        (ibv_qp_state::IBV_QPS_INIT, 6, 1)
    );
    assert_eq!(qi.qp_type, ibv_qp_type::IBV_QPT_RC);
    assert_eq!(qi.send_cq, cq);
    // An unknown state value from the application is refused, not trusted.
    let mut junk = ibv_qp_attr {
        qp_state: ibv_qp_state(77),
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut junk, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) },
        libc::EINVAL
    );
    unsafe {
        ibv_destroy_qp(qp);
        ibv_destroy_cq(cq);
    }
}

#[test]
fn moving_to_err_flushes_every_outstanding_wr_in_order() {
    let lb = Loopback::rc(16);
    let dst = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    for i in 0..5 {
        assert_eq!(post_one_recv(lb.b, i, &mut [dst.sge(0, 8)]), 0);
    }
    to_error(lb.b);
    let wcs = poll_n(lb.cq_b, 5);
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![0, 1, 2, 3, 4]
    );
    assert!(
        wcs.iter()
            .all(|w| w.status == ibv_wc_status::IBV_WC_WR_FLUSH_ERR && w.qp_num == qp_num(lb.b))
    );
    // Posting in ERR completes at once with a flush error.
    assert_eq!(post_one_recv(lb.b, 9, &mut [dst.sge(0, 8)]), 0);
    assert_eq!(
        poll_n(lb.cq_b, 1)[0].status,
        ibv_wc_status::IBV_WC_WR_FLUSH_ERR
    );
    // ERR -> RESET -> INIT works again.
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_RESET,
        ..Default::default()
    };
    assert_eq!(
        unsafe { ibv_modify_qp(lb.b, &mut a, ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int) },
        0
    );
    assert_eq!(qp_state(lb.b), ibv_qp_state::IBV_QPS_RESET.0);
}

/// `qp_access_flags` takes any flag of `enum ibv_access_flags` (the kernel passes them through
/// and rxe and mlx5 use only the remote ones; rdma-core's ODP tests give a QP the MR's flags,
/// ON_DEMAND included); a bit the enum does not define is EINVAL and changes nothing.
#[test]
fn qp_access_flags_take_every_defined_access_flag() {
    let dev = Device::open();
    let cq = dev.cq(16);
    let qp = dev.rc_qp(cq, cq, 4);
    let m = (ibv_qp_attr_mask::IBV_QP_STATE.0
        | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX.0
        | ibv_qp_attr_mask::IBV_QP_PORT.0
        | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS.0) as c_int;
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_INIT,
        port_num: 1,
        qp_access_flags: 1 << 15,
        ..Default::default()
    };
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, m) }, libc::EINVAL);
    assert_eq!(qp_state(qp), ibv_qp_state::IBV_QPS_RESET.0);
    let odp: u32 = 64 | 16; // IBV_ACCESS_ON_DEMAND | IBV_ACCESS_MW_BIND
    a.qp_access_flags = REMOTE_ALL | odp;
    assert_eq!(unsafe { ibv_modify_qp(qp, &mut a, m) }, 0);
    let mut qa = ibv_qp_attr::default();
    let mut qi = ibv_qp_init_attr::default();
    assert_eq!(unsafe { ibv_query_qp(qp, &mut qa, 0, &mut qi) }, 0);
    assert_eq!(
        (qa.qp_state, qa.qp_access_flags),
        (ibv_qp_state::IBV_QPS_INIT, REMOTE_ALL | odp)
    );
    unsafe {
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
    }
}

/// A QP moved to RESET takes its completions the application has not polled off its CQs (as
/// mlx4, mlx5, hns and bnxt_re clean their CQs; rdma-core's tests restart QPs after an error
/// and expect their CQs clean); other QPs' completions on the same CQ stay, in order. Then the
/// QP works again: a SEND from its reconnected peer completes on the same CQ.
#[test]
fn reset_discards_the_qps_unpolled_completions_and_no_others() {
    let dev = Device::open();
    let cq = dev.cq(64);
    let x = dev.rc_qp(cq, cq, 16);
    let y = dev.rc_qp(cq, cq, 16);
    connect(x, dev.lid, qp_num(y));
    connect(y, dev.lid, qp_num(x));
    let dst = Buffer::new(&dev, 64, LOCAL_WRITE);
    let src = Buffer::new(&dev, 64, LOCAL_WRITE);
    for i in 0..3 {
        assert_eq!(post_one_recv(x, 10 + i, &mut [dst.sge(0, 8)]), 0);
    }
    for i in 0..2 {
        assert_eq!(post_one_recv(y, 20 + i, &mut [dst.sge(8, 8)]), 0);
    }
    to_error(x);
    to_error(y);
    let mut a = ibv_qp_attr {
        qp_state: ibv_qp_state::IBV_QPS_RESET,
        ..Default::default()
    };
    let state = ibv_qp_attr_mask::IBV_QP_STATE.0 as c_int;
    assert_eq!(unsafe { ibv_modify_qp(x, &mut a, state) }, 0);
    let wcs = poll_n(cq, 2);
    assert_eq!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status, w.opcode, w.qp_num))
            .collect::<Vec<_>>(),
        vec![
            (
                20,
                ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                ibv_wc_opcode::IBV_WC_RECV,
                qp_num(y)
            ),
            (
                21,
                ibv_wc_status::IBV_WC_WR_FLUSH_ERR,
                ibv_wc_opcode::IBV_WC_RECV,
                qp_num(y)
            ),
        ],
        "only y's flushes are left"
    );
    assert_no_completion(cq, Duration::from_millis(20));
    // Both back to RTS: traffic completes on the same CQ, nothing of the old life shows up.
    assert_eq!(unsafe { ibv_modify_qp(y, &mut a, state) }, 0);
    connect(x, dev.lid, qp_num(y));
    connect(y, dev.lid, qp_num(x));
    assert_eq!(post_one_recv(x, 30, &mut [dst.sge(0, 8)]), 0);
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(y, &mut send_wr(31, &mut sge, SEND, SIGNALED)),
        0
    );
    let mut wcs = poll_n(cq, 2);
    wcs.sort_by_key(|w| w.wr_id);
    assert_eq!(
        wcs.iter()
            .map(|w| (w.wr_id, w.status, w.opcode, w.qp_num, w.byte_len))
            .collect::<Vec<_>>(),
        vec![
            (
                30,
                ibv_wc_status::IBV_WC_SUCCESS,
                ibv_wc_opcode::IBV_WC_RECV,
                qp_num(x),
                8
            ),
            (
                31,
                ibv_wc_status::IBV_WC_SUCCESS,
                ibv_wc_opcode::IBV_WC_SEND,
                qp_num(y),
                8
            ),
        ]
    );
    assert_no_completion(cq, Duration::from_millis(20));
    unsafe {
        assert_eq!(ibv_destroy_qp(x), 0);
        assert_eq!(ibv_destroy_qp(y), 0);
    }
    drop((dst, src));
    unsafe {
        assert_eq!(ibv_destroy_cq(cq), 0);
    }
}

#[test]
fn messages_wait_for_a_receive_and_arrive_in_order() {
    let lb = Loopback::rc(64);
    let src = Buffer::new(&lb.dev, 64 * 8, LOCAL_WRITE);
    let dst = Buffer::new(&lb.dev, 64 * 8, LOCAL_WRITE);
    let mut s = src;
    for i in 0..8 {
        s.data[i * 64] = i as u8 + 1;
    }
    for i in 0..8u64 {
        let mut sge = [s.sge(i as usize * 64, 64)];
        assert_eq!(
            post_one_send(lb.a, &mut send_wr(i, &mut sge, SEND, SIGNALED)),
            0
        );
    }
    assert_no_completion(lb.cq_b, Duration::from_millis(50));
    for i in 0..8u64 {
        assert_eq!(
            post_one_recv(lb.b, i, &mut [dst.sge(i as usize * 64, 64)]),
            0
        );
    }
    let wcs = poll_n(lb.cq_b, 8);
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    for i in 0..8 {
        assert_eq!(
            dst.data[i * 64],
            i as u8 + 1,
            "message {i} landed in receive {i}"
        );
    }
    assert_eq!(poll_n(lb.cq_a, 8).len(), 8);
}

#[test]
fn completion_channel_fires_without_polling_and_respects_arming() {
    let dev = Device::open();
    unsafe {
        let ch = ibv_create_comp_channel(dev.ctx);
        assert!(!ch.is_null());
        let cq_a = dev.cq(16);
        let cq_b = ibv_create_cq(dev.ctx, 16, 0x77 as *mut _, ch, 0);
        assert!(!cq_b.is_null());
        let a = dev.rc_qp(cq_a, cq_a, 8);
        let b = dev.rc_qp(cq_b, cq_b, 8);
        connect(a, dev.lid, qp_num(b));
        connect(b, dev.lid, qp_num(a));
        let src = Buffer::new(&dev, 64, LOCAL_WRITE);
        let dst = Buffer::new(&dev, 64, LOCAL_WRITE);
        assert_eq!(req_notify_cq(cq_b, 0), 0);
        assert_eq!(post_one_recv(b, 1, &mut [dst.sge(0, 8)]), 0);
        let mut sge = [src.sge(0, 8)];
        assert_eq!(
            post_one_send(a, &mut send_wr(2, &mut sge, SEND, SIGNALED)),
            0
        );
        // Block in ibv_get_cq_event: the progress thread must deliver without any poll.
        let mut ev_cq = null_mut();
        let mut ev_ctx = null_mut();
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), 0);
        assert_eq!((ev_cq, ev_ctx), (cq_b, 0x77 as *mut _));
        ibv_ack_cq_events(cq_b, 1);
        assert_eq!(poll_n(cq_b, 1)[0].wr_id, 1);
        // Not re-armed: the next completion raises no event.
        assert_eq!(post_one_recv(b, 3, &mut [dst.sge(0, 8)]), 0);
        assert_eq!(
            post_one_send(a, &mut send_wr(4, &mut sge, SEND, SIGNALED)),
            0
        );
        assert_eq!(poll_n(cq_b, 1)[0].wr_id, 3);
        let fd = (*ch).fd;
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), -1);
        assert_eq!(errno(), libc::EAGAIN);
        assert_eq!(poll_n(cq_a, 2).len(), 2);
        // Destroying a channel with CQs on it is refused.
        assert_eq!(ibv_destroy_comp_channel(ch), libc::EBUSY);
        ibv_destroy_qp(a);
        ibv_destroy_qp(b);
        ibv_destroy_cq(cq_a);
        ibv_destroy_cq(cq_b);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
    }
}

/// What `poll` says of `fd` right now, asked for reading and writing (0: nothing ready).
fn ready_now(fd: c_int) -> i16 {
    let mut pfd = libc::pollfd {
        fd,
        events: libc::POLLIN | libc::POLLOUT,
        revents: 0,
    };
    assert!(unsafe { libc::poll(&mut pfd, 1, 0) } >= 0);
    pfd.revents
}

/// Whether an epoll set that watches `fd` for EPOLLIN | EPOLLOUT (as SPDK's NVMe-oF target
/// watches a completion channel in interrupt mode) wakes up now.
fn epoll_wakes(fd: c_int) -> bool {
    unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        assert!(ep >= 0);
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLOUT) as u32,
            u64: 0,
        };
        assert_eq!(libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &mut ev), 0);
        let n = libc::epoll_wait(ep, &mut ev, 1, 0);
        libc::close(ep);
        n == 1
    }
}

#[test]
fn event_fds_are_readable_only_while_an_event_waits_and_never_writable() {
    // The kernel's completion-channel and async-event files poll readable while an event is
    // queued and are never writable: an event loop that also watches them for writing (SPDK's
    // target registers its completion channels for EPOLLIN | EPOLLOUT) must not spin.
    let dev = Device::open();
    unsafe {
        let ch = ibv_create_comp_channel(dev.ctx);
        assert!(!ch.is_null());
        let fd = (*ch).fd;
        let async_fd = (*dev.ctx).async_fd;
        assert_eq!(ready_now(fd), 0, "an empty completion channel");
        assert!(!epoll_wakes(fd), "an empty completion channel wakes epoll");
        assert_eq!(ready_now(async_fd), 0, "an empty async-event fd");
        assert!(
            !epoll_wakes(async_fd),
            "an empty async-event fd wakes epoll"
        );
        let cq = ibv_create_cq(dev.ctx, 16, null_mut(), ch, 0);
        assert!(!cq.is_null());
        let qp = dev.rc_qp(cq, cq, 8);
        connect(qp, dev.lid, qp_num(qp));
        let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
        assert_eq!(req_notify_cq(cq, 0), 0);
        assert_eq!(post_one_recv(qp, 1, &mut [buf.sge(32, 8)]), 0);
        let mut sge = [buf.sge(0, 8)];
        assert_eq!(
            post_one_send(qp, &mut send_wr(2, &mut sge, SEND, SIGNALED)),
            0
        );
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        assert_eq!(libc::poll(&mut pfd, 1, 10_000), 1, "no completion event");
        assert_eq!(ready_now(fd), libc::POLLIN, "a channel with an event");
        let (mut ev_cq, mut ev_ctx) = (null_mut(), null_mut());
        assert_eq!(ibv_get_cq_event(ch, &mut ev_cq, &mut ev_ctx), 0);
        assert_eq!(ev_cq, cq);
        ibv_ack_cq_events(cq, 1);
        assert_eq!(ready_now(fd), 0, "the event was taken");
        assert!(!epoll_wakes(fd));
        assert_eq!(poll_n(cq, 2).len(), 2);
        ibv_destroy_qp(qp);
        ibv_destroy_cq(cq);
        assert_eq!(ibv_destroy_comp_channel(ch), 0);
    }
}

#[test]
fn cq_overrun_raises_cq_err_async_event() {
    let dev = Device::open();
    unsafe {
        let (cq_a, cq_b, a, b) = connected_pair(&dev, 2, 64);
        let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
        signaled_sends(a, b, &buf, 4);
        poll_n(cq_b, 4);
        let mut ev = ibv_async_event::default();
        assert_eq!(ibv_get_async_event(dev.ctx, &mut ev), 0);
        assert_eq!(ev.event_type, ibv_event_type::IBV_EVENT_CQ_ERR);
        assert_eq!(ev.element.cq, cq_a);
        ibv_ack_async_event(&mut ev);
        ibv_destroy_qp(a);
        ibv_destroy_qp(b);
        ibv_destroy_cq(cq_a);
        ibv_destroy_cq(cq_b);
    }
}

#[test]
fn extended_send_path_posts_like_post_send() {
    let lb = Loopback::rc(16);
    let mut src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&lb.dev, 256, LOCAL_WRITE);
    src.data[..4].copy_from_slice(b"abcd");
    for i in 0..3 {
        assert_eq!(
            post_one_recv(lb.b, i, &mut [dst.sge(i as usize * 64, 64)]),
            0
        );
    }
    unsafe {
        let qpx = ibv_qp_to_qp_ex(lb.a);
        assert_eq!(qpx as *mut ibv_qp, lb.a);
        (*qpx).wr_start.unwrap()(qpx);
        (*qpx).wr_id = 21;
        (*qpx).wr_flags = SIGNALED;
        (*qpx).wr_send.unwrap()(qpx);
        (*qpx).wr_set_sge.unwrap()(qpx, src.lkey(), src.addr(), 4);
        (*qpx).wr_id = 22;
        (*qpx).wr_send_imm.unwrap()(qpx, 0xabcdu32.to_be());
        let list = [src.sge(0, 2), src.sge(2, 2)];
        (*qpx).wr_set_sge_list.unwrap()(qpx, 2, list.as_ptr());
        (*qpx).wr_id = 23;
        (*qpx).wr_send.unwrap()(qpx);
        let mut text = *b"xyz";
        (*qpx).wr_set_inline_data.unwrap()(qpx, text.as_mut_ptr().cast(), 3);
        assert_eq!((*qpx).wr_complete.unwrap()(qpx), 0);
        // An aborted batch posts nothing.
        (*qpx).wr_start.unwrap()(qpx);
        (*qpx).wr_send.unwrap()(qpx);
        (*qpx).wr_set_sge.unwrap()(qpx, src.lkey(), src.addr(), 4);
        (*qpx).wr_abort.unwrap()(qpx);
        // A builder for an opcode ugdr does not carry fails the batch.
        (*qpx).wr_start.unwrap()(qpx);
        (*qpx).wr_send_tso.unwrap()(qpx, std::ptr::null_mut(), 0, 0);
        assert_eq!((*qpx).wr_complete.unwrap()(qpx), libc::EINVAL);
    }
    let r = poll_n(lb.cq_b, 3);
    assert_eq!(&dst.data[..4], b"abcd");
    assert_eq!(&dst.data[64..68], b"abcd");
    assert_eq!(u32::from_be(imm(&r[1])), 0xabcd);
    assert_eq!(&dst.data[128..131], b"xyz");
    let s = poll_n(lb.cq_a, 3);
    assert_eq!(
        s.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![21, 22, 23]
    );
    assert_no_completion(lb.cq_b, Duration::from_millis(50));
}

#[test]
fn create_qp_ex_refuses_unsupported_requests() {
    let dev = Device::open();
    let cq = dev.cq(8);
    let mut attr = ibv_qp_init_attr_ex {
        send_cq: cq,
        recv_cq: cq,
        cap: ibv_qp_cap {
            max_send_wr: 4,
            max_recv_wr: 4,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ibv_qp_type::IBV_QPT_RC,
        comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0
            | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0,
        pd: dev.pd,
        send_ops_flags: ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0 as u64,
        ..Default::default()
    };
    let qp = unsafe { create_qp_ex(dev.ctx, &mut attr) };
    assert!(!qp.is_null());
    assert!(
        attr.cap.max_inline_data >= 64,
        "granted caps are written back"
    );
    let mut unknown = ibv_qp_init_attr_ex {
        comp_mask: attr.comp_mask | 1 << 30,
        ..attr
    };
    assert!(unsafe { create_qp_ex(dev.ctx, &mut unknown) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    // CREATE_FLAGS in the mask with no flag set is a plain request (pyverbs' random QPs send
    // it); a flag ugdr does not have (IBV_QP_CREATE_SCATTER_FCS = 2) is EOPNOTSUPP.
    let create_flags = ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_CREATE_FLAGS.0;
    let mut no_flags = ibv_qp_init_attr_ex {
        comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0 | create_flags,
        create_flags: 0,
        ..attr
    };
    let plain = unsafe { create_qp_ex(dev.ctx, &mut no_flags) };
    assert!(!plain.is_null(), "errno {}", errno());
    let mut a_flag = ibv_qp_init_attr_ex {
        create_flags: 2,
        ..no_flags
    };
    assert!(unsafe { create_qp_ex(dev.ctx, &mut a_flag) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP);
    // create_flags is read only when its bit is in comp_mask.
    let mut ignored = ibv_qp_init_attr_ex {
        comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0,
        create_flags: 2,
        ..no_flags
    };
    let qp2 = unsafe { create_qp_ex(dev.ctx, &mut ignored) };
    assert!(!qp2.is_null(), "errno {}", errno());
    unsafe {
        ibv_destroy_qp(qp);
        ibv_destroy_qp(plain);
        ibv_destroy_qp(qp2);
        ibv_destroy_cq(cq);
    }
}

#[test]
fn cq_ex_polling_reads_every_field() {
    let dev = Device::open();
    unsafe {
        let mut cattr = ibv_cq_init_attr_ex {
            cqe: 16,
            wc_flags: (ibv_create_cq_wc_flags::IBV_WC_EX_WITH_BYTE_LEN.0
                | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_IMM.0
                | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_QP_NUM.0
                | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SRC_QP.0
                | ibv_create_cq_wc_flags::IBV_WC_EX_WITH_SLID.0) as u64,
            ..Default::default()
        };
        let cqx = create_cq_ex(dev.ctx, &mut cattr);
        assert!(!cqx.is_null());
        let cq_b = cqx as *mut ibv_cq;
        let cq_a = dev.cq(16);
        let a = dev.rc_qp(cq_a, cq_a, 8);
        let b = dev.rc_qp(cq_b, cq_b, 8);
        connect(a, dev.lid, qp_num(b));
        connect(b, dev.lid, qp_num(a));
        let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
        let mut attr = ibv_poll_cq_attr::default();
        assert_eq!(
            (*cqx).start_poll.unwrap()(cqx, &mut attr),
            libc::ENOENT,
            "empty CQ"
        );
        assert_eq!(post_one_recv(b, 31, &mut [buf.sge(0, 32)]), 0);
        let mut sge = [buf.sge(32, 12)];
        let mut wr = send_wr(1, &mut sge, SEND_IMM, SIGNALED);
        wr.__bindgen_anon_1.imm_data = 0x0102_0304u32.to_be();
        assert_eq!(post_one_send(a, &mut wr), 0);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while (*cqx).start_poll.unwrap()(cqx, &mut attr) == libc::ENOENT {
            assert!(std::time::Instant::now() < deadline);
        }
        assert_eq!((*cqx).wr_id, 31);
        assert_eq!((*cqx).status, ibv_wc_status::IBV_WC_SUCCESS);
        assert_eq!((*cqx).read_opcode.unwrap()(cqx), ibv_wc_opcode::IBV_WC_RECV);
        assert_eq!((*cqx).read_byte_len.unwrap()(cqx), 12);
        assert_eq!(
            u32::from_be((*cqx).read_imm_data.unwrap()(cqx)),
            0x0102_0304
        );
        assert_eq!((*cqx).read_qp_num.unwrap()(cqx), qp_num(b));
        assert_eq!((*cqx).read_src_qp.unwrap()(cqx), qp_num(a));
        assert_eq!(
            (*cqx).read_wc_flags.unwrap()(cqx),
            ibv_wc_flags::IBV_WC_WITH_IMM.0
        );
        assert_eq!((*cqx).read_slid.unwrap()(cqx), u32::from(dev.lid));
        assert_eq!((*cqx).next_poll.unwrap()(cqx), libc::ENOENT);
        (*cqx).end_poll.unwrap()(cqx);
        // A flag ugdr does not produce is refused at creation.
        let mut tag = ibv_cq_init_attr_ex {
            cqe: 4,
            wc_flags: ibv_create_cq_wc_flags::IBV_WC_EX_WITH_FLOW_TAG.0 as u64,
            ..Default::default()
        };
        assert!(create_cq_ex(dev.ctx, &mut tag).is_null());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        poll_n(cq_a, 1);
        ibv_destroy_qp(a);
        ibv_destroy_qp(b);
        ibv_destroy_cq(cq_a);
        ibv_destroy_cq(cq_b);
    }
}

#[test]
fn device_port_gid_and_pkey_queries() {
    let dev = Device::open();
    unsafe {
        let mut da = ibv_device_attr::default();
        assert_eq!(ibv_query_device(dev.ctx, &mut da), 0);
        assert_eq!(da.phys_port_cnt, 1);
        assert!(da.max_qp_wr > 0 && da.max_sge > 0 && da.max_cqe > 0 && da.max_qp_rd_atom > 0);
        let mut pa = ibv_port_attr::default();
        assert_eq!(query_port_inline(dev.ctx, 1, &mut pa), 0);
        assert_eq!(pa.state, ibv_port_state::IBV_PORT_ACTIVE);
        assert_eq!(pa.link_layer, IBV_LINK_LAYER_INFINIBAND.0 as u8);
        assert_eq!(pa.active_mtu, ibv_mtu::IBV_MTU_4096);
        assert_ne!(pa.lid, 0);
        // The exported (compat) symbol writes only the 48-byte _compat_ibv_port_attr.
        let mut compat = [0xa5u8; 52];
        assert_eq!(ibv_query_port(dev.ctx, 1, compat.as_mut_ptr().cast()), 0);
        assert_eq!(&compat[48..], &[0xa5; 4]);
        assert_eq!(ibv_query_port(dev.ctx, 2, &mut pa), libc::EINVAL);
        let mut gid = ibv_gid::default();
        assert_eq!(ibv_query_gid(dev.ctx, 1, 0, &mut gid), 0);
        assert_ne!(
            u64::from_be_bytes(gid.raw[8..].try_into().unwrap()),
            0,
            "GID[0] interface id is non-zero"
        );
        assert_eq!(ibv_query_gid(dev.ctx, 1, 1, &mut gid), -1);
        let mut pkey = 0u16;
        assert_eq!(ibv_query_pkey(dev.ctx, 1, 0, &mut pkey), 0);
        assert_eq!(u16::from_be(pkey), 0xffff);
        assert_eq!(ibv_query_pkey(dev.ctx, 1, 1, &mut pkey), -1);
        // Every ops slot is filled and sz covers the whole verbs_context.
        let v = vctx(dev.ctx);
        assert_eq!((*v).sz, std::mem::size_of::<verbs_context>());
        assert!((*dev.ctx).async_fd >= 0);
        assert!((*dev.ctx).num_comp_vectors >= 1);
        assert_eq!((*v).alloc_null_mr.unwrap()(dev.pd), null_mut());
        assert_eq!(errno(), libc::EOPNOTSUPP);
        assert_eq!((*v).alloc_dm.unwrap()(dev.ctx, null_mut()), null_mut());
        assert_eq!(errno(), libc::EINVAL, "device memory is carried: NULL attr");
        assert_eq!(
            (*v).close_xrcd.unwrap()(null_mut()),
            libc::EINVAL,
            "XRC is carried: NULL xrcd"
        );
    }
}

#[test]
fn parents_with_children_are_busy() {
    let dev = Device::open();
    unsafe {
        let buf = Buffer::new(&dev, 64, LOCAL_WRITE);
        assert_eq!(ibv_dealloc_pd(dev.pd), libc::EBUSY, "PD with an MR");
        let cq = dev.cq(4);
        let qp = dev.rc_qp(cq, cq, 2);
        assert_eq!(ibv_destroy_cq(cq), libc::EBUSY, "CQ used by a QP");
        assert_eq!(ibv_destroy_qp(qp), 0);
        assert_eq!(ibv_destroy_cq(cq), 0);
        drop(buf);
        assert_eq!(ibv_dealloc_pd(dev.pd), 0);
    }
}

#[test]
fn null_and_invalid_arguments_get_rdma_core_errors() {
    unsafe {
        assert!(ibv_open_device(null_mut()).is_null());
        assert!(ibv_alloc_pd(null_mut()).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert_eq!(ibv_dealloc_pd(null_mut()), libc::EINVAL);
        assert!(ibv_reg_mr(null_mut(), null_mut(), 0, 0).is_null());
        assert_eq!(ibv_dereg_mr(null_mut()), libc::EINVAL);
        assert!(ibv_create_cq(null_mut(), 1, null_mut(), null_mut(), 0).is_null());
        assert_eq!(ibv_destroy_cq(null_mut()), libc::EINVAL);
        assert!(ibv_create_qp(null_mut(), null_mut()).is_null());
        assert_eq!(ibv_modify_qp(null_mut(), null_mut(), 0), libc::EINVAL);
        assert_eq!(
            ibv_query_qp(null_mut(), null_mut(), 0, null_mut()),
            libc::EINVAL
        );
        assert_eq!(ibv_destroy_qp(null_mut()), libc::EINVAL);
        assert_eq!(ibv_close_device(null_mut()), libc::EINVAL);
        assert!(ibv_create_comp_channel(null_mut()).is_null());
        assert_eq!(ibv_get_cq_event(null_mut(), null_mut(), null_mut()), -1);
        ibv_free_device_list(null_mut());
        ibv_ack_cq_events(null_mut(), 1);
        let mut n = -1;
        let list = ibv_get_device_list(&mut n);
        assert!(n >= 1);
        ibv_free_device_list(list);
        let list = ibv_get_device_list(null_mut());
        assert!(!list.is_null(), "num_devices may be NULL");
        ibv_free_device_list(list);

        let dev = Device::open();
        // Bad access flags: remote write without local write, unknown bits.
        let mut b = [0u8; 64];
        assert!(ibv_reg_mr(dev.pd, b.as_mut_ptr().cast(), 64, 2).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(ibv_reg_mr(dev.pd, b.as_mut_ptr().cast(), 64, 1 << 15).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // Optional-range bits (relaxed ordering) are accepted through reg_mr_iova2.
        let mr = ibv_reg_mr_iova2(
            dev.pd,
            b.as_mut_ptr().cast(),
            64,
            b.as_ptr() as u64,
            0x100001,
        );
        assert!(!mr.is_null());
        assert_ne!((*mr).lkey, 0);
        assert_eq!(ibv_dereg_mr(mr), 0);
        // CQ sizes and vectors.
        assert!(ibv_create_cq(dev.ctx, 0, null_mut(), null_mut(), 0).is_null());
        assert_eq!(errno(), libc::EINVAL);
        assert!(ibv_create_cq(dev.ctx, 4, null_mut(), null_mut(), 5).is_null());
        assert_eq!(errno(), libc::EINVAL);
        // QP types ugdr does not carry yet, and QPs without CQs.
        let cq = dev.cq(4);
        let mut attr = ibv_qp_init_attr {
            send_cq: cq,
            recv_cq: cq,
            cap: ibv_qp_cap {
                max_send_wr: 1,
                max_recv_wr: 1,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ibv_qp_type::IBV_QPT_RAW_PACKET,
            ..Default::default()
        };
        assert!(ibv_create_qp(dev.pd, &mut attr).is_null());
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.send_cq = null_mut();
        assert!(ibv_create_qp(dev.pd, &mut attr).is_null());
        assert_eq!(errno(), libc::EINVAL);
        attr.send_cq = cq;
        attr.cap.max_send_sge = 10_000;
        assert!(ibv_create_qp(dev.pd, &mut attr).is_null());
        assert_eq!(errno(), libc::EINVAL);
        ibv_destroy_cq(cq);
    }
}

#[test]
fn same_device_pointer_in_every_list_and_distinct_lids_per_process() {
    unsafe {
        let l1 = ibv_get_device_list(null_mut());
        let l2 = ibv_get_device_list(null_mut());
        assert_eq!(*l1, *l2);
        assert_ne!(ibv_get_device_guid(*l1), 0);
        ibv_free_device_list(l1);
        ibv_free_device_list(l2);
    }
}

#[test]
fn verbs_not_carried_yet_fail_cleanly_on_ugdr_objects_and_null_is_einval() {
    unsafe extern "C" {
        fn ibv_create_srq(pd: *mut ibv_pd, attr: *mut ibv_srq_init_attr) -> *mut ibv_srq;
        fn ibv_attach_mcast(qp: *mut ibv_qp, gid: *const ibv_gid, lid: u16) -> c_int;
    }
    let dev = Device::open();
    let cq = dev.cq(4);
    let qp = dev.rc_qp(cq, cq, 2);
    unsafe {
        let gid = ibv_gid::default();
        // Multicast is carried, for UD QPs only (tests/multicast.rs).
        assert_eq!(ibv_attach_mcast(qp, &gid, 0xc001), libc::EINVAL);
        let mut sattr = ibv_srq_init_attr {
            attr: ibv_srq_attr {
                max_wr: 4,
                max_sge: 1,
                srq_limit: 0,
            },
            ..Default::default()
        };
        assert!(ibv_create_srq(null_mut(), &mut sattr).is_null());
        assert_eq!(errno(), libc::EINVAL);
        ibv_destroy_qp(qp);
        ibv_destroy_cq(cq);
    }
}

/// ugdr's UCX lives in a link-map namespace of its own (dlmopen), with its InfiniBand and
/// rdmacm modules (UGDR_UCX_RDMA=auto) bound to the real libibverbs and librdmacm loaded there:
/// none of them is in the application's namespace, where ugdr's exports would interpose them.
#[test]
fn ucx_runs_in_its_own_namespace_with_its_infiniband_modules() {
    let _dev = Device::open(); // starts UCX
    let ucx = ugdr::ucp::Ucx::get().expect("UCX loaded");
    let ugdr::ucp::Namespace::Own(lmid) = ucx.namespace().clone() else {
        panic!(
            "UCX shares the application's namespace: {:?}",
            ucx.namespace()
        );
    };
    assert!(lmid > 0, "namespace {lmid}");
    let theirs = ucx.namespace_objects();
    for module in [
        "libucp.so",
        "libuct_ib.so",
        "libuct_rdmacm.so",
        "libibverbs.so",
        "librdmacm.so",
        "libc.so",
    ] {
        assert!(
            theirs.iter().any(|f| f.contains(module)),
            "{module} not in UCX's namespace: {theirs:?}"
        );
    }
    assert!(
        !theirs
            .iter()
            .any(|f| f.contains("libugdr") || f.contains("verbs_calls")),
        "ugdr is not in UCX's namespace: {theirs:?}"
    );
    let ours = objects_of_this_namespace();
    for module in ["libucp.so", "libuct_ib.so", "libuct_rdmacm.so"] {
        assert!(
            !ours.iter().any(|f| f.contains(module)),
            "{module} in the application's namespace: {ours:?}"
        );
    }
    assert_eq!(
        ucx.rdma_devices(),
        Some(Vec::new()),
        "no RDMA hardware here"
    );
}

/// The files of the objects loaded in this (the application's) namespace.
fn objects_of_this_namespace() -> Vec<String> {
    unsafe extern "C" fn collect(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        out: *mut libc::c_void,
    ) -> libc::c_int {
        // SAFETY: dl_iterate_phdr's info, and the Vec passed below.
        unsafe {
            let name = (*info).dlpi_name;
            if !name.is_null() {
                let out = &mut *(out as *mut Vec<String>);
                out.push(
                    std::ffi::CStr::from_ptr(name)
                        .to_string_lossy()
                        .into_owned(),
                );
            }
        }
        0
    }
    let mut out: Vec<String> = Vec::new();
    // SAFETY: the callback only reads the loader's entries and pushes into `out`.
    unsafe { libc::dl_iterate_phdr(Some(collect), (&raw mut out).cast()) };
    assert!(out.iter().any(|f| f.contains("libc.so")), "{out:?}");
    out
}
