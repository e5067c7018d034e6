/* UD multicast at the verbs level (ibv_attach_mcast(3), IBA 10.5.2.2).
 *   multicast                 one process: attach/detach rules, delivery to every attached
 *                             QP and to no other, every WC field and the GRH, the sender's
 *                             own QP only when attached, Q_Key mismatch, detach stops delivery,
 *                             an attached QP cannot be destroyed
 *   multicast recv N TAG [rejoin]
 *                             attaches one QP to the group TAG (with "rejoin": attaches,
 *                             detaches and attaches again), prints "ready", then takes N
 *                             datagrams from another process and checks each
 *   multicast send N TAG [MS] sends N datagrams to the group TAG (MS milliseconds after it
 *                             made its address handle)
 * Prints "multicast: ok" on success. */
#include "verbs_test.h"
#include <arpa/inet.h>
#include <unistd.h>

#define QKEY 0x11111111u
#define MSG 256
#define GRH 40

struct ud {
    struct ibv_qp *qp;
    struct ibv_cq *cq, *scq;
    char *buf;
    struct ibv_mr *mr;
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static uint16_t port_lid;
static union ibv_gid port_gid;

static union ibv_gid group_gid(int tag)
{
    union ibv_gid g;
    memset(&g, 0, sizeof g);
    g.raw[0] = 0xff; g.raw[1] = 0x12; g.raw[2] = 0x40; g.raw[3] = 0x1b; g.raw[4] = 0xff; g.raw[5] = 0xff;
    g.raw[12] = 0x0e; g.raw[13] = 0x77; g.raw[14] = (uint8_t)(tag >> 8); g.raw[15] = (uint8_t)tag;
    return g;
}

static uint16_t group_lid(int tag) { return (uint16_t)(0xc000 + tag); }

static struct ud ud_qp_flags(uint32_t qkey, uint32_t create_flags)
{
    struct ud u;
    u.cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    u.scq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(u.cq && u.scq, "create_cq");
    struct ibv_qp_init_attr ia = { .send_cq = u.scq, .recv_cq = u.cq, .qp_type = IBV_QPT_UD,
                                   .cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp_init_attr_ex iax = { .send_cq = u.scq, .recv_cq = u.cq, .qp_type = IBV_QPT_UD, .cap = ia.cap,
                                       .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_CREATE_FLAGS,
                                       .pd = pd, .create_flags = create_flags };
    u.qp = create_flags ? ibv_create_qp_ex(ctx, &iax) : ibv_create_qp(pd, &ia);
    CHECK(u.qp, "create_qp");
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = qkey };
    CHECK(ibv_modify_qp(u.qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY) == 0, "INIT");
    a.qp_state = IBV_QPS_RTR;
    CHECK(ibv_modify_qp(u.qp, &a, IBV_QP_STATE) == 0, "RTR");
    a.qp_state = IBV_QPS_RTS; a.sq_psn = 0;
    CHECK(ibv_modify_qp(u.qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN) == 0, "RTS");
    u.buf = calloc(1, 8 * (MSG + GRH));
    u.mr = ibv_reg_mr(pd, u.buf, 8 * (MSG + GRH), IBV_ACCESS_LOCAL_WRITE);
    CHECK(u.mr, "reg_mr");
    return u;
}

static struct ud ud_qp(uint32_t qkey) { return ud_qp_flags(qkey, 0); }

static void post_recv(struct ud *u, int slot)
{
    struct ibv_sge sge = { .addr = (uintptr_t)(u->buf + slot * (MSG + GRH)), .length = MSG + GRH, .lkey = u->mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = 100 + slot, .sg_list = &sge, .num_sge = 1 }, *bad;
    CHECK(ibv_post_recv(u->qp, &wr, &bad) == 0, "post_recv");
}

static struct ibv_ah *group_ah(int tag)
{
    struct ibv_ah_attr aa = { .dlid = group_lid(tag), .sl = 3, .port_num = 1, .is_global = 1 };
    aa.grh.dgid = group_gid(tag);
    aa.grh.hop_limit = 1;
    struct ibv_ah *ah = ibv_create_ah(pd, &aa);
    CHECK(ah, "create_ah to the group");
    return ah;
}

/* Sends one datagram of MSG bytes filled with `fill`, imm = the sender's QPN, and waits for
 * its (signaled) completion. */
static void send_to(struct ud *s, struct ibv_ah *ah, char fill, uint32_t qkey)
{
    memset(s->buf + 7 * (MSG + GRH), fill, MSG);
    struct ibv_sge sge = { .addr = (uintptr_t)(s->buf + 7 * (MSG + GRH)), .length = MSG, .lkey = s->mr->lkey };
    struct ibv_send_wr wr = { .wr_id = 7, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_IMM,
                              .send_flags = IBV_SEND_SIGNALED, .imm_data = htonl(s->qp->qp_num) }, *bad;
    wr.wr.ud.ah = ah; wr.wr.ud.remote_qpn = 0xffffff; wr.wr.ud.remote_qkey = qkey;
    CHECK(ibv_post_send(s->qp, &wr, &bad) == 0, "post_send to the group");
    struct ibv_wc wc;
    CHECK(poll_one(s->scq, &wc) == 1 && wc.status == IBV_WC_SUCCESS && wc.wr_id == 7 &&
          wc.opcode == IBV_WC_SEND, "send completion (status %d)", wc.status);
}

/* Takes one datagram on `r` and checks every field. `sender_qpn` 0: any (another process). */
static void expect(struct ud *r, int tag, char fill, uint32_t sender_qpn, uint16_t sender_lid)
{
    struct ibv_wc wc;
    CHECK(poll_one(r->cq, &wc) == 1, "qp %#x: no datagram", r->qp->qp_num);
    CHECK(wc.status == IBV_WC_SUCCESS, "status %d", wc.status);
    CHECK(wc.opcode == IBV_WC_RECV, "opcode %d", wc.opcode);
    CHECK(wc.byte_len == MSG + GRH, "byte_len %u", wc.byte_len);
    CHECK(wc.wc_flags == (IBV_WC_GRH | IBV_WC_WITH_IMM), "wc_flags %#x", wc.wc_flags);
    CHECK(wc.qp_num == r->qp->qp_num, "qp_num %#x", wc.qp_num);
    uint32_t imm_qpn = ntohl(wc.imm_data);
    CHECK(wc.src_qp == imm_qpn && (sender_qpn == 0 || wc.src_qp == sender_qpn), "src_qp %#x (imm %#x)", wc.src_qp, imm_qpn);
    CHECK(wc.sl == 3 && wc.dlid_path_bits == 0 && wc.pkey_index == 0, "sl %u", wc.sl);
    int slot = (int)wc.wr_id - 100;
    CHECK(slot >= 0 && slot < 7, "wr_id %lu", (unsigned long)wc.wr_id);
    const uint8_t *g = (const uint8_t *)r->buf + slot * (MSG + GRH);
    union ibv_gid mgid = group_gid(tag);
    CHECK((g[0] >> 4) == 6 && g[6] == 0x1b && g[7] == 1, "GRH header");
    CHECK(memcmp(g + 24, mgid.raw, 16) == 0, "GRH dgid is not the MGID");
    uint16_t grh_lid = (uint16_t)(g[18] << 8 | g[19]);
    CHECK(wc.slid == grh_lid && (sender_lid == 0 || wc.slid == sender_lid), "slid %#x, GRH sgid's lid %#x", wc.slid, grh_lid);
    if (sender_lid)
        CHECK(memcmp(g + 8, port_gid.raw, 16) == 0, "GRH sgid is not the sender's port GID");
    for (int i = 0; i < MSG; i++)
        CHECK(g[GRH + i] == (uint8_t)fill, "data byte %d", i);
}

/* Nothing arrives on `r` within 300 ms. */
static void expect_nothing(struct ud *r, const char *why)
{
    struct ibv_wc wc;
    struct timespec t = { 0, 1000000 };
    for (int i = 0; i < 300; i++) {
        CHECK(ibv_poll_cq(r->cq, 1, &wc) == 0, "%s: qp %#x got a datagram from %#x", why, r->qp->qp_num, wc.src_qp);
        nanosleep(&t, NULL);
    }
}

static void open_device(void)
{
    struct ibv_device **list = ibv_get_device_list(NULL);
    CHECK(list && list[0], "no device");
    ctx = ibv_open_device(list[0]);
    CHECK(ctx, "open_device");
    pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc_pd");
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(ctx, 1, &pa) == 0, "query_port");
    port_lid = pa.lid;
    CHECK(ibv_query_gid(ctx, 1, 0, &port_gid) == 0, "query_gid");
    struct ibv_device_attr da;
    CHECK(ibv_query_device(ctx, &da) == 0 && da.max_mcast_grp > 0 && da.max_mcast_qp_attach > 0 &&
          da.max_total_mcast_qp_attach >= da.max_mcast_qp_attach, "multicast limits");
}

static void one_process(void)
{
    const int tag = 1;
    union ibv_gid mgid = group_gid(tag);
    uint16_t mlid = group_lid(tag);
    struct ud s = ud_qp(QKEY), r1 = ud_qp(QKEY), r2 = ud_qp(QKEY), n = ud_qp(QKEY);

    /* The rules: UD QPs only, a multicast GID, a multicast LID (not the permissive one). */
    struct ibv_cq *cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
    struct ibv_qp_init_attr rc = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
                                   .cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp *rcqp = ibv_create_qp(pd, &rc);
    CHECK(rcqp, "rc qp");
    CHECK(ibv_attach_mcast(rcqp, &mgid, mlid) == EINVAL, "RC QP attached");
    union ibv_gid unicast = port_gid;
    CHECK(ibv_attach_mcast(r1.qp, &unicast, mlid) == EINVAL, "unicast GID attached");
    CHECK(ibv_attach_mcast(r1.qp, &mgid, 0x0101) == EINVAL, "unicast LID attached");
    CHECK(ibv_attach_mcast(r1.qp, &mgid, 0xffff) == EINVAL, "permissive LID attached");
    CHECK(ibv_detach_mcast(r1.qp, &mgid, mlid) == EINVAL, "detached a group never attached");
    CHECK(ibv_destroy_qp(rcqp) == 0 && ibv_destroy_cq(cq) == 0, "destroy rc");

    CHECK(ibv_attach_mcast(r1.qp, &mgid, mlid) == 0, "attach r1");
    CHECK(ibv_attach_mcast(r1.qp, &mgid, mlid) == 0, "attach r1 again");
    CHECK(ibv_attach_mcast(r2.qp, &mgid, mlid) == 0, "attach r2");
    /* An attached QP cannot be destroyed (the kernel's uverbs: EBUSY). */
    CHECK(ibv_destroy_qp(r2.qp) == EBUSY, "destroyed an attached QP");

    struct ibv_ah *ah = group_ah(tag);
    for (int i = 0; i < 6; i++) {
        post_recv(&r1, i); post_recv(&r2, i); post_recv(&n, i); post_recv(&s, i);
    }
    /* Every attached QP gets one copy (r1 attached twice: still one); the sender and a QP
     * that is not attached get nothing. */
    send_to(&s, ah, 'a', QKEY);
    expect(&r1, tag, 'a', s.qp->qp_num, port_lid);
    expect(&r2, tag, 'a', s.qp->qp_num, port_lid);
    expect_nothing(&r1, "a second copy");
    expect_nothing(&n, "not attached");
    expect_nothing(&s, "the sender, not attached");

    /* The sending QP gets its own datagram once it is attached (no BLOCK_SELF_MCAST_LB). */
    CHECK(ibv_attach_mcast(s.qp, &mgid, mlid) == 0, "attach s");
    send_to(&s, ah, 'b', QKEY);
    expect(&r1, tag, 'b', s.qp->qp_num, port_lid);
    expect(&r2, tag, 'b', s.qp->qp_num, port_lid);
    expect(&s, tag, 'b', s.qp->qp_num, port_lid);
    CHECK(ibv_detach_mcast(s.qp, &mgid, mlid) == 0, "detach s");

    /* A QP created with IBV_QP_CREATE_BLOCK_SELF_MCAST_LB does not get its own datagrams. */
    struct ud b = ud_qp_flags(QKEY, IBV_QP_CREATE_BLOCK_SELF_MCAST_LB);
    post_recv(&b, 0);
    CHECK(ibv_attach_mcast(b.qp, &mgid, mlid) == 0, "attach b");
    send_to(&b, ah, 'B', QKEY);
    expect(&r1, tag, 'B', b.qp->qp_num, port_lid);
    expect(&r2, tag, 'B', b.qp->qp_num, port_lid);
    expect_nothing(&b, "blocked loopback");
    send_to(&s, ah, 'S', QKEY);
    expect(&b, tag, 'S', s.qp->qp_num, port_lid);
    expect(&r1, tag, 'S', s.qp->qp_num, port_lid);
    expect(&r2, tag, 'S', s.qp->qp_num, port_lid);
    CHECK(ibv_detach_mcast(b.qp, &mgid, mlid) == 0, "detach b");

    /* Another Q_Key: dropped by every member. */
    send_to(&s, ah, 'c', QKEY + 1);
    expect_nothing(&r1, "wrong Q_Key");
    expect_nothing(&r2, "wrong Q_Key");

    /* Detaching stops delivery at once. */
    CHECK(ibv_detach_mcast(r2.qp, &mgid, mlid) == 0, "detach r2");
    CHECK(ibv_detach_mcast(r2.qp, &mgid, mlid) == EINVAL, "detached twice");
    send_to(&s, ah, 'd', QKEY);
    expect(&r1, tag, 'd', s.qp->qp_num, port_lid);
    expect_nothing(&r2, "detached");
    CHECK(ibv_detach_mcast(r1.qp, &mgid, mlid) == 0, "detach r1");
    send_to(&s, ah, 'e', QKEY);
    expect_nothing(&r1, "detached");
    CHECK(ibv_destroy_qp(r2.qp) == 0, "destroy a detached QP");
    CHECK(ibv_destroy_ah(ah) == 0, "destroy_ah");
}

/* One line in one write(2): two receivers of one shell share the pipe. */
static void say(const char *line)
{
    CHECK(write(STDOUT_FILENO, line, strlen(line)) == (ssize_t)strlen(line), "write");
}

int main(int argc, char **argv)
{
    open_device();
    if ((argc == 4 || argc == 5) && strcmp(argv[1], "recv") == 0) {
        int count = atoi(argv[2]), tag = atoi(argv[3]);
        struct ud r = ud_qp(QKEY);
        union ibv_gid mgid = group_gid(tag);
        for (int i = 0; i < 6; i++)
            post_recv(&r, i);
        CHECK(ibv_attach_mcast(r.qp, &mgid, group_lid(tag)) == 0, "attach");
        if (argc == 5 && strcmp(argv[4], "rejoin") == 0) {
            CHECK(ibv_detach_mcast(r.qp, &mgid, group_lid(tag)) == 0, "detach to rejoin");
            CHECK(ibv_attach_mcast(r.qp, &mgid, group_lid(tag)) == 0, "attach again");
        }
        say("ready\n");
        for (int i = 0; i < count; i++) {
            expect(&r, tag, (char)('A' + i), 0, 0);
            post_recv(&r, (int)(i % 6));
        }
        CHECK(ibv_detach_mcast(r.qp, &mgid, group_lid(tag)) == 0, "detach");
    } else if ((argc == 4 || argc == 5) && strcmp(argv[1], "send") == 0) {
        int count = atoi(argv[2]), tag = atoi(argv[3]);
        struct ud s = ud_qp(QKEY);
        struct ibv_ah *ah = group_ah(tag);
        if (argc == 5) {
            long ms = atol(argv[4]);
            struct timespec t = { ms / 1000, (ms % 1000) * 1000000 };
            nanosleep(&t, NULL);
        }
        for (int i = 0; i < count; i++) {
            send_to(&s, ah, (char)('A' + i), QKEY);
            struct timespec t = { 0, 20000000 };
            nanosleep(&t, NULL);
        }
    } else {
        one_process();
    }
    say("multicast: ok\n");
    return 0;
}
