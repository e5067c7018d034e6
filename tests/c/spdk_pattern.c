/* SPDK's NVMe-oF RDMA transport, reduced to its verbs and rdma_cm pattern (lib/nvmf/rdma.c as
 * the target, lib/nvme/nvme_rdma.c as the initiator), without SPDK. Two processes:
 *
 *   spdk_pattern target    ADDR PORT QPAIRS
 *   spdk_pattern initiator ADDR PORT QPAIRS CONCURRENCY
 *
 * Target: rdma_get_devices' context (the same pointer in every cm_id->verbs), one listening
 * id; NPG "poll groups", each one SRQ shared by the RC QPs it owns (rdma_create_qp) and one CQ
 * on its own completion channel (interrupt mode: one epoll set, the channels watched for
 * EPOLLIN | EPOLLOUT as SPDK's reactor watches them, and no fd may wake it but to be read),
 * resized as qpairs come and go. A command
 * capsule arrives on the SRQ (two receive SGEs: 64-byte command + in-capsule data buffer); the
 * qpair is found by wc.qp_num. Host reads: a chain of two unsignaled RDMA WRITEs (two SGEs
 * each) linked to the signaled response SEND, one ibv_post_send. Host writes: a signaled RDMA
 * READ (two SGEs), the data checked, then the response SEND. On DISCONNECTED the target calls
 * rdma_disconnect itself (the QP is already in ERR); it destroys a qpair only when no signaled
 * WR is outstanding and IBV_EVENT_QP_LAST_WQE_REACHED arrived, and reads async events while
 * it destroys.
 *
 * Initiator: one CQ for all its qpairs (a poll group) on a completion channel, resized as
 * qpairs come and go; per qpair rdma_resolve_addr/route, rdma_create_qp without SRQ, receives
 * for the responses, rdma_connect with SPDK's 32-byte private data (responder_resources 16,
 * initiator_depth 0). Qpairs end three ways: the target disconnects after N commands, the
 * initiator disconnects with commands in flight, or after they all completed.
 *
 * Both keep a registry of their live QPs: an async event naming a QP that is not live (it was
 * destroyed: a stale event, SPDK's use-after-free), LAST_WQE_REACHED twice for one QP or for a
 * QP not in ERR, CQ overruns, wrong completion fields or data: FAIL, exit 1. */
#define _GNU_SOURCE
#include <rdma/rdma_cma.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define QD 16           /* queue depth of every qpair */
#define IO_MAX 32768    /* largest transfer */
#define ICD_MAX 4096    /* in-capsule data */
#define CAPSULE 64
#define SRQ_DEPTH 128   /* receive WRs per poll group's SRQ (= its requests) */
#define NPG 2           /* target poll groups */
#define MAX_QPAIRS 1024
#define RD_ATOM 16
#define STALL_S 15      /* no progress for this long: FAIL */

static const char *role = "?";

static void fail(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "spdk_pattern %s: FAIL: ", role);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
    exit(1);
}

#define CHECK(cond, ...) do { if (!(cond)) fail(__VA_ARGS__); } while (0)

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

static uint8_t pattern(uint32_t seed, uint32_t off)
{
    uint32_t x = seed * 0x9e3779b1u + off;
    x ^= x >> 16;
    x *= 0x85ebca6bu;
    x ^= x >> 13;
    x *= 0xc2b2ae35u;
    x ^= x >> 16;
    return (uint8_t)x;
}

static void fill(uint8_t *p, uint32_t len, uint32_t seed)
{
    for (uint32_t i = 0; i < len; i++)
        p[i] = pattern(seed, i);
}

/* Index of the first wrong byte, or -1. */
static long mismatch(const uint8_t *p, uint32_t len, uint32_t seed)
{
    for (uint32_t i = 0; i < len; i++)
        if (p[i] != pattern(seed, i))
            return i;
    return -1;
}

static void nonblocking(int fd)
{
    CHECK(fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) == 0, "fcntl: %s", strerror(errno));
}

/* ---- wire formats (SPDK's capsule is 64 bytes, its response 16, its private data 32) ---- */

enum { OP_READ = 1 /* target WRITEs host memory */, OP_WRITE = 2 /* target READs it */,
       OP_WRITE_ICD = 3 /* data in the capsule */ };

struct capsule {
    uint8_t opc;
    uint8_t pad;
    uint16_t cid;
    uint32_t len;
    uint32_t seed;
    uint32_t rkey;
    uint64_t addr;
    uint8_t rsvd[40];
};

struct response {
    uint16_t cid;
    uint16_t status;
    uint32_t seed;
    uint64_t rsvd;
};

struct conn_priv {
    uint16_t recfmt;
    uint16_t qid;
    uint16_t hrqsize;
    uint16_t hsqsize;
    uint32_t tgt_disconnect_after; /* 0: the target never disconnects first */
    uint8_t rsvd[20];
};

struct accept_priv {
    uint16_t recfmt;
    uint16_t crqsize;
    uint8_t rsvd[28];
};

_Static_assert(sizeof(struct capsule) == CAPSULE, "capsule");
_Static_assert(sizeof(struct response) == 16, "response");
_Static_assert(sizeof(struct conn_priv) == 32, "conn_priv");
_Static_assert(sizeof(struct accept_priv) == 32, "accept_priv");

/* ---- the registry of live QPs: what an async event may name ---- */

struct live_qp {
    struct ibv_qp *qp;
    void *owner;
};
static struct live_qp live[MAX_QPAIRS];
static int nlive;
static unsigned long stale_checks;

static void registry_add(struct ibv_qp *qp, void *owner)
{
    CHECK(nlive < MAX_QPAIRS, "registry full");
    for (int i = 0; i < nlive; i++)
        CHECK(live[i].qp != qp, "QP %p created twice", (void *)qp);
    live[nlive++] = (struct live_qp){ qp, owner };
}

static void registry_remove(struct ibv_qp *qp)
{
    for (int i = 0; i < nlive; i++)
        if (live[i].qp == qp) {
            live[i] = live[--nlive];
            return;
        }
    fail("QP %p not registered", (void *)qp);
}

static void *registry_find(struct ibv_qp *qp)
{
    for (int i = 0; i < nlive; i++)
        if (live[i].qp == qp)
            return live[i].owner;
    return NULL;
}

/* Reads every queued async event (the fd is non-blocking, as SPDK makes it). Events about a
 * QP go to `on_qp` with the QP's owner; the QP must be live. */
static void drain_async(struct ibv_context *ctx, void (*on_qp)(void *owner, struct ibv_async_event *))
{
    for (;;) {
        struct ibv_async_event ev;
        if (ibv_get_async_event(ctx, &ev)) {
            CHECK(errno == EAGAIN, "ibv_get_async_event: %s", strerror(errno));
            return;
        }
        switch (ev.event_type) {
        case IBV_EVENT_QP_FATAL:
        case IBV_EVENT_QP_REQ_ERR:
        case IBV_EVENT_QP_ACCESS_ERR:
        case IBV_EVENT_COMM_EST:
        case IBV_EVENT_SQ_DRAINED:
        case IBV_EVENT_PATH_MIG:
        case IBV_EVENT_PATH_MIG_ERR:
        case IBV_EVENT_QP_LAST_WQE_REACHED: {
            stale_checks++;
            void *owner = registry_find(ev.element.qp);
            CHECK(owner, "async event %s names QP %p, which is not live (destroyed: a stale event)",
                  ibv_event_type_str(ev.event_type), (void *)ev.element.qp);
            on_qp(owner, &ev);
            break;
        }
        default:
            fail("unexpected async event %s", ibv_event_type_str(ev.event_type));
        }
        ibv_ack_async_event(&ev);
    }
}

static struct ibv_context *the_device(void)
{
    int n = 0;
    struct ibv_context **list = rdma_get_devices(&n);
    CHECK(list && n >= 1, "rdma_get_devices: none");
    struct ibv_context *ctx = list[0];
    rdma_free_devices(list); /* SPDK keeps using the contexts */
    CHECK(strcmp(ibv_get_device_name(ctx->device), "ugdr0") == 0, "device %s",
          ibv_get_device_name(ctx->device));
    nonblocking(ctx->async_fd);
    return ctx;
}

static struct sockaddr_in ipv4(const char *addr, int port)
{
    struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(port) };
    CHECK(inet_pton(AF_INET, addr, &sin.sin_addr) == 1, "bad address %s", addr);
    return sin;
}

/* Resizes `cq` to `want` entries when it differs (grow as qpairs come, shrink as they go). */
static void resize(struct ibv_cq *cq, int want, unsigned long *resizes)
{
    if (cq->cqe == want)
        return;
    CHECK(ibv_resize_cq(cq, want) == 0, "ibv_resize_cq(%d): %s", want, strerror(errno));
    CHECK(cq->cqe >= want, "resized cq has %d entries, asked %d", cq->cqe, want);
    (*resizes)++;
}

/* Arms the CQ after an event and polls it until empty (the race-free interrupt pattern). */
static void cq_event(struct ibv_comp_channel *ch, void (*on_wc)(struct ibv_wc *))
{
    struct ibv_cq *cq;
    void *cq_ctx;
    while (ibv_get_cq_event(ch, &cq, &cq_ctx) == 0) {
        ibv_ack_cq_events(cq, 1);
        CHECK(ibv_req_notify_cq(cq, 0) == 0, "ibv_req_notify_cq");
        struct ibv_wc wc[16];
        int n;
        while ((n = ibv_poll_cq(cq, 16, wc)) > 0)
            for (int i = 0; i < n; i++)
                on_wc(&wc[i]);
        CHECK(n == 0, "ibv_poll_cq: %d", n);
    }
    CHECK(errno == EAGAIN, "ibv_get_cq_event: %s", strerror(errno));
}

/* Sleeps until one of `fds` is readable (at most 100 ms); none may be invalid or hung up
 * (SPDK logs an error every tick if its fds report that). */
static void wait_fds(struct pollfd *fds, int n)
{
    int got = poll(fds, n, 100);
    CHECK(got >= 0 || errno == EINTR, "poll: %s", strerror(errno));
    for (int i = 0; i < n; i++)
        CHECK(!(fds[i].revents & (POLLNVAL | POLLHUP | POLLERR)), "fd %d revents %#x", fds[i].fd,
              fds[i].revents);
}

static void watch(int ep, int fd, uint32_t events)
{
    struct epoll_event ev = { .events = events, .data.fd = fd };
    CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, fd, &ev) == 0, "epoll_ctl fd %d: %s", fd, strerror(errno));
}

/* Waits up to 100 ms; every fd that woke it must be readable and nothing else (an event fd
 * that polls writable would keep an interrupt-mode reactor from ever sleeping). */
static void wait_epoll(int ep)
{
    struct epoll_event evs[8];
    int got = epoll_wait(ep, evs, 8, 100);
    CHECK(got >= 0 || errno == EINTR, "epoll_wait: %s", strerror(errno));
    for (int i = 0; i < got; i++)
        CHECK(evs[i].events == EPOLLIN, "fd %d woke epoll with events %#x", evs[i].data.fd,
              evs[i].events);
}

/* Reads every queued CM event (the channel is non-blocking), hands it to `on` (which returns
 * 0 for an event it does not expect), and acks it. */
static void drain_cm(struct rdma_event_channel *ch, int (*on)(struct rdma_cm_event *))
{
    struct rdma_cm_event *ev;
    while (rdma_get_cm_event(ch, &ev) == 0) {
        if (ev->event != RDMA_CM_EVENT_TIMEWAIT_EXIT && !on(ev))
            fail("rdma_cm event %s (status %d)", rdma_event_str(ev->event), ev->status);
        rdma_ack_cm_event(ev);
    }
    CHECK(errno == EAGAIN, "rdma_get_cm_event: %s", strerror(errno));
}

/* ================================ target ================================ */

enum { K_RECV = 1, K_READ = 2, K_WRITE = 3, K_RSP = 4 };

struct tqpair;

struct treq {
    struct tqpair *q;
    struct capsule cmd;
};

struct tpoller {
    int index;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    struct ibv_srq *srq;
    int nqpairs;
    struct treq reqs[SRQ_DEPTH];
    uint8_t *mem; /* cmd | icd | data | rsp areas, one MR */
    struct ibv_mr *mr;
};

struct tqpair {
    struct rdma_cm_id *id;
    struct ibv_qp *qp;
    struct tpoller *pg;
    uint32_t disconnect_after;
    uint32_t processed;
    int send_depth; /* signaled WRs (READ, response SEND) not completed */
    int established, disconnected_event, disconnect_called, last_wqe;
};

static struct {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct rdma_event_channel *cm;
    struct rdma_cm_id *listen;
    struct tpoller pg[NPG];
    struct tqpair *qpairs[MAX_QPAIRS]; /* live, any order */
    int nqpairs;
    int next_pg;
    int want, connected, destroyed;
    unsigned long commands, bytes, last_wqe, late, resizes, target_disconnects;
    double progress;
} T;

#define T_CMD(pg, r) ((pg)->mem + (size_t)(r) * CAPSULE)
#define T_ICD(pg, r) ((pg)->mem + (size_t)SRQ_DEPTH * CAPSULE + (size_t)(r) * ICD_MAX)
#define T_DATA(pg, r) ((pg)->mem + (size_t)SRQ_DEPTH * (CAPSULE + ICD_MAX) + (size_t)(r) * IO_MAX)
#define T_RSP(pg, r) ((struct response *)((pg)->mem + (size_t)SRQ_DEPTH * (CAPSULE + ICD_MAX + IO_MAX)) + (r))
#define T_MEM ((size_t)SRQ_DEPTH * (CAPSULE + ICD_MAX + IO_MAX + sizeof(struct response)))

static uint64_t t_wr_id(struct tpoller *pg, int kind, int r)
{
    return (uint64_t)pg->index << 24 | (uint64_t)kind << 16 | (uint64_t)r;
}

static int t_cq_size(struct tpoller *pg)
{
    /* every SRQ receive, plus every send-queue slot of its qpairs (flushes complete all). */
    return SRQ_DEPTH + pg->nqpairs * 3 * QD;
}

static void t_post_recv(struct tpoller *pg, int r)
{
    struct ibv_sge sge[2] = {
        { (uintptr_t)T_CMD(pg, r), CAPSULE, pg->mr->lkey },
        { (uintptr_t)T_ICD(pg, r), ICD_MAX, pg->mr->lkey },
    };
    struct ibv_recv_wr wr = { .wr_id = t_wr_id(pg, K_RECV, r), .sg_list = sge, .num_sge = 2 }, *bad;
    pg->reqs[r].q = NULL;
    CHECK(ibv_post_srq_recv(pg->srq, &wr, &bad) == 0, "ibv_post_srq_recv");
}

static struct tqpair *t_by_qpn(uint32_t qpn)
{
    for (int i = 0; i < T.nqpairs; i++)
        if (T.qpairs[i]->qp->qp_num == qpn)
            return T.qpairs[i];
    return NULL;
}

static void t_respond(struct tpoller *pg, int r, uint16_t status)
{
    struct treq *req = &pg->reqs[r];
    struct response *rsp = T_RSP(pg, r);
    *rsp = (struct response){ .cid = req->cmd.cid, .status = status, .seed = req->cmd.seed };
    struct ibv_sge sge = { (uintptr_t)rsp, sizeof *rsp, pg->mr->lkey };
    struct ibv_send_wr wr = { .wr_id = t_wr_id(pg, K_RSP, r), .sg_list = &sge, .num_sge = 1,
                              .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
    CHECK(ibv_post_send(req->q->qp, &wr, &bad) == 0, "post response: %s", strerror(errno));
    req->q->send_depth++;
}

static void t_disconnect(struct tqpair *q)
{
    if (q->disconnect_called)
        return;
    q->disconnect_called = 1;
    CHECK(rdma_disconnect(q->id) == 0, "rdma_disconnect: %s", strerror(errno));
}

/* A command capsule arrived in receive WR r. */
static void t_command(struct tpoller *pg, int r, struct tqpair *q, uint32_t byte_len)
{
    struct treq *req = &pg->reqs[r];
    memcpy(&req->cmd, T_CMD(pg, r), CAPSULE);
    req->q = q;
    struct capsule *c = &req->cmd;
    CHECK(c->len >= 1 && c->len <= IO_MAX, "command length %u", c->len);
    CHECK(byte_len == CAPSULE + (c->opc == OP_WRITE_ICD ? c->len : 0), "capsule byte_len %u (op %u len %u)",
          byte_len, c->opc, c->len);
    q->processed++;
    T.commands++;
    uint8_t *data = T_DATA(pg, r);
    switch (c->opc) {
    case OP_WRITE_ICD: {
        long bad = mismatch(T_ICD(pg, r), c->len, c->seed);
        CHECK(bad < 0, "in-capsule data wrong at byte %ld", bad);
        T.bytes += c->len;
        t_respond(pg, r, 0);
        break;
    }
    case OP_WRITE: {
        uint32_t half = c->len / 2;
        struct ibv_sge sge[2] = { { (uintptr_t)data, half, pg->mr->lkey },
                                  { (uintptr_t)data + half, c->len - half, pg->mr->lkey } };
        memset(data, 0, c->len);
        struct ibv_send_wr wr = { .wr_id = t_wr_id(pg, K_READ, r), .sg_list = sge,
                                  .num_sge = half ? 2 : 1, .opcode = IBV_WR_RDMA_READ,
                                  .send_flags = IBV_SEND_SIGNALED }, *bad;
        if (!half)
            sge[0] = sge[1];
        wr.wr.rdma.remote_addr = c->addr;
        wr.wr.rdma.rkey = c->rkey;
        CHECK(ibv_post_send(q->qp, &wr, &bad) == 0, "post READ: %s", strerror(errno));
        q->send_depth++;
        break;
    }
    case OP_READ: {
        /* WRITE, WRITE (unsignaled, two SGEs each) -> response SEND, one post. */
        fill(data, c->len, c->seed);
        uint32_t q1 = c->len / 4, h = c->len / 2, q3 = h + (c->len - h) / 2;
        struct ibv_sge s1[2] = { { (uintptr_t)data, q1, pg->mr->lkey },
                                 { (uintptr_t)data + q1, h - q1, pg->mr->lkey } };
        struct ibv_sge s2[2] = { { (uintptr_t)data + h, q3 - h, pg->mr->lkey },
                                 { (uintptr_t)data + q3, c->len - q3, pg->mr->lkey } };
        struct response *rsp = T_RSP(pg, r);
        *rsp = (struct response){ .cid = c->cid, .status = 0, .seed = c->seed };
        struct ibv_sge s3 = { (uintptr_t)rsp, sizeof *rsp, pg->mr->lkey };
        struct ibv_send_wr w3 = { .wr_id = t_wr_id(pg, K_RSP, r), .sg_list = &s3, .num_sge = 1,
                                  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
        struct ibv_send_wr w2 = { .wr_id = t_wr_id(pg, K_WRITE, r), .next = &w3, .sg_list = s2,
                                  .num_sge = 2, .opcode = IBV_WR_RDMA_WRITE };
        struct ibv_send_wr w1 = { .wr_id = t_wr_id(pg, K_WRITE, r), .next = &w2, .sg_list = s1,
                                  .num_sge = 2, .opcode = IBV_WR_RDMA_WRITE }, *bad;
        w1.wr.rdma.remote_addr = c->addr;
        w1.wr.rdma.rkey = c->rkey;
        w2.wr.rdma.remote_addr = c->addr + h;
        w2.wr.rdma.rkey = c->rkey;
        /* zero-length SGEs are legal; keep every WR non-empty anyway */
        if (q1 == 0) { s1[0] = s1[1]; w1.num_sge = 1; }
        if (q3 == h) { s2[0] = s2[1]; w2.num_sge = 1; }
        CHECK(ibv_post_send(q->qp, &w1, &bad) == 0, "post WRITE chain: %s", strerror(errno));
        q->send_depth++;
        T.bytes += c->len;
        break;
    }
    default:
        fail("unknown opcode %u", c->opc);
    }
    if (q->disconnect_after && q->processed == q->disconnect_after) {
        /* the target disconnects first, with this command (and others) in flight */
        T.target_disconnects++;
        t_disconnect(q);
    }
}

static void t_on_wc(struct ibv_wc *wc)
{
    int p = wc->wr_id >> 24, kind = (wc->wr_id >> 16) & 0xff, r = wc->wr_id & 0xffff;
    CHECK(p < NPG && r < SRQ_DEPTH, "bad wr_id %#lx", (unsigned long)wc->wr_id);
    struct tpoller *pg = &T.pg[p];
    struct treq *req = &pg->reqs[r];
    T.progress = now_s();
    if (wc->status != IBV_WC_SUCCESS)
        CHECK(wc->status == IBV_WC_WR_FLUSH_ERR, "wr_id %#lx kind %d: %s", (unsigned long)wc->wr_id,
              kind, ibv_wc_status_str(wc->status));
    if (kind == K_RECV) {
        /* With an SRQ the qpair comes from wc.qp_num; completions of a qpair already destroyed
         * only give the WR back (SPDK does the same). */
        struct tqpair *q = t_by_qpn(wc->qp_num);
        if (!q) {
            T.late++;
            t_post_recv(pg, r);
            return;
        }
        CHECK(q->pg == pg, "receive of poll group %d names a QP of group %d", p, q->pg->index);
        if (wc->status != IBV_WC_SUCCESS || q->disconnect_called || q->disconnected_event) {
            t_post_recv(pg, r);
            return;
        }
        CHECK(wc->opcode == IBV_WC_RECV, "receive opcode %d", wc->opcode);
        t_command(pg, r, q, wc->byte_len);
        return;
    }
    struct tqpair *q = req->q;
    CHECK(q, "send completion kind %d for a free request %d", kind, r);
    CHECK(wc->qp_num == q->qp->qp_num, "send completion qp_num %#x, QP %#x", wc->qp_num, q->qp->qp_num);
    if (kind == K_WRITE) {
        /* unsignaled: only a flush reports them */
        CHECK(wc->status == IBV_WC_WR_FLUSH_ERR, "unsignaled WRITE completed with success");
        return;
    }
    q->send_depth--;
    CHECK(q->send_depth >= 0, "send depth below zero");
    if (kind == K_READ) {
        if (wc->status == IBV_WC_SUCCESS) {
            CHECK(wc->opcode == IBV_WC_RDMA_READ && wc->byte_len == req->cmd.len,
                  "READ completion opcode %d byte_len %u (len %u)", wc->opcode, wc->byte_len, req->cmd.len);
            long bad = mismatch(T_DATA(pg, r), req->cmd.len, req->cmd.seed);
            CHECK(bad < 0, "RDMA READ data wrong at byte %ld of %u (got %02x, want %02x; qp %#x cid %u seed %u "
                  "disconnect_called %d disconnected %d processed %u)", bad, req->cmd.len, T_DATA(pg, r)[bad],
                  pattern(req->cmd.seed, bad), q->qp->qp_num, req->cmd.cid, req->cmd.seed, q->disconnect_called,
                  q->disconnected_event, q->processed);
            T.bytes += req->cmd.len;
            t_respond(pg, r, 0);
        } else {
            t_post_recv(pg, r);
        }
        return;
    }
    CHECK(kind == K_RSP, "kind %d", kind);
    if (wc->status == IBV_WC_SUCCESS)
        CHECK(wc->opcode == IBV_WC_SEND, "response opcode %d", wc->opcode);
    t_post_recv(pg, r);
}

static void t_on_qp_event(void *owner, struct ibv_async_event *ev)
{
    struct tqpair *q = owner;
    if (ev->event_type == IBV_EVENT_COMM_EST)
        return;
    CHECK(ev->event_type == IBV_EVENT_QP_LAST_WQE_REACHED, "async event %s on a target QP",
          ibv_event_type_str(ev->event_type));
    CHECK(!q->last_wqe, "IBV_EVENT_QP_LAST_WQE_REACHED twice for QP %#x", q->qp->qp_num);
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr ia;
    CHECK(ibv_query_qp(q->qp, &a, IBV_QP_STATE, &ia) == 0, "ibv_query_qp");
    CHECK(a.qp_state == IBV_QPS_ERR, "LAST_WQE_REACHED for QP %#x in state %d", q->qp->qp_num, a.qp_state);
    q->last_wqe = 1;
    T.last_wqe++;
}

static void t_destroy(struct tqpair *q)
{
    struct ibv_qp *qp = q->qp;
    rdma_destroy_qp(q->id);
    registry_remove(qp);
    /* SPDK reads async events in the same poller that destroys qpairs */
    drain_async(T.ctx, t_on_qp_event);
    CHECK(rdma_destroy_id(q->id) == 0, "rdma_destroy_id: %s", strerror(errno));
    for (int i = 0; i < T.nqpairs; i++)
        if (T.qpairs[i] == q) {
            T.qpairs[i] = T.qpairs[--T.nqpairs];
            break;
        }
    q->pg->nqpairs--;
    resize(q->pg->cq, t_cq_size(q->pg), &T.resizes);
    memset(q, 0xa5, sizeof *q);
    free(q);
    T.destroyed++;
}

static void t_connect_request(struct rdma_cm_event *ev)
{
    CHECK(ev->listen_id == T.listen, "listen_id");
    CHECK(ev->id->verbs == T.ctx, "new id's verbs %p, device %p", (void *)ev->id->verbs, (void *)T.ctx);
    CHECK(ev->param.conn.private_data && ev->param.conn.private_data_len >= sizeof(struct conn_priv),
          "request private data (%u bytes)", ev->param.conn.private_data_len);
    struct conn_priv cp;
    memcpy(&cp, ev->param.conn.private_data, sizeof cp);
    CHECK(cp.hsqsize == QD - 1 && cp.hrqsize == QD, "private data sizes %u %u", cp.hsqsize, cp.hrqsize);
    /* the host's responder_resources arrive as our initiator_depth, swapped as librdmacm does */
    CHECK(ev->param.conn.initiator_depth == RD_ATOM && ev->param.conn.responder_resources == 0,
          "request depths: initiator_depth %u responder_resources %u", ev->param.conn.initiator_depth,
          ev->param.conn.responder_resources);
    struct tpoller *pg = &T.pg[T.next_pg++ % NPG];
    pg->nqpairs++;
    resize(pg->cq, t_cq_size(pg), &T.resizes);
    struct ibv_qp_init_attr attr = {
        .send_cq = pg->cq, .recv_cq = pg->cq, .srq = pg->srq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
        .cap = { .max_send_wr = 3 * QD, .max_recv_wr = QD, .max_send_sge = 16, .max_recv_sge = 2 },
    };
    CHECK(rdma_create_qp(ev->id, T.pd, &attr) == 0, "rdma_create_qp: %s", strerror(errno));
    CHECK(attr.cap.max_send_wr >= 3 * QD && attr.cap.max_send_sge >= 16, "caps written back");
    struct tqpair *q = calloc(1, sizeof *q);
    CHECK(q, "calloc");
    q->id = ev->id;
    q->qp = ev->id->qp;
    q->pg = pg;
    q->disconnect_after = cp.tgt_disconnect_after;
    ev->id->context = q;
    registry_add(q->qp, q);
    T.qpairs[T.nqpairs++] = q;
    struct accept_priv ap = { .recfmt = 0, .crqsize = QD };
    struct rdma_conn_param param = { .private_data = &ap, .private_data_len = sizeof ap,
                                     .initiator_depth = ev->param.conn.initiator_depth,
                                     .responder_resources = ev->param.conn.responder_resources,
                                     .rnr_retry_count = 7 };
    CHECK(rdma_accept(ev->id, &param) == 0, "rdma_accept: %s", strerror(errno));
    T.connected++;
}

static int t_cm_event(struct rdma_cm_event *ev)
{
    T.progress = now_s();
    struct tqpair *q = ev->id->context;
    switch (ev->event) {
    case RDMA_CM_EVENT_CONNECT_REQUEST:
        t_connect_request(ev);
        return 1;
    case RDMA_CM_EVENT_ESTABLISHED:
        q->established = 1;
        return 1;
    case RDMA_CM_EVENT_DISCONNECTED:
        CHECK(!q->disconnected_event, "DISCONNECTED twice");
        q->disconnected_event = 1;
        /* nvmf_rdma_disconnect -> spdk_rdma_provider_qp_disconnect: the QP is in ERR by now
         * (the peer's DREQ, or our own rdma_disconnect), and this must succeed. */
        t_disconnect(q);
        return 1;
    default:
        return 0;
    }
}

static int target(const char *addr, int port, int want)
{
    T.want = want;
    T.ctx = the_device();
    struct ibv_device_attr da;
    CHECK(ibv_query_device(T.ctx, &da) == 0, "ibv_query_device");
    CHECK(da.max_srq > 0 && da.max_qp_init_rd_atom >= RD_ATOM && da.max_sge >= 16, "device caps");
    T.pd = ibv_alloc_pd(T.ctx);
    CHECK(T.pd, "ibv_alloc_pd");
    T.cm = rdma_create_event_channel();
    CHECK(T.cm, "rdma_create_event_channel");
    nonblocking(T.cm->fd);
    CHECK(rdma_create_id(T.cm, &T.listen, NULL, RDMA_PS_TCP) == 0, "rdma_create_id");
    struct sockaddr_in sin = ipv4(addr, port);
    CHECK(rdma_bind_addr(T.listen, (struct sockaddr *)&sin) == 0, "rdma_bind_addr: %s", strerror(errno));
    CHECK(T.listen->verbs == T.ctx, "listening id's verbs %p is not rdma_get_devices' %p",
          (void *)T.listen->verbs, (void *)T.ctx);
    for (int p = 0; p < NPG; p++) {
        struct tpoller *pg = &T.pg[p];
        pg->index = p;
        pg->ch = ibv_create_comp_channel(T.ctx);
        CHECK(pg->ch, "ibv_create_comp_channel");
        nonblocking(pg->ch->fd);
        pg->cq = ibv_create_cq(T.ctx, SRQ_DEPTH, pg, pg->ch, 0);
        CHECK(pg->cq, "ibv_create_cq");
        CHECK(ibv_req_notify_cq(pg->cq, 0) == 0, "ibv_req_notify_cq");
        struct ibv_srq_init_attr sa = { .attr = { .max_wr = SRQ_DEPTH, .max_sge = 2 } };
        pg->srq = ibv_create_srq(T.pd, &sa);
        CHECK(pg->srq, "ibv_create_srq: %s", strerror(errno));
        pg->mem = aligned_alloc(4096, T_MEM);
        CHECK(pg->mem, "memory");
        /* the target registers LOCAL_WRITE only (it reads into and writes from its memory) */
        pg->mr = ibv_reg_mr(T.pd, pg->mem, T_MEM, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING);
        CHECK(pg->mr, "ibv_reg_mr: %s", strerror(errno));
        for (int r = 0; r < SRQ_DEPTH; r++)
            t_post_recv(pg, r);
    }
    CHECK(rdma_listen(T.listen, 64) == 0, "rdma_listen: %s", strerror(errno));
    printf("spdk_pattern target: listening on %s:%d\n", addr, port);
    fflush(stdout);
    /* As SPDK's reactor in interrupt mode: one epoll set, the completion channels watched for
     * EPOLLIN | EPOLLOUT (nvmf_rdma_poller_create), the CM and async fds for EPOLLIN. The
     * kernel's files are never writable, so a wake-up names a readable fd or none. */
    int ep = epoll_create1(EPOLL_CLOEXEC);
    CHECK(ep >= 0, "epoll_create1: %s", strerror(errno));
    watch(ep, T.cm->fd, EPOLLIN);
    watch(ep, T.ctx->async_fd, EPOLLIN);
    for (int p = 0; p < NPG; p++)
        watch(ep, T.pg[p].ch->fd, EPOLLIN | EPOLLOUT);
    T.progress = now_s();
    while (T.destroyed < T.want) {
        wait_epoll(ep);
        drain_cm(T.cm, t_cm_event);
        drain_async(T.ctx, t_on_qp_event);
        for (int p = 0; p < NPG; p++)
            cq_event(T.pg[p].ch, t_on_wc);
        /* nvmf_rdma_destroy_drained_qpair: nothing outstanding, and with an SRQ the last WQE */
        for (int i = T.nqpairs - 1; i >= 0; i--) {
            struct tqpair *q = T.qpairs[i];
            if (q->disconnected_event && q->send_depth == 0 && q->last_wqe) {
                t_destroy(q);
                T.progress = now_s();
            }
        }
        if (now_s() - T.progress > STALL_S) {
            for (int i = 0; i < T.nqpairs; i++) {
                struct tqpair *q = T.qpairs[i];
                fprintf(stderr, "qp %#x: established %d disconnected %d called %d last_wqe %d depth %d\n",
                        q->qp->qp_num, q->established, q->disconnected_event, q->disconnect_called,
                        q->last_wqe, q->send_depth);
            }
            fail("no progress for %d s (%d of %d qpairs destroyed)", STALL_S, T.destroyed, T.want);
        }
    }
    close(ep);
    /* late completions of the last qpairs, and any event still queued, must be harmless */
    usleep(200 * 1000);
    drain_async(T.ctx, t_on_qp_event);
    for (int p = 0; p < NPG; p++) {
        struct tpoller *pg = &T.pg[p];
        struct ibv_wc wc;
        while (ibv_poll_cq(pg->cq, 1, &wc) == 1)
            t_on_wc(&wc);
        CHECK(ibv_destroy_srq(pg->srq) == 0, "ibv_destroy_srq");
        CHECK(ibv_destroy_cq(pg->cq) == 0, "ibv_destroy_cq: %s", strerror(errno));
        CHECK(ibv_destroy_comp_channel(pg->ch) == 0, "ibv_destroy_comp_channel");
        CHECK(ibv_dereg_mr(pg->mr) == 0, "ibv_dereg_mr");
        free(pg->mem);
    }
    drain_async(T.ctx, t_on_qp_event);
    CHECK(rdma_destroy_id(T.listen) == 0, "rdma_destroy_id(listen)");
    rdma_destroy_event_channel(T.cm);
    CHECK(ibv_dealloc_pd(T.pd) == 0, "ibv_dealloc_pd");
    CHECK(T.last_wqe == (unsigned long)T.want, "%lu LAST_WQE_REACHED events for %d qpairs", T.last_wqe, T.want);
    CHECK(T.target_disconnects > 0 && T.resizes > 0, "pattern not exercised");
    printf("spdk_pattern target: ok qpairs=%d last_wqe=%lu commands=%lu bytes=%lu target_disconnects=%lu "
           "resizes=%lu late_completions=%lu qp_events_checked=%lu\n",
           T.destroyed, T.last_wqe, T.commands, T.bytes, T.target_disconnects, T.resizes, T.late, stale_checks);
    return 0;
}

/* ================================ initiator ================================ */

enum { I_SEND = 1, I_RECV = 2 };
enum { M_TARGET = 0, M_INFLIGHT = 1, M_CLEAN = 2 }; /* who disconnects, and when */

struct icmd {
    int busy, send_done, rsp_done;
    uint8_t opc;
    uint32_t len, seed;
};

struct iqpair {
    int serial, slot, mode;
    struct rdma_cm_id *id;
    struct ibv_qp *qp;
    uint32_t quota, issued, completed;
    int established, flushed, disconnected_event, disconnect_called;
    int sends_out, recvs_out;
    struct icmd cmds[QD];
};

static struct {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct rdma_event_channel *cm;
    struct ibv_comp_channel *ch;
    struct ibv_cq *cq;
    uint8_t *mem;
    struct ibv_mr *mr;
    struct iqpair *by_serial[MAX_QPAIRS];
    int *slot_used;
    int want, conc, started, nlive, done;
    struct sockaddr_in dst;
    unsigned long commands, bytes, flushed_cmds, resizes, inflight_disconnects;
    double progress;
} I;

/* per slot: QD capsules | QD*ICD | QD responses | QD*IO_MAX data */
#define I_SLOT ((size_t)QD * (CAPSULE + ICD_MAX + sizeof(struct response) + IO_MAX))
#define I_CAP(q, c) (I.mem + (size_t)(q)->slot * I_SLOT + (size_t)(c) * CAPSULE)
#define I_ICD(q, c) (I.mem + (size_t)(q)->slot * I_SLOT + (size_t)QD * CAPSULE + (size_t)(c) * ICD_MAX)
#define I_RSP(q, c) ((struct response *)(I.mem + (size_t)(q)->slot * I_SLOT + (size_t)QD * (CAPSULE + ICD_MAX)) + (c))
#define I_DATA(q, c) (I.mem + (size_t)(q)->slot * I_SLOT + (size_t)QD * (CAPSULE + ICD_MAX + sizeof(struct response)) \
                      + (size_t)(c) * IO_MAX)

static uint64_t i_wr_id(struct iqpair *q, int kind, int c)
{
    return (uint64_t)q->serial << 24 | (uint64_t)kind << 16 | (uint64_t)c;
}

static int i_cq_size(void)
{
    return (I.nlive > 0 ? I.nlive : 1) * 2 * QD;
}

static void i_post_recv(struct iqpair *q, int c)
{
    struct ibv_sge sge = { (uintptr_t)I_RSP(q, c), sizeof(struct response), I.mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = i_wr_id(q, I_RECV, c), .sg_list = &sge, .num_sge = 1 }, *bad;
    CHECK(ibv_post_recv(q->qp, &wr, &bad) == 0, "ibv_post_recv: %s", strerror(errno));
    q->recvs_out++;
}

static void i_disconnect(struct iqpair *q)
{
    if (q->disconnect_called)
        return;
    q->disconnect_called = 1;
    CHECK(rdma_disconnect(q->id) == 0, "rdma_disconnect: %s", strerror(errno));
}

static void i_start(void)
{
    int serial = I.started++;
    struct iqpair *q = calloc(1, sizeof *q);
    CHECK(q, "calloc");
    q->serial = serial;
    q->mode = serial % 3;
    q->quota = q->mode == M_TARGET ? UINT32_MAX : 20u + (uint32_t)(serial * 7) % 50u;
    for (q->slot = 0; I.slot_used[q->slot]; q->slot++)
        ;
    I.slot_used[q->slot] = 1;
    I.by_serial[serial] = q;
    I.nlive++;
    CHECK(rdma_create_id(I.cm, &q->id, q, RDMA_PS_TCP) == 0, "rdma_create_id");
    CHECK(rdma_resolve_addr(q->id, NULL, (struct sockaddr *)&I.dst, 2000) == 0, "rdma_resolve_addr: %s",
          strerror(errno));
}

static void i_issue(struct iqpair *q)
{
    while (q->established && !q->flushed && !q->disconnect_called && q->issued < q->quota) {
        int c = 0;
        while (c < QD && q->cmds[c].busy)
            c++;
        if (c == QD)
            return;
        struct icmd *cmd = &q->cmds[c];
        uint32_t n = q->issued++;
        *cmd = (struct icmd){ .busy = 1, .opc = 1 + n % 3, .seed = q->serial * 100003u + n };
        cmd->len = cmd->opc == OP_WRITE_ICD ? 1 + (cmd->seed * 37) % ICD_MAX : 512 + (cmd->seed * 977) % (IO_MAX - 511);
        struct capsule *cap = (struct capsule *)I_CAP(q, c);
        uint8_t *data = I_DATA(q, c);
        *cap = (struct capsule){ .opc = cmd->opc, .cid = c, .len = cmd->len, .seed = cmd->seed,
                                 .rkey = I.mr->rkey, .addr = (uintptr_t)data };
        struct ibv_sge sge[2] = { { (uintptr_t)cap, CAPSULE, I.mr->lkey } };
        int nsge = 1;
        if (cmd->opc == OP_WRITE_ICD) {
            fill(I_ICD(q, c), cmd->len, cmd->seed);
            sge[1] = (struct ibv_sge){ (uintptr_t)I_ICD(q, c), cmd->len, I.mr->lkey };
            nsge = 2;
        } else if (cmd->opc == OP_WRITE) {
            fill(data, cmd->len, cmd->seed);
        } else {
            memset(data, 0, cmd->len);
        }
        struct ibv_send_wr wr = { .wr_id = i_wr_id(q, I_SEND, c), .sg_list = sge, .num_sge = nsge,
                                  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
        CHECK(ibv_post_send(q->qp, &wr, &bad) == 0, "post command: %s", strerror(errno));
        q->sends_out++;
        if (q->mode == M_INFLIGHT && q->issued == q->quota) {
            /* disconnect now, with commands in flight */
            I.inflight_disconnects++;
            i_disconnect(q);
        }
    }
}

static void i_finish_cmd(struct iqpair *q, struct icmd *cmd)
{
    if (cmd->send_done && cmd->rsp_done) {
        cmd->busy = 0;
        q->completed++;
        I.commands++;
        if (q->mode == M_CLEAN && q->completed == q->quota)
            i_disconnect(q);
    }
}

static void i_on_wc(struct ibv_wc *wc)
{
    int serial = wc->wr_id >> 24, kind = (wc->wr_id >> 16) & 0xff, c = wc->wr_id & 0xffff;
    CHECK(serial < I.started && c < QD, "bad wr_id %#lx", (unsigned long)wc->wr_id);
    struct iqpair *q = I.by_serial[serial];
    CHECK(q, "completion for destroyed qpair %d", serial);
    CHECK(wc->qp_num == q->qp->qp_num, "completion qp_num %#x, QP %#x", wc->qp_num, q->qp->qp_num);
    I.progress = now_s();
    if (wc->status != IBV_WC_SUCCESS) {
        CHECK(wc->status == IBV_WC_WR_FLUSH_ERR, "kind %d: %s", kind, ibv_wc_status_str(wc->status));
        q->flushed = 1;
        if (kind == I_SEND) {
            q->sends_out--;
            if (q->cmds[c].busy) {
                q->cmds[c].busy = 0;
                I.flushed_cmds++;
            }
        } else {
            q->recvs_out--;
        }
        return;
    }
    if (kind == I_SEND) {
        CHECK(wc->opcode == IBV_WC_SEND, "send opcode %d", wc->opcode);
        q->sends_out--;
        CHECK(q->cmds[c].busy && !q->cmds[c].send_done, "send completion for command %d", c);
        q->cmds[c].send_done = 1;
        i_finish_cmd(q, &q->cmds[c]);
        return;
    }
    CHECK(wc->opcode == IBV_WC_RECV && wc->byte_len == sizeof(struct response), "response opcode %d byte_len %u",
          wc->opcode, wc->byte_len);
    q->recvs_out--;
    struct response rsp = *I_RSP(q, c);
    CHECK(rsp.cid < QD, "response cid %u", rsp.cid);
    struct icmd *cmd = &q->cmds[rsp.cid];
    CHECK(cmd->busy && !cmd->rsp_done && rsp.seed == cmd->seed, "response for command %u (seed %u)", rsp.cid,
          rsp.seed);
    CHECK(rsp.status == 0, "command %u failed at the target (%u)", rsp.cid, rsp.status);
    if (cmd->opc == OP_READ) {
        /* RC ordering: the WRITEs landed before the response SEND completed here */
        long bad = mismatch(I_DATA(q, rsp.cid), cmd->len, cmd->seed);
        CHECK(bad < 0, "read data wrong at byte %ld of %u", bad, cmd->len);
    }
    I.bytes += cmd->len;
    cmd->rsp_done = 1;
    if (!q->flushed && !q->disconnect_called)
        i_post_recv(q, c);
    i_finish_cmd(q, cmd);
}

static void i_on_qp_event(void *owner, struct ibv_async_event *ev)
{
    (void)owner;
    CHECK(ev->event_type == IBV_EVENT_COMM_EST, "async event %s on an initiator QP",
          ibv_event_type_str(ev->event_type));
}

static void i_destroy(struct iqpair *q)
{
    struct ibv_qp *qp = q->qp;
    rdma_destroy_qp(q->id);
    registry_remove(qp);
    drain_async(I.ctx, i_on_qp_event);
    CHECK(rdma_destroy_id(q->id) == 0, "rdma_destroy_id: %s", strerror(errno));
    I.by_serial[q->serial] = NULL;
    I.slot_used[q->slot] = 0;
    I.nlive--;
    I.done++;
    resize(I.cq, i_cq_size(), &I.resizes);
    memset(q, 0xa5, sizeof *q);
    free(q);
}

static int i_cm_event(struct rdma_cm_event *ev)
{
    I.progress = now_s();
    struct iqpair *q = ev->id->context;
    switch (ev->event) {
    case RDMA_CM_EVENT_ADDR_RESOLVED:
        CHECK(q->id->verbs == I.ctx, "resolved id's verbs %p is not rdma_get_devices' %p",
              (void *)q->id->verbs, (void *)I.ctx);
        CHECK(rdma_resolve_route(q->id, 2000) == 0, "rdma_resolve_route: %s", strerror(errno));
        return 1;
    case RDMA_CM_EVENT_ROUTE_RESOLVED: {
        resize(I.cq, i_cq_size(), &I.resizes);
        struct ibv_qp_init_attr attr = {
            .send_cq = I.cq, .recv_cq = I.cq, .qp_type = IBV_QPT_RC, .sq_sig_all = 0,
            .cap = { .max_send_wr = QD, .max_recv_wr = QD, .max_send_sge = 2, .max_recv_sge = 1 },
        };
        CHECK(rdma_create_qp(q->id, I.pd, &attr) == 0, "rdma_create_qp: %s", strerror(errno));
        q->qp = q->id->qp;
        registry_add(q->qp, q);
        for (int c = 0; c < QD; c++)
            i_post_recv(q, c);
        struct conn_priv cp = { .recfmt = 0, .qid = q->serial + 1, .hrqsize = QD, .hsqsize = QD - 1,
                                .tgt_disconnect_after = q->mode == M_TARGET ? 10 + (q->serial * 13) % 40 : 0 };
        struct rdma_conn_param param = { .private_data = &cp, .private_data_len = sizeof cp,
                                         .responder_resources = RD_ATOM, .initiator_depth = 0,
                                         .retry_count = 7, .rnr_retry_count = 7 };
        CHECK(rdma_connect(q->id, &param) == 0, "rdma_connect: %s", strerror(errno));
        return 1;
    }
    case RDMA_CM_EVENT_ESTABLISHED: {
        CHECK(ev->param.conn.private_data && ev->param.conn.private_data_len >= sizeof(struct accept_priv),
              "ESTABLISHED without the accept's private data");
        struct accept_priv ap;
        memcpy(&ap, ev->param.conn.private_data, sizeof ap);
        CHECK(ap.crqsize == QD, "crqsize %u", ap.crqsize);
        q->established = 1;
        return 1;
    }
    case RDMA_CM_EVENT_DISCONNECTED:
        CHECK(!q->disconnected_event, "DISCONNECTED twice");
        q->disconnected_event = 1;
        i_disconnect(q); /* nvme_rdma does, whoever started it */
        return 1;
    default:
        return 0;
    }
}

static int initiator(const char *addr, int port, int want, int conc)
{
    I.want = want;
    I.conc = conc;
    I.dst = ipv4(addr, port);
    I.ctx = the_device();
    I.pd = ibv_alloc_pd(I.ctx);
    CHECK(I.pd, "ibv_alloc_pd");
    I.mem = aligned_alloc(4096, I_SLOT * conc);
    CHECK(I.mem, "memory");
    I.slot_used = calloc(conc, sizeof(int));
    I.mr = ibv_reg_mr(I.pd, I.mem, I_SLOT * conc,
                      IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE |
                          IBV_ACCESS_RELAXED_ORDERING);
    CHECK(I.mr, "ibv_reg_mr: %s", strerror(errno));
    I.cm = rdma_create_event_channel();
    CHECK(I.cm, "rdma_create_event_channel");
    nonblocking(I.cm->fd);
    I.ch = ibv_create_comp_channel(I.ctx);
    CHECK(I.ch, "ibv_create_comp_channel");
    nonblocking(I.ch->fd);
    I.cq = ibv_create_cq(I.ctx, 2 * QD, NULL, I.ch, 0);
    CHECK(I.cq, "ibv_create_cq");
    CHECK(ibv_req_notify_cq(I.cq, 0) == 0, "ibv_req_notify_cq");
    I.progress = now_s();
    while (I.done < I.want) {
        while (I.nlive < I.conc && I.started < I.want)
            i_start();
        struct pollfd fds[3] = { { I.cm->fd, POLLIN, 0 }, { I.ctx->async_fd, POLLIN, 0 }, { I.ch->fd, POLLIN, 0 } };
        wait_fds(fds, 3);
        drain_cm(I.cm, i_cm_event);
        drain_async(I.ctx, i_on_qp_event);
        cq_event(I.ch, i_on_wc);
        for (int s = 0; s < I.started; s++) {
            struct iqpair *q = I.by_serial[s];
            if (!q)
                continue;
            i_issue(q);
            if (q->disconnected_event && q->sends_out == 0 && q->recvs_out == 0) {
                i_destroy(q);
                I.progress = now_s();
            }
        }
        if (now_s() - I.progress > STALL_S) {
            for (int s = 0; s < I.started; s++) {
                struct iqpair *q = I.by_serial[s];
                if (q)
                    fprintf(stderr, "qpair %d mode %d: established %d flushed %d disconnected %d called %d "
                            "issued %u completed %u sends_out %d recvs_out %d\n", s, q->mode, q->established,
                            q->flushed, q->disconnected_event, q->disconnect_called, q->issued, q->completed,
                            q->sends_out, q->recvs_out);
            }
            fail("no progress for %d s (%d of %d qpairs done)", STALL_S, I.done, I.want);
        }
    }
    drain_async(I.ctx, i_on_qp_event);
    CHECK(ibv_destroy_cq(I.cq) == 0, "ibv_destroy_cq: %s", strerror(errno));
    CHECK(ibv_destroy_comp_channel(I.ch) == 0, "ibv_destroy_comp_channel");
    CHECK(ibv_dereg_mr(I.mr) == 0, "ibv_dereg_mr");
    CHECK(ibv_dealloc_pd(I.pd) == 0, "ibv_dealloc_pd");
    rdma_destroy_event_channel(I.cm);
    CHECK(I.inflight_disconnects > 0 && I.resizes > 0, "pattern not exercised");
    printf("spdk_pattern initiator: ok qpairs=%d commands=%lu bytes=%lu flushed_commands=%lu "
           "inflight_disconnects=%lu resizes=%lu\n",
           I.done, I.commands, I.bytes, I.flushed_cmds, I.inflight_disconnects, I.resizes);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 5 && strcmp(argv[1], "target") == 0) {
        role = "target";
        return target(argv[2], atoi(argv[3]), atoi(argv[4]));
    }
    if (argc == 6 && strcmp(argv[1], "initiator") == 0) {
        role = "initiator";
        int want = atoi(argv[4]), conc = atoi(argv[5]);
        CHECK(want > 0 && want < MAX_QPAIRS && conc > 0 && conc <= want, "bad counts");
        return initiator(argv[2], atoi(argv[3]), want, conc);
    }
    fprintf(stderr, "usage: %s target ADDR PORT QPAIRS | initiator ADDR PORT QPAIRS CONCURRENCY\n", argv[0]);
    return 2;
}
