/* The cost of one small SEND through ugdr: one process, two connected RC QPs, SENDs of SIZE
 * bytes posted 32 at a time (one ibv_post_send each, signaled), every receive and send
 * completion polled and every receive posted again. Prints CPU time per message; run under
 * callgrind by scripts/instructions, which turns it into instructions per message (a figure
 * a noisy machine does not change). Usage: msgcost [SIZE [ITERATIONS]] under LD_PRELOAD. */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <arpa/inet.h>
#define DIE(...) do { fprintf(stderr, __VA_ARGS__); exit(1); } while (0)
static double tcpu(clockid_t c) { struct timespec t; clock_gettime(c, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char **argv) {
    int size = argc > 1 ? atoi(argv[1]) : 64, iters = argc > 2 ? atoi(argv[2]) : 200000, batch = 32;
    int n; struct ibv_device **l = ibv_get_device_list(&n); if (!n) DIE("nodev\n");
    struct ibv_context *ctx = ibv_open_device(l[0]);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *scq = ibv_create_cq(ctx, 256, 0, 0, 0), *rcq = ibv_create_cq(ctx, 256, 0, 0, 0);
    char *buf = calloc(1, 1 << 20);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, 1 << 20, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 128, .max_recv_wr = 128, .max_send_sge = 1, .max_recv_sge = 1, .max_inline_data = 64 } };
    struct ibv_qp *a = ibv_create_qp(pd, &ia), *b = ibv_create_qp(pd, &ia);
    struct ibv_port_attr pa; ibv_query_port(ctx, 1, &pa);
    struct ibv_qp *qs[2] = { a, b };
    for (int i = 0; i < 2; i++) {
        struct ibv_qp_attr at = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = 0 };
        if (ibv_modify_qp(qs[i], &at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS)) DIE("init\n");
        struct ibv_qp_attr r = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024, .dest_qp_num = qs[1 - i]->qp_num,
            .rq_psn = 0, .max_dest_rd_atomic = 1, .min_rnr_timer = 12, .ah_attr = { .dlid = pa.lid, .port_num = 1 } };
        if (ibv_modify_qp(qs[i], &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)) DIE("rtr\n");
        struct ibv_qp_attr s = { .qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7, .rnr_retry = 7, .sq_psn = 0, .max_rd_atomic = 1 };
        if (ibv_modify_qp(qs[i], &s, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC)) DIE("rts\n");
    }
    struct ibv_sge rs = { .addr = (uintptr_t)buf + 65536, .length = 65536, .lkey = mr->lkey };
    struct ibv_recv_wr rw = { .sg_list = &rs, .num_sge = 1 }, *brw;
    for (int i = 0; i < 128; i++) if (ibv_post_recv(b, &rw, &brw)) DIE("recv\n");
    struct ibv_sge ss = { .addr = (uintptr_t)buf, .length = size, .lkey = mr->lkey };
    struct ibv_send_wr sw = { .sg_list = &ss, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bsw;
    double t0 = tcpu(CLOCK_THREAD_CPUTIME_ID), p0 = tcpu(CLOCK_PROCESS_CPUTIME_ID), w0 = tcpu(CLOCK_MONOTONIC);
    struct ibv_wc wc[64];
    for (int done = 0; done < iters; done += batch) {
        for (int k = 0; k < batch; k++) if (ibv_post_send(a, &sw, &bsw)) DIE("send\n");
        int sc = 0, rc = 0;
        while (sc < batch || rc < batch) {
            int m = ibv_poll_cq(rcq, 64, wc); if (m < 0) DIE("poll\n");
            for (int j = 0; j < m; j++) { if (wc[j].status) DIE("rstatus %d\n", wc[j].status); if (ibv_post_recv(b, &rw, &brw)) DIE("rerecv\n"); }
            rc += m;
            m = ibv_poll_cq(scq, 64, wc); if (m < 0) DIE("poll\n");
            for (int j = 0; j < m; j++) if (wc[j].status) DIE("sstatus %d\n", wc[j].status);
            sc += m;
        }
    }
    double t1 = tcpu(CLOCK_THREAD_CPUTIME_ID), p1 = tcpu(CLOCK_PROCESS_CPUTIME_ID), w1 = tcpu(CLOCK_MONOTONIC);
    printf("size %d: %.0f ns/msg app-thread cpu, %.0f ns/msg process cpu, %.0f ns/msg wall\n", size,
           (t1 - t0) * 1e9 / iters, (p1 - p0) * 1e9 / iters, (w1 - w0) * 1e9 / iters);
    return 0;
}
