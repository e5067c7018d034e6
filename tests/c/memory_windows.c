/* Memory windows across two processes, with the real <infiniband/verbs.h> (ibv_alloc_mw,
 * ibv_bind_mw, ibv_dealloc_mw, ibv_inc_rkey and the ibv_wr_* builders are inline there) and
 * libugdr.so preloaded (tests/memory_window.rs).
 *
 *   memory_windows target PORT             owns the windows: answers commands on a TCP socket
 *   memory_windows initiator PORT SECTION  drives it: binds, invalidations, and RDMA WRITE,
 *                                          READ, atomics and SEND_WITH_INV through the keys
 *
 * Sections: type1, type2, errors, uc. Every completion's fields and the bytes moved are checked;
 * an access error moves both QPs to ERR, after which a fresh pair is connected. Both exit 0
 * and print "memory_windows SECTION: ok" / "memory_windows target: ok" only if all held. */
#include "verbs_test.h"
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

enum { C_CONNECT = 1, C_BIND, C_LOCAL_INV, C_STATE, C_RECV, C_POLL_RECV, C_FILL, C_HASH, C_BUSY,
       C_FREE, C_DEALLOC, C_LOCAL_ERRORS, C_QUIT };
enum { VIA_POST, VIA_WR }; /* ibv_post_send, or the ibv_wr_* builders */
#define NO_MR 9

typedef uint64_t msg[8];
static int sock;
static struct ibv_context *ctx;
static struct ibv_pd *pd;
static uint16_t lid;
static long page;
static struct ibv_cq_ex *cqx; /* every CQ is extended: receives are also read with ibv_wc_read_* */
static struct ibv_cq *cq;
static struct ibv_qp *qp;

static void put(const uint64_t *m) { CHECK(write(sock, m, sizeof(msg)) == sizeof(msg), "write"); }
static void get(uint64_t *m)
{
    size_t got = 0;
    while (got < sizeof(msg)) {
        ssize_t n = read(sock, (char *)m + got, sizeof(msg) - got);
        CHECK(n > 0, "peer gone");
        got += n;
    }
}

static uint64_t hash(const unsigned char *p, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return h;
}

static const uint64_t rc_ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_INV |
    IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_READ | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD |
    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_BIND_MW;
static const uint64_t uc_ops = IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_SEND_WITH_INV | IBV_QP_EX_WITH_RDMA_WRITE |
    IBV_QP_EX_WITH_LOCAL_INV | IBV_QP_EX_WITH_BIND_MW;
static const int qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

static struct ibv_qp *new_qp(struct ibv_pd *p, enum ibv_qp_type type)
{
    struct ibv_qp_init_attr_ex a = { .send_cq = cq, .recv_cq = cq, .qp_type = type,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 },
        .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = p,
        .send_ops_flags = type == IBV_QPT_UD ? IBV_QP_EX_WITH_SEND : type == IBV_QPT_UC ? uc_ops : rc_ops };
    struct ibv_qp *q = ibv_create_qp_ex(ctx, &a);
    CHECK(q, "create_qp_ex");
    return q;
}

/* A fresh CQ and QP of `type` (the old ones destroyed). */
static void fresh_qp(enum ibv_qp_type type)
{
    if (qp)
        CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0, "destroy");
    struct ibv_cq_init_attr_ex ca = { .cqe = 64, .wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM |
                                      IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_SRC_QP };
    cqx = ibv_create_cq_ex(ctx, &ca);
    CHECK(cqx, "create_cq_ex");
    cq = ibv_cq_ex_to_cq(cqx);
    qp = new_qp(pd, type);
}

/* RESET → RTS towards (dlid, dqpn): RC as verbs_test.h's to_rts, UC with UC's attributes. */
static void connect_qp(enum ibv_qp_type type, uint16_t dlid, uint32_t dqpn)
{
    if (type == IBV_QPT_RC) {
        to_rts(qp, dlid, dqpn, qp_access);
        return;
    }
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = IBV_ACCESS_REMOTE_WRITE };
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0, "UC INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dqpn;
    a.ah_attr.dlid = dlid; a.ah_attr.port_num = 1;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN) == 0,
          "UC RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS;
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "UC RTS");
}

static enum ibv_qp_state state_of(struct ibv_qp *q)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr i;
    CHECK(ibv_query_qp(q, &a, IBV_QP_STATE, &i) == 0, "query_qp");
    return a.qp_state;
}

static void open_device(void)
{
    page = sysconf(_SC_PAGESIZE);
    struct ibv_device **list = ibv_get_device_list(NULL);
    CHECK(list && list[0], "no device");
    ctx = ibv_open_device(list[0]);
    CHECK(ctx, "open_device");
    ibv_free_device_list(list);
    pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc_pd");
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0, "query_port");
    lid = pa.lid;
}

/* ================================================================== target */

#define T_PAGES 4
static unsigned char *tbuf, *other;
static struct ibv_mr *mrs[4]; /* 0: MW_BIND + local write; 1: no MW_BIND; 2: MW_BIND, no local write; 3: other PD */
static struct ibv_mw *mws[4]; /* 1: type 1; 2: type 2; 3: type 2 of the other PD */
static uint32_t t2_rkey[4];   /* the type 2 windows' keys, as bound */
static struct ibv_pd *pd2;
static const int full = IBV_ACCESS_LOCAL_WRITE | qp_access | IBV_ACCESS_MW_BIND;

static void *pages(int n)
{
    void *p = mmap(NULL, n * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED, "mmap");
    return p;
}

/* One signaled completion of the target's send queue, as 8 numbers: post result, status,
 * opcode, wr_id, qp_num matches, byte_len, wc_flags, and `key`. */
static void send_completion(int posted, uint64_t wr_id, uint32_t key, uint64_t *r)
{
    memset(r, 0, sizeof(msg));
    r[0] = (uint64_t)posted;
    r[7] = key;
    if (posted != 0)
        return;
    struct ibv_wc wc;
    CHECK(poll_one(cq, &wc) == 1, "target: no completion");
    r[1] = wc.status; r[2] = wc.opcode; r[3] = wc.wr_id == wr_id; r[4] = wc.qp_num == qp->qp_num;
    r[5] = wc.byte_len; r[6] = wc.wc_flags;
}

/* ibv_wr_start on `q` with the next WR's id, signaled. */
static struct ibv_qp_ex *wr_begin(struct ibv_qp *q, uint64_t wr_id)
{
    struct ibv_qp_ex *x = ibv_qp_to_qp_ex(q);
    ibv_wr_start(x);
    x->wr_id = wr_id;
    x->wr_flags = IBV_SEND_SIGNALED;
    return x;
}

static int post_one(struct ibv_send_wr *wr)
{
    struct ibv_send_wr *bad = NULL;
    int rc = ibv_post_send(qp, wr, &bad);
    CHECK(rc == 0 || bad == wr, "bad_wr");
    return rc;
}

static void t_bind(const uint64_t *m, uint64_t *r)
{
    int w = (int)m[1], via = (int)m[7];
    struct ibv_mr *mr = m[2] == NO_MR ? NULL : mrs[m[2]];
    struct ibv_mw_bind_info info = { .mr = mr, .addr = mr ? (uint64_t)(uintptr_t)mr->addr + m[3] : 0,
                                     .length = m[4], .mw_access_flags = (unsigned)m[5] };
    uint64_t wr_id = m[6];
    struct ibv_mw *mw = mws[w];
    if (mw->type == IBV_MW_TYPE_1) {
        uint32_t old = mw->rkey;
        struct ibv_mw_bind b = { .wr_id = wr_id, .send_flags = IBV_SEND_SIGNALED, .bind_info = info };
        int rc = ibv_bind_mw(qp, mw, &b);
        CHECK(rc != 0 || mw->rkey == ibv_inc_rkey(old), "ibv_bind_mw: mw->rkey %#x after %#x", mw->rkey, old);
        send_completion(rc, wr_id, mw->rkey, r);
        if (rc != 0 || r[1] != IBV_WC_SUCCESS)
            mw->rkey = old; /* the application undoes it (rxe's provider comment) */
        return;
    }
    uint32_t key = ibv_inc_rkey(t2_rkey[w]);
    int rc;
    if (via == VIA_POST) {
        struct ibv_send_wr wr = { .wr_id = wr_id, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED };
        wr.bind_mw.mw = mw;
        wr.bind_mw.rkey = key;
        wr.bind_mw.bind_info = info;
        rc = post_one(&wr);
    } else {
        struct ibv_qp_ex *x = wr_begin(qp, wr_id);
        ibv_wr_bind_mw(x, mw, key, &info);
        rc = ibv_wr_complete(x);
    }
    send_completion(rc, wr_id, key, r);
    if (rc == 0 && r[1] == IBV_WC_SUCCESS)
        t2_rkey[w] = key;
}

static void t_local_inv(const uint64_t *m, uint64_t *r)
{
    uint32_t key = (uint32_t)m[1];
    uint64_t wr_id = m[2];
    int rc;
    if (m[3] == VIA_POST) {
        struct ibv_send_wr wr = { .wr_id = wr_id, .opcode = IBV_WR_LOCAL_INV, .send_flags = IBV_SEND_SIGNALED };
        wr.invalidate_rkey = key;
        rc = post_one(&wr);
    } else {
        struct ibv_qp_ex *x = wr_begin(qp, wr_id);
        ibv_wr_local_inv(x, key);
        rc = ibv_wr_complete(x);
    }
    send_completion(rc, wr_id, key, r);
}

/* What fails before any WR executes, on the target alone. */
static void t_local_errors(void)
{
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0, "query_device");
    const unsigned want = IBV_DEVICE_MEM_WINDOW | IBV_DEVICE_MEM_WINDOW_TYPE_2B | IBV_DEVICE_MEM_MGT_EXTENSIONS;
    CHECK((da.device_cap_flags & want) == want && da.max_mw > 0, "caps %#x max_mw %d", da.device_cap_flags, da.max_mw);
    FAILS_WITH(ibv_alloc_mw(pd, (enum ibv_mw_type)3), NULL, EINVAL);
    FAILS_WITH(ibv_dealloc_pd(pd2), EBUSY, EBUSY); /* a window and a region on it */
    struct ibv_mw_bind_info info = { .mr = mrs[0], .addr = (uintptr_t)tbuf, .length = 64,
                                     .mw_access_flags = IBV_ACCESS_REMOTE_READ };
    /* ibv_bind_mw is for type 1; zero-based windows are not offered (EINVAL, as rxe). */
    struct ibv_mw_bind b = { .wr_id = 1, .send_flags = IBV_SEND_SIGNALED, .bind_info = info };
    errno = 0;
    CHECK(ibv_bind_mw(qp, mws[2], &b) == EINVAL, "ibv_bind_mw of a type 2 window");
    b.bind_info.mw_access_flags |= IBV_ACCESS_ZERO_BASED;
    uint32_t before = mws[1]->rkey;
    CHECK(ibv_bind_mw(qp, mws[1], &b) == EINVAL && errno == EINVAL && mws[1]->rkey == before, "zero-based ibv_bind_mw");
    b.bind_info.mw_access_flags = IBV_ACCESS_REMOTE_READ;
    b.bind_info.mr = mrs[3];
    CHECK(ibv_bind_mw(qp, mws[1], &b) == EPERM, "ibv_bind_mw with a region of another PD");
    /* A type 1 window is never bound by a BIND_MW WR; no WR carries a BIND_MW with SGEs. */
    struct ibv_send_wr wr = { .wr_id = 2, .opcode = IBV_WR_BIND_MW, .send_flags = IBV_SEND_SIGNALED };
    wr.bind_mw.mw = mws[1];
    wr.bind_mw.rkey = ibv_inc_rkey(mws[1]->rkey);
    wr.bind_mw.bind_info = info;
    CHECK(post_one(&wr) == EINVAL, "BIND_MW WR of a type 1 window");
    wr.bind_mw.mw = mws[2];
    struct ibv_sge sge = { (uintptr_t)tbuf, 8, mrs[0]->lkey };
    wr.sg_list = &sge;
    wr.num_sge = 1;
    CHECK(post_one(&wr) == EINVAL, "BIND_MW WR with an SGE");
    /* Nor on a UD QP (nor LOCAL_INV or SEND_WITH_INV there). */
    struct ibv_qp *ud = new_qp(pd, IBV_QPT_UD);
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = 0x11 };
    CHECK(ibv_modify_qp(ud, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0, "UD INIT");
    a.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(ud, &a, IBV_QP_STATE) == 0, "UD RTR");
    a.qp_state = IBV_QPS_RTS;
    CHECK(ibv_modify_qp(ud, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "UD RTS");
    wr.sg_list = NULL;
    wr.num_sge = 0;
    struct ibv_send_wr *bad = NULL;
    CHECK(ibv_post_send(ud, &wr, &bad) == EINVAL && bad == &wr, "BIND_MW on a UD QP");
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.invalidate_rkey = mws[2]->rkey;
    CHECK(ibv_post_send(ud, &wr, &bad) == EINVAL, "LOCAL_INV on a UD QP");
    CHECK(ibv_destroy_qp(ud) == 0, "destroy UD");
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "a refused WR completed");
    CHECK(state_of(qp) == IBV_QPS_RTS, "refused WRs moved the QP");
}

static int target(int port)
{
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    CHECK(bind(ls, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(ls, 1) == 0, "listen");
    printf("listening\n");
    fflush(stdout);
    sock = accept(ls, NULL, NULL);
    CHECK(sock >= 0, "accept");
    open_device();
    tbuf = pages(T_PAGES);
    other = pages(1);
    pd2 = ibv_alloc_pd(ctx);
    CHECK(pd2, "alloc_pd");
    mrs[0] = ibv_reg_mr(pd, tbuf, 2 * page, full);
    mrs[1] = ibv_reg_mr(pd, tbuf + 2 * page, page, IBV_ACCESS_LOCAL_WRITE | qp_access);
    mrs[2] = ibv_reg_mr(pd, tbuf + 3 * page, page, IBV_ACCESS_MW_BIND | IBV_ACCESS_REMOTE_READ);
    mrs[3] = ibv_reg_mr(pd2, other, page, full);
    CHECK(mrs[0] && mrs[1] && mrs[2] && mrs[3], "reg_mr");
    mws[1] = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
    mws[2] = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    mws[3] = ibv_alloc_mw(pd2, IBV_MW_TYPE_2);
    CHECK(mws[1] && mws[2] && mws[3], "alloc_mw");
    for (int i = 1; i < 4; i++) {
        CHECK(mws[i]->pd == (i == 3 ? pd2 : pd) && mws[i]->context == ctx &&
              mws[i]->type == (i == 1 ? IBV_MW_TYPE_1 : IBV_MW_TYPE_2), "ibv_mw fields");
        t2_rkey[i] = mws[i]->rkey;
    }
    unsigned char *rbuf = tbuf + page + page / 2; /* receives: in region 0, away from the windows */
    msg m, r;
    for (;;) {
        get(m);
        memset(r, 0, sizeof r);
        switch (m[0]) {
        case C_CONNECT:
            fresh_qp((enum ibv_qp_type)m[3]);
            connect_qp((enum ibv_qp_type)m[3], (uint16_t)m[1], (uint32_t)m[2]);
            r[0] = lid; r[1] = qp->qp_num; r[2] = (uintptr_t)tbuf; r[3] = mrs[0]->rkey;
            r[4] = mrs[1]->rkey;
            break;
        case C_BIND: t_bind(m, r); break;
        case C_LOCAL_INV: t_local_inv(m, r); break;
        case C_STATE: r[0] = state_of(qp); break;
        case C_RECV: {
            struct ibv_sge sge = { (uintptr_t)rbuf, 256, mrs[0]->lkey };
            struct ibv_recv_wr wr = { .wr_id = m[1], .sg_list = &sge, .num_sge = 1 }, *bad;
            r[0] = ibv_post_recv(qp, &wr, &bad);
            break;
        }
        case C_POLL_RECV: {
            if (m[1]) { /* the extended API: ibv_wc_read_invalidated_rkey reads the union */
                struct ibv_poll_cq_attr pa = { .comp_mask = 0 };
                int rc = ENOENT;
                for (int i = 0; i < 10000 && rc == ENOENT; i++)
                    if ((rc = ibv_start_poll(cqx, &pa)) == ENOENT)
                        usleep(1000);
                CHECK(rc == 0, "target: ibv_start_poll %d", rc);
                r[0] = cqx->status; r[1] = ibv_wc_read_opcode(cqx); r[2] = cqx->wr_id;
                r[3] = ibv_wc_read_byte_len(cqx); r[4] = ibv_wc_read_wc_flags(cqx);
                r[5] = ibv_wc_read_invalidated_rkey(cqx); r[6] = ibv_wc_read_qp_num(cqx) == qp->qp_num;
                r[7] = ibv_wc_read_src_qp(cqx);
                ibv_end_poll(cqx);
                break;
            }
            struct ibv_wc wc;
            CHECK(poll_one(cq, &wc) == 1, "target: no receive completion");
            r[0] = wc.status; r[1] = wc.opcode; r[2] = wc.wr_id; r[3] = wc.byte_len;
            r[4] = wc.wc_flags; r[5] = wc.invalidated_rkey; r[6] = wc.qp_num == qp->qp_num;
            r[7] = wc.src_qp;
            break;
        }
        case C_FILL: memset(tbuf, (int)m[1], T_PAGES * page); break;
        case C_HASH: r[0] = hash(m[1] == 1 ? rbuf : tbuf + m[2], m[3]); break;
        case C_BUSY:
            errno = 0;
            r[0] = (uint64_t)ibv_dereg_mr(mrs[0]); r[1] = errno;
            errno = 0;
            r[2] = (uint64_t)ibv_rereg_mr(mrs[0], IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, full);
            r[3] = errno;
            break;
        case C_FREE:
            r[0] = (uint64_t)ibv_rereg_mr(mrs[0], IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, full);
            r[1] = mrs[0]->rkey;
            break;
        case C_DEALLOC: {
            int w = (int)m[1];
            enum ibv_mw_type type = mws[w]->type;
            r[0] = (uint64_t)ibv_dealloc_mw(mws[w]);
            mws[w] = ibv_alloc_mw(w == 3 ? pd2 : pd, type);
            CHECK(mws[w], "alloc_mw");
            t2_rkey[w] = mws[w]->rkey;
            break;
        }
        case C_LOCAL_ERRORS: t_local_errors(); break;
        case C_QUIT:
            put(r);
            for (int i = 1; i < 4; i++)
                CHECK(ibv_dealloc_mw(mws[i]) == 0, "dealloc_mw");
            for (int i = 0; i < 4; i++)
                CHECK(ibv_dereg_mr(mrs[i]) == 0, "dereg_mr");
            CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0, "destroy");
            CHECK(ibv_dealloc_pd(pd2) == 0 && ibv_dealloc_pd(pd) == 0, "dealloc_pd");
            CHECK(ibv_close_device(ctx) == 0, "close_device");
            printf("memory_windows target: ok\n");
            return 0;
        default: CHECK(0, "unknown command %llu", (unsigned long long)m[0]);
        }
        put(r);
    }
}

/* ================================================================== initiator */

static msg r;                 /* the target's last answer */
static uint64_t tbase;        /* the target's buffer */
static uint32_t mr_rkey, nobind_rkey;
static unsigned char *lbuf;   /* 0: data out; 2 pages on: data in; 3 pages on: atomics */
static struct ibv_mr *lmr;
static uint64_t next_id = 100;

#define T(...) do { uint64_t m_[8] = { __VA_ARGS__ }; put(m_); get(r); } while (0)

static enum ibv_qp_type conn_type = IBV_QPT_RC;

static void connect_pair(void)
{
    fresh_qp(conn_type);
    T(C_CONNECT, lid, qp->qp_num, conn_type);
    connect_qp(conn_type, (uint16_t)r[0], (uint32_t)r[1]);
    tbase = r[2]; mr_rkey = (uint32_t)r[3]; nobind_rkey = (uint32_t)r[4];
}

static uint32_t target_state(void)
{
    T(C_STATE);
    return (uint32_t)r[0];
}

/* An error moved the target's QP to ERR (`mine`: the initiator's too; else it stays in RTS,
 * a local error never reaches the peer): checked, then a new pair. */
static void after_error(int mine, const char *what)
{
    CHECK(state_of(qp) == (mine ? IBV_QPS_ERR : IBV_QPS_RTS), "%s: initiator in %d", what, state_of(qp));
    for (int i = 0; i < 1000 && target_state() != IBV_QPS_ERR; i++)
        usleep(1000);
    CHECK(target_state() == IBV_QPS_ERR, "%s: target in %u", what, (unsigned)r[0]);
    connect_pair();
}

static void pattern(unsigned char *p, size_t n, unsigned seed)
{
    for (size_t i = 0; i < n; i++)
        p[i] = (unsigned char)(i * 7 + seed);
}

/* One signaled WRITE, READ, FETCH_ADD or CMP_SWP of `len` bytes at `raddr` under `rkey`;
 * its completion must be `want`. Returns the atomic's old value. */
static uint64_t access_remote(enum ibv_wr_opcode op, uint64_t raddr, uint32_t rkey, uint32_t len,
                              enum ibv_wc_status want, const char *what)
{
    uint64_t id = next_id++;
    int atomic = op == IBV_WR_ATOMIC_FETCH_AND_ADD || op == IBV_WR_ATOMIC_CMP_AND_SWP;
    unsigned char *local = op == IBV_WR_RDMA_WRITE ? lbuf : atomic ? lbuf + 3 * page : lbuf + 2 * page;
    struct ibv_sge sge = { (uintptr_t)local, len, lmr->lkey };
    struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
                              .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
    if (atomic) {
        wr.wr.atomic.remote_addr = raddr;
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.compare_add = op == IBV_WR_ATOMIC_FETCH_AND_ADD ? 5 : *(uint64_t *)(lbuf + 8);
        wr.wr.atomic.swap = 0x5157;
    } else {
        wr.wr.rdma.remote_addr = raddr;
        wr.wr.rdma.rkey = rkey;
    }
    CHECK(ibv_post_send(qp, &wr, &bad) == 0, "%s: post_send", what);
    struct ibv_wc wc;
    CHECK(poll_one(cq, &wc) == 1, "%s: no completion", what);
    CHECK(wc.wr_id == id && wc.status == want && wc.qp_num == qp->qp_num, "%s: wr_id %llu status %s qp_num %u",
          what, (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status), wc.qp_num);
    if (want != IBV_WC_SUCCESS) {
        after_error(1, what);
        return 0;
    }
    enum ibv_wc_opcode wop = op == IBV_WR_RDMA_WRITE ? IBV_WC_RDMA_WRITE : op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ
                           : op == IBV_WR_ATOMIC_FETCH_AND_ADD ? IBV_WC_FETCH_ADD : IBV_WC_COMP_SWAP;
    CHECK(wc.opcode == wop && wc.wc_flags == 0, "%s: opcode %d flags %u", what, wc.opcode, wc.wc_flags);
    if (op != IBV_WR_RDMA_WRITE)
        CHECK(wc.byte_len == len, "%s: byte_len %u", what, wc.byte_len);
    return atomic ? *(uint64_t *)local : 0;
}

/* The target binds window `w` (1: type 1, 2: type 2, 3: type 2 of another PD) to region
 * `mr` at `off` from its start, `len` bytes, `access`; the bind must complete with `want`. Its new key. */
static uint32_t bind_window(int w, int mr, uint64_t off, uint64_t len, unsigned access, int via,
                            enum ibv_wc_status want, const char *what)
{
    uint64_t id = next_id++;
    T(C_BIND, w, mr, off, len, access, id, via);
    CHECK(r[0] == 0, "%s: bind posted %d", what, (int)r[0]);
    CHECK(r[1] == want && r[3] && r[4], "%s: status %s wr_id ok %d qp_num ok %d", what,
          ibv_wc_status_str((enum ibv_wc_status)r[1]), (int)r[3], (int)r[4]);
    if (want == IBV_WC_SUCCESS)
        CHECK(r[2] == IBV_WC_BIND_MW && r[5] == 0 && r[6] == 0, "%s: opcode %d byte_len %d flags %d", what,
              (int)r[2], (int)r[5], (int)r[6]);
    uint32_t key = (uint32_t)r[7];
    if (want != IBV_WC_SUCCESS)
        after_error(0, what); /* a local error: the target's QP alone */
    return key;
}

static void local_inv(uint32_t key, int via, enum ibv_wc_status want, const char *what)
{
    uint64_t id = next_id++;
    T(C_LOCAL_INV, key, id, via);
    CHECK(r[0] == 0 && r[1] == want && r[3] && r[4], "%s: posted %d status %s", what, (int)r[0],
          ibv_wc_status_str((enum ibv_wc_status)r[1]));
    if (want == IBV_WC_SUCCESS)
        CHECK(r[2] == IBV_WC_LOCAL_INV && r[6] == 0, "%s: opcode %d flags %d", what, (int)r[2], (int)r[6]);
    else
        after_error(0, what);
}

/* A 64-byte SEND_WITH_INV of `key` into a receive the target posts; `want` at both ends. */
static void send_inv(uint32_t key, int via, enum ibv_wc_status want, const char *what)
{
    uint64_t id = next_id++, rid = next_id++;
    T(C_RECV, rid);
    CHECK(r[0] == 0, "%s: post_recv", what);
    pattern(lbuf, 64, (unsigned)id);
    struct ibv_sge sge = { (uintptr_t)lbuf, 64, lmr->lkey };
    if (via == VIA_POST) {
        struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_INV,
                                  .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
        wr.invalidate_rkey = key;
        CHECK(ibv_post_send(qp, &wr, &bad) == 0, "%s: post_send", what);
    } else {
        struct ibv_qp_ex *x = wr_begin(qp, id);
        ibv_wr_send_inv(x, key);
        ibv_wr_set_sge(x, lmr->lkey, (uintptr_t)lbuf, 64);
        CHECK(ibv_wr_complete(x) == 0, "%s: wr_complete", what);
    }
    struct ibv_wc wc;
    CHECK(poll_one(cq, &wc) == 1, "%s: no completion", what);
    CHECK(wc.wr_id == id && wc.status == want && wc.qp_num == qp->qp_num, "%s: status %s", what,
          ibv_wc_status_str(wc.status));
    T(C_POLL_RECV, via == VIA_WR); /* ibv_poll_cq, or ibv_start_poll and ibv_wc_read_* */
    uint32_t my_qpn = qp->qp_num;
    if (want != IBV_WC_SUCCESS) {
        CHECK(r[0] == IBV_WC_REM_INV_REQ_ERR && r[2] == rid && r[3] == 0 && r[4] == 0 && r[6],
              "%s: receive status %s byte_len %d flags %d", what, ibv_wc_status_str((enum ibv_wc_status)r[0]),
              (int)r[3], (int)r[4]);
        after_error(1, what);
        return;
    }
    CHECK(wc.opcode == IBV_WC_SEND && wc.wc_flags == 0, "%s: opcode %d flags %u", what, wc.opcode, wc.wc_flags);
    CHECK(r[0] == IBV_WC_SUCCESS && r[1] == IBV_WC_RECV && r[2] == rid && r[3] == 64 && r[4] == IBV_WC_WITH_INV &&
          r[5] == key && r[6] && r[7] == my_qpn, "%s: receive status %s opcode %d byte_len %d flags %d "
          "invalidated_rkey %#x (want %#x) src_qp %#x", what, ibv_wc_status_str((enum ibv_wc_status)r[0]), (int)r[1],
          (int)r[3], (int)r[4], (unsigned)r[5], key, (unsigned)r[7]);
    T(C_HASH, 1, 0, 64);
    CHECK(r[0] == hash(lbuf, 64), "%s: received bytes", what);
}

static void expect_hash(uint64_t off, size_t len, const unsigned char *want, const char *what)
{
    T(C_HASH, 0, off, len);
    CHECK(r[0] == hash(want, len), "%s: bytes at %llu+%zu", what, (unsigned long long)off, len);
}

static void expect_busy(const char *what)
{
    T(C_BUSY);
    CHECK((int)r[0] == EINVAL && r[1] == EINVAL, "%s: dereg_mr %d errno %d", what, (int)r[0], (int)r[1]);
    CHECK((int)r[2] == IBV_REREG_MR_ERR_CMD && r[3] == EBUSY, "%s: rereg_mr %d errno %d", what, (int)r[2], (int)r[3]);
}

static void expect_free(const char *what)
{
    T(C_FREE);
    CHECK(r[0] == 0, "%s: rereg_mr %d", what, (int)r[0]);
    mr_rkey = (uint32_t)r[1];
}

static const unsigned RW = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
#define W IBV_WR_RDMA_WRITE
#define R IBV_WR_RDMA_READ
#define OK IBV_WC_SUCCESS
#define ACC IBV_WC_REM_ACCESS_ERR

static void type1(void)
{
    static unsigned char zeros[4096];
    T(C_FILL, 0);
    /* The region's own key (the same-host direct path when it is on). */
    pattern(lbuf, 64, 3);
    access_remote(W, tbase + page, mr_rkey, 64, OK, "write with the region's key");
    expect_hash(page, 64, lbuf, "region key");
    uint32_t k1 = bind_window(1, 0, 512, 1024, RW | IBV_ACCESS_REMOTE_ATOMIC, VIA_POST, OK, "type 1 bind");
    pattern(lbuf, 1024, 1);
    access_remote(W, tbase + 512, k1, 1024, OK, "write through the window");
    expect_hash(512, 1024, lbuf, "window write");
    expect_hash(0, 512, zeros, "in front of the window");
    expect_hash(1536, 512, zeros, "behind the window");
    access_remote(R, tbase + 512, k1, 1024, OK, "read through the window");
    CHECK(memcmp(lbuf + 2 * page, lbuf, 1024) == 0, "read data");
    uint64_t first = *(uint64_t *)lbuf, second = *(uint64_t *)(lbuf + 8);
    CHECK(access_remote(IBV_WR_ATOMIC_FETCH_AND_ADD, tbase + 512, k1, 8, OK, "fetch-add") == first, "fetch-add old");
    CHECK(access_remote(IBV_WR_ATOMIC_CMP_AND_SWP, tbase + 520, k1, 8, OK, "cmp-swap") == second, "cmp-swap old");
    access_remote(R, tbase + 512, k1, 16, OK, "read the atomics' results");
    CHECK(*(uint64_t *)(lbuf + 2 * page) == first + 5 && *(uint64_t *)(lbuf + 2 * page + 8) == 0x5157, "atomics");
    expect_busy("type 1 bound");
    access_remote(W, tbase + 512 + 1020, k1, 8, ACC, "write across the window's end");
    access_remote(R, tbase + 504, k1, 16, ACC, "read across the window's start");
    access_remote(R, tbase + 512, nobind_rkey, 8, ACC, "a region's key on another range");
    /* Rebinding read-only: a new key; the old one is dead, the new one reads only. */
    uint32_t k2 = bind_window(1, 0, 0, 4096, IBV_ACCESS_REMOTE_READ, VIA_POST, OK, "type 1 rebind");
    CHECK(k2 == ibv_inc_rkey(k1) && k2 >> 8 == k1 >> 8, "rebind key %#x after %#x", k2, k1);
    access_remote(R, tbase + 512, k1, 8, ACC, "read with the old key");
    access_remote(W, tbase, k2, 8, ACC, "write through a read-only window");
    access_remote(IBV_WR_ATOMIC_FETCH_AND_ADD, tbase, k2, 8, ACC, "atomic through a read-only window");
    access_remote(R, tbase + 4000, k2, 96, OK, "read at the window's end");
    access_remote(R, tbase + 4000, k2, 97, ACC, "read past the window's end");
    /* Remote invalidation of a type 1 window, or of a region's key: class J, both QPs to ERR. */
    send_inv(k2, VIA_POST, IBV_WC_REM_INV_REQ_ERR, "SEND_WITH_INV of a type 1 window");
    access_remote(R, tbase, k2, 8, OK, "the type 1 window survived");
    send_inv(mr_rkey, VIA_WR, IBV_WC_REM_INV_REQ_ERR, "SEND_WITH_INV of a region's key");
    access_remote(R, tbase, mr_rkey, 8, OK, "the region survived");
    /* Unbinding (length 0, no region): the key is dead and the region free. */
    uint32_t k3 = bind_window(1, NO_MR, 0, 0, 0, VIA_POST, OK, "type 1 unbind");
    access_remote(R, tbase, k2, 8, ACC, "read after unbind (old key)");
    access_remote(R, tbase, k3, 8, ACC, "read after unbind (new key)");
    expect_free("type 1 unbound");
    /* Deallocating a bound window unbinds it. */
    uint32_t k4 = bind_window(1, 0, 0, 2 * page, RW, VIA_POST, OK, "type 1 bind again");
    access_remote(W, tbase + 100, k4, 8, OK, "write after binding again");
    T(C_DEALLOC, 1);
    CHECK(r[0] == 0, "dealloc_mw of a bound window: %d", (int)r[0]);
    access_remote(W, tbase + 100, k4, 8, ACC, "write after dealloc");
    expect_free("type 1 deallocated");
}

static void type2(void)
{
    static unsigned char zeros[4096];
    T(C_FILL, 0);
    /* Local write in a window's access is accepted and grants nothing (rxe, mlx5; rdma-core's
     * own tests bind with it). */
    uint32_t k = bind_window(2, 0, 1024, 2048, RW | IBV_ACCESS_LOCAL_WRITE, VIA_POST, OK, "type 2 bind");
    pattern(lbuf, 2048, 2);
    access_remote(W, tbase + 1024, k, 2048, OK, "write through a type 2 window");
    expect_hash(1024, 2048, lbuf, "type 2 write");
    expect_hash(0, 1024, zeros, "in front of the type 2 window");
    access_remote(R, tbase + 1024, k, 2048, OK, "read through a type 2 window");
    CHECK(memcmp(lbuf + 2 * page, lbuf, 2048) == 0, "type 2 read data");
    access_remote(IBV_WR_ATOMIC_FETCH_AND_ADD, tbase + 1024, k, 8, ACC, "atomic without atomic access");
    expect_busy("type 2 bound");
    /* A bound type 2 window is not bound again; it belongs to the QP that bound it. */
    bind_window(2, 0, 0, 64, RW, VIA_POST, IBV_WC_MW_BIND_ERR, "type 2 bound twice");
    access_remote(R, tbase + 1024, k, 8, ACC, "through another QP than the binding one");
    local_inv(k, VIA_POST, OK, "LOCAL_INV");
    local_inv(k, VIA_POST, IBV_WC_LOC_QP_OP_ERR, "LOCAL_INV of an invalid window");
    expect_free("type 2 invalidated");
    uint32_t k2 = bind_window(2, 0, 1024, 2048, RW, VIA_WR, OK, "ibv_wr_bind_mw");
    CHECK(k2 == ibv_inc_rkey(k), "key %#x after %#x", k2, k);
    access_remote(W, tbase + 1024, k2, 8, OK, "write after ibv_wr_bind_mw");
    local_inv(k2, VIA_WR, OK, "ibv_wr_local_inv");
    access_remote(R, tbase + 1024, k2, 8, ACC, "read after LOCAL_INV");
    /* Remote invalidation: the receive says which key, and the key is dead at once. */
    uint32_t k3 = bind_window(2, 0, 0, 4096, RW, VIA_POST, OK, "bind for SEND_WITH_INV");
    access_remote(R, tbase, k3, 8, OK, "read before SEND_WITH_INV");
    send_inv(k3, VIA_POST, OK, "SEND_WITH_INV");
    access_remote(W, tbase, k3, 8, ACC, "write after SEND_WITH_INV");
    expect_free("type 2 remotely invalidated");
    uint32_t k4 = bind_window(2, 0, 0, 4096, RW, VIA_WR, OK, "bind for ibv_wr_send_inv");
    send_inv(k4, VIA_WR, OK, "ibv_wr_send_inv");
    send_inv(k4, VIA_POST, IBV_WC_REM_INV_REQ_ERR, "SEND_WITH_INV of an invalidated window");
    /* Deallocating a bound type 2 window. */
    uint32_t k5 = bind_window(2, 0, 0, 4096, RW, VIA_POST, OK, "bind before dealloc");
    T(C_DEALLOC, 2);
    CHECK(r[0] == 0, "dealloc_mw of a bound type 2 window: %d", (int)r[0]);
    access_remote(R, tbase, k5, 8, ACC, "read after dealloc");
    expect_free("type 2 deallocated");
}

static void errors(void)
{
    const unsigned RO = IBV_ACCESS_REMOTE_READ;
    bind_window(2, 1, 0, 64, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "region without MW_BIND");
    bind_window(2, 2, 0, 64, RW, VIA_POST, IBV_WC_MW_BIND_ERR, "writable window without local write");
    uint32_t k = bind_window(2, 2, 0, 64, RO, VIA_POST, OK, "read-only window without local write");
    local_inv(k, VIA_POST, OK, "LOCAL_INV of the read-only window");
    bind_window(2, 3, 0, 64, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "region of another PD");
    bind_window(3, 3, 0, 64, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "window of another PD than the QP's");
    bind_window(2, 0, 2 * page - 8, 16, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "range outside the region");
    bind_window(2, 0, 0, 0, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "type 2 with length 0");
    bind_window(2, 0, 0, 64, RO | IBV_ACCESS_ZERO_BASED, VIA_POST, IBV_WC_MW_BIND_ERR, "zero-based window");
    bind_window(1, 1, 0, 64, RO, VIA_POST, IBV_WC_MW_BIND_ERR, "type 1 on a region without MW_BIND");
    local_inv(mr_rkey, VIA_POST, IBV_WC_LOC_QP_OP_ERR, "LOCAL_INV of a region's key");
    uint32_t k1 = bind_window(1, 0, 0, 64, RO, VIA_POST, OK, "type 1 bind");
    local_inv(k1, VIA_POST, IBV_WC_LOC_QP_OP_ERR, "LOCAL_INV of a type 1 window");
    access_remote(R, tbase, k1, 8, OK, "the type 1 window survived LOCAL_INV");
    T(C_LOCAL_ERRORS);
}

/* UC: a type 2 window binds on a UC QP, SEND_WITH_INV invalidates it, and a WRITE through the
 * dead key is dropped at the target while the initiator completes it (UC acknowledges
 * nothing). Each SEND_WITH_INV, in order behind the WRITEs, shows they arrived. */
static void uc(void)
{
    conn_type = IBV_QPT_UC;
    connect_pair();
    T(C_FILL, 0);
    uint32_t k = bind_window(2, 0, 0, 4096, RW, VIA_POST, OK, "type 2 bind on UC");
    pattern(lbuf, 64, 9);
    access_remote(W, tbase + 64, k, 64, OK, "UC write through the window");
    send_inv(k, VIA_POST, OK, "UC SEND_WITH_INV");
    unsigned char landed[64];
    pattern(landed, 64, 9);
    expect_hash(64, 64, landed, "UC write");
    pattern(lbuf, 64, 10);
    access_remote(W, tbase + 64, k, 64, OK, "UC write through the invalidated window");
    uint32_t k2 = bind_window(2, 0, 0, 4096, RW, VIA_WR, OK, "type 2 bind on UC again");
    send_inv(k2, VIA_WR, OK, "UC ibv_wr_send_inv");
    expect_hash(64, 64, landed, "UC write through the invalidated window: dropped");
    conn_type = IBV_QPT_RC;
}

static int initiator(int port, const char *section)
{
    struct sockaddr_in sa = { .sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
    sock = socket(AF_INET, SOCK_STREAM, 0);
    int connected = 0;
    for (int i = 0; i < 500 && !connected; i++) {
        connected = connect(sock, (struct sockaddr *)&sa, sizeof sa) == 0;
        if (!connected)
            usleep(10000);
    }
    CHECK(connected, "connect to the target");
    open_device();
    lbuf = pages(4);
    lmr = ibv_reg_mr(pd, lbuf, 4 * page, IBV_ACCESS_LOCAL_WRITE);
    CHECK(lmr, "reg_mr");
    connect_pair();
    if (!strcmp(section, "type1"))
        type1();
    else if (!strcmp(section, "type2"))
        type2();
    else if (!strcmp(section, "errors"))
        errors();
    else if (!strcmp(section, "uc"))
        uc();
    else
        CHECK(0, "unknown section %s", section);
    T(C_QUIT);
    CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(cq) == 0 && ibv_dereg_mr(lmr) == 0, "teardown");
    CHECK(ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "teardown");
    printf("memory_windows %s: ok\n", section);
    return 0;
}

int main(int argc, char **argv)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc == 3 && !strcmp(argv[1], "target"))
        return target(atoi(argv[2]));
    if (argc == 4 && !strcmp(argv[1], "initiator"))
        return initiator(atoi(argv[2]), argv[3]);
    fprintf(stderr, "usage: memory_windows target PORT | initiator PORT SECTION\n");
    return 2;
}
