/* RDMA WRITE, WRITE_WITH_IMM, READ and atomics over XRC (an XRC_SEND QP of this process to an
 * XRC_RECV QP of this process, each WR naming an XRC SRQ of the target's domain), as
 * applications post them (ibv_post_send with qp_type.xrc.remote_srqn; ibv_wr_* with
 * ibv_wr_set_xrc_srqn), linked against libibverbs and run with libugdr.so preloaded.
 *
 * The rkey is checked in the PD of the XRC SRQ the WR names (rxe's XRC responder: the SRQ's
 * PD), not the requester's PD: a WRITE of a region of PD B succeeds when it names an SRQ of
 * PD B and is refused when it names one of PD A. Every completion field and the bytes moved
 * are checked; WRITE_WITH_IMM takes a WR of the named SRQ (waiting for one, RNR, when it has
 * none) and completes on its CQ; an ODP MR of the SRQ's PD is written and read; 1 MiB
 * transfers (rendezvous) too. The errors,
 * each on a fresh pair: a bad rkey, an MR of another PD (the SRQ's is not it; the
 * requester's PD is not it either), an MR without REMOTE_WRITE, a range past the MR, an
 * atomic on a target QP without REMOTE_ATOMIC, a WRITE_WITH_IMM with an rkey of another PD
 * (its SRQ WR completes with IBV_WC_REM_ACCESS_ERR): IBV_WC_REM_ACCESS_ERR at the requester,
 * the target QP to ERR with IBV_EVENT_QP_ACCESS_ERR, the memory untouched. An SRQ of another
 * domain is an invalid request (IBV_WC_REM_INV_REQ_ERR, IBV_EVENT_QP_REQ_ERR) for a WRITE too.
 * SEND_WITH_INV is not carried over XRC (EINVAL at post). Exit 0 and "xrc_rdma: ok". */
#include "xrc_test.h"

#define ALL_REMOTE (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
#define XRC_OPS (IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_WRITE | \
                 IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |                   \
                 IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD)
#define TSIZE 8192

static struct ibv_xrcd *xrcd;
static struct ibv_pd *send_pd; /* the XRC_SEND QPs' PD: their local buffers */
static struct ibv_cq *scq, *rcq, *rcq2;
static struct ibv_mr *lmr;
static char lbuf[TSIZE] __attribute__((aligned(8)));
/* The target's memory: tbuf (the SRQ's PD, every remote access), robuf (the SRQ's PD, remote
 * read only), obuf (another PD, every remote access). */
static char tbuf[TSIZE] __attribute__((aligned(8))), robuf[4096], obuf[4096];
static char before[3][TSIZE];

struct pair {
    struct ibv_qp *tgt, *snd;
};

static struct pair make_pair(int access)
{
    struct pair p = { target_qp(xrcd), send_qp(send_pd, scq, XRC_OPS) };
    connect_qp_access(p.tgt, p.snd->qp_num, 1, access);
    connect_qp(p.snd, p.tgt->qp_num, 0);
    return p;
}

static int is_atomic(enum ibv_wr_opcode op)
{
    return op == IBV_WR_ATOMIC_CMP_AND_SWP || op == IBV_WR_ATOMIC_FETCH_AND_ADD;
}

/* Posts one signaled WR on `p.snd` from base+loff (registered by `mr`), naming SRQ `srqn`. */
static void post_from(struct ibv_mr *mr, char *base, struct pair p, enum ibv_wr_opcode op, uint64_t id,
                      uint32_t loff, uint32_t len, void *raddr, uint32_t rkey, uint32_t srqn,
                      uint64_t compare_add, uint64_t swap, uint32_t imm)
{
    struct ibv_sge sge = { (uintptr_t)base + loff, len, mr->lkey };
    struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
                              .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(imm) }, *bad;
    if (is_atomic(op)) {
        wr.wr.atomic.remote_addr = (uintptr_t)raddr;
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.compare_add = compare_add;
        wr.wr.atomic.swap = swap;
    } else {
        wr.wr.rdma.remote_addr = (uintptr_t)raddr;
        wr.wr.rdma.rkey = rkey;
    }
    wr.qp_type.xrc.remote_srqn = srqn;
    CHECK(ibv_post_send(p.snd, &wr, &bad) == 0, "post_send wr %llu", (unsigned long long)id);
}

/* post_from lbuf. */
static void post(struct pair p, enum ibv_wr_opcode op, uint64_t id, uint32_t loff, uint32_t len, void *raddr,
                 uint32_t rkey, uint32_t srqn, uint64_t compare_add, uint64_t swap, uint32_t imm)
{
    post_from(lmr, lbuf, p, op, id, loff, len, raddr, rkey, srqn, compare_add, swap, imm);
}

/* The requester's completion of `id`: every field (byte_len is the length on success). */
static void expect_wc(struct pair p, uint64_t id, enum ibv_wr_opcode op, uint32_t len, enum ibv_wc_status status)
{
    enum ibv_wc_opcode wop = op == IBV_WR_RDMA_READ               ? IBV_WC_RDMA_READ
                           : op == IBV_WR_ATOMIC_FETCH_AND_ADD    ? IBV_WC_FETCH_ADD
                           : op == IBV_WR_ATOMIC_CMP_AND_SWP      ? IBV_WC_COMP_SWAP
                                                                  : IBV_WC_RDMA_WRITE;
    struct ibv_wc wc;
    memset(&wc, 0xab, sizeof wc);
    CHECK(poll_one(scq, &wc) == 1, "completion of wr %llu", (unsigned long long)id);
    CHECK(wc.wr_id == id && wc.status == status && wc.qp_num == p.snd->qp_num && wc.vendor_err == 0,
          "wc wr_id %llu (want %llu) status %s (want %s) qp %#x", (unsigned long long)wc.wr_id,
          (unsigned long long)id, ibv_wc_status_str(wc.status), ibv_wc_status_str(status), wc.qp_num);
    CHECK(wc.opcode == wop && wc.wc_flags == 0, "wc %llu opcode %d flags %#x", (unsigned long long)id,
          wc.opcode, wc.wc_flags);
    CHECK(wc.byte_len == (status == IBV_WC_SUCCESS ? len : 0), "wc %llu byte_len %u", (unsigned long long)id,
          wc.byte_len);
    CHECK(wc.src_qp == 0 && wc.slid == 0 && wc.sl == 0 && wc.dlid_path_bits == 0 && wc.pkey_index == 0 &&
          wc.imm_data == 0, "wc %llu: no receive fields", (unsigned long long)id);
}

/* A WRITE_WITH_IMM's receive completion of SRQ WR `wr_id` through `p.tgt`. */
static void expect_imm_wc(struct ibv_cq *cq, struct pair p, uint64_t wr_id, enum ibv_wc_status status,
                          uint32_t len, uint32_t imm)
{
    struct ibv_wc wc;
    memset(&wc, 0xab, sizeof wc);
    CHECK(poll_one(cq, &wc) == 1, "receive completion of SRQ WR %llu", (unsigned long long)wr_id);
    CHECK(wc.wr_id == wr_id && wc.status == status && wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM &&
          wc.vendor_err == 0, "imm wc %llu %s opcode %d", (unsigned long long)wc.wr_id,
          ibv_wc_status_str(wc.status), wc.opcode);
    CHECK(wc.qp_num == p.tgt->qp_num && wc.src_qp == p.snd->qp_num, "imm wc qp %#x src_qp %#x", wc.qp_num,
          wc.src_qp);
    CHECK(wc.slid == lid && wc.sl == 0 && wc.dlid_path_bits == 0 && wc.pkey_index == 0, "imm wc path fields");
    if (status == IBV_WC_SUCCESS)
        CHECK(wc.byte_len == len && wc.wc_flags == IBV_WC_WITH_IMM && ntohl(wc.imm_data) == imm,
              "imm wc byte_len %u flags %#x imm %#x", wc.byte_len, wc.wc_flags, ntohl(wc.imm_data));
    else
        CHECK(wc.byte_len == 0 && wc.wc_flags == 0, "failed imm wc byte_len %u flags %#x", wc.byte_len,
              wc.wc_flags);
}

static uint64_t u64_at(const char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void keep_memory(void)
{
    memcpy(before[0], tbuf, TSIZE);
    memcpy(before[1], robuf, sizeof robuf);
    memcpy(before[2], obuf, sizeof obuf);
}

static void memory_untouched(const char *what)
{
    CHECK(memcmp(before[0], tbuf, TSIZE) == 0 && memcmp(before[1], robuf, sizeof robuf) == 0 &&
          memcmp(before[2], obuf, sizeof obuf) == 0, "%s: the target's memory changed", what);
}

/* `op` on a fresh pair (target access `access`) is refused: REM_ACCESS_ERR at the requester,
 * the target to ERR with IBV_EVENT_QP_ACCESS_ERR, nothing written. */
static void refused(int access, enum ibv_wr_opcode op, uint32_t len, void *raddr, uint32_t rkey,
                    uint32_t srqn, const char *what)
{
    static uint64_t id = 9000;
    struct pair p = make_pair(access);
    memset(lbuf, 0x77, sizeof lbuf);
    keep_memory();
    post(p, op, ++id, 0, len, raddr, rkey, srqn, 1, 2, 0);
    expect_wc(p, id, op, len, IBV_WC_REM_ACCESS_ERR);
    expect_qp_event(IBV_EVENT_QP_ACCESS_ERR, p.tgt);
    CHECK(qp_state(p.tgt) == IBV_QPS_ERR && qp_state(p.snd) == IBV_QPS_ERR, "%s: both QPs in ERR", what);
    if (is_atomic(op) || op == IBV_WR_RDMA_READ)
        for (uint32_t i = 0; i < len; i++)
            CHECK(lbuf[i] == 0x77, "%s: nothing came back", what);
    memory_untouched(what);
    expect_empty(rcq, what);
    CHECK(ibv_destroy_qp(p.snd) == 0 && ibv_destroy_qp(p.tgt) == 0, "%s: destroy the pair", what);
}

int main(void)
{
    struct ibv_device **list = open_xrc_device();
    xrcd = open_xrcd(-1, O_CREAT);
    struct ibv_xrcd *other_xrcd = open_xrcd(-1, O_CREAT);
    CHECK(xrcd && other_xrcd, "open_xrcd");
    struct ibv_pd *pd = ibv_alloc_pd(ctx), *pd_other = ibv_alloc_pd(ctx);
    send_pd = ibv_alloc_pd(ctx);
    CHECK(pd && pd_other && send_pd, "alloc_pd");
    static char rbuf[2][256];
    lmr = ibv_reg_mr(send_pd, lbuf, sizeof lbuf, IBV_ACCESS_LOCAL_WRITE | ALL_REMOTE);
    struct ibv_mr *tmr = ibv_reg_mr(pd, tbuf, sizeof tbuf, IBV_ACCESS_LOCAL_WRITE | ALL_REMOTE);
    struct ibv_mr *romr = ibv_reg_mr(pd, robuf, sizeof robuf, IBV_ACCESS_REMOTE_READ);
    struct ibv_mr *omr = ibv_reg_mr(pd_other, obuf, sizeof obuf, IBV_ACCESS_LOCAL_WRITE | ALL_REMOTE);
    struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE);
    CHECK(lmr && tmr && romr && omr && rmr, "reg_mr");
    scq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    rcq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    rcq2 = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_cq *other_cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(scq && rcq && rcq2 && other_cq, "create_cq");
    /* Two SRQs of the domain in two PDs, one of another domain. */
    struct ibv_srq *srq = xrc_srq(xrcd, pd, rcq), *srq2 = xrc_srq(xrcd, pd_other, rcq2);
    struct ibv_srq *foreign = xrc_srq(other_xrcd, pd, other_cq);
    uint32_t srqn, srqn2, foreign_srqn;
    CHECK(ibv_get_srq_num(srq, &srqn) == 0 && ibv_get_srq_num(srq2, &srqn2) == 0 &&
          ibv_get_srq_num(foreign, &foreign_srqn) == 0, "get_srq_num");

    struct pair p = make_pair(ALL_REMOTE);
    for (int i = 0; i < TSIZE; i++)
        lbuf[i] = (char)(i * 7 + 3);
    memset(tbuf, 0, sizeof tbuf);
    memset(rbuf, 0x5a, sizeof rbuf);
    post_srq(srq, rmr, rbuf[0], sizeof rbuf[0], 500);

    /* 1. RDMA WRITE into the SRQ's PD: the data lands, no SRQ WR is taken. */
    post(p, IBV_WR_RDMA_WRITE, 1, 0, 3000, tbuf + 64, tmr->rkey, srqn, 0, 0, 0);
    expect_wc(p, 1, IBV_WR_RDMA_WRITE, 3000, IBV_WC_SUCCESS);
    CHECK(memcmp(tbuf + 64, lbuf, 3000) == 0 && tbuf[63] == 0 && tbuf[64 + 3000] == 0, "data of the WRITE");
    expect_empty(rcq, "a WRITE takes no SRQ WR");

    /* 2. WRITE_WITH_IMM: the data lands in the MR, the SRQ's WR completes on its CQ (its
     * buffer, smaller than the WRITE, is not written). */
    post(p, IBV_WR_RDMA_WRITE_WITH_IMM, 2, 3000, 1000, tbuf + 4096, tmr->rkey, srqn, 0, 0, 0xcafe0002);
    expect_wc(p, 2, IBV_WR_RDMA_WRITE_WITH_IMM, 1000, IBV_WC_SUCCESS);
    expect_imm_wc(rcq, p, 500, IBV_WC_SUCCESS, 1000, 0xcafe0002);
    CHECK(memcmp(tbuf + 4096, lbuf + 3000, 1000) == 0, "data of the WRITE_WITH_IMM");
    for (size_t i = 0; i < sizeof rbuf; i++)
        CHECK(((char *)rbuf)[i] == 0x5a, "the SRQ WR's buffer is untouched");

    /* 2b. A WRITE_WITH_IMM to an SRQ without a WR waits (RNR), nothing written, and lands
     * when a WR is posted. */
    post(p, IBV_WR_RDMA_WRITE_WITH_IMM, 15, 0, 32, tbuf + 7000, tmr->rkey, srqn, 0, 0, 0xcafe0015);
    expect_empty(scq, "a WRITE_WITH_IMM waiting for an SRQ WR");
    expect_empty(rcq, "the SRQ's CQ before a WR is posted");
    for (int i = 0; i < 32; i++)
        CHECK(tbuf[7000 + i] == 0, "nothing is written before the WR is there");
    post_srq(srq, rmr, rbuf[1], sizeof rbuf[1], 503);
    expect_wc(p, 15, IBV_WR_RDMA_WRITE_WITH_IMM, 32, IBV_WC_SUCCESS);
    expect_imm_wc(rcq, p, 503, IBV_WC_SUCCESS, 32, 0xcafe0015);
    CHECK(memcmp(tbuf + 7000, lbuf, 32) == 0, "data of the waiting WRITE_WITH_IMM");

    /* 3. READ back what the WRITE put there; READ of a remote-read-only region. */
    memset(lbuf + 4096, 0, 4096);
    post(p, IBV_WR_RDMA_READ, 3, 4096, 3000, tbuf + 64, tmr->rkey, srqn, 0, 0, 0);
    expect_wc(p, 3, IBV_WR_RDMA_READ, 3000, IBV_WC_SUCCESS);
    CHECK(memcmp(lbuf + 4096, lbuf, 3000) == 0, "data of the READ");
    memset(robuf, 'r', sizeof robuf);
    post(p, IBV_WR_RDMA_READ, 4, 4096, 100, robuf + 10, romr->rkey, srqn, 0, 0, 0);
    expect_wc(p, 4, IBV_WR_RDMA_READ, 100, IBV_WC_SUCCESS);
    CHECK(memcmp(lbuf + 4096, robuf, 100) == 0, "data of the READ of a read-only region");

    /* 4. Atomics: FETCH_ADD, CMP_SWP that swaps, CMP_SWP that does not. */
    uint64_t v = 40;
    memcpy(tbuf + 6144, &v, 8);
    post(p, IBV_WR_ATOMIC_FETCH_AND_ADD, 5, 7168, 8, tbuf + 6144, tmr->rkey, srqn, 2, 0, 0);
    expect_wc(p, 5, IBV_WR_ATOMIC_FETCH_AND_ADD, 8, IBV_WC_SUCCESS);
    CHECK(u64_at(lbuf + 7168) == 40 && u64_at(tbuf + 6144) == 42, "FETCH_ADD: %llu, now %llu",
          (unsigned long long)u64_at(lbuf + 7168), (unsigned long long)u64_at(tbuf + 6144));
    post(p, IBV_WR_ATOMIC_CMP_AND_SWP, 6, 7168, 8, tbuf + 6144, tmr->rkey, srqn, 42, 7, 0);
    expect_wc(p, 6, IBV_WR_ATOMIC_CMP_AND_SWP, 8, IBV_WC_SUCCESS);
    CHECK(u64_at(lbuf + 7168) == 42 && u64_at(tbuf + 6144) == 7, "CMP_SWP that swaps");
    post(p, IBV_WR_ATOMIC_CMP_AND_SWP, 7, 7168, 8, tbuf + 6144, tmr->rkey, srqn, 1, 9, 0);
    expect_wc(p, 7, IBV_WR_ATOMIC_CMP_AND_SWP, 8, IBV_WC_SUCCESS);
    CHECK(u64_at(lbuf + 7168) == 7 && u64_at(tbuf + 6144) == 7, "CMP_SWP that does not swap");

    /* 4b. An on-demand-paging MR of the SRQ's PD (xrc_odp_caps says WRITE and READ). */
    static char odp_buf[4096];
    struct ibv_mr *odp = ibv_reg_mr(pd, odp_buf, sizeof odp_buf,
                                    IBV_ACCESS_LOCAL_WRITE | ALL_REMOTE | IBV_ACCESS_ON_DEMAND);
    CHECK(odp, "reg_mr ODP");
    post(p, IBV_WR_RDMA_WRITE, 16, 200, 1000, odp_buf + 1000, odp->rkey, srqn, 0, 0, 0);
    expect_wc(p, 16, IBV_WR_RDMA_WRITE, 1000, IBV_WC_SUCCESS);
    CHECK(memcmp(odp_buf + 1000, lbuf + 200, 1000) == 0, "data of the WRITE to an ODP MR");
    memset(lbuf + 4096, 0, 1000);
    post(p, IBV_WR_RDMA_READ, 17, 4096, 1000, odp_buf + 1000, odp->rkey, srqn, 0, 0, 0);
    expect_wc(p, 17, IBV_WR_RDMA_READ, 1000, IBV_WC_SUCCESS);
    CHECK(memcmp(lbuf + 4096, lbuf + 200, 1000) == 0, "data of the READ of an ODP MR");
    CHECK(ibv_dereg_mr(odp) == 0, "dereg ODP MR");

    /* 4c. Large transfers (UCX rendezvous): a 1 MiB WRITE, READ and WRITE_WITH_IMM. */
    size_t big = 1 << 20;
    char *lbig = malloc(big), *back = malloc(big), *tbig = calloc(1, big);
    CHECK(lbig && back && tbig, "malloc");
    for (size_t i = 0; i < big; i++)
        lbig[i] = (char)(i * 13 + 5);
    struct ibv_mr *lbig_mr = ibv_reg_mr(send_pd, lbig, big, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *back_mr = ibv_reg_mr(send_pd, back, big, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *tbig_mr = ibv_reg_mr(pd, tbig, big, IBV_ACCESS_LOCAL_WRITE | ALL_REMOTE);
    CHECK(lbig_mr && back_mr && tbig_mr, "reg_mr 1 MiB");
    post_from(lbig_mr, lbig, p, IBV_WR_RDMA_WRITE, 18, 0, (uint32_t)big, tbig, tbig_mr->rkey, srqn, 0, 0, 0);
    expect_wc(p, 18, IBV_WR_RDMA_WRITE, (uint32_t)big, IBV_WC_SUCCESS);
    CHECK(memcmp(tbig, lbig, big) == 0, "data of the 1 MiB WRITE");
    post_from(back_mr, back, p, IBV_WR_RDMA_READ, 19, 0, (uint32_t)big, tbig, tbig_mr->rkey, srqn, 0, 0, 0);
    expect_wc(p, 19, IBV_WR_RDMA_READ, (uint32_t)big, IBV_WC_SUCCESS);
    CHECK(memcmp(back, lbig, big) == 0, "data of the 1 MiB READ");
    memset(tbig, 0, big);
    post_srq(srq, rmr, rbuf[0], sizeof rbuf[0], 504);
    post_from(lbig_mr, lbig, p, IBV_WR_RDMA_WRITE_WITH_IMM, 20, 0, (uint32_t)big, tbig, tbig_mr->rkey, srqn, 0, 0, 0xcafe0020);
    expect_wc(p, 20, IBV_WR_RDMA_WRITE_WITH_IMM, (uint32_t)big, IBV_WC_SUCCESS);
    expect_imm_wc(rcq, p, 504, IBV_WC_SUCCESS, (uint32_t)big, 0xcafe0020);
    CHECK(memcmp(tbig, lbig, big) == 0, "data of the 1 MiB WRITE_WITH_IMM");
    CHECK(ibv_dereg_mr(lbig_mr) == 0 && ibv_dereg_mr(back_mr) == 0 && ibv_dereg_mr(tbig_mr) == 0, "dereg 1 MiB");
    free(lbig);
    free(back);
    free(tbig);

    /* 5. The rkey's PD is the named SRQ's: a region of pd_other is written when the WRITE
     * names srq2 (of pd_other), not when it names srq (see 7b). */
    memset(obuf, 0, sizeof obuf);
    post(p, IBV_WR_RDMA_WRITE, 8, 0, 500, obuf + 8, omr->rkey, srqn2, 0, 0, 0);
    expect_wc(p, 8, IBV_WR_RDMA_WRITE, 500, IBV_WC_SUCCESS);
    CHECK(memcmp(obuf + 8, lbuf, 500) == 0, "data of the WRITE through srq2's PD");
    expect_empty(rcq2, "a WRITE takes no WR of srq2");

    /* 6. The ibv_wr_* API with ibv_wr_set_xrc_srqn: a WRITE and a FETCH_ADD in one batch. */
    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(p.snd);
    CHECK(qx, "qp_to_qp_ex");
    ibv_wr_start(qx);
    qx->wr_id = 9;
    qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_rdma_write(qx, tmr->rkey, (uintptr_t)(tbuf + 5000));
    ibv_wr_set_xrc_srqn(qx, srqn);
    ibv_wr_set_sge(qx, lmr->lkey, (uintptr_t)lbuf + 100, 64);
    qx->wr_id = 10;
    ibv_wr_atomic_fetch_add(qx, tmr->rkey, (uintptr_t)(tbuf + 6144), 5);
    ibv_wr_set_xrc_srqn(qx, srqn);
    ibv_wr_set_sge(qx, lmr->lkey, (uintptr_t)lbuf + 7168, 8);
    CHECK(ibv_wr_complete(qx) == 0, "wr_complete");
    expect_wc(p, 9, IBV_WR_RDMA_WRITE, 64, IBV_WC_SUCCESS);
    expect_wc(p, 10, IBV_WR_ATOMIC_FETCH_AND_ADD, 8, IBV_WC_SUCCESS);
    CHECK(memcmp(tbuf + 5000, lbuf + 100, 64) == 0, "data of the ibv_wr_rdma_write");
    CHECK(u64_at(lbuf + 7168) == 7 && u64_at(tbuf + 6144) == 12, "ibv_wr_atomic_fetch_add");

    /* SEND_WITH_INV is not carried over XRC. */
    struct ibv_sge sge = { (uintptr_t)lbuf, 8, lmr->lkey };
    struct ibv_send_wr inv = { .wr_id = 11, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_INV,
                               .send_flags = IBV_SEND_SIGNALED, .invalidate_rkey = tmr->rkey }, *bad;
    inv.qp_type.xrc.remote_srqn = srqn;
    CHECK(ibv_post_send(p.snd, &inv, &bad) == EINVAL && bad == &inv, "SEND_WITH_INV over XRC: EINVAL");
    expect_empty(scq, "nothing after the refused post");
    CHECK(qp_state(p.snd) == IBV_QPS_RTS && qp_state(p.tgt) == IBV_QPS_RTS, "the pair is still in RTS");

    /* 7. Remote access errors, as RC's. */
    refused(ALL_REMOTE, IBV_WR_RDMA_WRITE, 64, tbuf, tmr->rkey ^ 0x100000, srqn, "a bad rkey");
    refused(ALL_REMOTE, IBV_WR_RDMA_WRITE, 64, obuf, omr->rkey, srqn, "an MR of another PD than the SRQ's");
    refused(ALL_REMOTE, IBV_WR_RDMA_WRITE, 64, lbuf, lmr->rkey, srqn, "an MR of the requester's PD");
    refused(ALL_REMOTE, IBV_WR_RDMA_WRITE, 64, robuf, romr->rkey, srqn, "an MR without REMOTE_WRITE");
    refused(ALL_REMOTE, IBV_WR_RDMA_WRITE, 64, tbuf + TSIZE - 32, tmr->rkey, srqn, "a WRITE past the MR");
    refused(ALL_REMOTE, IBV_WR_RDMA_READ, 64, tbuf + TSIZE - 32, tmr->rkey, srqn, "a READ past the MR");
    refused(IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ, IBV_WR_ATOMIC_FETCH_AND_ADD, 8, tbuf + 6144,
            tmr->rkey, srqn, "an atomic on a target without REMOTE_ATOMIC");
    refused(IBV_ACCESS_REMOTE_READ, IBV_WR_RDMA_WRITE, 64, tbuf, tmr->rkey, srqn,
            "a WRITE on a target without REMOTE_WRITE");

    /* 7b. WRITE_WITH_IMM with an rkey of another PD than its SRQ's: its SRQ WR completes with
     * IBV_WC_REM_ACCESS_ERR on the SRQ's CQ, the next WR of the SRQ stays for later. */
    struct pair q = make_pair(ALL_REMOTE);
    post_srq(srq, rmr, rbuf[0], sizeof rbuf[0], 501);
    post_srq(srq, rmr, rbuf[1], sizeof rbuf[1], 502);
    keep_memory();
    post(q, IBV_WR_RDMA_WRITE_WITH_IMM, 12, 0, 64, obuf, omr->rkey, srqn, 0, 0, 12);
    expect_wc(q, 12, IBV_WR_RDMA_WRITE_WITH_IMM, 64, IBV_WC_REM_ACCESS_ERR);
    expect_imm_wc(rcq, q, 501, IBV_WC_REM_ACCESS_ERR, 0, 0);
    expect_qp_event(IBV_EVENT_QP_ACCESS_ERR, q.tgt);
    CHECK(qp_state(q.tgt) == IBV_QPS_ERR, "target QP in ERR after a refused WRITE_WITH_IMM");
    memory_untouched("a refused WRITE_WITH_IMM");
    expect_empty(rcq, "the SRQ's other WR stays posted");

    /* 8. A WRITE naming an SRQ of another domain: an invalid request. */
    struct pair f = make_pair(ALL_REMOTE);
    post(f, IBV_WR_RDMA_WRITE, 13, 0, 64, tbuf, tmr->rkey, foreign_srqn, 0, 0, 0);
    expect_wc(f, 13, IBV_WR_RDMA_WRITE, 64, IBV_WC_REM_INV_REQ_ERR);
    expect_qp_event(IBV_EVENT_QP_REQ_ERR, f.tgt);
    CHECK(qp_state(f.tgt) == IBV_QPS_ERR, "target QP in ERR after a foreign SRQ");
    memory_untouched("a WRITE naming a foreign SRQ");

    /* The SRQ's remaining WR still serves a WRITE_WITH_IMM on the first pair. */
    post(p, IBV_WR_RDMA_WRITE_WITH_IMM, 14, 0, 16, tbuf, tmr->rkey, srqn, 0, 0, 14);
    expect_wc(p, 14, IBV_WR_RDMA_WRITE_WITH_IMM, 16, IBV_WC_SUCCESS);
    expect_imm_wc(rcq, p, 502, IBV_WC_SUCCESS, 16, 14);
    CHECK(memcmp(tbuf, lbuf, 16) == 0, "data of the last WRITE_WITH_IMM");

    struct ibv_qp *qps[] = { p.snd, p.tgt, q.snd, q.tgt, f.snd, f.tgt };
    for (size_t i = 0; i < sizeof qps / sizeof qps[0]; i++)
        CHECK(ibv_destroy_qp(qps[i]) == 0, "destroy QP %zu", i);
    CHECK(ibv_destroy_srq(srq) == 0 && ibv_destroy_srq(srq2) == 0 && ibv_destroy_srq(foreign) == 0, "destroy SRQs");
    CHECK(ibv_close_xrcd(xrcd) == 0 && ibv_close_xrcd(other_xrcd) == 0, "close xrcds");
    CHECK(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0 && ibv_destroy_cq(rcq2) == 0 &&
          ibv_destroy_cq(other_cq) == 0, "destroy CQs");
    CHECK(ibv_dereg_mr(lmr) == 0 && ibv_dereg_mr(tmr) == 0 && ibv_dereg_mr(romr) == 0 && ibv_dereg_mr(omr) == 0 &&
          ibv_dereg_mr(rmr) == 0, "dereg MRs");
    CHECK(ibv_dealloc_pd(pd) == 0 && ibv_dealloc_pd(pd_other) == 0 && ibv_dealloc_pd(send_pd) == 0, "free PDs");
    CHECK(ibv_close_device(ctx) == 0, "close_device");
    ibv_free_device_list(list);
    printf("xrc_rdma: ok\n");
    return 0;
}
