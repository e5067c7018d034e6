/* IBV_SEND_FENCE between two processes (forked: the child is the responder, whose memory the
 * parent reads and writes). A fenced WR waits until every RDMA READ and atomic posted before
 * it completed:
 *   1. READ of 1 MiB, then a fenced WRITE of other bytes to the same memory: the READ returns
 *      only the bytes from before the WRITE, in every one of 20 rounds; a WRITE posted behind
 *      the fenced one waits with it and lands too, in post order;
 *   2. FETCH_AND_ADD, then a fenced WRITE of the same 8 bytes: the atomic returns the value
 *      from before the WRITE, and the WRITE's bytes are there after;
 *   3. a READ the stopped responder never answers, and a fenced WRITE held behind it: the READ
 *      fails (RETRY_EXC_ERR) and the WRITE is flushed (WR_FLUSH_ERR), and once the responder
 *      runs again its memory holds no byte of the WRITE: a held WR is never sent, not even by
 *      the retransmission timer.
 * Every completion's wr_id, status, opcode, qp_num and (for READs) byte_len is checked. Run
 * with UGDR_DIRECT=off (the message path, as between hosts; on one host the direct path
 * completes a READ at post time). Prints "fence: ok". */
#include "responder_process.h"
#include <stdint.h>

enum { LEN = 1 << 20, TAIL = 64 };

struct info {
    uint16_t lid;
    uint32_t qpn, rkey;
    uint64_t addr;
};

static struct ibv_qp *qp;
static struct ibv_cq *cq;

static void post(struct ibv_send_wr *first)
{
    struct ibv_send_wr *bad = NULL;
    CHECK(ibv_post_send(qp, first, &bad) == 0, "post_send");
}

/* The next completion: `id`, `status`, and (on success) `opcode` and `byte_len` (-1: any). */
static void expect(uint64_t id, enum ibv_wc_status status, enum ibv_wc_opcode opcode, long len)
{
    struct ibv_wc wc;
    CHECK(poll_one(cq, &wc) == 1, "wr %llu: no completion in 10 s", (unsigned long long)id);
    CHECK(wc.wr_id == id && wc.status == status && wc.qp_num == qp->qp_num,
          "wr %llu: got wr %llu, %s", (unsigned long long)id, (unsigned long long)wc.wr_id,
          ibv_wc_status_str(wc.status));
    if (status == IBV_WC_SUCCESS)
        CHECK(wc.opcode == opcode && (len < 0 || wc.byte_len == (uint32_t)len),
              "wr %llu: opcode %d byte_len %u", (unsigned long long)id, wc.opcode, wc.byte_len);
}

int main(void)
{
    int in, out;
    pid_t child = fork_responder(&in, &out);

    struct ibv_port_attr port;
    struct ibv_pd *pd = open_pd_and_cq(&port, &cq);
    qp = rc_qp(pd, cq);
    int remote = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
    /* target (the child's): LEN bytes, TAIL more, and 8 for the atomic; the parent's own:
     * where READs land, and the bytes its WRITEs carry. */
    char *target = aligned_alloc(4096, LEN + TAIL + 8);
    char *landed = malloc(LEN), *old = malloc(LEN), *new = malloc(LEN), *tail = malloc(TAIL);
    uint64_t *fetched = malloc(8), *value = malloc(8);
    CHECK(target && landed && old && new && tail && fetched && value, "malloc");
    memset(target, 0x11, LEN + TAIL + 8);
    struct ibv_mr *mt = ibv_reg_mr(pd, target, LEN + TAIL + 8, IBV_ACCESS_LOCAL_WRITE | remote);
    struct ibv_mr *ml = ibv_reg_mr(pd, landed, LEN, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mo = ibv_reg_mr(pd, old, LEN, 0), *mn = ibv_reg_mr(pd, new, LEN, 0);
    struct ibv_mr *mtl = ibv_reg_mr(pd, tail, TAIL, 0);
    struct ibv_mr *mf = ibv_reg_mr(pd, fetched, 8, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mv = ibv_reg_mr(pd, value, 8, 0);
    CHECK(mt && ml && mo && mn && mtl && mf && mv, "reg_mr");

    struct info me = { port.lid, qp->qp_num, mt->rkey, (uintptr_t)target }, peer;
    CHECK(write(out, &me, sizeof me) == sizeof me, "send info");
    CHECK(read(in, &peer, sizeof peer) == sizeof peer, "peer info");
    to_rts(qp, peer.lid, peer.qpn, remote);
    both_at_rts(in, out);
    if (child == 0)
        return serve_reports(in, out, target, LEN);

    memset(old, 0xAA, LEN);
    memset(new, 0xBB, LEN);
    memset(tail, 0xCC, TAIL);
    struct ibv_sge s_old = { (uintptr_t)old, LEN, mo->lkey }, s_new = { (uintptr_t)new, LEN, mn->lkey },
                   s_landed = { (uintptr_t)landed, LEN, ml->lkey },
                   s_tail = { (uintptr_t)tail, TAIL, mtl->lkey };
    /* 1. */
    for (int round = 0; round < 20; round++) {
        memset(landed, 0, LEN);
        memset(tail, 0xC0 + round, TAIL);
        struct ibv_send_wr w_old = { .wr_id = 1, .sg_list = &s_old, .num_sge = 1,
                                     .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED },
            r = { .wr_id = 2, .sg_list = &s_landed, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
                  .send_flags = IBV_SEND_SIGNALED },
            w_new = { .wr_id = 3, .sg_list = &s_new, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                      .send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE },
            w_tail = { .wr_id = 4, .sg_list = &s_tail, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                       .send_flags = IBV_SEND_SIGNALED };
        w_old.wr.rdma.remote_addr = r.wr.rdma.remote_addr = w_new.wr.rdma.remote_addr = peer.addr;
        w_tail.wr.rdma.remote_addr = peer.addr + LEN;
        w_old.wr.rdma.rkey = r.wr.rdma.rkey = w_new.wr.rdma.rkey = w_tail.wr.rdma.rkey = peer.rkey;
        w_old.next = &r;
        r.next = &w_new;
        w_new.next = &w_tail;
        post(&w_old);
        expect(1, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
        expect(2, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, LEN);
        expect(3, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
        expect(4, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
        size_t stale = count_of(landed, LEN, 0xAA);
        CHECK(stale == LEN, "round %d: the READ holds %zu bytes of the fenced WRITE after it, %zu others",
              round, count_of(landed, LEN, 0xBB), LEN - stale - count_of(landed, LEN, 0xBB));
        /* What the two WRITEs left, read back. */
        struct ibv_sge back = { (uintptr_t)landed, LEN, ml->lkey };
        struct ibv_send_wr rb = { .wr_id = 5, .sg_list = &back, .num_sge = 1,
                                  .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED };
        rb.wr.rdma.remote_addr = peer.addr + TAIL; /* the last TAIL bytes: the tail WRITE's */
        rb.wr.rdma.rkey = peer.rkey;
        post(&rb);
        expect(5, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, LEN);
        CHECK(count_of(landed, LEN - TAIL, 0xBB) == LEN - TAIL &&
                  count_of(landed + LEN - TAIL, TAIL, 0xC0 + round) == TAIL,
              "round %d: the WRITEs' bytes", round);
    }

    /* 2. */
    struct ibv_sge s_fetched = { (uintptr_t)fetched, 8, mf->lkey }, s_value = { (uintptr_t)value, 8, mv->lkey };
    *value = 0x0123456789abcdefULL;
    struct ibv_send_wr set = { .wr_id = 6, .sg_list = &s_value, .num_sge = 1,
                               .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED };
    set.wr.rdma.remote_addr = peer.addr + LEN + TAIL;
    set.wr.rdma.rkey = peer.rkey;
    post(&set);
    expect(6, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
    *value = 7;
    struct ibv_send_wr add = { .wr_id = 7, .sg_list = &s_fetched, .num_sge = 1,
                               .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD, .send_flags = IBV_SEND_SIGNALED },
        overwrite = { .wr_id = 8, .sg_list = &s_value, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                      .send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE };
    add.wr.atomic.remote_addr = overwrite.wr.rdma.remote_addr = peer.addr + LEN + TAIL;
    add.wr.atomic.rkey = overwrite.wr.rdma.rkey = peer.rkey;
    add.wr.atomic.compare_add = 1;
    add.next = &overwrite;
    post(&add);
    expect(7, IBV_WC_SUCCESS, IBV_WC_FETCH_ADD, 8);
    expect(8, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, -1);
    CHECK(*fetched == 0x0123456789abcdefULL, "the atomic fetched %#llx", (unsigned long long)*fetched);
    struct ibv_send_wr check = { .wr_id = 9, .sg_list = &s_fetched, .num_sge = 1,
                                 .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED };
    check.wr.rdma.remote_addr = peer.addr + LEN + TAIL;
    check.wr.rdma.rkey = peer.rkey;
    post(&check);
    expect(9, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 8);
    CHECK(*fetched == 7, "after the fenced WRITE: %#llx", (unsigned long long)*fetched);

    /* 3. The responder's memory now starts 0xBB and ends 0xBB (round 20's WRITE). */
    stop_responder();
    memset(new, 0xDD, LEN);
    struct ibv_send_wr r = { .wr_id = 10, .sg_list = &s_landed, .num_sge = 1,
                             .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED },
        w = { .wr_id = 11, .sg_list = &s_new, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
              .send_flags = IBV_SEND_SIGNALED | IBV_SEND_FENCE };
    r.wr.rdma.remote_addr = w.wr.rdma.remote_addr = peer.addr;
    r.wr.rdma.rkey = w.wr.rdma.rkey = peer.rkey;
    r.next = &w;
    post(&r);
    expect(10, IBV_WC_RETRY_EXC_ERR, 0, 0);
    expect(11, IBV_WC_WR_FLUSH_ERR, 0, 0);
    unsigned char bytes[2];
    resume_and_report(in, out, bytes);
    CHECK(bytes[0] == 0xBB && bytes[1] == 0xBB, "the flushed WRITE landed: %#x %#x", bytes[0], bytes[1]);

    end_responder(out);
    printf("fence: ok\n");
    return 0;
}
