/* A verbs program as users write them: the real <infiniband/verbs.h>, its inline
 * ibv_post_send/ibv_post_recv/ibv_poll_cq/ibv_query_port, linked against libibverbs, run
 * with libugdr.so preloaded. Two RC QPs of this process exchange SENDs; every completion
 * field and the bytes are checked, then the error paths. Exit 0 only if all hold. */
#include "verbs_test.h"
#include <arpa/inet.h>

int main(void)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1, "no device");
    CHECK(strcmp(ibv_get_device_name(list[0]), "ugdr0") == 0, "first device is %s", ibv_get_device_name(list[0]));
    struct ibv_context *ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open: %s", strerror(errno));

    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
    CHECK(port.state == IBV_PORT_ACTIVE && port.lid != 0 && port.link_layer == IBV_LINK_LAYER_INFINIBAND, "port");
    struct ibv_device_attr_ex dx;
    CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0 && dx.orig_attr.phys_port_cnt == 1, "query_device_ex");

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(pd && cq, "pd/cq");
    struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2 } };
    struct ibv_qp *a = ibv_create_qp(pd, &init);
    struct ibv_qp *b = ibv_create_qp(pd, &init);
    CHECK(a && b, "create_qp: %s", strerror(errno));
    to_rts(a, port.lid, b->qp_num, 0);
    to_rts(b, port.lid, a->qp_num, 0);

    char *src = calloc(1, 8192), *dst = calloc(1, 8192);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, 8192, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *dmr = ibv_reg_mr(pd, dst, 8192, IBV_ACCESS_LOCAL_WRITE);
    CHECK(smr && dmr, "reg_mr");
    for (int i = 0; i < 8192; i++)
        src[i] = (char)(i * 7);

    struct ibv_sge rs[2] = { { (uintptr_t)dst, 100, dmr->lkey }, { (uintptr_t)dst + 4096, 4000, dmr->lkey } };
    struct ibv_recv_wr rwr = { .wr_id = 11, .sg_list = rs, .num_sge = 2 }, *bad_r = NULL;
    CHECK(ibv_post_recv(b, &rwr, &bad_r) == 0, "post_recv");
    struct ibv_sge ss = { (uintptr_t)src, 3000, smr->lkey };
    struct ibv_send_wr swr = { .wr_id = 22, .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_IMM,
                               .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(0xfeedbeef) }, *bad_s = NULL;
    CHECK(ibv_post_send(a, &swr, &bad_s) == 0, "post_send");

    struct ibv_wc wc[2];
    int got_recv = 0, got_send = 0;
    while (!(got_recv && got_send)) {
        CHECK(poll_one(cq, &wc[0]) == 1, "no completion in 10 s");
        if (wc[0].wr_id == 11) {
            CHECK(wc[0].status == IBV_WC_SUCCESS, "recv status %s", ibv_wc_status_str(wc[0].status));
            CHECK(wc[0].opcode == IBV_WC_RECV && wc[0].byte_len == 3000, "recv opcode/len");
            CHECK(wc[0].qp_num == b->qp_num && wc[0].src_qp == a->qp_num && wc[0].slid == port.lid, "recv qp fields");
            CHECK((wc[0].wc_flags & IBV_WC_WITH_IMM) && ntohl(wc[0].imm_data) == 0xfeedbeef, "imm");
            got_recv = 1;
        } else {
            CHECK(wc[0].wr_id == 22 && wc[0].status == IBV_WC_SUCCESS && wc[0].opcode == IBV_WC_SEND, "send wc");
            CHECK(wc[0].qp_num == a->qp_num, "send qp_num");
            got_send = 1;
        }
    }
    CHECK(memcmp(dst, src, 100) == 0 && memcmp(dst + 4096, src + 100, 2900) == 0, "data scattered wrongly");

    /* Errors as rdma-core reports them. */
    struct ibv_qp_attr bad = { .qp_state = IBV_QPS_RTR };
    CHECK(ibv_modify_qp(a, &bad, IBV_QP_STATE) == EINVAL, "RTS->RTR must be EINVAL");
    struct ibv_send_wr bogus = { .wr_id = 1, .opcode = (enum ibv_wr_opcode)99 };
    bad_s = NULL;
    CHECK(ibv_post_send(a, &bogus, &bad_s) == EINVAL && bad_s == &bogus, "bad opcode");
    CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc busy PD");
    CHECK(ibv_alloc_pd(NULL) == NULL && errno == EINVAL, "alloc_pd(NULL)");

    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
    CHECK(ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(dmr) == 0, "dereg");
    CHECK(ibv_destroy_cq(cq) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "teardown");
    printf("rc_loopback: ok\n");
    return 0;
}
