/* What the C test programs share: checks that exit 1 with the place and errno, and two RC
 * QPs of one process brought to RTS towards each other (ibv_rc_pingpong's attributes). */
#ifndef UGDR_VERBS_TEST_H
#define UGDR_VERBS_TEST_H

#include <infiniband/verbs.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, " (errno %d)\n", errno); exit(1); } } while (0)
/* A call that must fail with `bad` and errno `e`. */
#define FAILS_WITH(call, bad, e) do { errno = 0; CHECK((call) == (bad) && errno == (e), "%s", #call); } while (0)

/* The first device's context (ugdr0 under ugdr), port 1's attributes in `port`. */
static inline struct ibv_context *open_first_device(struct ibv_port_attr *port)
{
    struct ibv_device **list = ibv_get_device_list(NULL);
    CHECK(list && list[0], "no device");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open");
    CHECK(ibv_query_port(ctx, 1, port) == 0, "query_port");
    return ctx;
}

/* RESET → INIT (with `access` as the QP's remote access) → RTR towards (dlid, dqpn) → RTS
 * with local ACK timeout `timeout` (4.096 µs × 2^timeout) and `depth` READs and atomics in
 * flight at most (max_rd_atomic). */
static inline void to_rts_with_depth(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn, int access,
                                     uint8_t timeout, uint8_t depth)
{
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access };
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0, "INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dqpn;
    a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12; a.ah_attr.dlid = dlid; a.ah_attr.port_num = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                        IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0, "RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS; a.timeout = timeout; a.retry_cnt = 7; a.rnr_retry = 7; a.max_rd_atomic = depth;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                        IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0, "RTS");
}

/* As to_rts_with_depth, one READ or atomic in flight (ibv_rc_pingpong's max_rd_atomic). */
static inline void to_rts_with_timeout(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn, int access,
                                       uint8_t timeout)
{
    to_rts_with_depth(qp, dlid, dqpn, access, timeout, 1);
}

/* As to_rts_with_timeout, ibv_rc_pingpong's timeout (14: ~67 ms). */
static inline void to_rts(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn, int access)
{
    to_rts_with_timeout(qp, dlid, dqpn, access, 14);
}

/* One completion from `cq` within 10 s: 1, or 0 when none came. */
static inline int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        int n = ibv_poll_cq(cq, 1, wc);
        if (n != 0)
            return n;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec - start.tv_sec > 10)
            return 0;
    }
}

#endif
