/* RDMA ATOMIC WRITE (ibv_wr_atomic_write) between two RC QPs of one process: the 8 bytes land
 * whole at the aligned address, in order with the WRITEs before them, and complete as
 * IBV_WC_ATOMIC_WRITE (every field checked); a misaligned address is EINVAL at
 * ibv_wr_complete; an MR without REMOTE_WRITE is IBV_WC_REM_ACCESS_ERR and nothing changes;
 * a UC QP cannot be created with IBV_QP_EX_WITH_ATOMIC_WRITE. Exit 0 only if all hold. */
#include "verbs_test.h"
#include <stdint.h>

static struct ibv_qp *create(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_cq *cq, int type)
{
    struct ibv_qp_init_attr_ex init = { .send_cq = cq, .recv_cq = cq, .qp_type = type, .pd = pd,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
        .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
        .send_ops_flags = IBV_QP_EX_WITH_ATOMIC_WRITE | IBV_QP_EX_WITH_RDMA_WRITE };
    return ibv_create_qp_ex(ctx, &init);
}

int main(void)
{
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1, "no device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open");
    struct ibv_device_attr_ex dx;
    CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0, "query_device_ex");
    /* IBV_ODP_SUPPORT_ATOMIC_WRITE (1 << 7; rdma-core after v44). */
    CHECK(dx.odp_caps.per_transport_caps.rc_odp_caps & (1 << 7), "odp atomic write");
    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(pd && cq, "pd/cq");

    errno = 0;
    CHECK(create(ctx, pd, cq, IBV_QPT_UC) == NULL && errno == EOPNOTSUPP, "UC with ATOMIC_WRITE");

    struct ibv_qp *a = create(ctx, pd, cq, IBV_QPT_RC), *b = create(ctx, pd, cq, IBV_QPT_RC);
    CHECK(a && b, "create_qp_ex: %s", strerror(errno));
    to_rts(a, port.lid, b->qp_num, 0);
    to_rts(b, port.lid, a->qp_num, IBV_ACCESS_REMOTE_WRITE);

    uint64_t *target = aligned_alloc(4096, 4096), *ro = aligned_alloc(4096, 4096), *src = aligned_alloc(4096, 4096);
    memset(target, 0x11, 4096); memset(ro, 0x22, 4096); memset(src, 0x33, 4096);
    struct ibv_mr *tmr = ibv_reg_mr(pd, target, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    struct ibv_mr *romr = ibv_reg_mr(pd, ro, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, 4096, IBV_ACCESS_LOCAL_WRITE);
    CHECK(tmr && romr && smr, "reg_mr");
    struct ibv_qp_ex *qx = ibv_qp_to_qp_ex(a);
    CHECK(qx, "qp_ex");

    /* A 64-byte WRITE over words 8..15, then an atomic write of word 9: the atomic one wins. */
    const uint64_t value = 0x0123456789abcdefULL;
    ibv_wr_start(qx);
    qx->wr_id = 1; qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_rdma_write(qx, tmr->rkey, (uintptr_t)&target[8]);
    ibv_wr_set_sge(qx, smr->lkey, (uintptr_t)src, 64);
    qx->wr_id = 2; qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_atomic_write(qx, tmr->rkey, (uintptr_t)&target[9], &value);
    CHECK(ibv_wr_complete(qx) == 0, "wr_complete");
    struct ibv_wc wc;
    for (uint64_t id = 1; id <= 2; id++) {
        CHECK(poll_one(cq, &wc) == 1, "completion %lu", (unsigned long)id);
        CHECK(wc.wr_id == id && wc.status == IBV_WC_SUCCESS && wc.qp_num == a->qp_num &&
              wc.opcode == (id == 1 ? IBV_WC_RDMA_WRITE : IBV_WC_ATOMIC_WRITE) &&
              wc.byte_len == (id == 1 ? 64 : 8) && wc.wc_flags == 0 && wc.vendor_err == 0,
              "wc %lu: status %d opcode %d len %u", (unsigned long)id, wc.status, wc.opcode, wc.byte_len);
    }
    CHECK(target[9] == value, "the atomic write landed: %lx", (unsigned long)target[9]);
    CHECK(target[8] == 0x3333333333333333ULL && target[10] == 0x3333333333333333ULL, "the WRITE landed");
    CHECK(target[7] == 0x1111111111111111ULL && target[16] == 0x1111111111111111ULL, "nothing else");

    /* Misaligned: nothing is posted. */
    ibv_wr_start(qx);
    qx->wr_id = 3; qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_atomic_write(qx, tmr->rkey, (uintptr_t)target + 4, &value);
    CHECK(ibv_wr_complete(qx) == EINVAL, "misaligned atomic write");
    ibv_wr_start(qx);
    ibv_wr_atomic_write(qx, tmr->rkey, (uintptr_t)target, NULL);
    CHECK(ibv_wr_complete(qx) == EINVAL, "no operand");
    CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "nothing completed");

    /* An MR without REMOTE_WRITE (atomics only): remote access error, memory unchanged. */
    ibv_wr_start(qx);
    qx->wr_id = 4; qx->wr_flags = IBV_SEND_SIGNALED;
    ibv_wr_atomic_write(qx, romr->rkey, (uintptr_t)&ro[0], &value);
    CHECK(ibv_wr_complete(qx) == 0, "wr_complete");
    CHECK(poll_one(cq, &wc) == 1, "error completion");
    CHECK(wc.wr_id == 4 && wc.status == IBV_WC_REM_ACCESS_ERR && wc.qp_num == a->qp_num,
          "wc 4: status %d", wc.status);
    CHECK(ro[0] == 0x2222222222222222ULL, "nothing written without REMOTE_WRITE");

    ibv_destroy_qp(a); ibv_destroy_qp(b);
    ibv_dereg_mr(tmr); ibv_dereg_mr(romr); ibv_dereg_mr(smr);
    ibv_destroy_cq(cq); ibv_dealloc_pd(pd); ibv_close_device(ctx);
    printf("atomic_write: ok\n");
    return 0;
}
