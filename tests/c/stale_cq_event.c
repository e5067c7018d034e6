/* Completion events of a CQ re-armed while it still holds completions, as ibv_rc_pingpong
 * -e does (wait for an event, arm, then poll), on a blocking channel:
 *   1. a completion that comes after such an arming fires an event; if the application polls
 *      that completion before it asks for the event, the event finds an empty CQ and is not
 *      handed out (the arming's own event, which it stands for, is told only while the CQ
 *      holds completions): the next ibv_get_cq_event returns for the next completion, and
 *      the CQ then holds it (ibv_rc_pingpong -t takes an empty CQ after an event for an
 *      error);
 *   2. an event fired on an arming made while the CQ was empty is handed out even when its
 *      completion was polled first, at once.
 * Two RC QPs of this process, one CQ for everything. Prints "stale_cq_event: ok". */
#include "verbs_test.h"
#include <pthread.h>
#include <unistd.h>

static struct ibv_qp *a, *b;
static struct ibv_mr *mr;
static char *buf;
static volatile int late_send_posted;

static void post_recv(uint64_t id)
{
    struct ibv_sge s = { (uintptr_t)buf + 4096, 64, mr->lkey };
    struct ibv_recv_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1 }, *bad = NULL;
    CHECK(ibv_post_recv(b, &w, &bad) == 0, "post_recv");
}

static void post_send(uint64_t id)
{
    struct ibv_sge s = { (uintptr_t)buf, 64, mr->lkey };
    struct ibv_send_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND,
                             .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
    CHECK(ibv_post_send(a, &w, &bad) == 0, "post_send");
}

/* Polls the completions of `sends` SENDs and of their receives (within 10 s), every field
 * that tells them apart checked; then the CQ must be empty. */
static void drain(struct ibv_cq *cq, int sends)
{
    int got = 0;
    while (got < 2 * sends) {
        struct ibv_wc wc;
        CHECK(poll_one(cq, &wc) == 1, "%d of %d completions in 10 s", got, 2 * sends);
        CHECK(wc.status == IBV_WC_SUCCESS, "wr_id %llu: %s", (unsigned long long)wc.wr_id,
              ibv_wc_status_str(wc.status));
        if (wc.opcode == IBV_WC_RECV)
            CHECK(wc.qp_num == b->qp_num && wc.byte_len == 64 && wc.wr_id >= 200, "receive wc");
        else
            CHECK(wc.opcode == IBV_WC_SEND && wc.qp_num == a->qp_num && wc.wr_id > 100 &&
                  wc.wr_id < 200, "send wc");
        got++;
    }
    struct ibv_wc more;
    CHECK(ibv_poll_cq(cq, 1, &more) == 0, "a completion more: wr_id %llu",
          (unsigned long long)more.wr_id);
}

static void *late_send(void *arg)
{
    (void)arg;
    usleep(300 * 1000);
    late_send_posted = 1;
    post_send(103);
    return NULL;
}

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(void)
{
    struct ibv_port_attr port;
    struct ibv_context *ctx = open_first_device(&port);
    struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    struct ibv_cq *cq = ibv_create_cq(ctx, 64, NULL, ch, 0);
    CHECK(ch && pd && cq, "channel/pd/cq");
    struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
    a = ibv_create_qp(pd, &init);
    b = ibv_create_qp(pd, &init);
    CHECK(a && b, "create_qp");
    to_rts(a, port.lid, b->qp_num, 0);
    to_rts(b, port.lid, a->qp_num, 0);
    buf = calloc(1, 8192);
    mr = ibv_reg_mr(pd, buf, 8192, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr, "reg_mr");
    for (int i = 0; i < 8; i++)
        post_recv(200 + i);

    struct ibv_cq *ev_cq;
    void *ev_ctx;
    unsigned events = 0;

    /* 1. Armed while empty; a SEND: its completions fire an event, handed out. */
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm");
    post_send(101);
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq, "first event");
    events++;
    usleep(200 * 1000); /* both completions of SEND 101 are in the CQ */
    /* Re-armed while it holds them, then a second SEND fires an event: polled first. */
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "re-arm over completions");
    post_send(102);
    drain(cq, 2);
    pthread_t t;
    CHECK(pthread_create(&t, NULL, late_send, NULL) == 0, "thread");
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq, "event for the late SEND");
    events++;
    CHECK(late_send_posted, "an event was handed out for completions polled before it");
    pthread_join(t, NULL);
    drain(cq, 1);

    /* 2. Armed while empty: the event of a completion polled before it is still handed out,
     * at once. */
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "arm while empty");
    post_send(104);
    drain(cq, 1);
    double start = now_s();
    CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == cq, "event of an empty arming");
    events++;
    CHECK(now_s() - start < 1.0, "that event took %.3f s", now_s() - start);

    ibv_ack_cq_events(cq, events);
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
    CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(cq) == 0, "dereg/destroy_cq");
    CHECK(ibv_destroy_comp_channel(ch) == 0 && ibv_dealloc_pd(pd) == 0, "teardown");
    CHECK(ibv_close_device(ctx) == 0, "close");
    printf("stale_cq_event: ok\n");
    return 0;
}
