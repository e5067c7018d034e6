/* max_rd_atomic (the initiator depth) between two processes (forked: the child is the
 * responder, whose memory the parent reads and writes). A requester has at most that many
 * RDMA READs and atomics in flight; the send queue stalls at the next one until one of them
 * completes, and every WR posted behind it waits too, in post order (a
 * max_rd_atomic of 0 allows one, as mlx4 and mlx5 program it). For QPs of depth 1 and of
 * depth 0:
 *   1. 20 rounds of: a READ of 1 MiB, a READ (or a FETCH_AND_ADD) of 8 other bytes, then an
 *      unfenced WRITE of other bytes to the first READ's memory. The second READ or atomic
 *      waits for the first READ's answer and the WRITE waits behind it, so the first READ
 *      returns only the bytes from before the WRITE (without the stall the WRITE overtakes
 *      the READ's data in most rounds, as without a fence); the WRITE's bytes are there after,
 *      and the atomic fetched the value from before it;
 *   2. (depth 1, the shortest ACK timeout) a READ of 128 MiB and a READ held behind it; once
 *      the first bytes of the big one landed, the responder stops for 600 ms: a READ whose
 *      answer is landing is not timed out, and neither is the one held behind it (it was
 *      never sent), so both succeed once the responder runs again (the held one used to
 *      expire with RETRY_EXC_ERR);
 *   3. (depth 1) a READ the stopped responder never answers, a second READ and a WRITE held
 *      behind it: the first fails (RETRY_EXC_ERR), the others are flushed (WR_FLUSH_ERR), and
 *      once the responder runs again its memory holds no byte of the WRITE: a held WR is never
 *      sent, not even by the retransmission timer.
 * ibv_query_qp reports the depth set. Every completion's wr_id, status, opcode, qp_num and
 * byte_len is checked. Run with UGDR_DIRECT=off (the message path, as between hosts; on one
 * host the direct path completes a READ at post time) and UCX_TLS=tcp (2. stops the answer
 * by stopping the responder: over shared memory the requester pulls the bytes itself).
 * Prints "initiator_depth: ok". */
#include "responder_process.h"
#include <stdint.h>

enum { LEN = 1 << 20, SMALL = 8, BIG = 128 << 20, DEPTHS = 2, QPS = DEPTHS + 1 };
static const uint8_t depths[DEPTHS] = { 1, 0 };

struct info {
    uint16_t lid;
    uint32_t qpn[QPS], rkey, big_rkey;
    uint64_t addr, big_addr;
};

static struct ibv_cq *cq;

static void post(struct ibv_qp *qp, struct ibv_send_wr *first)
{
    struct ibv_send_wr *bad = NULL;
    CHECK(ibv_post_send(qp, first, &bad) == 0, "post_send");
}

/* The next completion: `id` on `qp`, `status`, and (on success) `opcode` and `byte_len` (-1:
 * any, for WRITEs, whose byte_len the verbs leave undefined). */
static void expect(struct ibv_qp *qp, uint64_t id, enum ibv_wc_status status,
                   enum ibv_wc_opcode opcode, long len)
{
    struct ibv_wc wc;
    CHECK(poll_one(cq, &wc) == 1, "wr %llu: no completion in 10 s", (unsigned long long)id);
    CHECK(wc.wr_id == id && wc.status == status && wc.qp_num == qp->qp_num,
          "wr %llu: got wr %llu on qp %#x, %s", (unsigned long long)id,
          (unsigned long long)wc.wr_id, wc.qp_num, ibv_wc_status_str(wc.status));
    if (status == IBV_WC_SUCCESS)
        CHECK(wc.opcode == opcode && (len < 0 || wc.byte_len == (uint32_t)len), "wr %llu: opcode %d byte_len %u",
              (unsigned long long)id, wc.opcode, wc.byte_len);
}

int main(void)
{
    const char *direct = getenv("UGDR_DIRECT"), *tls = getenv("UCX_TLS");
    CHECK(direct && strcmp(direct, "off") == 0 && tls && strcmp(tls, "tcp") == 0,
          "run with UGDR_DIRECT=off UCX_TLS=tcp");
    int in, out;
    pid_t child = fork_responder(&in, &out);

    struct ibv_port_attr port;
    struct ibv_pd *pd = open_pd_and_cq(&port, &cq);
    /* qps[DEPTHS]: depth 1 and the shortest ACK timeout, for 2. */
    struct ibv_qp *qps[QPS];
    for (int d = 0; d < QPS; d++)
        qps[d] = rc_qp(pd, cq);
    int remote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    /* target (the child's): LEN bytes the first READ reads and the WRITE overwrites, then
     * SMALL for the second READ and the atomic. The parent's own: where READs land, the bytes
     * its WRITEs carry. */
    char *target = aligned_alloc(4096, LEN + SMALL);
    char *landed = malloc(LEN), *old = malloc(LEN), *new = malloc(LEN);
    uint64_t *small = malloc(SMALL);
    /* BIG bytes the child serves in 2. and where the parent reads them to (each side only
     * touches its own). */
    char *big = aligned_alloc(4096, BIG);
    CHECK(target && landed && old && new && small && big, "malloc");
    memset(target, 0x11, LEN + SMALL);
    memset(big, child == 0 ? 0x5A : 0, BIG);
    struct ibv_mr *mt = ibv_reg_mr(pd, target, LEN + SMALL, IBV_ACCESS_LOCAL_WRITE | remote);
    struct ibv_mr *ml = ibv_reg_mr(pd, landed, LEN, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mo = ibv_reg_mr(pd, old, LEN, 0), *mn = ibv_reg_mr(pd, new, LEN, 0);
    struct ibv_mr *ms = ibv_reg_mr(pd, small, SMALL, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mb = ibv_reg_mr(pd, big, BIG, IBV_ACCESS_LOCAL_WRITE | remote);
    CHECK(mt && ml && mo && mn && ms && mb, "reg_mr");

    struct info me = { port.lid, { qps[0]->qp_num, qps[1]->qp_num, qps[2]->qp_num }, mt->rkey,
                       mb->rkey, (uintptr_t)target, (uintptr_t)big },
                peer;
    CHECK(write(out, &me, sizeof me) == sizeof me, "send info");
    CHECK(read(in, &peer, sizeof peer) == sizeof peer, "peer info");
    for (int d = 0; d < DEPTHS; d++) {
        to_rts_with_depth(qps[d], peer.lid, peer.qpn[d], remote, 14, depths[d]);
        struct ibv_qp_attr attr;
        struct ibv_qp_init_attr init;
        CHECK(ibv_query_qp(qps[d], &attr, IBV_QP_MAX_QP_RD_ATOMIC, &init) == 0 &&
                  attr.max_rd_atomic == depths[d],
              "query_qp: max_rd_atomic %u, set %u", attr.max_rd_atomic, depths[d]);
    }
    to_rts_with_depth(qps[DEPTHS], peer.lid, peer.qpn[DEPTHS], remote, 1, 1);
    both_at_rts(in, out);
    if (child == 0)
        return serve_reports(in, out, target, LEN);

    struct ibv_sge s_old = { (uintptr_t)old, LEN, mo->lkey }, s_new = { (uintptr_t)new, LEN, mn->lkey },
                   s_landed = { (uintptr_t)landed, LEN, ml->lkey },
                   s_small = { (uintptr_t)small, SMALL, ms->lkey };
    uint64_t counter = 0x1111111111111111ULL; /* the target's SMALL bytes, as the atomics leave them */
    /* 1. */
    for (int d = 0; d < DEPTHS; d++) {
        struct ibv_qp *qp = qps[d];
        for (int round = 0; round < 20; round++) {
            int atomic = round % 2;
            memset(old, 0xA0 + round, LEN);
            memset(new, 0xB0 + round, LEN);
            memset(landed, 0, LEN);
            *small = 0;
            struct ibv_send_wr w_old = { .wr_id = 1, .sg_list = &s_old, .num_sge = 1,
                                         .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED },
                r = { .wr_id = 2, .sg_list = &s_landed, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
                      .send_flags = IBV_SEND_SIGNALED },
                second = { .wr_id = 3, .sg_list = &s_small, .num_sge = 1,
                           .opcode = atomic ? IBV_WR_ATOMIC_FETCH_AND_ADD : IBV_WR_RDMA_READ,
                           .send_flags = IBV_SEND_SIGNALED },
                w_new = { .wr_id = 4, .sg_list = &s_new, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                          .send_flags = IBV_SEND_SIGNALED };
            w_old.wr.rdma.remote_addr = r.wr.rdma.remote_addr = w_new.wr.rdma.remote_addr = peer.addr;
            w_old.wr.rdma.rkey = r.wr.rdma.rkey = w_new.wr.rdma.rkey = peer.rkey;
            if (atomic) {
                second.wr.atomic.remote_addr = peer.addr + LEN;
                second.wr.atomic.rkey = peer.rkey;
                second.wr.atomic.compare_add = 1;
            } else {
                second.wr.rdma.remote_addr = peer.addr + LEN;
                second.wr.rdma.rkey = peer.rkey;
            }
            w_old.next = &r;
            r.next = &second;
            second.next = &w_new;
            post(qp, &w_old);
            expect(qp, 1, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
            expect(qp, 2, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, LEN);
            expect(qp, 3, IBV_WC_SUCCESS, atomic ? IBV_WC_FETCH_ADD : IBV_WC_RDMA_READ, SMALL);
            expect(qp, 4, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
            size_t stale = count_of(landed, LEN, 0xA0 + round),
                   overtaken = count_of(landed, LEN, 0xB0 + round);
            CHECK(stale == LEN,
                  "depth %u, round %d: the READ holds %zu bytes of the WRITE posted after it, %zu others",
                  depths[d], round, overtaken, LEN - stale - overtaken);
            CHECK(*small == counter, "depth %u, round %d: %s %#llx, the target held %#llx",
                  depths[d], round, atomic ? "the atomic fetched" : "the READ read",
                  (unsigned long long)*small, (unsigned long long)counter);
            counter += atomic;
            /* What the WRITE left, read back. */
            struct ibv_send_wr rb = { .wr_id = 5, .sg_list = &s_landed, .num_sge = 1,
                                      .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED };
            rb.wr.rdma.remote_addr = peer.addr;
            rb.wr.rdma.rkey = peer.rkey;
            post(qp, &rb);
            expect(qp, 5, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, LEN);
            CHECK(count_of(landed, LEN, 0xB0 + round) == LEN, "depth %u, round %d: the WRITE's bytes",
                  depths[d], round);
        }
    }

    /* 2. */
    {
        struct ibv_qp *qp = qps[DEPTHS];
        struct ibv_sge s_big = { (uintptr_t)big, BIG, mb->lkey };
        struct ibv_send_wr r_big = { .wr_id = 20, .sg_list = &s_big, .num_sge = 1,
                                     .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED },
            r_small = { .wr_id = 21, .sg_list = &s_small, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
                        .send_flags = IBV_SEND_SIGNALED };
        r_big.wr.rdma.remote_addr = peer.big_addr;
        r_big.wr.rdma.rkey = peer.big_rkey;
        r_small.wr.rdma.remote_addr = peer.addr + LEN;
        r_small.wr.rdma.rkey = peer.rkey;
        r_big.next = &r_small;
        *small = 0;
        post(qp, &r_big);
        /* Its answer is landing once its first bytes are here: then the responder stops. */
        struct timespec start, now;
        clock_gettime(CLOCK_MONOTONIC, &start);
        while (*(volatile char *)big != 0x5A) {
            clock_gettime(CLOCK_MONOTONIC, &now);
            CHECK(now.tv_sec - start.tv_sec < 10, "no byte of the 128 MiB READ in 10 s");
        }
        stop_responder();
        /* The ACK timeout (20 ms at the least, 8 tries) would expire several times over. */
        usleep(600 * 1000);
        unsigned char ends[2];
        resume_and_report(in, out, ends);
        expect(qp, 20, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, BIG);
        expect(qp, 21, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, SMALL);
        CHECK(count_of(big, BIG, 0x5A) == BIG, "the 128 MiB READ's bytes");
        CHECK(*small == counter, "the held READ read %#llx, the target held %#llx",
              (unsigned long long)*small, (unsigned long long)counter);
    }

    /* 3. The responder's memory now starts and ends with the last round's WRITE (0xB0 + 19). */
    struct ibv_qp *qp = qps[0];
    stop_responder();
    memset(new, 0xDD, LEN);
    struct ibv_send_wr r1 = { .wr_id = 10, .sg_list = &s_landed, .num_sge = 1,
                              .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED },
        r2 = { .wr_id = 11, .sg_list = &s_small, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
               .send_flags = IBV_SEND_SIGNALED },
        w = { .wr_id = 12, .sg_list = &s_new, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
              .send_flags = IBV_SEND_SIGNALED };
    r1.wr.rdma.remote_addr = w.wr.rdma.remote_addr = peer.addr;
    r2.wr.rdma.remote_addr = peer.addr + LEN;
    r1.wr.rdma.rkey = r2.wr.rdma.rkey = w.wr.rdma.rkey = peer.rkey;
    r1.next = &r2;
    r2.next = &w;
    post(qp, &r1);
    expect(qp, 10, IBV_WC_RETRY_EXC_ERR, 0, 0);
    expect(qp, 11, IBV_WC_WR_FLUSH_ERR, 0, 0);
    expect(qp, 12, IBV_WC_WR_FLUSH_ERR, 0, 0);
    unsigned char bytes[2];
    resume_and_report(in, out, bytes);
    CHECK(bytes[0] == 0xB0 + 19 && bytes[1] == 0xB0 + 19, "the flushed WRITE landed: %#x %#x",
          bytes[0], bytes[1]);

    end_responder(out);
    printf("initiator_depth: ok\n");
    return 0;
}
