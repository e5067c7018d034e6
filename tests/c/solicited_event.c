/* Solicited events (ibv_req_notify_cq with solicited_only, IBV_SEND_SOLICITED): a CQ armed
 * for the next solicited completion raises no event for an unsolicited SEND or
 * SEND_WITH_IMM, one for a SEND or RDMA WRITE_WITH_IMM sent solicited, and one for an
 * unsuccessful completion (a flushed receive), as the IBA and rdma-core's providers do (rxe
 * posts a receive's CQE with the packet's SE bit, a flush's as solicited). Two RC QPs of this
 * process, the receiver's CQ on a channel of its own; every completion's fields checked.
 * Prints "solicited_event: ok". */
#include "verbs_test.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>

static struct ibv_qp *a, *b;
static struct ibv_mr *mr;
static char *buf;
static struct ibv_comp_channel *ch;
static struct ibv_cq *scq, *rcq;
static unsigned events;

enum { SIZE = 64, RECV_AT = 4096, WRITE_AT = 8192 };

static void post_recv(uint64_t id)
{
    struct ibv_sge s = { (uintptr_t)buf + RECV_AT + (id % 8) * SIZE, SIZE, mr->lkey };
    struct ibv_recv_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1 }, *bad = NULL;
    CHECK(ibv_post_recv(b, &w, &bad) == 0, "post_recv");
}

/* Posts one signaled WR from `a` and waits for its successful completion on the send CQ
 * (the receiver acknowledged it: its receive completion is in the receive CQ). */
static void send_and_wait(uint64_t id, enum ibv_wr_opcode op, int flags, uint32_t imm)
{
    memset(buf, (int)id, SIZE);
    struct ibv_sge s = { (uintptr_t)buf, SIZE, mr->lkey };
    struct ibv_send_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1, .opcode = op,
                             .send_flags = IBV_SEND_SIGNALED | flags }, *bad = NULL;
    w.imm_data = htonl(imm);
    if (op == IBV_WR_RDMA_WRITE_WITH_IMM) {
        w.wr.rdma.remote_addr = (uintptr_t)buf + WRITE_AT;
        w.wr.rdma.rkey = mr->rkey;
    }
    CHECK(ibv_post_send(a, &w, &bad) == 0, "post_send %llu", (unsigned long long)id);
    struct ibv_wc wc;
    CHECK(poll_one(scq, &wc) == 1, "send %llu: no completion in 10 s", (unsigned long long)id);
    CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == id && wc.qp_num == a->qp_num &&
              wc.opcode == (op == IBV_WR_RDMA_WRITE_WITH_IMM ? IBV_WC_RDMA_WRITE : IBV_WC_SEND),
          "send %llu: %s, opcode %d", (unsigned long long)id, ibv_wc_status_str(wc.status),
          wc.opcode);
}

/* Whether the channel told an event within `ms` (taken and counted if so). */
static int event_within(int ms)
{
    struct pollfd p = { .fd = ch->fd, .events = POLLIN };
    int ready = poll(&p, 1, ms);
    CHECK(ready >= 0, "poll");
    struct ibv_cq *ev_cq;
    void *ev_ctx;
    if (ibv_get_cq_event(ch, &ev_cq, &ev_ctx) != 0) {
        CHECK(errno == EAGAIN, "ibv_get_cq_event on a non-blocking channel");
        return 0;
    }
    CHECK(ev_cq == rcq && ev_ctx == NULL, "an event for another CQ");
    events++;
    return 1;
}

/* The receive completion of `id`: its opcode, length, immediate data and flags. */
static void receive_completion(uint64_t id, enum ibv_wc_opcode op, int with_imm, uint32_t imm)
{
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(rcq, 1, &wc) == 1, "receive %llu: not in the CQ", (unsigned long long)id);
    CHECK(wc.status == IBV_WC_SUCCESS, "receive %llu: %s", (unsigned long long)id,
          ibv_wc_status_str(wc.status));
    CHECK(wc.wr_id == id && wc.opcode == op && wc.qp_num == b->qp_num && wc.src_qp == a->qp_num,
          "receive %llu: wr_id %llu opcode %d qp %u src %u", (unsigned long long)id,
          (unsigned long long)wc.wr_id, wc.opcode, wc.qp_num, wc.src_qp);
    CHECK(wc.byte_len == SIZE, "receive %llu: byte_len %u", (unsigned long long)id, wc.byte_len);
    CHECK(!!(wc.wc_flags & IBV_WC_WITH_IMM) == with_imm && (!with_imm || ntohl(wc.imm_data) == imm),
          "receive %llu: wc_flags %#x imm %#x", (unsigned long long)id, wc.wc_flags,
          ntohl(wc.imm_data));
}

/* Armed for the next solicited completion: `op` sent unsolicited as WR `first` raises no
 * event; sent solicited as WR `first + 1` (immediate data `imm + 1`), one. */
static void unsolicited_then_solicited(uint64_t first, enum ibv_wr_opcode op, uint32_t imm)
{
    CHECK(ibv_req_notify_cq(rcq, 1) == 0, "arm for solicited");
    send_and_wait(first, op, 0, imm);
    CHECK(!event_within(300), "an event for WR %llu, unsolicited", (unsigned long long)first);
    send_and_wait(first + 1, op, IBV_SEND_SOLICITED, imm + 1);
    CHECK(event_within(5000), "no event for WR %llu, solicited", (unsigned long long)first + 1);
}

int main(void)
{
    struct ibv_port_attr port;
    struct ibv_context *ctx = open_first_device(&port);
    ch = ibv_create_comp_channel(ctx);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    scq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    rcq = ibv_create_cq(ctx, 64, NULL, ch, 0);
    CHECK(ch && pd && scq && rcq, "channel/pd/cqs");
    CHECK(fcntl(ch->fd, F_SETFL, fcntl(ch->fd, F_GETFL) | O_NONBLOCK) == 0, "non-blocking");
    struct ibv_qp_init_attr sender = { .send_cq = scq, .recv_cq = scq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp_init_attr receiver = sender;
    receiver.send_cq = rcq;
    receiver.recv_cq = rcq;
    a = ibv_create_qp(pd, &sender);
    b = ibv_create_qp(pd, &receiver);
    CHECK(a && b, "create_qp");
    to_rts(a, port.lid, b->qp_num, 0);
    to_rts(b, port.lid, a->qp_num, IBV_ACCESS_REMOTE_WRITE);
    buf = calloc(1, 16384);
    mr = ibv_reg_mr(pd, buf, 16384, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(mr, "reg_mr");
    for (uint64_t id = 200; id < 209; id++)
        post_recv(id);

    /* SEND_WITH_IMM, SEND and RDMA WRITE_WITH_IMM, each unsolicited (no event, though its
     * receive completed) then solicited (the event; the CQ holds both receives in order). */
    unsolicited_then_solicited(101, IBV_WR_SEND_WITH_IMM, 0x1010);
    receive_completion(200, IBV_WC_RECV, 1, 0x1010);
    receive_completion(201, IBV_WC_RECV, 1, 0x1011);
    unsolicited_then_solicited(103, IBV_WR_SEND, 0);
    receive_completion(202, IBV_WC_RECV, 0, 0);
    receive_completion(203, IBV_WC_RECV, 0, 0);
    CHECK(buf[RECV_AT + 3 * SIZE] == 104 && buf[RECV_AT + 4 * SIZE - 1] == 104, "SEND 104's bytes");
    unsolicited_then_solicited(105, IBV_WR_RDMA_WRITE_WITH_IMM, 0x1050);
    receive_completion(204, IBV_WC_RECV_RDMA_WITH_IMM, 1, 0x1050);
    receive_completion(205, IBV_WC_RECV_RDMA_WITH_IMM, 1, 0x1051);
    CHECK(buf[WRITE_AT] == 106 && buf[WRITE_AT + SIZE - 1] == 106, "WRITE 106's bytes");

    /* Armed for any completion: an unsolicited SEND fires it. */
    CHECK(ibv_req_notify_cq(rcq, 0) == 0, "arm for any");
    send_and_wait(107, IBV_WR_SEND, 0, 0);
    CHECK(event_within(5000), "no event for a SEND on a CQ armed for any completion");
    receive_completion(206, IBV_WC_RECV, 0, 0);

    /* An unsuccessful completion fires a solicited arming: the receiver fails, and its two
     * receives left are flushed. */
    CHECK(ibv_req_notify_cq(rcq, 1) == 0, "arm for solicited");
    struct ibv_qp_attr err = { .qp_state = IBV_QPS_ERR };
    CHECK(ibv_modify_qp(b, &err, IBV_QP_STATE) == 0, "receiver to ERR");
    CHECK(event_within(5000), "no event for flushed receives");
    for (uint64_t id = 207; id < 209; id++) {
        struct ibv_wc wc;
        CHECK(ibv_poll_cq(rcq, 1, &wc) == 1, "flushed receive %llu", (unsigned long long)id);
        CHECK(wc.wr_id == id && wc.status == IBV_WC_WR_FLUSH_ERR && wc.qp_num == b->qp_num,
              "flushed receive %llu: wr_id %llu %s", (unsigned long long)id,
              (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status));
    }
    struct ibv_wc more;
    CHECK(ibv_poll_cq(rcq, 1, &more) == 0, "a completion more: wr_id %llu",
          (unsigned long long)more.wr_id);
    CHECK(!event_within(100), "an event more");

    ibv_ack_cq_events(rcq, events);
    CHECK(events == 5, "%u events", events);
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
    CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(scq) == 0 && ibv_destroy_cq(rcq) == 0,
          "dereg/destroy_cq");
    CHECK(ibv_destroy_comp_channel(ch) == 0 && ibv_dealloc_pd(pd) == 0, "teardown");
    CHECK(ibv_close_device(ctx) == 0, "close");
    printf("solicited_event: ok\n");
    return 0;
}
