/* One RC QP in a process of its own, driven line by line on stdin by a test (tests/pairing.rs),
 * so that tests can play a victim, its real peer and a stranger as separate processes, on one
 * host or in two network namespaces. Usage: qp_peer FILL_BYTE
 *
 * At start it prints "ready lid=L qpn=Q rkey=R addr=A pid=P": its buffer (BUF_LEN bytes, all
 * FILL_BYTE, registered for local and remote write and remote read) is at A under rkey R.
 * Commands (each answer ends with a line "done"; "err ..." when a verb fails):
 *   init                          RESET -> INIT (remote write and read allowed)
 *   rtr DLID DQPN RQ_PSN          INIT -> RTR towards DLID/DQPN
 *   rts SQ_PSN TIMEOUT RETRY RNR  RTR -> RTS
 *   error                         -> ERR
 *   recv WR_ID LEN COUNT          COUNT receives of LEN bytes into slots of the receive half
 *   send WR_ID LEN COUNT          COUNT signaled SENDs of LEN bytes, message i from slot i of
 *                                 the send half, its first 4 bytes set to i
 *   write WR_ID RKEY RADDR LEN    a signaled RDMA WRITE of LEN bytes from the send half
 *   read WR_ID RKEY RADDR LEN     a signaled RDMA READ of LEN bytes into the receive half
 *   fadd RKEY RADDR COUNT         COUNT FETCH_AND_ADDs of 1 at RADDR, one at a time, each
 *                                 completion checked: "fadd sum S sumsq Q max M" over the
 *                                 values they returned
 *   poll N MS                     up to N completions within MS ms: "wc ..." lines, then
 *                                 "polled K"
 *   drain N MS                    up to N completions within MS ms: "first ..." (the first
 *                                 completion), "count STATUS K" per status, "polled K"
 *   seq LEN COUNT                 "seq ok" if receive slot i starts with i for every i < COUNT
 *   bytes OFF LEN                 "bytes uniform X" if all LEN bytes at OFF are X, else
 *                                 "bytes mixed"
 *   qpns K                        creates K more QPs (each with its own CQ) and prints
 *                                 "qpns N1 N2 ..."
 *   use I                         the commands above act on QP I (0: the first; 1..: those
 *                                 qpns created, in order) from now on; prints "qpn N"
 *   rss                           "rss KB" (VmRSS)
 *   state                         "state S" (ibv_query_qp)
 */
#include <infiniband/verbs.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define BUF_LEN (16u << 20)
#define SEND_HALF 0
#define RECV_HALF (BUF_LEN / 2)
#define MAX_WR 16384

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); exit(1); } } while (0)

#define MAX_QPS 64

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq, *cqs[MAX_QPS];
static struct ibv_qp *qp, *qps[MAX_QPS];
static int nqps;
static struct ibv_mr *mr;
static unsigned char *buf;

static double now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

/* A QP with a CQ of its own, remembered as qps[nqps]. */
static struct ibv_qp *new_qp(void)
{
    CHECK(nqps < MAX_QPS, "too many QPs");
    struct ibv_cq *own = ibv_create_cq(ctx, 4 * MAX_WR, NULL, NULL, 0);
    CHECK(own, "create_cq: %s", strerror(errno));
    struct ibv_qp_init_attr init = { .send_cq = own, .recv_cq = own, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = MAX_WR, .max_recv_wr = MAX_WR, .max_send_sge = 1,
                 .max_recv_sge = 1 } };
    struct ibv_qp *q = ibv_create_qp(pd, &init);
    CHECK(q, "create_qp: %s", strerror(errno));
    cqs[nqps] = own;
    qps[nqps++] = q;
    return q;
}

static void answer_rc(int rc, const char *what)
{
    if (rc)
        printf("err %s: %s\n", what, strerror(rc < 0 ? -rc : rc));
}

static void modify(struct ibv_qp_attr *a, int mask, const char *what)
{
    answer_rc(ibv_modify_qp(qp, a, mask), what);
}

static void print_wc(const char *tag, const struct ibv_wc *wc)
{
    printf("%s wr_id=%" PRIu64 " status=%d opcode=%d byte_len=%u qp_num=%u src_qp=%u slid=%u\n",
           tag, wc->wr_id, wc->status, wc->opcode, wc->byte_len, wc->qp_num, wc->src_qp, wc->slid);
}

static void poll_cmd(int n, int ms, int summary)
{
    int got = 0, counts[32] = { 0 };
    double until = now_ms() + ms;
    struct ibv_wc wc;
    while (got < n && now_ms() < until) {
        int k = ibv_poll_cq(cq, 1, &wc);
        CHECK(k >= 0, "poll_cq");
        if (k == 0) {
            usleep(100);
            continue;
        }
        if (!summary)
            print_wc("wc", &wc);
        else if (got == 0)
            print_wc("first", &wc);
        counts[wc.status & 31]++;
        got++;
    }
    if (summary)
        for (int s = 0; s < 32; s++)
            if (counts[s])
                printf("count %d %d\n", s, counts[s]);
    printf("polled %d\n", got);
}

static void post_sends(uint64_t wr_id, uint32_t len, int count)
{
    for (int i = 0; i < count; i++) {
        unsigned char *slot = buf + SEND_HALF + (size_t)i * len % (BUF_LEN / 2);
        if (len >= 4)
            memcpy(slot, &i, 4);
        struct ibv_sge sge = { (uintptr_t)slot, len, mr->lkey };
        struct ibv_send_wr wr = { .wr_id = wr_id + i, .sg_list = &sge, .num_sge = 1,
                                  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
        int rc = ibv_post_send(qp, &wr, &bad);
        if (rc) {
            answer_rc(rc, "post_send");
            return;
        }
    }
}

static void post_recvs(uint64_t wr_id, uint32_t len, int count)
{
    for (int i = 0; i < count; i++) {
        unsigned char *slot = buf + RECV_HALF + (size_t)i * len % (BUF_LEN / 2);
        struct ibv_sge sge = { (uintptr_t)slot, len, mr->lkey };
        struct ibv_recv_wr wr = { .wr_id = wr_id + i, .sg_list = &sge, .num_sge = 1 }, *bad;
        int rc = ibv_post_recv(qp, &wr, &bad);
        if (rc) {
            answer_rc(rc, "post_recv");
            return;
        }
    }
}

static void fetch_adds(uint32_t rkey, uint64_t raddr, int count)
{
    unsigned long long sum = 0, sumsq = 0, max = 0;
    uint64_t *result = (uint64_t *)(buf + RECV_HALF);
    for (int i = 0; i < count; i++) {
        struct ibv_sge sge = { (uintptr_t)result, 8, mr->lkey };
        struct ibv_send_wr wr = { .wr_id = (uint64_t)i, .sg_list = &sge, .num_sge = 1,
                                  .opcode = IBV_WR_ATOMIC_FETCH_AND_ADD,
                                  .send_flags = IBV_SEND_SIGNALED }, *bad;
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.remote_addr = raddr;
        wr.wr.atomic.compare_add = 1;
        int rc = ibv_post_send(qp, &wr, &bad);
        if (rc) {
            answer_rc(rc, "post_send");
            return;
        }
        struct ibv_wc wc;
        time_t until = time(NULL) + 10;
        while ((rc = ibv_poll_cq(cq, 1, &wc)) == 0 && time(NULL) < until) {
        }
        if (rc != 1 || wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_FETCH_ADD ||
            wc.wr_id != (uint64_t)i || wc.byte_len != 8) {
            printf("err fadd %d: rc %d status %d opcode %d wr_id %" PRIu64 " byte_len %u\n", i, rc,
                   rc == 1 ? (int)wc.status : -1, rc == 1 ? (int)wc.opcode : -1,
                   rc == 1 ? wc.wr_id : 0, rc == 1 ? wc.byte_len : 0);
            return;
        }
        sum += *result;
        sumsq += (unsigned long long)*result * *result;
        if (*result > max)
            max = *result;
    }
    printf("fadd sum %llu sumsq %llu max %llu\n", sum, sumsq, max);
}

static void rss(void)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, "VmRSS:", 6) == 0)
            printf("rss %ld\n", strtol(line + 6, NULL, 10));
    if (f)
        fclose(f);
}

int main(int argc, char **argv)
{
    CHECK(argc == 2, "usage: qp_peer FILL_BYTE");
    setvbuf(stdout, NULL, _IOLBF, 0);
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1, "no device");
    ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open: %s", strerror(errno));
    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
    pd = ibv_alloc_pd(ctx);
    CHECK(pd, "pd");
    qp = new_qp();
    cq = cqs[0];
    buf = aligned_alloc(4096, BUF_LEN);
    CHECK(buf, "buffer");
    memset(buf, (int)strtol(argv[1], NULL, 0), BUF_LEN);
    mr = ibv_reg_mr(pd, buf, BUF_LEN,
                    IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                    IBV_ACCESS_REMOTE_ATOMIC);
    CHECK(mr, "reg_mr: %s", strerror(errno));
    printf("ready lid=%u qpn=%u rkey=%u addr=%" PRIu64 " pid=%d\n", port.lid, qp->qp_num,
           mr->rkey, (uint64_t)(uintptr_t)buf, (int)getpid());

    char line[512], cmd[32];
    while (fgets(line, sizeof line, stdin)) {
        unsigned long long a = 0, b = 0, c = 0, d = 0;
        if (sscanf(line, "%31s %llu %llu %llu %llu", cmd, &a, &b, &c, &d) < 1)
            continue;
        struct ibv_qp_attr at;
        memset(&at, 0, sizeof at);
        if (!strcmp(cmd, "init")) {
            at.qp_state = IBV_QPS_INIT; at.port_num = 1;
            at.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                                 IBV_ACCESS_REMOTE_ATOMIC;
            modify(&at, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS,
                   "INIT");
        } else if (!strcmp(cmd, "rtr")) {
            at.qp_state = IBV_QPS_RTR; at.path_mtu = IBV_MTU_4096; at.dest_qp_num = (uint32_t)b;
            at.rq_psn = (uint32_t)c; at.max_dest_rd_atomic = 1; at.min_rnr_timer = 12;
            at.ah_attr.dlid = (uint16_t)a; at.ah_attr.port_num = 1;
            modify(&at, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
                   IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER, "RTR");
        } else if (!strcmp(cmd, "rts")) {
            at.qp_state = IBV_QPS_RTS; at.sq_psn = (uint32_t)a; at.timeout = (uint8_t)b;
            at.retry_cnt = (uint8_t)c; at.rnr_retry = (uint8_t)d; at.max_rd_atomic = 1;
            modify(&at, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                   IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC, "RTS");
        } else if (!strcmp(cmd, "error")) {
            at.qp_state = IBV_QPS_ERR;
            modify(&at, IBV_QP_STATE, "ERR");
        } else if (!strcmp(cmd, "recv")) {
            post_recvs(a, (uint32_t)b, (int)c);
        } else if (!strcmp(cmd, "send")) {
            post_sends(a, (uint32_t)b, (int)c);
        } else if (!strcmp(cmd, "write") || !strcmp(cmd, "read")) {
            int read = !strcmp(cmd, "read");
            struct ibv_sge sge = { (uintptr_t)(buf + (read ? RECV_HALF : SEND_HALF)), (uint32_t)d, mr->lkey };
            struct ibv_send_wr wr = { .wr_id = a, .sg_list = &sge, .num_sge = 1,
                                      .opcode = read ? IBV_WR_RDMA_READ : IBV_WR_RDMA_WRITE,
                                      .send_flags = IBV_SEND_SIGNALED }, *bad;
            wr.wr.rdma.rkey = (uint32_t)b;
            wr.wr.rdma.remote_addr = c;
            answer_rc(ibv_post_send(qp, &wr, &bad), "post_send");
        } else if (!strcmp(cmd, "fadd")) {
            fetch_adds((uint32_t)a, b, (int)c);
        } else if (!strcmp(cmd, "poll") || !strcmp(cmd, "drain")) {
            poll_cmd((int)a, (int)b, !strcmp(cmd, "drain"));
        } else if (!strcmp(cmd, "seq")) {
            int bad = -1;
            for (uint32_t i = 0; i < c && bad < 0; i++) {
                uint32_t v;
                memcpy(&v, buf + RECV_HALF + (size_t)i * a % (BUF_LEN / 2), 4);
                if (v != i)
                    bad = (int)i;
            }
            if (bad < 0)
                printf("seq ok\n");
            else
                printf("seq bad at %d\n", bad);
        } else if (!strcmp(cmd, "bytes")) {
            int uniform = 1;
            for (unsigned long long i = 1; i < b; i++)
                uniform &= buf[a + i] == buf[a];
            if (uniform)
                printf("bytes uniform %u\n", buf[a]);
            else
                printf("bytes mixed\n");
        } else if (!strcmp(cmd, "qpns")) {
            printf("qpns");
            for (unsigned long long i = 0; i < a; i++)
                printf(" %u", new_qp()->qp_num);
            printf("\n");
        } else if (!strcmp(cmd, "use")) {
            if (a < (unsigned long long)nqps) {
                qp = qps[a];
                cq = cqs[a];
                printf("qpn %u\n", qp->qp_num);
            } else {
                printf("err no QP %llu\n", a);
            }
        } else if (!strcmp(cmd, "rss")) {
            rss();
        } else if (!strcmp(cmd, "state")) {
            struct ibv_qp_init_attr ia;
            answer_rc(ibv_query_qp(qp, &at, IBV_QP_STATE, &ia), "query_qp");
            printf("state %d\n", at.qp_state);
        } else {
            printf("err unknown command %s\n", cmd);
        }
        printf("done\n");
    }
    return 0;
}
