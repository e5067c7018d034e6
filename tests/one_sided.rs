//! RDMA WRITE/READ and atomics through the exported ABI: bytes, every completion field,
//! remote access errors as a HCA reports them, atomics under concurrent requesters, and RC
//! ordering of a SEND behind WRITEs.

mod fixture;

use fixture::*;
use std::os::raw::c_int;
use std::ptr::null_mut;

const WRITE: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
const WRITE_IMM: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM;
const READ: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
const FADD: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_ATOMIC_FETCH_AND_ADD;
const CSWAP: ibv_wr_opcode = ibv_wr_opcode::IBV_WR_ATOMIC_CMP_AND_SWP;
const REMOTE_RW: c_int = LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ;

#[test]
fn write_then_read_back_for_sizes_and_odd_sge_splits() {
    let lb = Loopback::rc(16);
    for &len in &[1usize, 3, 4096, 65_537, 1 << 20, 4 << 20] {
        let mut src = Buffer::new(&lb.dev, len, LOCAL_WRITE);
        for (i, b) in src.data.iter_mut().enumerate() {
            *b = (i * 13 % 251) as u8 ^ (len as u8);
        }
        let remote = Buffer::new(&lb.dev, len + 16, REMOTE_RW);
        let back = Buffer::new(&lb.dev, len, LOCAL_WRITE);
        let (a, b) = (len / 3, len / 3 + len / 4);
        let mut sges = [
            src.sge(0, a as u32),
            src.sge(a, (b - a) as u32),
            src.sge(b, (len - b) as u32),
        ];
        assert_eq!(
            post_one_send(
                lb.a,
                &mut rdma_wr(1, &mut sges, WRITE, remote.addr() + 8, remote.rkey())
            ),
            0
        );
        let wc = poll_n(lb.cq_a, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (
                1,
                ibv_wc_status::IBV_WC_SUCCESS,
                ibv_wc_opcode::IBV_WC_RDMA_WRITE
            ),
            "len {len}"
        );
        assert_eq!(wc.qp_num, qp_num(lb.a));
        assert_eq!(
            &remote.data[8..8 + len],
            &src.data[..],
            "written bytes, len {len}"
        );
        assert_eq!(
            &remote.data[..8],
            &[0; 8],
            "bytes before the target untouched"
        );
        let r = len / 2 + 1;
        let mut rsges = [
            back.sge(0, r.min(len) as u32),
            back.sge(r.min(len), (len - r.min(len)) as u32),
        ];
        assert_eq!(
            post_one_send(
                lb.a,
                &mut rdma_wr(2, &mut rsges, READ, remote.addr() + 8, remote.rkey())
            ),
            0
        );
        let wc = poll_n(lb.cq_a, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (
                2,
                ibv_wc_status::IBV_WC_SUCCESS,
                ibv_wc_opcode::IBV_WC_RDMA_READ,
                len as u32
            ),
            "len {len}"
        );
        assert_eq!(&back.data[..], &src.data[..], "read bytes, len {len}");
        assert_no_completion(lb.cq_b, std::time::Duration::from_millis(1));
    }
}

#[test]
fn write_with_imm_consumes_a_receive() {
    let lb = Loopback::rc(8);
    let mut src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    src.data[..5].copy_from_slice(b"12345");
    let remote = Buffer::new(&lb.dev, 64, REMOTE_RW);
    assert_eq!(post_one_recv(lb.b, 77, &mut []), 0);
    let mut sge = [src.sge(0, 5)];
    let mut wr = rdma_wr(3, &mut sge, WRITE_IMM, remote.addr(), remote.rkey());
    wr.__bindgen_anon_1.imm_data = 0xa1b2c3d4u32.to_be();
    assert_eq!(post_one_send(lb.a, &mut wr), 0);
    let wc = poll_n(lb.cq_b, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status, wc.opcode),
        (
            77,
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
        )
    );
    assert_eq!(wc.byte_len, 5);
    assert_eq!(wc.wc_flags, ibv_wc_flags::IBV_WC_WITH_IMM.0);
    assert_eq!(u32::from_be(imm(&wc)), 0xa1b2c3d4);
    assert_eq!((wc.qp_num, wc.src_qp), (qp_num(lb.b), qp_num(lb.a)));
    assert_eq!(&remote.data[..5], b"12345");
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].opcode,
        ibv_wc_opcode::IBV_WC_RDMA_WRITE
    );
}

/// A WRITE_WITH_IMM the responder refuses (a bad rkey) took a receive WR: that WR completes
/// with IBV_WC_REM_ACCESS_ERR (as rxe's responder completes it), the next one is flushed, and
/// nothing is written (before, the WR it took was never completed).
#[test]
fn a_refused_write_with_imm_completes_the_receive_it_took() {
    let lb = Loopback::rc(8);
    let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let remote = Buffer::new(&lb.dev, 64, REMOTE_RW);
    assert_eq!(post_one_recv(lb.b, 81, &mut []), 0);
    assert_eq!(post_one_recv(lb.b, 82, &mut []), 0);
    let mut sge = [src.sge(0, 5)];
    let bad_rkey = remote.rkey() ^ 0x00ff_0000;
    let mut wr = rdma_wr(6, &mut sge, WRITE_IMM, remote.addr(), bad_rkey);
    wr.__bindgen_anon_1.imm_data = 0x0102_0304u32.to_be();
    assert_eq!(post_one_send(lb.a, &mut wr), 0);
    let wc = poll_n(lb.cq_a, 1)[0];
    assert_eq!(
        (wc.wr_id, wc.status),
        (6, ibv_wc_status::IBV_WC_REM_ACCESS_ERR)
    );
    let wcs = poll_n(lb.cq_b, 2);
    assert_eq!(
        (wcs[0].wr_id, wcs[0].status, wcs[0].opcode),
        (
            81,
            ibv_wc_status::IBV_WC_REM_ACCESS_ERR,
            ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM
        )
    );
    assert_eq!((wcs[0].byte_len, wcs[0].wc_flags), (0, 0));
    assert_eq!((wcs[0].qp_num, wcs[0].src_qp), (qp_num(lb.b), qp_num(lb.a)));
    assert_eq!(
        (wcs[1].wr_id, wcs[1].status),
        (82, ibv_wc_status::IBV_WC_WR_FLUSH_ERR)
    );
    assert_eq!(qp_state(lb.b), ibv_qp_state::IBV_QPS_ERR.0);
    assert!(
        remote.data.iter().all(|b| *b == 0),
        "nothing may be written"
    );
}

#[test]
fn bad_remote_keys_are_remote_access_errors_and_nothing_is_written() {
    type Case = fn(&Buffer, &Buffer) -> (u64, u32);
    let cases: [(&str, c_int, Case); 5] = [
        ("unknown rkey", REMOTE_RW, |r, _| {
            (r.addr(), r.rkey() ^ 0x00ff_0000)
        }),
        ("no remote write", LOCAL_WRITE | REMOTE_READ, |r, _| {
            (r.addr(), r.rkey())
        }),
        ("past the end", REMOTE_RW, |r, _| (r.addr() + 60, r.rkey())),
        ("before the start", REMOTE_RW, |r, _| {
            (r.addr() - 1, r.rkey())
        }),
        ("addr + len overflows", REMOTE_RW, |r, _| {
            (u64::MAX - 4, r.rkey())
        }),
    ];
    for (what, access, target) in cases {
        let lb = Loopback::rc(8);
        let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
        let remote = Buffer::new(&lb.dev, 64, access);
        let (addr, rkey) = target(&remote, &src);
        let mut sge = [src.sge(0, 16)];
        assert_eq!(
            post_one_send(lb.a, &mut rdma_wr(9, &mut sge, WRITE, addr, rkey)),
            0
        );
        let wc = poll_n(lb.cq_a, 1)[0];
        assert_eq!(
            (wc.wr_id, wc.status),
            (9, ibv_wc_status::IBV_WC_REM_ACCESS_ERR),
            "{what}"
        );
        assert_eq!(qp_state(lb.a), ibv_qp_state::IBV_QPS_ERR.0, "{what}");
        assert!(
            remote.data.iter().all(|b| *b == 0),
            "{what}: nothing may be written"
        );
    }
}

#[test]
fn deregistering_revokes_remote_access_at_once() {
    let lb = Loopback::rc(8);
    let src = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let mut remote = vec![0u8; 64];
    let mr = unsafe { ibv_reg_mr(lb.dev.pd, remote.as_mut_ptr().cast(), 64, REMOTE_RW) };
    let (addr, rkey) = (remote.as_ptr() as u64, unsafe { (*mr).rkey });
    assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    let mut sge = [src.sge(0, 8)];
    assert_eq!(
        post_one_send(lb.a, &mut rdma_wr(4, &mut sge, READ, addr, rkey)),
        0
    );
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    );
    assert!(remote.iter().all(|b| *b == 0));
}

#[test]
fn read_and_atomic_need_their_access_flags() {
    let lb = Loopback::rc(8);
    let local = Buffer::new(&lb.dev, 64, LOCAL_WRITE);
    let remote = Buffer::new(&lb.dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    let mut sge = [local.sge(0, 8)];
    assert_eq!(
        post_one_send(
            lb.a,
            &mut atomic_wr(5, &mut sge, FADD, remote.addr(), remote.rkey(), 1, 0)
        ),
        0
    );
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_REM_ACCESS_ERR
    );
    let lb = Loopback::rc(8);
    let remote = Buffer::new(&lb.dev, 64, LOCAL_WRITE | REMOTE_WRITE);
    let mut sge = [local.sge(0, 8)];
    // A READ landing in a local buffer of another device's PD is a local protection error.
    assert_eq!(
        post_one_send(
            lb.a,
            &mut rdma_wr(6, &mut sge, READ, remote.addr(), remote.rkey())
        ),
        0
    );
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].status,
        ibv_wc_status::IBV_WC_LOC_PROT_ERR
    );
}

#[test]
fn atomics_return_the_original_value() {
    let lb = Loopback::rc(8);
    let local = Buffer::new(&lb.dev, 16, LOCAL_WRITE);
    let mut remote = Buffer::new(&lb.dev, 16, LOCAL_WRITE | REMOTE_WRITE | REMOTE_ATOMIC);
    remote.data[8..16].copy_from_slice(&100u64.to_ne_bytes());
    let slot = remote.addr() + 8;
    let mut sge = [local.sge(0, 8)];
    assert_eq!(
        post_one_send(
            lb.a,
            &mut atomic_wr(1, &mut sge, FADD, slot, remote.rkey(), 5, 0)
        ),
        0
    );
    let wc = poll_n(lb.cq_a, 1)[0];
    assert_eq!(
        (wc.status, wc.opcode, wc.byte_len),
        (
            ibv_wc_status::IBV_WC_SUCCESS,
            ibv_wc_opcode::IBV_WC_FETCH_ADD,
            8
        )
    );
    assert_eq!(u64::from_ne_bytes(local.data[..8].try_into().unwrap()), 100);
    assert_eq!(
        u64::from_ne_bytes(remote.data[8..16].try_into().unwrap()),
        105
    );
    // compare-and-swap: a miss leaves the value, a hit replaces it; both return the original.
    assert_eq!(
        post_one_send(
            lb.a,
            &mut atomic_wr(2, &mut sge, CSWAP, slot, remote.rkey(), 7, 999)
        ),
        0
    );
    assert_eq!(
        poll_n(lb.cq_a, 1)[0].opcode,
        ibv_wc_opcode::IBV_WC_COMP_SWAP
    );
    assert_eq!(u64::from_ne_bytes(local.data[..8].try_into().unwrap()), 105);
    assert_eq!(
        u64::from_ne_bytes(remote.data[8..16].try_into().unwrap()),
        105
    );
    assert_eq!(
        post_one_send(
            lb.a,
            &mut atomic_wr(3, &mut sge, CSWAP, slot, remote.rkey(), 105, 555)
        ),
        0
    );
    poll_n(lb.cq_a, 1);
    assert_eq!(
        u64::from_ne_bytes(remote.data[8..16].try_into().unwrap()),
        555
    );
    // Misaligned or not 8 bytes: refused at post, as rxe does.
    let mut bad = [local.sge(0, 4)];
    let mut wr = atomic_wr(4, &mut bad, FADD, slot, remote.rkey(), 1, 0);
    let mut bad_wr = null_mut();
    assert_eq!(
        unsafe { post_send(lb.a, &mut wr, &mut bad_wr) },
        libc::EINVAL
    );
    let mut wr = atomic_wr(5, &mut sge, FADD, slot + 1, remote.rkey(), 1, 0);
    assert_eq!(
        unsafe { post_send(lb.a, &mut wr, &mut bad_wr) },
        libc::EINVAL
    );
}

#[test]
fn fetch_add_from_two_concurrent_requesters() {
    let dev = Device::open();
    let target_cq = dev.cq(16);
    let mut counter = Buffer::new(&dev, 8, LOCAL_WRITE | REMOTE_ATOMIC);
    counter.data.fill(0);
    let (addr, rkey) = (counter.addr(), counter.rkey());
    const N: u64 = 500;
    let results: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|_| {
                let dev = &dev;
                let target = dev.rc_qp(target_cq, target_cq, 4);
                let cq = dev.cq(16);
                let qp = dev.rc_qp(cq, cq, 4);
                connect(qp, dev.lid, qp_num(target));
                connect(target, dev.lid, qp_num(qp));
                let (qp, cq) = (qp as usize, cq as usize);
                s.spawn(move || {
                    let (qp, cq) = (qp as *mut ibv_qp, cq as *mut ibv_cq);
                    let local = Buffer::new(dev, 8, LOCAL_WRITE);
                    let mut seen = Vec::new();
                    for i in 0..N {
                        let mut sge = [local.sge(0, 8)];
                        assert_eq!(
                            post_one_send(qp, &mut atomic_wr(i, &mut sge, FADD, addr, rkey, 1, 0)),
                            0
                        );
                        let wc = poll_n(cq, 1)[0];
                        assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
                        seen.push(u64::from_ne_bytes(local.data[..8].try_into().unwrap()));
                    }
                    seen
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(
        u64::from_ne_bytes(counter.data[..8].try_into().unwrap()),
        2 * N
    );
    let mut all: Vec<u64> = results.concat();
    all.sort_unstable();
    assert_eq!(
        all,
        (0..2 * N).collect::<Vec<_>>(),
        "every original value is seen exactly once"
    );
}

#[test]
fn a_send_after_writes_arrives_after_the_writes_are_visible() {
    let lb = Loopback::rc(64);
    let mut src = Buffer::new(&lb.dev, 64 * 1024 + 8, LOCAL_WRITE);
    let remote = Buffer::new(&lb.dev, 64 * 1024 + 8, REMOTE_RW);
    let recv = Buffer::new(&lb.dev, 64 * 8, LOCAL_WRITE);
    const ITERS: u64 = 100_000;
    let mut posted_recv = 0u64;
    for i in 0..ITERS {
        while posted_recv < ITERS && posted_recv < i + 8 {
            assert_eq!(
                post_one_recv(
                    lb.b,
                    posted_recv,
                    &mut [recv.sge((posted_recv % 8) as usize * 64, 64)]
                ),
                0
            );
            posted_recv += 1;
        }
        // Every 64th iteration writes a rendezvous-sized block first, so the write lands late.
        let len = if i % 64 == 0 { 64 * 1024 } else { 8 };
        src.data[len - 8..len].copy_from_slice(&i.to_ne_bytes());
        let mut wsge = [src.sge(0, len as u32)];
        let mut w = rdma_wr(i, &mut wsge, WRITE, remote.addr(), remote.rkey());
        w.send_flags = 0;
        let mut msg = i.to_ne_bytes();
        let mut ssge = [ibv_sge {
            addr: msg.as_mut_ptr() as u64,
            length: 8,
            lkey: 0,
        }];
        let mut s = send_wr(
            i,
            &mut ssge,
            ibv_wr_opcode::IBV_WR_SEND,
            ibv_send_flags::IBV_SEND_SIGNALED.0 | ibv_send_flags::IBV_SEND_INLINE.0,
        );
        w.next = &mut s;
        let mut bad = null_mut();
        assert_eq!(unsafe { post_send(lb.a, &mut w, &mut bad) }, 0);
        let wc = poll_n(lb.cq_b, 1)[0];
        assert_eq!(wc.status, ibv_wc_status::IBV_WC_SUCCESS);
        let slot = (wc.wr_id % 8) as usize * 64;
        let got = u64::from_ne_bytes(recv.data[slot..slot + 8].try_into().unwrap());
        assert_eq!(got, i);
        let visible = u64::from_ne_bytes(remote.data[len - 8..len].try_into().unwrap());
        assert_eq!(
            visible, i,
            "iteration {i}: the SEND arrived before the WRITE was visible"
        );
        poll_n(lb.cq_a, 1);
    }
}
