//! UD and UC queue pairs through the exported ABI: address handles, Q_Keys, the GRH area,
//! the completion fields, oversize datagrams, drops without a receive, `ibv_wr_set_ud_addr`,
//! and what each type refuses at post time.

mod fixture;

use fixture::*;
use std::os::raw::c_int;
use std::ptr::null_mut;
use std::time::Duration;

unsafe extern "C" {
    fn ibv_create_ah(pd: *mut ibv_pd, attr: *mut ibv_ah_attr) -> *mut ibv_ah;
    fn ibv_destroy_ah(ah: *mut ibv_ah) -> c_int;
    fn ibv_init_ah_from_wc(
        ctx: *mut ibv_context,
        port: u8,
        wc: *mut ibv_wc,
        grh: *mut ibv_grh,
        attr: *mut ibv_ah_attr,
    ) -> c_int;
    fn ibv_create_ah_from_wc(
        pd: *mut ibv_pd,
        wc: *mut ibv_wc,
        grh: *mut ibv_grh,
        port: u8,
    ) -> *mut ibv_ah;
}

const QKEY: u32 = 0x1111_1111;
const GRH: usize = 40;
const SEND: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_SEND;
const SIGNALED: u32 = ibv_send_flags::IBV_SEND_SIGNALED.0;
const QUIET: Duration = Duration::from_millis(300);

fn port_gid(dev: &Device) -> [u8; 16] {
    let mut gid = ibv_gid::default();
    assert_eq!(unsafe { ibv_query_gid(dev.ctx, 1, 0, &mut gid) }, 0);
    unsafe { gid.raw }
}

fn qp_of_type(dev: &Device, cq: *mut ibv_cq, qp_type: ibv_qp_type) -> *mut ibv_qp {
    let mut attr = ibv_qp_init_attr {
        send_cq: cq,
        recv_cq: cq,
        cap: ibv_qp_cap {
            max_send_wr: 16,
            max_recv_wr: 16,
            max_send_sge: 2,
            max_recv_sge: 2,
            max_inline_data: 0,
        },
        qp_type,
        ..Default::default()
    };
    let qp = unsafe { ibv_create_qp(dev.pd, &mut attr) };
    assert!(!qp.is_null(), "ibv_create_qp failed: errno {}", errno());
    qp
}

fn modify(qp: *mut ibv_qp, mut a: ibv_qp_attr, mask: u32, what: &str) {
    assert_eq!(
        unsafe { ibv_modify_qp(qp, &mut a, mask as c_int) },
        0,
        "{what}"
    );
}

/// A UD QP in RTS with `qkey`.
fn ud_qp(dev: &Device, cq: *mut ibv_cq, qkey: u32) -> *mut ibv_qp {
    let qp = qp_of_type(dev, cq, ibv_qp_type::IBV_QPT_UD);
    ud_to_rts(qp, qkey);
    qp
}

/// RESET → INIT (with `qkey`) → RTR → RTS, as ibv_ud_pingpong does.
fn ud_to_rts(qp: *mut ibv_qp, qkey: u32) {
    use ibv_qp_attr_mask as m;
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: 1,
            qkey,
            ..Default::default()
        },
        m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_QKEY.0,
        "UD to INIT",
    );
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTR,
            ..Default::default()
        },
        m::IBV_QP_STATE.0,
        "UD to RTR",
    );
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTS,
            sq_psn: 0,
            ..Default::default()
        },
        m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0,
        "UD to RTS",
    );
}

/// RESET → INIT → RTR → RTS towards (`dlid`, `dqpn`), as ibv_uc_pingpong does.
fn uc_connect(qp: *mut ibv_qp, dlid: u16, dqpn: u32) {
    use ibv_qp_attr_mask as m;
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_INIT,
            port_num: 1,
            qp_access_flags: REMOTE_WRITE as u32,
            ..Default::default()
        },
        m::IBV_QP_STATE.0 | m::IBV_QP_PKEY_INDEX.0 | m::IBV_QP_PORT.0 | m::IBV_QP_ACCESS_FLAGS.0,
        "UC to INIT",
    );
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTR,
            path_mtu: ibv_mtu::IBV_MTU_1024,
            dest_qp_num: dqpn,
            ah_attr: ibv_ah_attr {
                dlid,
                port_num: 1,
                ..Default::default()
            },
            ..Default::default()
        },
        m::IBV_QP_STATE.0
            | m::IBV_QP_AV.0
            | m::IBV_QP_PATH_MTU.0
            | m::IBV_QP_DEST_QPN.0
            | m::IBV_QP_RQ_PSN.0,
        "UC to RTR",
    );
    modify(
        qp,
        ibv_qp_attr {
            qp_state: ibv_qp_state::IBV_QPS_RTS,
            ..Default::default()
        },
        m::IBV_QP_STATE.0 | m::IBV_QP_SQ_PSN.0,
        "UC to RTS",
    );
}

fn ah(dev: &Device, attr: ibv_ah_attr) -> *mut ibv_ah {
    let mut attr = attr;
    let ah = unsafe { ibv_create_ah(dev.pd, &mut attr) };
    assert!(!ah.is_null(), "ibv_create_ah failed: errno {}", errno());
    ah
}

fn lid_ah(dev: &Device, sl: u8) -> *mut ibv_ah {
    ah(
        dev,
        ibv_ah_attr {
            dlid: dev.lid,
            sl,
            port_num: 1,
            ..Default::default()
        },
    )
}

fn ud_wr(
    wr_id: u64,
    sges: &mut [ibv_sge],
    ah: *mut ibv_ah,
    qpn: u32,
    qkey: u32,
    opcode: ibv_wr_opcode,
) -> ibv_send_wr {
    let mut wr = send_wr(wr_id, sges, opcode, SIGNALED);
    wr.wr.ud.ah = ah;
    wr.wr.ud.remote_qpn = qpn;
    wr.wr.ud.remote_qkey = qkey;
    wr
}

/// Two UD QPs of one device, each with its own CQ.
struct UdPair {
    dev: Device,
    cq_a: *mut ibv_cq,
    cq_b: *mut ibv_cq,
    a: *mut ibv_qp,
    b: *mut ibv_qp,
}

impl UdPair {
    fn new(qkey_b: u32) -> UdPair {
        let dev = Device::open();
        let cq_a = dev.cq(64);
        let cq_b = dev.cq(64);
        let a = ud_qp(&dev, cq_a, QKEY);
        let b = ud_qp(&dev, cq_b, qkey_b);
        UdPair {
            dev,
            cq_a,
            cq_b,
            a,
            b,
        }
    }
}

fn assert_send_ok(cq: *mut ibv_cq, wr_id: u64, qp: *mut ibv_qp, byte_len: u32) {
    let wc = poll_n(cq, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (
            wr_id,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_SEND
        )
    );
    assert_eq!(wc.qp_num, qp_num(qp));
    assert_eq!(wc.byte_len, byte_len);
}

#[test]
fn ud_send_lands_after_the_grh_area_with_every_completion_field() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 3);
    let src = Buffer::new(&p.dev, 256, LOCAL_WRITE);
    let mut dst = Buffer::new(&p.dev, 256, LOCAL_WRITE);
    dst.data.fill(0xee);
    for (i, b) in unsafe { std::slice::from_raw_parts_mut(src.addr() as *mut u8, 100) }
        .iter_mut()
        .enumerate()
    {
        *b = i as u8;
    }
    assert_eq!(post_one_recv(p.b, 21, &mut [dst.sge(0, 256)]), 0);
    let mut sge = [src.sge(0, 100)];
    let mut wr = ud_wr(
        11,
        &mut sge,
        ah,
        qp_num(p.b),
        QKEY,
        ibv_wr_opcode::IBV_WR_SEND_WITH_IMM,
    );
    wr.__bindgen_anon_1.imm_data = 0x0102_0304u32.to_be();
    assert_eq!(post_one_send(p.a, &mut wr), 0);
    assert_send_ok(p.cq_a, 11, p.a, 100);

    let wc = poll_n(p.cq_b, 1)[0];
    assert_eq!(wc.wr_id, 21);
    assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(wc.opcode, ibv_wc_opcode::IBV_WC_RECV);
    assert_eq!(wc.byte_len, 100 + GRH as u32, "the GRH area counts");
    assert_eq!(wc.qp_num, qp_num(p.b));
    assert_eq!(wc.src_qp, qp_num(p.a));
    assert_eq!(wc.slid, p.dev.lid);
    assert_eq!(wc.sl, 3);
    assert_eq!(wc.pkey_index, 0);
    assert_eq!(wc.dlid_path_bits, 0);
    assert_eq!(wc.vendor_err, 0);
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_WITH_IMM.0, "no GRH flag");
    assert_eq!(u32::from_be(imm(&wc)), 0x0102_0304);
    assert!(
        dst.data[..GRH].iter().all(|b| *b == 0xee),
        "without a GRH the area is left alone"
    );
    assert_eq!(&dst.data[GRH..GRH + 100], &src.data[..100]);
    assert!(dst.data[GRH + 100..].iter().all(|b| *b == 0xee));
    assert_eq!(unsafe { ibv_destroy_ah(ah) }, 0);
}

#[test]
fn a_global_ah_writes_the_grh_and_a_reply_ah_comes_from_the_completion() {
    let p = UdPair::new(QKEY);
    let gid = port_gid(&p.dev);
    let ah = ah(
        &p.dev,
        ibv_ah_attr {
            dlid: p.dev.lid,
            is_global: 1,
            port_num: 1,
            grh: ibv_global_route {
                dgid: ibv_gid { raw: gid },
                flow_label: 0x54321,
                sgid_index: 0,
                hop_limit: 7,
                traffic_class: 0x2c,
            },
            ..Default::default()
        },
    );
    let src = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&p.dev, 128, LOCAL_WRITE);
    assert_eq!(post_one_recv(p.b, 1, &mut [dst.sge(0, 128)]), 0);
    let mut sge = [src.sge(0, 64)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(2, &mut sge, ah, qp_num(p.b), QKEY, SEND)),
        0
    );
    assert_send_ok(p.cq_a, 2, p.a, 64);
    let mut wc = poll_n(p.cq_b, 1)[0];
    assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_GRH.0);
    assert_eq!(wc.byte_len, 64 + GRH as u32);
    let g = &dst.data[..GRH];
    let vtf = u32::from_be_bytes(g[0..4].try_into().unwrap());
    assert_eq!(vtf >> 28, 6, "IP version 6");
    assert_eq!((vtf >> 20) & 0xff, 0x2c, "traffic class");
    assert_eq!(vtf & 0xf_ffff, 0x54321, "flow label");
    assert_eq!(
        u16::from_be_bytes([g[4], g[5]]),
        64 + 24,
        "paylen: BTH + DETH + payload + ICRC"
    );
    assert_eq!(g[6], 0x1b, "next header: BTH");
    assert_eq!(g[7], 7, "hop limit");
    assert_eq!(&g[8..24], &gid, "source GID: the sending port's");
    assert_eq!(&g[24..40], &gid, "destination GID: this port's");

    // The reply address, from the completion and the GRH.
    let grh = dst.addr() as *mut ibv_grh;
    let mut attr = ibv_ah_attr::default();
    assert_eq!(
        unsafe { ibv_init_ah_from_wc(p.dev.ctx, 1, &mut wc, grh, &mut attr) },
        0
    );
    assert_eq!(attr.dlid, p.dev.lid);
    assert_eq!(attr.is_global, 1);
    assert_eq!(unsafe { attr.grh.dgid.raw }, gid);
    assert_eq!(attr.grh.flow_label, 0x54321);
    assert_eq!(attr.grh.traffic_class, 0x2c);
    assert_eq!(attr.grh.sgid_index, 0);
    assert_eq!(attr.port_num, 1);
    assert_eq!(
        unsafe { ibv_init_ah_from_wc(p.dev.ctx, 2, &mut wc, grh, &mut attr) },
        libc::EINVAL,
        "port 2 does not exist"
    );
    let reply = unsafe { ibv_create_ah_from_wc(p.dev.pd, &mut wc, grh, 1) };
    assert!(!reply.is_null(), "errno {}", errno());
    let back = Buffer::new(&p.dev, 128, LOCAL_WRITE);
    assert_eq!(post_one_recv(p.a, 3, &mut [back.sge(0, 128)]), 0);
    let mut sge = [dst.sge(GRH, 8)];
    assert_eq!(
        post_one_send(p.b, &mut ud_wr(4, &mut sge, reply, wc.src_qp, QKEY, SEND)),
        0
    );
    assert_send_ok(p.cq_b, 4, p.b, 8);
    let wc = poll_n(p.cq_a, 1)[0];
    assert_eq!((wc.wr_id, wc.status), (3, ibv_wc_status::IBV_WC_SUCCESS));
    assert_eq!(wc.src_qp, qp_num(p.b));
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_GRH.0);
    assert_eq!(&back.data[GRH..GRH + 8], &src.data[..8]);
    unsafe {
        assert_eq!(ibv_destroy_ah(reply), 0);
        assert_eq!(ibv_destroy_ah(ah), 0);
    }
}

#[test]
fn a_q_key_mismatch_is_dropped_silently_and_the_high_bit_means_the_qps_own() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 0);
    let src = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&p.dev, 128, LOCAL_WRITE);
    assert_eq!(post_one_recv(p.b, 7, &mut [dst.sge(0, 128)]), 0);
    let mut sge = [src.sge(0, 16)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(1, &mut sge, ah, qp_num(p.b), 0x2222, SEND)),
        0
    );
    assert_send_ok(p.cq_a, 1, p.a, 16);
    assert_no_completion(p.cq_b, QUIET);
    // 0x8000_0000: the sender's own Q_Key (QKEY), which matches.
    assert_eq!(
        post_one_send(
            p.a,
            &mut ud_wr(2, &mut sge, ah, qp_num(p.b), 0x8000_0000, SEND)
        ),
        0
    );
    assert_send_ok(p.cq_a, 2, p.a, 16);
    let wc = poll_n(p.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (7, ibv_wc_status::IBV_WC_SUCCESS, 16 + GRH as u32),
        "the receive the mismatched datagram did not take"
    );
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn a_datagram_above_the_mtu_is_not_sent_and_is_no_error() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 0);
    let src = Buffer::new(&p.dev, 8192, LOCAL_WRITE);
    let dst = Buffer::new(&p.dev, 8192 + GRH, LOCAL_WRITE);
    assert_eq!(
        post_one_recv(p.b, 5, &mut [dst.sge(0, 8192 + GRH as u32)]),
        0
    );
    let mut big = [src.sge(0, 4097)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(1, &mut big, ah, qp_num(p.b), QKEY, SEND)),
        0
    );
    // C10-93.1.1 (and rxe): no packet, no error.
    assert_send_ok(p.cq_a, 1, p.a, 4097);
    assert_no_completion(p.cq_b, QUIET);
    let mut mtu = [src.sge(0, 4096)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(2, &mut mtu, ah, qp_num(p.b), QKEY, SEND)),
        0
    );
    assert_send_ok(p.cq_a, 2, p.a, 4096);
    let wc = poll_n(p.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (5, ibv_wc_status::IBV_WC_SUCCESS, 4096 + GRH as u32)
    );
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn a_datagram_without_a_posted_receive_is_lost() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 0);
    let src = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&p.dev, 128, LOCAL_WRITE);
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(1, &mut sge, ah, qp_num(p.b), QKEY, SEND)),
        0
    );
    assert_send_ok(p.cq_a, 1, p.a, 8);
    std::thread::sleep(QUIET);
    assert_eq!(post_one_recv(p.b, 9, &mut [dst.sge(0, 128)]), 0);
    assert_no_completion(p.cq_b, QUIET);
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn a_receive_without_room_for_the_grh_area_and_the_payload_is_a_length_error() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 0);
    let src = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    let small = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    // 50 bytes: room for the 16-byte payload, not for it and the GRH area.
    assert_eq!(post_one_recv(p.b, 3, &mut [small.sge(0, 50)]), 0);
    let mut sge = [src.sge(0, 16)];
    assert_eq!(
        post_one_send(p.a, &mut ud_wr(1, &mut sge, ah, qp_num(p.b), QKEY, SEND)),
        0
    );
    assert_send_ok(p.cq_a, 1, p.a, 16);
    let wc = poll_n(p.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (3, ibv_wc_status::IBV_WC_LOC_LEN_ERR, 0)
    );
    assert_eq!(wc.qp_num, qp_num(p.b));
    assert_eq!(qp_state(p.b), ibv_qp_state::IBV_QPS_ERR.0);
    unsafe { ibv_destroy_ah(ah) };
}

#[test]
fn ud_refuses_rdma_and_a_missing_or_foreign_address_handle_at_post() {
    let p = UdPair::new(QKEY);
    let ah = lid_ah(&p.dev, 0);
    let src = Buffer::new(&p.dev, 64, LOCAL_WRITE);
    let mut sge = [src.sge(0, 8)];
    let mut wr = ud_wr(
        1,
        &mut sge,
        ah,
        qp_num(p.b),
        QKEY,
        ibv_wr_opcode::IBV_WR_RDMA_WRITE,
    );
    let mut bad = null_mut();
    assert_eq!(unsafe { post_send(p.a, &mut wr, &mut bad) }, libc::EINVAL);
    assert_eq!(bad, &mut wr as *mut _);
    let mut wr = ud_wr(2, &mut sge, null_mut(), qp_num(p.b), QKEY, SEND);
    assert_eq!(post_one_send(p.a, &mut wr), libc::EINVAL);
    // An AH of another PD.
    let other = Device::open();
    let foreign = lid_ah(&other, 0);
    let mut wr = ud_wr(3, &mut sge, foreign, qp_num(p.b), QKEY, SEND);
    assert_eq!(post_one_send(p.a, &mut wr), libc::EINVAL);
    assert_no_completion(p.cq_a, Duration::from_millis(50));
    unsafe {
        ibv_destroy_ah(foreign);
        ibv_destroy_ah(ah);
    }
}

#[test]
fn ibv_create_ah_checks_the_pd_and_the_address() {
    let dev = Device::open();
    let cases = [
        (
            "port 2",
            ibv_ah_attr {
                dlid: dev.lid,
                port_num: 2,
                ..Default::default()
            },
        ),
        (
            "LID 0 without a GRH",
            ibv_ah_attr {
                dlid: 0,
                port_num: 1,
                ..Default::default()
            },
        ),
        (
            "sgid_index 1",
            ibv_ah_attr {
                is_global: 1,
                port_num: 1,
                grh: ibv_global_route {
                    sgid_index: 1,
                    ..Default::default()
                },
                ..Default::default()
            },
        ),
    ];
    for (what, mut attr) in cases {
        let ah = unsafe { ibv_create_ah(dev.pd, &mut attr) };
        assert!(ah.is_null(), "{what} must be refused");
        assert_eq!(errno(), libc::EINVAL, "{what}");
    }
    let mut attr = ibv_ah_attr {
        dlid: dev.lid,
        port_num: 1,
        ..Default::default()
    };
    assert!(unsafe { ibv_create_ah(dev.pd, null_mut()) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert!(unsafe { ibv_create_ah(null_mut(), &mut attr) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    // The PD cannot go while an AH uses it.
    let ah = lid_ah(&dev, 0);
    assert_eq!(unsafe { ibv_dealloc_pd(dev.pd) }, libc::EBUSY);
    assert_eq!(unsafe { (*ah).pd }, dev.pd);
    assert_eq!(unsafe { (*ah).context }, dev.ctx);
    assert_eq!(unsafe { ibv_destroy_ah(ah) }, 0);
}

#[test]
fn ibv_wr_set_ud_addr_sends_a_datagram_on_the_extended_path() {
    let dev = Device::open();
    let cq_a = dev.cq(16);
    let cq_b = dev.cq(16);
    let mut attr = ibv_qp_init_attr_ex {
        send_cq: cq_a,
        recv_cq: cq_a,
        cap: ibv_qp_cap {
            max_send_wr: 8,
            max_recv_wr: 8,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        },
        qp_type: ibv_qp_type::IBV_QPT_UD,
        comp_mask: ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_PD.0
            | ibv_qp_init_attr_mask::IBV_QP_INIT_ATTR_SEND_OPS_FLAGS.0,
        pd: dev.pd,
        send_ops_flags: ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_SEND.0 as u64,
        ..Default::default()
    };
    let mut rdma = attr;
    rdma.send_ops_flags |= ibv_qp_create_send_ops_flags::IBV_QP_EX_WITH_RDMA_WRITE.0 as u64;
    assert!(unsafe { create_qp_ex(dev.ctx, &mut rdma) }.is_null());
    assert_eq!(errno(), libc::EOPNOTSUPP, "UD QPs carry no RDMA WRITE");
    let a = unsafe { create_qp_ex(dev.ctx, &mut attr) };
    assert!(!a.is_null(), "errno {}", errno());
    ud_to_rts(a, QKEY);
    let b = ud_qp(&dev, cq_b, QKEY);
    let ah = lid_ah(&dev, 0);
    let src = Buffer::new(&dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&dev, 128, LOCAL_WRITE);
    unsafe { std::ptr::write_bytes(src.addr() as *mut u8, 0x5a, 32) };
    assert_eq!(post_one_recv(b, 8, &mut [dst.sge(0, 128)]), 0);
    let qpx = unsafe { ibv_qp_to_qp_ex(a) };
    unsafe {
        (*qpx).wr_start.unwrap()(qpx);
        (*qpx).wr_id = 77;
        (*qpx).wr_flags = SIGNALED;
        (*qpx).wr_send.unwrap()(qpx);
        (*qpx).wr_set_ud_addr.unwrap()(qpx, ah, qp_num(b), QKEY);
        (*qpx).wr_set_sge.unwrap()(qpx, src.lkey(), src.addr(), 32);
        assert_eq!((*qpx).wr_complete.unwrap()(qpx), 0);
    }
    assert_send_ok(cq_a, 77, a, 32);
    let wc = poll_n(cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len, wc.src_qp),
        (8, ibv_wc_status::IBV_WC_SUCCESS, 32 + GRH as u32, qp_num(a))
    );
    assert!(dst.data[GRH..GRH + 32].iter().all(|b| *b == 0x5a));
    // Without an address the batch fails and nothing is sent.
    unsafe {
        (*qpx).wr_start.unwrap()(qpx);
        (*qpx).wr_id = 78;
        (*qpx).wr_send.unwrap()(qpx);
        (*qpx).wr_set_ud_addr.unwrap()(qpx, null_mut(), qp_num(b), QKEY);
        (*qpx).wr_set_sge.unwrap()(qpx, src.lkey(), src.addr(), 32);
        assert_eq!((*qpx).wr_complete.unwrap()(qpx), libc::EINVAL);
    }
    assert_no_completion(cq_a, Duration::from_millis(50));
    unsafe { ibv_destroy_ah(ah) };
}

/// Two UC QPs of one device connected to each other.
fn uc_pair(dev: &Device) -> (*mut ibv_cq, *mut ibv_cq, *mut ibv_qp, *mut ibv_qp) {
    let cq_a = dev.cq(64);
    let cq_b = dev.cq(64);
    let a = qp_of_type(dev, cq_a, ibv_qp_type::IBV_QPT_UC);
    let b = qp_of_type(dev, cq_b, ibv_qp_type::IBV_QPT_UC);
    uc_connect(a, dev.lid, qp_num(b));
    uc_connect(b, dev.lid, qp_num(a));
    (cq_a, cq_b, a, b)
}

#[test]
fn uc_send_and_write_with_imm_complete_with_every_field() {
    let dev = Device::open();
    let (cq_a, cq_b, a, b) = uc_pair(&dev);
    let src = Buffer::new(&dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    unsafe { std::ptr::write_bytes(src.addr() as *mut u8, 0x33, 64) };
    assert_eq!(post_one_recv(b, 1, &mut [dst.sge(0, 16)]), 0);
    let mut sge = [src.sge(0, 16)];
    assert_eq!(
        post_one_send(a, &mut send_wr(10, &mut sge, SEND, SIGNALED)),
        0
    );
    assert_send_ok(cq_a, 10, a, 16);
    let wc = poll_n(cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (
            1,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV,
            16
        )
    );
    assert_eq!(
        (wc.qp_num, wc.src_qp, wc.slid, wc.wc_flags),
        (qp_num(b), qp_num(a), dev.lid, 0)
    );
    assert!(dst.data[..16].iter().all(|b| *b == 0x33));

    assert_eq!(post_one_recv(b, 2, &mut [dst.sge(0, 1)]), 0);
    let mut sge = [src.sge(0, 32)];
    let mut wr = rdma_wr(
        11,
        &mut sge,
        ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
        dst.addr() + 32,
        dst.rkey(),
    );
    wr.__bindgen_anon_1.imm_data = 0xcafe_u32.to_be();
    assert_eq!(post_one_send(a, &mut wr), 0);
    let wc = poll_n(cq_a, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
        (
            11,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RDMA_WRITE,
            32
        )
    );
    let wc = poll_n(cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (
            2,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
        )
    );
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_WITH_IMM.0);
    assert_eq!(u32::from_be(imm(&wc)), 0xcafe);
    assert_eq!((wc.qp_num, wc.src_qp), (qp_num(b), qp_num(a)));
    assert!(dst.data[32..64].iter().all(|b| *b == 0x33));
}

#[test]
fn uc_drops_a_message_without_a_receive_and_the_sender_still_succeeds() {
    let dev = Device::open();
    let (cq_a, cq_b, a, b) = uc_pair(&dev);
    let src = Buffer::new(&dev, 64, LOCAL_WRITE);
    let dst = Buffer::new(&dev, 64, LOCAL_WRITE);
    unsafe { std::ptr::write_bytes(src.addr() as *mut u8, 0x44, 64) };
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(a, &mut send_wr(1, &mut sge, SEND, SIGNALED)),
        0
    );
    assert_send_ok(cq_a, 1, a, 8);
    std::thread::sleep(QUIET);
    assert_eq!(post_one_recv(b, 5, &mut [dst.sge(0, 64)]), 0);
    assert_no_completion(cq_b, QUIET);
    assert!(
        dst.data.iter().all(|b| *b == 0),
        "nothing was kept for later"
    );
    // The next message takes the receive: the QP kept working.
    let mut sge = [src.sge(0, 4)];
    assert_eq!(
        post_one_send(a, &mut send_wr(2, &mut sge, SEND, SIGNALED)),
        0
    );
    assert_send_ok(cq_a, 2, a, 4);
    let wc = poll_n(cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.byte_len),
        (5, ibv_wc_status::IBV_WC_SUCCESS, 4)
    );
    assert_eq!(qp_state(b), ibv_qp_state::IBV_QPS_RTS.0);
}

#[test]
fn uc_refuses_read_and_atomics_at_post() {
    let dev = Device::open();
    let (cq_a, _cq_b, a, _b) = uc_pair(&dev);
    let buf = Buffer::new(&dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    let mut sge = [buf.sge(0, 8)];
    let mut wr = rdma_wr(
        1,
        &mut sge,
        ibv_wr_opcode::IBV_WR_RDMA_READ,
        buf.addr(),
        buf.rkey(),
    );
    assert_eq!(post_one_send(a, &mut wr), libc::EINVAL);
    let mut sge = [buf.sge(0, 8)];
    let mut wr = atomic_wr(
        2,
        &mut sge,
        ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD,
        buf.addr(),
        buf.rkey(),
        1,
        0,
    );
    assert_eq!(post_one_send(a, &mut wr), libc::EINVAL);
    assert_no_completion(cq_a, Duration::from_millis(50));
    assert_eq!(qp_state(a), ibv_qp_state::IBV_QPS_RTS.0);
}

/// XRC QPs are made as rdma-core makes them: an XRC_SEND QP with `ibv_create_qp` (no receive
/// CQ needed), an XRC_RECV QP only on an xrcd (`ibv_create_qp_ex`; `ibv_create_qp` has none:
/// EINVAL); `ibv_open_qp` needs a number, an xrcd and the type (EINVAL). Data and completions:
/// tests/c/xrc.c.
#[test]
fn xrc_queue_pairs_are_made_as_rdma_core_makes_them() {
    let dev = Device::open();
    let v = unsafe { vctx(dev.ctx) };
    let mut attr = ibv_xrcd_init_attr {
        comp_mask: ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_FD.0
            | ibv_xrcd_init_attr_mask::IBV_XRCD_INIT_ATTR_OFLAGS.0,
        fd: -1,
        oflags: libc::O_CREAT,
    };
    let xrcd = unsafe { (*v).open_xrcd.unwrap()(dev.ctx, &mut attr) };
    assert!(!xrcd.is_null(), "errno {}", errno());
    let cq = dev.cq(4);
    let init = |qp_type, recv_cq| ibv_qp_init_attr {
        send_cq: cq,
        recv_cq,
        cap: ibv_qp_cap {
            max_send_wr: 1,
            max_send_sge: 1,
            ..Default::default()
        },
        qp_type,
        ..Default::default()
    };
    let mut send = init(ibv_qp_type::IBV_QPT_XRC_SEND, null_mut());
    let qp = unsafe { ibv_create_qp(dev.pd, &mut send) };
    assert!(!qp.is_null(), "XRC_SEND: errno {}", errno());
    assert_eq!(unsafe { (*qp).qp_type }, ibv_qp_type::IBV_QPT_XRC_SEND);
    let mut recv = init(ibv_qp_type::IBV_QPT_XRC_RECV, cq);
    assert!(unsafe { ibv_create_qp(dev.pd, &mut recv) }.is_null());
    assert_eq!(errno(), libc::EINVAL, "XRC_RECV without an xrcd");
    let mut open = ibv_qp_open_attr::default();
    assert!(unsafe { (*v).open_qp.unwrap()(dev.ctx, &mut open) }.is_null());
    assert_eq!(errno(), libc::EINVAL);
    assert_eq!(unsafe { ibv_destroy_qp(qp) }, 0);
    assert_eq!(unsafe { (*v).close_xrcd.unwrap()(xrcd) }, 0);
}
