/* XRC as applications call it (the real <infiniband/verbs.h>: ibv_open_xrcd, ibv_close_xrcd,
 * ibv_create_srq_ex, ibv_get_srq_num, ibv_create_qp_ex, ibv_open_qp and ibv_wr_set_xrc_srqn are
 * inline there), linked against libibverbs and run with libugdr.so preloaded. An XRC_SEND QP
 * of this process sends to an XRC_RECV QP of this process; every completion's fields and the
 * bytes moved are checked, and the error cases: an SRQ number of another domain or of none (the
 * sender's WR completes with IBV_WC_REM_INV_REQ_ERR, the target goes to ERR with
 * IBV_EVENT_QP_REQ_ERR), a SEND above the SRQ WR's length (LOC_LEN_ERR on the SRQ's CQ), a
 * SEND waiting for an SRQ WR (RNR), xrcd open flags, closing an xrcd in use (EBUSY), ibv_open_qp of a
 * number that is not a target QP of the domain. Exit 0 and "xrc: ok" only if all hold. */
#include "xrc_test.h"

static int post_xrc_send(struct ibv_qp *qp, struct ibv_mr *mr, char *buf, uint32_t len, uint64_t wr_id,
                         uint32_t srqn, uint32_t imm)
{
    struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
    struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1,
                              .opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
                              .imm_data = htonl(imm) }, *bad;
    wr.qp_type.xrc.remote_srqn = srqn;
    return ibv_post_send(qp, &wr, &bad);
}

static void expect_send_wc(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status status,
                           struct ibv_qp *qp, uint32_t len)
{
    struct ibv_wc wc;
    memset(&wc, 0xab, sizeof wc);
    CHECK(poll_one(cq, &wc) == 1, "send completion of wr %llu", (unsigned long long)wr_id);
    CHECK(wc.wr_id == wr_id && wc.status == status, "send wc wr_id %llu status %s",
          (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
    CHECK(wc.opcode == IBV_WC_SEND && wc.qp_num == qp->qp_num && wc.vendor_err == 0, "send wc opcode/qp");
    CHECK(wc.byte_len == (status == IBV_WC_SUCCESS ? len : 0) && wc.wc_flags == 0, "send wc len %u flags %#x",
          wc.byte_len, wc.wc_flags);
    CHECK(wc.src_qp == 0 && wc.slid == 0 && wc.sl == 0 && wc.dlid_path_bits == 0 && wc.pkey_index == 0 &&
          wc.imm_data == 0, "send wc: no receive fields");
}

/* The receive completion of a SEND_WITH_IMM from `from` through target QP `tgt_qpn`. */
static void expect_recv_wc(struct ibv_cq *cq, uint64_t wr_id, uint32_t tgt_qpn, struct ibv_qp *from,
                           uint32_t len, uint32_t imm)
{
    struct ibv_wc wc;
    memset(&wc, 0xab, sizeof wc);
    CHECK(poll_one(cq, &wc) == 1, "receive completion");
    CHECK(wc.wr_id == wr_id && wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_RECV, "recv wc %llu %s",
          (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
    CHECK(wc.byte_len == len && wc.vendor_err == 0, "recv byte_len %u", wc.byte_len);
    CHECK(wc.qp_num == tgt_qpn, "recv qp_num %#x is the XRC_RECV QP %#x", wc.qp_num, tgt_qpn);
    CHECK(wc.src_qp == from->qp_num, "recv src_qp %#x is the XRC_SEND QP %#x", wc.src_qp, from->qp_num);
    CHECK(wc.wc_flags == IBV_WC_WITH_IMM && ntohl(wc.imm_data) == imm, "recv imm");
    CHECK(wc.slid == lid && wc.sl == 0 && wc.dlid_path_bits == 0 && wc.pkey_index == 0, "recv path fields");
}

int main(void)
{
    struct ibv_device **list = open_xrc_device();

    /* Domains: the same file opened twice is one domain; open flags as the kernel's. */
    char path[] = "/tmp/ugdr-xrc-XXXXXX";
    int fd = mkstemp(path), fd2 = dup(fd);
    CHECK(fd >= 0 && fd2 >= 0, "mkstemp");
    char other[] = "/tmp/ugdr-xrc-other-XXXXXX";
    int fd_other = mkstemp(other);
    CHECK(fd_other >= 0, "mkstemp");
    FAILS_WITH(open_xrcd(fd_other, 0), NULL, EAGAIN); /* no domain there and no O_CREAT */
    struct ibv_xrcd_init_attr no_oflags = { .comp_mask = IBV_XRCD_INIT_ATTR_FD, .fd = fd };
    FAILS_WITH(ibv_open_xrcd(ctx, &no_oflags), NULL, EINVAL);
    FAILS_WITH(open_xrcd(123456, O_CREAT), NULL, EBADF);
    struct ibv_xrcd *x1 = open_xrcd(fd, O_CREAT);
    CHECK(x1 && x1->context == ctx, "open_xrcd O_CREAT");
    struct ibv_xrcd *x2 = open_xrcd(fd2, 0); /* the same file: the same domain */
    CHECK(x2 && x2 != x1, "open_xrcd of the same file");
    FAILS_WITH(open_xrcd(fd, O_CREAT | O_EXCL), NULL, EINVAL);
    struct ibv_xrcd *x_anon = open_xrcd(-1, O_CREAT); /* a domain no file names */
    CHECK(x_anon, "open_xrcd fd -1");

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc_pd");
    static char sbuf[4096], rbuf[4][4096];
    struct ibv_mr *smr = ibv_reg_mr(pd, sbuf, sizeof sbuf, 0);
    struct ibv_mr *rmr = ibv_reg_mr(pd, rbuf, sizeof rbuf, IBV_ACCESS_LOCAL_WRITE);
    CHECK(smr && rmr, "reg_mr");
    struct ibv_cq *scq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_cq *rcq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    struct ibv_cq *other_cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(scq && rcq && other_cq, "create_cq");

    /* An XRC SRQ made through x1; a target QP made through x2 (same domain) delivers into it. */
    struct ibv_srq *srq = xrc_srq(x1, pd, rcq);
    struct ibv_srq *foreign = xrc_srq(x_anon, pd, other_cq);
    uint32_t srqn = 0, foreign_srqn = 0;
    CHECK(ibv_get_srq_num(srq, &srqn) == 0 && srqn != 0 && srqn <= 0xffffff, "get_srq_num");
    CHECK(ibv_get_srq_num(foreign, &foreign_srqn) == 0 && foreign_srqn != srqn, "get_srq_num (other domain)");
    CHECK(ibv_close_xrcd(x1) == EBUSY, "%s", "ibv_close_xrcd(x1)"); /* its SRQ remains */
    CHECK(ibv_destroy_cq(rcq) == EBUSY, "%s", "ibv_destroy_cq(rcq)"); /* the XRC SRQ completes on it */
    struct ibv_qp *tgt = target_qp(x2);
    struct ibv_qp *snd = send_qp(pd, scq, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM);
    connect_qp(tgt, snd->qp_num, 1);
    connect_qp(snd, tgt->qp_num, 0);
    CHECK(qp_state(tgt) == IBV_QPS_RTS && qp_state(snd) == IBV_QPS_RTS, "both in RTS");
    struct ibv_recv_wr rwr = { .wr_id = 1 }, *rbad;
    CHECK(ibv_post_recv(snd, &rwr, &rbad) == EINVAL, "%s", "ibv_post_recv(snd, &rwr, &rbad)"); /* XRC_SEND has no receive queue */

    /* 1. ibv_post_send with qp_type.xrc.remote_srqn. */
    for (int i = 0; i < 3; i++)
        post_srq(srq, rmr, rbuf[i], sizeof rbuf[i], 100 + i);
    memset(sbuf, 'x', 3000);
    CHECK(post_xrc_send(snd, smr, sbuf, 3000, 1, srqn, 0xfeed0001) == 0, "post_send");
    expect_send_wc(scq, 1, IBV_WC_SUCCESS, snd, 3000);
    expect_recv_wc(rcq, 100, tgt->qp_num, snd, 3000, 0xfeed0001);
    CHECK(memcmp(rbuf[0], sbuf, 3000) == 0, "data of message 1");

    /* 2. ibv_wr_* with ibv_wr_set_xrc_srqn, inline. */
    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(snd);
    CHECK(qx, "qp_to_qp_ex");
    memcpy(sbuf, "xrc through the wr api", 23);
    ibv_wr_start(qx);
    qx->wr_id = 2;
    qx->wr_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    ibv_wr_send_imm(qx, htonl(0xfeed0002));
    ibv_wr_set_xrc_srqn(qx, srqn);
    ibv_wr_set_inline_data(qx, sbuf, 23);
    CHECK(ibv_wr_complete(qx) == 0, "wr_complete");
    expect_send_wc(scq, 2, IBV_WC_SUCCESS, snd, 23);
    expect_recv_wc(rcq, 101, tgt->qp_num, snd, 23, 0xfeed0002);
    CHECK(memcmp(rbuf[1], "xrc through the wr api", 23) == 0, "data of message 2");

    /* 3. ibv_open_qp: another handle of the target QP; the creator's handle goes, the QP stays. */
    struct ibv_qp_open_attr oa = { .comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD |
                                   IBV_QP_OPEN_ATTR_TYPE | IBV_QP_OPEN_ATTR_CONTEXT,
                                   .qp_num = tgt->qp_num, .xrcd = x1, .qp_context = &oa,
                                   .qp_type = IBV_QPT_XRC_RECV };
    struct ibv_qp *opened = ibv_open_qp(ctx, &oa);
    CHECK(opened && opened != tgt && opened->qp_num == tgt->qp_num && opened->qp_context == &oa &&
          opened->qp_type == IBV_QPT_XRC_RECV, "open_qp");
    struct ibv_qp_open_attr bad_num = oa;
    bad_num.qp_num = snd->qp_num; /* not a target QP of the domain */
    FAILS_WITH(ibv_open_qp(ctx, &bad_num), NULL, EINVAL);
    struct ibv_qp_open_attr other_domain = oa;
    other_domain.xrcd = x_anon;
    FAILS_WITH(ibv_open_qp(ctx, &other_domain), NULL, EINVAL);
    uint32_t tgt_qpn = tgt->qp_num;
    CHECK(ibv_destroy_qp(tgt) == 0, "destroy the creator's handle");
    CHECK(qp_state(opened) == IBV_QPS_RTS, "the opened handle still sees the QP in RTS");
    memset(sbuf, 'y', 100);
    CHECK(post_xrc_send(snd, smr, sbuf, 100, 3, srqn, 0xfeed0003) == 0, "post_send after destroy of one handle");
    expect_send_wc(scq, 3, IBV_WC_SUCCESS, snd, 100);
    expect_recv_wc(rcq, 102, tgt_qpn, snd, 100, 0xfeed0003);
    CHECK(memcmp(rbuf[2], sbuf, 100) == 0, "data of message 3");

    /* 3b. A SEND before its SRQ has a WR waits (RNR) and lands when one is posted. */
    memset(sbuf, 'z', 200);
    CHECK(post_xrc_send(snd, smr, sbuf, 200, 7, srqn, 0xfeed0007) == 0, "post_send to an empty SRQ");
    expect_empty(scq, "a SEND waiting for an SRQ WR");
    expect_empty(rcq, "the SRQ's CQ before a WR is posted");
    post_srq(srq, rmr, rbuf[0], sizeof rbuf[0], 103);
    expect_send_wc(scq, 7, IBV_WC_SUCCESS, snd, 200);
    expect_recv_wc(rcq, 103, tgt_qpn, snd, 200, 0xfeed0007);
    CHECK(memcmp(rbuf[0], sbuf, 200) == 0, "data of message 7");

    /* 4. An SRQ number of another domain: an invalid request. */
    post_srq(foreign, rmr, rbuf[3], sizeof rbuf[3], 200);
    CHECK(post_xrc_send(snd, smr, sbuf, 100, 4, foreign_srqn, 4) == 0, "post_send to a foreign SRQ");
    CHECK(post_xrc_send(snd, smr, sbuf, 100, 5, srqn, 5) == 0, "post_send behind it");
    expect_send_wc(scq, 4, IBV_WC_REM_INV_REQ_ERR, snd, 0);
    expect_send_wc(scq, 5, IBV_WC_WR_FLUSH_ERR, snd, 0);
    expect_qp_event(IBV_EVENT_QP_REQ_ERR, opened);
    CHECK(qp_state(opened) == IBV_QPS_ERR, "the target QP went to ERR");
    CHECK(qp_state(snd) == IBV_QPS_ERR, "the XRC_SEND QP went to ERR");
    expect_empty(other_cq, "the foreign SRQ's CQ");
    expect_empty(rcq, "the SRQ's CQ");

    /* 5. A number that is no SRQ at all, on a fresh pair of the same domain. */
    struct ibv_qp *tgt2 = target_qp(x1);
    struct ibv_qp *snd2 = send_qp(pd, scq, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM);
    connect_qp(tgt2, snd2->qp_num, 1);
    connect_qp(snd2, tgt2->qp_num, 0);
    CHECK(post_xrc_send(snd2, smr, sbuf, 10, 6, 0, 6) == 0, "post_send to SRQ 0");
    expect_send_wc(scq, 6, IBV_WC_REM_INV_REQ_ERR, snd2, 0);
    expect_qp_event(IBV_EVENT_QP_REQ_ERR, tgt2);
    CHECK(qp_state(tgt2) == IBV_QPS_ERR, "target QP 2 went to ERR");
    expect_empty(rcq, "the SRQ's CQ after SRQ 0");

    /* 6. A SEND longer than the SRQ's WR: LOC_LEN_ERR on the SRQ's CQ, REM_INV_REQ_ERR at the
     * sender, the target QP to ERR with IBV_EVENT_QP_REQ_ERR. */
    struct ibv_qp *tgt3 = target_qp(x1);
    struct ibv_qp *snd3 = send_qp(pd, scq, IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_IMM);
    connect_qp(tgt3, snd3->qp_num, 1);
    connect_qp(snd3, tgt3->qp_num, 0);
    post_srq(srq, rmr, rbuf[1], 16, 104);
    CHECK(post_xrc_send(snd3, smr, sbuf, 100, 8, srqn, 8) == 0, "post_send above the WR's length");
    struct ibv_wc wc;
    memset(&wc, 0xab, sizeof wc);
    CHECK(poll_one(rcq, &wc) == 1, "LOC_LEN_ERR completion");
    CHECK(wc.wr_id == 104 && wc.status == IBV_WC_LOC_LEN_ERR && wc.qp_num == tgt3->qp_num &&
          wc.vendor_err == 0 && wc.byte_len == 0 && wc.wc_flags == 0, "LOC_LEN_ERR wc: wr %llu %s qp %#x",
          (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status), wc.qp_num);
    expect_send_wc(scq, 8, IBV_WC_REM_INV_REQ_ERR, snd3, 0);
    expect_qp_event(IBV_EVENT_QP_REQ_ERR, tgt3);
    CHECK(qp_state(tgt3) == IBV_QPS_ERR, "target QP 3 went to ERR");
    CHECK(ibv_destroy_qp(snd3) == 0 && ibv_destroy_qp(tgt3) == 0, "destroy pair 3");

    /* Teardown: each xrcd closes once its objects are gone. */
    CHECK(ibv_destroy_qp(snd) == 0 && ibv_destroy_qp(snd2) == 0, "destroy XRC_SEND QPs");
    CHECK(ibv_destroy_qp(opened) == 0, "destroy the opened handle (the QP itself)");
    CHECK(ibv_close_xrcd(x1) == EBUSY, "%s", "ibv_close_xrcd(x1)");
    CHECK(ibv_destroy_qp(tgt2) == 0, "destroy target QP 2");
    CHECK(ibv_destroy_srq(srq) == 0 && ibv_destroy_srq(foreign) == 0, "destroy SRQs");
    CHECK(ibv_close_xrcd(x1) == 0 && ibv_close_xrcd(x2) == 0 && ibv_close_xrcd(x_anon) == 0, "close xrcds");
    CHECK(ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0 && ibv_destroy_cq(other_cq) == 0, "destroy CQs");
    CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(rmr) == 0 && ibv_dealloc_pd(pd) == 0, "free PD");
    CHECK(ibv_close_device(ctx) == 0, "close_device");
    ibv_free_device_list(list);
    unlink(path);
    unlink(other);
    printf("xrc: ok\n");
    return 0;
}
