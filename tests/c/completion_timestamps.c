/* Completion timestamps as applications read them: ibv_create_cq_ex with
 * IBV_WC_EX_WITH_COMPLETION_TIMESTAMP and _WALLCLOCK, the inline ibv_start_poll /
 * ibv_wc_read_completion_ts / ibv_wc_read_completion_wallclock_ns, hca_core_clock and
 * completion_timestamp_mask from ibv_query_device_ex, ibv_query_rt_values_ex. Run with
 * libugdr.so preloaded; two RC QPs of this process exchange SENDs. Every stamp must lie
 * between clock_gettime readings taken around the operation (CLOCK_MONOTONIC for the device
 * clock at hca_core_clock, CLOCK_REALTIME for the wall clock), and stamps never decrease
 * along the CQ. Exit 0 and "completion_timestamps: ok" only if every check holds. */
#include "verbs_test.h"
#include <stdint.h>

#define N 64

static uint64_t now_ns(clockid_t c)
{
    struct timespec t;
    clock_gettime(c, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int main(void)
{
    struct ibv_device **list = ibv_get_device_list(NULL);
    CHECK(list && list[0] && strcmp(ibv_get_device_name(list[0]), "ugdr0") == 0, "no ugdr0");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open");
    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");

    struct ibv_device_attr_ex dx;
    CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0, "query_device_ex");
    CHECK(dx.hca_core_clock == 1000000, "hca_core_clock %llu kHz", (unsigned long long)dx.hca_core_clock);
    CHECK(dx.completion_timestamp_mask == UINT64_MAX, "completion_timestamp_mask");

    /* ibv_query_rt_values_ex: the raw clock, as mlx5 reports it (cycles in tv_nsec). */
    struct ibv_values_ex v = { .comp_mask = IBV_VALUES_MASK_RAW_CLOCK };
    uint64_t before = now_ns(CLOCK_MONOTONIC);
    CHECK(ibv_query_rt_values_ex(ctx, &v) == 0, "query_rt_values_ex");
    uint64_t after = now_ns(CLOCK_MONOTONIC);
    CHECK(v.comp_mask == IBV_VALUES_MASK_RAW_CLOCK && v.raw_clock.tv_sec == 0, "rt values mask/sec");
    uint64_t raw = (uint64_t)v.raw_clock.tv_nsec;
    CHECK(raw >= before && raw <= after, "raw clock %llu outside [%llu, %llu]", (unsigned long long)raw,
          (unsigned long long)before, (unsigned long long)after);
    struct ibv_values_ex none = { .comp_mask = 0 };
    CHECK(ibv_query_rt_values_ex(ctx, &none) == 0 && none.comp_mask == 0, "rt values, nothing asked");
    struct ibv_values_ex unknown = { .comp_mask = 1 << 5 };
    CHECK(ibv_query_rt_values_ex(ctx, &unknown) == EINVAL, "rt values, unknown mask");

    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    uint64_t flags = IBV_WC_EX_WITH_COMPLETION_TIMESTAMP | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK |
                     IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP |
                     IBV_WC_EX_WITH_SLID;
    struct ibv_cq_init_attr_ex ca = { .cqe = 4 * N, .wc_flags = flags };
    struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &ca);
    CHECK(pd && cq, "pd/cq_ex");
    struct ibv_qp_init_attr init = { .send_cq = ibv_cq_ex_to_cq(cq), .recv_cq = ibv_cq_ex_to_cq(cq),
        .qp_type = IBV_QPT_RC, .cap = { .max_send_wr = N, .max_recv_wr = N, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp *a = ibv_create_qp(pd, &init), *b = ibv_create_qp(pd, &init);
    CHECK(a && b, "create_qp");
    to_rts(a, port.lid, b->qp_num, 0);
    to_rts(b, port.lid, a->qp_num, 0);
    char *buf = calloc(N, 64);
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, N * 64, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr, "reg_mr");
    static char msg[32] = "timestamped";

    uint64_t t0 = now_ns(CLOCK_MONOTONIC), w0 = now_ns(CLOCK_REALTIME);
    for (int i = 0; i < N; i++) {
        struct ibv_sge r = { (uintptr_t)buf + 64 * i, 64, mr->lkey };
        struct ibv_recv_wr rwr = { .wr_id = 1000 + i, .sg_list = &r, .num_sge = 1 }, *rbad = NULL;
        CHECK(ibv_post_recv(b, &rwr, &rbad) == 0, "post_recv");
    }
    for (int i = 0; i < N; i++) {
        struct ibv_sge s = { (uintptr_t)msg, sizeof msg, 0 };
        struct ibv_send_wr swr = { .wr_id = i, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
                                   .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE }, *sbad = NULL;
        CHECK(ibv_post_send(a, &swr, &sbad) == 0, "post_send %d", i);
    }
    int got = 0, sends = 0, recvs = 0;
    uint64_t last_ts = 0, last_wall = 0;
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (got < 2 * N) {
        struct ibv_poll_cq_attr pa = { 0 };
        int rc = ibv_start_poll(cq, &pa);
        if (rc == ENOENT) {
            struct timespec t;
            clock_gettime(CLOCK_MONOTONIC, &t);
            CHECK(t.tv_sec - start.tv_sec < 10, "only %d completions in 10 s", got);
            continue;
        }
        CHECK(rc == 0, "start_poll %d", rc);
        do {
            uint64_t t1 = now_ns(CLOCK_MONOTONIC), w1 = now_ns(CLOCK_REALTIME);
            CHECK(cq->status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(cq->status));
            uint64_t ts = ibv_wc_read_completion_ts(cq);
            uint64_t wall = ibv_wc_read_completion_wallclock_ns(cq);
            /* hca_core_clock is 1 GHz: a tick is a nanosecond of CLOCK_MONOTONIC. */
            CHECK(ts >= t0 && ts <= t1, "ts %llu outside [%llu, %llu]", (unsigned long long)ts,
                  (unsigned long long)t0, (unsigned long long)t1);
            CHECK(wall >= w0 && wall <= w1 + 1000000, "wallclock %llu outside [%llu, %llu]",
                  (unsigned long long)wall, (unsigned long long)w0, (unsigned long long)w1);
            CHECK(ts >= last_ts, "timestamps decrease along the CQ");
            CHECK(wall + 1000000 >= last_wall, "wall clock stamps go back by more than 1 ms");
            last_ts = ts;
            last_wall = wall;
            enum ibv_wc_opcode op = ibv_wc_read_opcode(cq);
            uint32_t qpn = ibv_wc_read_qp_num(cq);
            if (cq->wr_id >= 1000) {
                CHECK(op == IBV_WC_RECV && qpn == b->qp_num && ibv_wc_read_byte_len(cq) == sizeof msg &&
                      ibv_wc_read_src_qp(cq) == a->qp_num && ibv_wc_read_slid(cq) == port.lid &&
                      ibv_wc_read_wc_flags(cq) == 0, "recv fields");
                CHECK(cq->wr_id == 1000u + recvs, "receives out of order");
                CHECK(memcmp(buf + 64 * recvs, msg, sizeof msg) == 0, "received data");
                recvs++;
            } else {
                CHECK(op == IBV_WC_SEND && qpn == a->qp_num && cq->wr_id == (uint64_t)sends, "send fields");
                sends++;
            }
            got++;
        } while ((rc = ibv_next_poll(cq)) == 0);
        CHECK(rc == ENOENT, "next_poll %d", rc);
        ibv_end_poll(cq);
    }
    CHECK(sends == N && recvs == N, "sends %d recvs %d", sends, recvs);

    /* A device without a flag refuses it: unknown wc_flags are still EOPNOTSUPP. */
    struct ibv_cq_init_attr_ex bad = { .cqe = 4, .wc_flags = IBV_WC_EX_WITH_FLOW_TAG };
    errno = 0;
    CHECK(ibv_create_cq_ex(ctx, &bad) == NULL && errno == EOPNOTSUPP, "flow tag");

    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_dereg_mr(mr) == 0, "teardown qp/mr");
    CHECK(ibv_destroy_cq(ibv_cq_ex_to_cq(cq)) == 0 && ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0,
          "teardown");
    free(buf);
    printf("completion_timestamps: ok\n");
    return 0;
}
