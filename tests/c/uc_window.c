/* A UC sender that sleeps in ibv_get_cq_event between windows of SENDs larger than UCX's
 * shared-memory FIFO towards its peer (64 slots by default): the SENDs that find the FIFO
 * full wait inside UCX, and only a progress call of the sender's process pushes them once
 * the receiver made room. No ACK comes back over UC to wake anyone, so a sender whose
 * threads all sleep must still look at them soon (they waited for a 100 ms timer per window).
 *
 * Forks: the child receives (every receive WR posted before the first SEND, so nothing is
 * dropped; it sleeps on completion events too, so the FIFO fills while it is woken), the parent sends WINDOWS windows of WINDOW 64-byte SENDs, message i carrying
 * i in its first 4 bytes, only the last of each window signaled, and waits for that one's
 * completion with ibv_get_cq_event. Checks every completion's fields and every message's
 * slot. Prints "uc_window: ok MESSAGES messages, sender MS ms". Usage: uc_window */
#include <infiniband/verbs.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define WINDOW 128
#define WINDOWS 96
#define MESSAGES (WINDOW * WINDOWS)
#define MSG 64

#define DIE(...) do { fprintf(stderr, __VA_ARGS__); fputc('\n', stderr); exit(1); } while (0)

struct side {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_comp_channel *channel;
    struct ibv_cq *cq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    char *buf;
    uint16_t lid;
};

static double now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static void setup(struct side *s, int with_channel) {
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    if (!list || n < 1) DIE("no device");
    s->ctx = ibv_open_device(list[0]);
    if (!s->ctx) DIE("open: %s", strerror(errno));
    ibv_free_device_list(list);
    s->pd = ibv_alloc_pd(s->ctx);
    s->buf = calloc(MESSAGES, MSG);
    s->mr = ibv_reg_mr(s->pd, s->buf, (size_t)MESSAGES * MSG, IBV_ACCESS_LOCAL_WRITE);
    if (!s->pd || !s->buf || !s->mr) DIE("pd/mr: %s", strerror(errno));
    s->channel = with_channel ? ibv_create_comp_channel(s->ctx) : NULL;
    if (with_channel && !s->channel) DIE("channel: %s", strerror(errno));
    s->cq = ibv_create_cq(s->ctx, MESSAGES + 1, NULL, s->channel, 0);
    if (!s->cq) DIE("cq: %s", strerror(errno));
    struct ibv_qp_init_attr ia = {
        .send_cq = s->cq, .recv_cq = s->cq, .qp_type = IBV_QPT_UC,
        .cap = { .max_send_wr = WINDOW, .max_recv_wr = MESSAGES, .max_send_sge = 1,
                 .max_recv_sge = 1 },
    };
    s->qp = ibv_create_qp(s->pd, &ia);
    if (!s->qp) DIE("qp: %s", strerror(errno));
    struct ibv_port_attr pa;
    if (ibv_query_port(s->ctx, 1, &pa)) DIE("query_port");
    s->lid = pa.lid;
}

static void connect_to(struct side *s, uint16_t dlid, uint32_t dqpn) {
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
    if (ibv_modify_qp(s->qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
                                     IBV_QP_ACCESS_FLAGS))
        DIE("init: %s", strerror(errno));
    struct ibv_qp_attr r = { .qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
                             .dest_qp_num = dqpn, .rq_psn = 0,
                             .ah_attr = { .dlid = dlid, .port_num = 1 } };
    if (ibv_modify_qp(s->qp, &r, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
                                     IBV_QP_DEST_QPN | IBV_QP_RQ_PSN))
        DIE("rtr: %s", strerror(errno));
    struct ibv_qp_attr t = { .qp_state = IBV_QPS_RTS, .sq_psn = 0 };
    if (ibv_modify_qp(s->qp, &t, IBV_QP_STATE | IBV_QP_SQ_PSN)) DIE("rts: %s", strerror(errno));
}

static void put(int fd, const void *p, size_t n) {
    if (write(fd, p, n) != (ssize_t)n) DIE("pipe write");
}

static void get(int fd, void *p, size_t n) {
    if (read(fd, p, n) != (ssize_t)n) DIE("pipe read");
}

static void check_wc(const struct ibv_wc *wc, enum ibv_wc_opcode op, uint64_t wr_id,
                     uint32_t qpn, uint32_t len) {
    if (wc->status != IBV_WC_SUCCESS || wc->opcode != op || wc->wr_id != wr_id ||
        wc->qp_num != qpn || (op == IBV_WC_RECV && wc->byte_len != len) || wc->wc_flags != 0)
        DIE("completion: status %d opcode %d wr_id %" PRIu64 " (want %" PRIu64 ") qp %u len %u "
            "flags %u", wc->status, wc->opcode, wc->wr_id, wr_id, wc->qp_num, wc->byte_len,
            wc->wc_flags);
}

static void receiver(int in, int out) {
    struct side s;
    setup(&s, 1);
    uint32_t me[2] = { s.lid, s.qp->qp_num }, peer[2];
    put(out, me, sizeof me);
    get(in, peer, sizeof peer);
    connect_to(&s, peer[0], peer[1]);
    for (uint32_t i = 0; i < MESSAGES; i++) {
        struct ibv_sge sge = { .addr = (uintptr_t)s.buf + (size_t)i * MSG, .length = MSG,
                               .lkey = s.mr->lkey };
        struct ibv_recv_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1 }, *bad;
        if (ibv_post_recv(s.qp, &wr, &bad)) DIE("post_recv %u: %s", i, strerror(errno));
    }
    put(out, "r", 1);
    uint32_t got = 0;
    struct ibv_wc wc[32];
    if (ibv_req_notify_cq(s.cq, 0)) DIE("req_notify");
    while (got < MESSAGES) {
        struct ibv_cq *ev_cq;
        void *ev_ctx;
        if (ibv_get_cq_event(s.channel, &ev_cq, &ev_ctx)) DIE("get_cq_event: %s", strerror(errno));
        ibv_ack_cq_events(ev_cq, 1);
        if (ibv_req_notify_cq(s.cq, 0)) DIE("req_notify");
        int n;
        while ((n = ibv_poll_cq(s.cq, 32, wc)) > 0)
            for (int k = 0; k < n; k++, got++)
                check_wc(&wc[k], IBV_WC_RECV, got, s.qp->qp_num, MSG);
        if (n < 0) DIE("poll_cq");
    }
    for (uint32_t i = 0; i < MESSAGES; i++) {
        uint32_t v;
        memcpy(&v, s.buf + (size_t)i * MSG, sizeof v);
        if (v != i) DIE("slot %u holds message %u", i, v);
    }
    exit(0);
}

int main(void) {
    int to_child[2], to_parent[2];
    if (pipe(to_child) || pipe(to_parent)) DIE("pipe");
    pid_t child = fork();
    if (child < 0) DIE("fork");
    if (child == 0) receiver(to_child[0], to_parent[1]);

    struct side s;
    setup(&s, 1);
    uint32_t peer[2], me[2] = { s.lid, s.qp->qp_num };
    get(to_parent[0], peer, sizeof peer);
    put(to_child[1], me, sizeof me);
    connect_to(&s, peer[0], peer[1]);
    char ready;
    get(to_parent[0], &ready, 1);
    if (ibv_req_notify_cq(s.cq, 0)) DIE("req_notify");
    double start = now_ms();
    for (uint32_t w = 0; w < WINDOWS; w++) {
        for (uint32_t k = 0; k < WINDOW; k++) {
            uint32_t i = w * WINDOW + k;
            char *slot = s.buf + (size_t)i * MSG;
            memcpy(slot, &i, sizeof i);
            struct ibv_sge sge = { .addr = (uintptr_t)slot, .length = MSG, .lkey = s.mr->lkey };
            struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
                                      .opcode = IBV_WR_SEND,
                                      .send_flags = k == WINDOW - 1 ? IBV_SEND_SIGNALED : 0 };
            struct ibv_send_wr *bad;
            if (ibv_post_send(s.qp, &wr, &bad)) DIE("post_send %u: %s", i, strerror(errno));
        }
        struct ibv_cq *ev_cq;
        void *ev_ctx;
        if (ibv_get_cq_event(s.channel, &ev_cq, &ev_ctx)) DIE("get_cq_event: %s", strerror(errno));
        if (ev_cq != s.cq) DIE("event for another CQ");
        ibv_ack_cq_events(s.cq, 1);
        if (ibv_req_notify_cq(s.cq, 0)) DIE("req_notify");
        struct ibv_wc wc;
        int n = ibv_poll_cq(s.cq, 1, &wc);
        if (n != 1) DIE("window %u: poll after the event returned %d", w, n);
        check_wc(&wc, IBV_WC_SEND, (uint64_t)(w + 1) * WINDOW - 1, s.qp->qp_num, 0);
    }
    double ms = now_ms() - start;
    int status;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        DIE("receiver failed (status %d)", status);
    printf("uc_window: ok %d messages, sender %.0f ms\n", MESSAGES, ms);
    return 0;
}
