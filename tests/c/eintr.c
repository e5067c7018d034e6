/* The calls that block as rdma-core's and librdmacm's do in read() (ibv_get_cq_event,
 * ibv_get_async_event, rdma_get_cm_event), interrupted by a signal: a handler installed
 * without SA_RESTART ends them with -1 and errno EINTR, as the kernel ends the read(); with
 * SA_RESTART they go on waiting (the kernel restarts the read) and return the event that
 * comes later. The signal goes to the waiting thread (pthread_kill) from a helper thread,
 * which later makes the event come. Last, a signal sent to the process reaches the program's
 * waiting thread, not one of ugdr's or UCX's, when the main thread blocks it. Prints
 * "eintr: ok". */
#define _GNU_SOURCE /* gettid */
#include "verbs_test.h"
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <arpa/inet.h>
#include <signal.h>
#include <unistd.h>

enum call { CQ_EVENT, ASYNC_EVENT, CM_EVENT };
static const char *names[] = { "ibv_get_cq_event", "ibv_get_async_event", "rdma_get_cm_event" };

static volatile sig_atomic_t fired;
static void on_signal(int sig) { (void)sig; fired++; }

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* What the waiting thread waits on, and how the helper makes its event come. */
static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_comp_channel *channel;
static struct ibv_cq *cq;
static struct ibv_qp *qa, *qb;
static struct ibv_mr *mr;
static char buf[64];
static struct rdma_event_channel *cm_channel;
static struct rdma_cm_id *cm_id;

static pthread_t waiter;
static enum call current;
static int restart;

static void make_event(enum call c)
{
    if (c == CQ_EVENT) {
        struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey };
        struct ibv_recv_wr rwr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1 }, *rbad;
        CHECK(ibv_post_recv(qb, &rwr, &rbad) == 0, "post_recv");
        struct ibv_send_wr swr = { .wr_id = 8, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
                                   .send_flags = IBV_SEND_SIGNALED }, *sbad;
        CHECK(ibv_post_send(qa, &swr, &sbad) == 0, "post_send");
    } else if (c == ASYNC_EVENT) {
        /* IBV_EVENT_SQ_DRAINED: qa moved to SQD with the asynchronous notification. */
        struct ibv_qp_attr a = { .qp_state = IBV_QPS_SQD, .en_sqd_async_notify = 1 };
        CHECK(ibv_modify_qp(qa, &a, IBV_QP_STATE | IBV_QP_EN_SQD_ASYNC_NOTIFY) == 0, "to SQD");
    } else {
        struct sockaddr_in dst = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
        CHECK(rdma_resolve_addr(cm_id, NULL, (struct sockaddr *)&dst, 2000) == 0, "resolve_addr");
    }
}

static volatile int returned;

/* Signals the waiter after 200 ms; with SA_RESTART, makes its event come 300 ms later;
 * without, 3 s later if the waiter still waits (so that a wait the signal did not end fails
 * the check instead of hanging). */
static void *helper(void *arg)
{
    (void)arg;
    usleep(200000);
    CHECK(pthread_kill(waiter, SIGUSR1) == 0, "pthread_kill");
    if (restart) {
        usleep(300000);
        make_event(current);
        return NULL;
    }
    for (int i = 0; i < 300 && !__atomic_load_n(&returned, __ATOMIC_ACQUIRE); i++)
        usleep(10000);
    if (!__atomic_load_n(&returned, __ATOMIC_ACQUIRE))
        make_event(current);
    return NULL;
}

static int wait_once(enum call c)
{
    if (c == CQ_EVENT) {
        struct ibv_cq *ev_cq;
        void *ev_ctx;
        int rc = ibv_get_cq_event(channel, &ev_cq, &ev_ctx);
        if (rc == 0) {
            CHECK(ev_cq == cq, "event for another CQ");
            ibv_ack_cq_events(ev_cq, 1);
            /* The SEND's and the receive's completions (the CQ empty for the next wait). */
            for (int k = 0; k < 2; k++) {
                struct ibv_wc wc;
                CHECK(poll_one(cq, &wc) == 1, "completion %d of the event's message", k);
                int send = wc.wr_id == 8;
                CHECK(wc.status == IBV_WC_SUCCESS && (send || wc.wr_id == 7) &&
                          wc.opcode == (send ? IBV_WC_SEND : IBV_WC_RECV) &&
                          wc.qp_num == (send ? qa : qb)->qp_num && (send || wc.byte_len == 8),
                      "completion wr_id %llu status %d opcode %d qp %u len %u",
                      (unsigned long long)wc.wr_id, wc.status, wc.opcode, wc.qp_num, wc.byte_len);
            }
        }
        return rc;
    }
    if (c == ASYNC_EVENT) {
        struct ibv_async_event ev;
        int rc = ibv_get_async_event(ctx, &ev);
        if (rc == 0) {
            CHECK(ev.event_type == IBV_EVENT_SQ_DRAINED && ev.element.qp == qa,
                  "async event %d", ev.event_type);
            ibv_ack_async_event(&ev);
        }
        return rc;
    }
    struct rdma_cm_event *ev;
    int rc = rdma_get_cm_event(cm_channel, &ev);
    if (rc == 0) {
        CHECK(ev->event == RDMA_CM_EVENT_ADDR_RESOLVED && ev->id == cm_id, "cm event %d",
              ev->event);
        rdma_ack_cm_event(ev);
    }
    return rc;
}

static void scenario(enum call c, int with_restart)
{
    struct sigaction sa = { .sa_handler = on_signal, .sa_flags = with_restart ? SA_RESTART : 0 };
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGUSR1, &sa, NULL) == 0, "sigaction");
    fired = 0;
    current = c;
    restart = with_restart;
    waiter = pthread_self();
    pthread_t t;
    CHECK(pthread_create(&t, NULL, helper, NULL) == 0, "pthread_create");
    double start = now_ms();
    errno = 0;
    __atomic_store_n(&returned, 0, __ATOMIC_RELEASE);
    int rc = wait_once(c);
    int err = errno;
    double ms = now_ms() - start;
    __atomic_store_n(&returned, 1, __ATOMIC_RELEASE);
    pthread_join(t, NULL);
    if (with_restart)
        CHECK(rc == 0 && fired == 1 && ms >= 450, "%s with SA_RESTART: rc %d fired %d after %.0f ms",
              names[c], rc, (int)fired, ms);
    else
        CHECK(rc == -1 && err == EINTR && fired == 1 && ms >= 150 && ms < 5000,
              "%s without SA_RESTART: rc %d errno %d fired %d after %.0f ms", names[c], rc, err,
              (int)fired, ms);
}

/* A signal sent to the process, not to a thread: the kernel hands it to a thread that does
 * not block it. The main thread blocks it and another of the program's threads waits: that
 * one must get it (and its call end with EINTR), never one of ugdr's or UCX's threads. */
static volatile pid_t handled_on;
static void on_process_signal(int sig) { (void)sig; handled_on = gettid(); }

struct waited { int rc, err; pid_t tid; };

static void *process_signal_waiter(void *arg)
{
    struct waited *w = arg;
    w->tid = gettid();
    CHECK(ibv_req_notify_cq(cq, 0) == 0, "req_notify");
    errno = 0;
    w->rc = wait_once(CQ_EVENT);
    w->err = errno;
    __atomic_store_n(&returned, 1, __ATOMIC_RELEASE);
    return NULL;
}

static void process_directed_signal(void)
{
    struct sigaction sa = { .sa_handler = on_process_signal, .sa_flags = 0 };
    sigemptyset(&sa.sa_mask);
    CHECK(sigaction(SIGUSR2, &sa, NULL) == 0, "sigaction");
    handled_on = 0;
    __atomic_store_n(&returned, 0, __ATOMIC_RELEASE);
    struct waited w = { 0 };
    pthread_t t;
    CHECK(pthread_create(&t, NULL, process_signal_waiter, &w) == 0, "pthread_create");
    sigset_t usr2, old;
    sigemptyset(&usr2);
    sigaddset(&usr2, SIGUSR2);
    CHECK(pthread_sigmask(SIG_BLOCK, &usr2, &old) == 0, "block SIGUSR2");
    usleep(200000);
    CHECK(kill(getpid(), SIGUSR2) == 0, "kill");
    for (int i = 0; i < 300 && !__atomic_load_n(&returned, __ATOMIC_ACQUIRE); i++)
        usleep(10000);
    if (!__atomic_load_n(&returned, __ATOMIC_ACQUIRE))
        make_event(CQ_EVENT);
    pthread_join(t, NULL);
    CHECK(w.rc == -1 && w.err == EINTR && handled_on == w.tid,
          "process-directed signal: rc %d errno %d, handled on thread %d, waiter %d", w.rc, w.err,
          (int)handled_on, (int)w.tid);
    CHECK(pthread_sigmask(SIG_SETMASK, &old, NULL) == 0, "unblock");
}

int main(void)
{
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n > 0, "no device");
    ctx = ibv_open_device(list[0]);
    CHECK(ctx, "open");
    pd = ibv_alloc_pd(ctx);
    mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    channel = ibv_create_comp_channel(ctx);
    cq = ibv_create_cq(ctx, 16, NULL, channel, 0);
    CHECK(pd && mr && channel && cq, "pd, mr, channel, cq");
    struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
    qa = ibv_create_qp(pd, &ia);
    qb = ibv_create_qp(pd, &ia);
    CHECK(qa && qb, "qps");
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0, "query_port");
    to_rts(qa, pa.lid, qb->qp_num, 0);
    to_rts(qb, pa.lid, qa->qp_num, 0);
    cm_channel = rdma_create_event_channel();
    CHECK(cm_channel && rdma_create_id(cm_channel, &cm_id, NULL, RDMA_PS_TCP) == 0, "cm id");

    for (enum call c = CQ_EVENT; c <= CM_EVENT; c++) {
        if (c == CQ_EVENT)
            CHECK(ibv_req_notify_cq(cq, 0) == 0, "req_notify");
        scenario(c, 0);
        scenario(c, 1);
    }
    process_directed_signal();
    rdma_destroy_id(cm_id);
    rdma_destroy_event_channel(cm_channel);
    printf("eintr: ok\n");
    return 0;
}
