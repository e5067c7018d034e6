/* The same-host SEND path (docs/design.md, "Same-host SEND path"): between two processes on one
 * host, an RC SEND is placed by the sender in the receiver's next receive WR (up to 256 bytes
 * in the receive ring, larger ones written in place into the WR's buffer when it is one SGE),
 * and the receiver completes it when it polls. Whatever path a SEND takes, the
 * receiver must see what a HCA gives: data, order and every completion field, and the errors of
 * the message path. This program checks them the same way with the path on or off
 * (UGDR_DIRECT=off); tests/c_program.rs runs it both ways and reads which path was taken from
 * ugdr's debug log.
 *
 * Forks: the child receives, the parent sends; each scenario has its own QP pair, and the two
 * exchange LID and QP number, then step markers, through pipes.
 *   shapes   SEND of 8 bytes, SEND_WITH_IMM of 100 inline bytes scattered over a receive WR of
 *            two SGEs (10 + 300 bytes), a 0-byte SEND, 256 bytes (the most the ring holds), 257
 *            bytes (written in place), then 16 bytes again: every field of every completion, every byte.
 *   stream   20,000 SENDs in windows of 64 (every 16th signaled): 64 bytes, in the second half
 *            every 7th 1000 bytes (a message: its receive WR has two SGEs), every
 *            11th otherwise 700 bytes (written in place), every 5th with immediate data; the
 *            receiver keeps 128 receive WRs posted and checks each message's number, length, bytes and
 *            immediate data.
 *   short    a receive WR of 8 bytes for a SEND of 16: LOC_LEN_ERR at the receiver,
 *            REM_INV_REQ_ERR at the sender.
 *   dereg    the receive WR's MR is deregistered before the SEND: LOC_PROT_ERR at the
 *            receiver, REM_OP_ERR at the sender.
 *   ahead    the sender's first SEND lands in receive WR 30 and shows it WR 31 posted too
 *            (a sender reads a line of posted slots at a time); the receiver then deregisters
 *            the MR WR 31 names: the next SEND must not land there (REM_OP_ERR at the sender,
 *            LOC_PROT_ERR at the receiver, the buffer untouched), as in `dereg`.
 *   queued   a 1000-byte SEND (a message, into two SGEs) completes at the sender, then a 64-byte one (placed:
 *            the receiver delivered the first), before the receiver polls for both at once:
 *            the first one's completion, queued when it was delivered, comes first.
 *   arrived  the MR is deregistered after the SEND completed at the sender but before the
 *            receiver polled: the receive completes with the data, as a HCA's would have.
 *   flush    three SENDs complete at the sender; the receiver moves its QP to ERR before
 *            polling: the three receives complete with their data, then the two other posted
 *            receives are flushed, in order.
 *   ack      200 times: a 1000-byte SEND whose sender polls only its send CQ until it
 *            completes, answered by a small SEND (placed, carrying the ACK): each completes
 *            within a second (the local ACK timeout is ~4.3 s).
 *   catchup  20 rounds: three unsignaled 1000-byte SENDs (messages, into two SGEs) reach the receiver, which
 *            polls them and stops itself (SIGSTOP), in most rounds before its ACK of them
 *            leaves (it goes once the receiver runs out of work); a 64-byte RDMA WRITE
 *            and two 16-byte SENDs then complete at post: the receiver's ring says its
 *            responder delivered everything before them, which acknowledges the three (a
 *            sender that waited for that ACK first would send them as messages to a stopped
 *            process). With UGDR_DIRECT=off they complete once the receiver runs again. The
 *            receiver gets the five SENDs in order, and the WRITE's bytes.
 *   refused  an RDMA WRITE with a key the receiver's MR does not grant, then at once a 16-byte
 *            SEND: the WRITE fails at the responder (REM_ACCESS_ERR), the SEND is flushed, and
 *            nothing reaches the receiver: its two posted receives are flushed, their buffers
 *            untouched, and it gets IBV_EVENT_QP_ACCESS_ERR: nothing behind a request that
 *            failed at the responder reaches it, whichever path it would take.
 *   inplace  SENDs of 257 bytes to 1 MiB (two with immediate data) into one-SGE WRs larger
 *            than them: every field, every byte, nothing past them; then 2000 bytes into a
 *            WR of 1000: LOC_LEN_ERR at the receiver, REM_INV_REQ_ERR at the sender, the
 *            WR's buffer untouched.
 *   race     16 KiB SENDs into WRs of a second MR, deregistered after 300 receives: earlier
 *            ones complete with their data, then one LOC_PROT_ERR and flushes, REM_OP_ERR at
 *            the sender, and no byte of that memory changes once ibv_dereg_mr returned.
 *   write_imm  RDMA WRITE_WITH_IMM of 8 bytes to 1 MiB: the bytes at the target, the
 *            receive WR's completion (RECV_RDMA_WITH_IMM, length, immediate data), its buffer
 *            untouched; then one with a key that grants no remote writing: REM_ACCESS_ERR,
 *            the receiver's QP to ERR (IBV_EVENT_QP_ACCESS_ERR), the WR it took completed
 *            with REM_ACCESS_ERR, the next flushed.
 * Prints "direct_send: ok". Usage: direct_send */
#include "verbs_test.h"
#include <arpa/inet.h>
#include <inttypes.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define STREAM 20000
#define WINDOW 64
#define POSTED 128
#define SLOT 1024
#define CATCHUP_ROUNDS 20

static int to_child[2], to_parent[2];
static int is_child;
/* The local ACK timeout and the remote access the next open_side gives its QP. */
static uint8_t ack_timeout = 14;
static int qp_access;

static void put(const void *p, size_t n)
{
    int fd = is_child ? to_parent[1] : to_child[1];
    CHECK(write(fd, p, n) == (ssize_t)n, "pipe write");
}

static void get(void *p, size_t n)
{
    int fd = is_child ? to_child[0] : to_parent[0];
    CHECK(read(fd, p, n) == (ssize_t)n, "pipe read");
}

static void step(char c)
{
    put(&c, 1);
}

static void await_step(char want)
{
    char c;
    get(&c, 1);
    CHECK(c == want, "step %c, wanted %c", c, want);
}

struct side {
    struct ibv_context *ctx;
    struct ibv_pd *pd;
    struct ibv_cq *scq, *rcq;
    struct ibv_qp *qp;
    struct ibv_mr *mr;
    char *buf;
    uint16_t lid, peer_lid;
    uint32_t peer_qpn;
};

/* A QP pair's side: its own context, PD, CQs and a 4 MiB buffer, connected to the other
 * process's side. */
static void open_side(struct side *s)
{
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n > 0, "no device");
    s->ctx = ibv_open_device(list[0]);
    CHECK(s->ctx, "open");
    ibv_free_device_list(list);
    s->pd = ibv_alloc_pd(s->ctx);
    s->buf = calloc(1, 4 << 20);
    CHECK(s->pd && s->buf, "pd");
    s->mr = ibv_reg_mr(s->pd, s->buf, 4 << 20, IBV_ACCESS_LOCAL_WRITE);
    CHECK(s->mr, "reg_mr");
    s->scq = ibv_create_cq(s->ctx, 4 * POSTED, NULL, NULL, 0);
    s->rcq = ibv_create_cq(s->ctx, 4 * POSTED, NULL, NULL, 0);
    CHECK(s->scq && s->rcq, "cq");
    struct ibv_qp_init_attr ia = {
        .send_cq = s->scq, .recv_cq = s->rcq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 2 * WINDOW, .max_recv_wr = POSTED, .max_send_sge = 2,
                 .max_recv_sge = 2, .max_inline_data = 128 },
    };
    s->qp = ibv_create_qp(s->pd, &ia);
    CHECK(s->qp, "create_qp");
    struct ibv_port_attr pa;
    CHECK(ibv_query_port(s->ctx, 1, &pa) == 0, "query_port");
    s->lid = pa.lid;
    uint32_t me[2] = { s->lid, s->qp->qp_num }, peer[2];
    put(me, sizeof me);
    get(peer, sizeof peer);
    s->peer_lid = peer[0];
    s->peer_qpn = peer[1];
    to_rts_with_timeout(s->qp, s->peer_lid, s->peer_qpn, qp_access, ack_timeout);
}

static void close_side(struct side *s)
{
    CHECK(ibv_destroy_qp(s->qp) == 0, "destroy_qp");
    CHECK(ibv_destroy_cq(s->scq) == 0 && ibv_destroy_cq(s->rcq) == 0, "destroy_cq");
    if (s->mr)
        CHECK(ibv_dereg_mr(s->mr) == 0, "dereg_mr");
    CHECK(ibv_dealloc_pd(s->pd) == 0, "dealloc_pd");
    CHECK(ibv_close_device(s->ctx) == 0, "close_device");
    free(s->buf);
}

static void post_recv(struct side *s, uint64_t wr_id, struct ibv_sge *sges, int n)
{
    struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = sges, .num_sge = n }, *bad;
    CHECK(ibv_post_recv(s->qp, &wr, &bad) == 0, "post_recv %" PRIu64, wr_id);
}

static void post_recv_slot(struct side *s, uint64_t wr_id, uint32_t slot, uint32_t len)
{
    struct ibv_sge sge = { .addr = (uintptr_t)s->buf + (size_t)slot * SLOT, .length = len,
                           .lkey = s->mr->lkey };
    post_recv(s, wr_id, &sge, 1);
}

/* The same `len` bytes as two SGEs (32 bytes, then the rest): a WR no SEND above 256 bytes is
 * written into in place, so such a SEND reaches it as a message. */
static void post_recv_for_message(struct side *s, uint64_t wr_id, uint32_t slot, uint32_t len)
{
    uintptr_t at = (uintptr_t)s->buf + (size_t)slot * SLOT;
    struct ibv_sge two[2] = { { .addr = at, .length = 32, .lkey = s->mr->lkey },
                              { .addr = at + 32, .length = len - 32, .lkey = s->mr->lkey } };
    post_recv(s, wr_id, two, 2);
}

/* A SEND of `len` bytes from `at` in the buffer (or inline), signaled or not, with immediate
 * data when `imm` is non-zero. */
static void post_send(struct side *s, uint64_t wr_id, size_t at, uint32_t len, uint32_t imm,
                      int flags)
{
    struct ibv_sge sge = { .addr = (uintptr_t)s->buf + at, .length = len, .lkey = s->mr->lkey };
    struct ibv_send_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = len ? 1 : 0,
                              .opcode = imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND,
                              .send_flags = flags, .imm_data = htonl(imm) }, *bad;
    CHECK(ibv_post_send(s->qp, &wr, &bad) == 0, "post_send %" PRIu64, wr_id);
}

static void expect_send(struct side *s, uint64_t wr_id, enum ibv_wc_status status)
{
    struct ibv_wc wc;
    CHECK(poll_one(s->scq, &wc) == 1, "no send completion for %" PRIu64, wr_id);
    CHECK(wc.status == status && wc.wr_id == wr_id && wc.qp_num == s->qp->qp_num &&
              (status != IBV_WC_SUCCESS || (wc.opcode == IBV_WC_SEND && wc.wc_flags == 0)),
          "send completion: status %s wr_id %" PRIu64 " opcode %d flags %u (wanted %s %" PRIu64 ")",
          ibv_wc_status_str(wc.status), wc.wr_id, wc.opcode, wc.wc_flags,
          ibv_wc_status_str(status), wr_id);
}

/* The next receive completion: every field of a successful one. */
static void expect_recv(struct side *s, uint64_t wr_id, uint32_t len, uint32_t imm)
{
    struct ibv_wc wc;
    CHECK(poll_one(s->rcq, &wc) == 1, "no receive completion for %" PRIu64, wr_id);
    CHECK(wc.status == IBV_WC_SUCCESS, "receive %" PRIu64 ": %s", wr_id,
          ibv_wc_status_str(wc.status));
    CHECK(wc.wr_id == wr_id && wc.opcode == IBV_WC_RECV && wc.byte_len == len &&
              wc.qp_num == s->qp->qp_num && wc.src_qp == s->peer_qpn && wc.slid == s->peer_lid &&
              wc.sl == 0 && wc.dlid_path_bits == 0 && wc.pkey_index == 0 &&
              wc.wc_flags == (imm ? IBV_WC_WITH_IMM : 0) && (!imm || wc.imm_data == htonl(imm)),
          "receive completion: wr_id %" PRIu64 " (want %" PRIu64 ") opcode %d len %u (want %u) "
          "qp %u src_qp %u (want %u) slid %u (want %u) flags %u imm %#x",
          wc.wr_id, wr_id, wc.opcode, wc.byte_len, len, wc.qp_num, wc.src_qp, s->peer_qpn,
          wc.slid, s->peer_lid, wc.wc_flags, ntohl(wc.imm_data));
}

static void expect_recv_status(struct side *s, uint64_t wr_id, enum ibv_wc_status status)
{
    struct ibv_wc wc;
    CHECK(poll_one(s->rcq, &wc) == 1, "no receive completion for %" PRIu64, wr_id);
    CHECK(wc.wr_id == wr_id && wc.status == status && wc.qp_num == s->qp->qp_num,
          "receive completion: wr_id %" PRIu64 " status %s (wanted %" PRIu64 " %s)", wc.wr_id,
          ibv_wc_status_str(wc.status), wr_id, ibv_wc_status_str(status));
}

static void expect_cq_empty(struct ibv_cq *cq, const char *what)
{
    struct ibv_wc wc;
    CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "%s: one completion too many (wr_id %" PRIu64 " %s)",
          what, wc.wr_id, ibv_wc_status_str(wc.status));
}

static void fill(char *p, uint32_t len, uint32_t seed)
{
    for (uint32_t k = 0; k < len; k++)
        p[k] = (char)(seed * 31 + k * 7 + 1);
}

static void check_bytes(const char *p, uint32_t len, uint32_t seed, const char *what)
{
    for (uint32_t k = 0; k < len; k++)
        CHECK(p[k] == (char)(seed * 31 + k * 7 + 1), "%s: byte %u differs", what, k);
}

/* A signaled SEND of `len` bytes of `seed` from `at`, which must complete with `status`. */
static void send_filled(struct side *s, uint64_t wr_id, size_t at, uint32_t len, uint32_t seed,
                        enum ibv_wc_status status)
{
    fill(s->buf + at, len, seed);
    post_send(s, wr_id, at, len, 0, IBV_SEND_SIGNALED);
    expect_send(s, wr_id, status);
}

/* ------------------------------------------------------------------------------ shapes */

static const uint32_t SHAPE_LEN[] = { 8, 100, 0, 256, 257, 16 };
#define SHAPES 6

static void shapes_receiver(void)
{
    struct side s;
    open_side(&s);
    memset(s.buf, 0xee, 4 << 20);
    for (uint32_t i = 0; i < SHAPES; i++) {
        if (i == 1) {
            struct ibv_sge two[2] = {
                { .addr = (uintptr_t)s.buf + SLOT, .length = 10, .lkey = s.mr->lkey },
                { .addr = (uintptr_t)s.buf + 2 * SLOT, .length = 300, .lkey = s.mr->lkey },
            };
            post_recv(&s, 100 + i, two, 2);
        } else if (i == 2) {
            post_recv(&s, 100 + i, NULL, 0);
        } else {
            post_recv_slot(&s, 100 + i, 4 + i, SLOT);
        }
    }
    step('r');
    for (uint32_t i = 0; i < SHAPES; i++)
        expect_recv(&s, 100 + i, SHAPE_LEN[i], i == 1 ? 0x12345678 : 0);
    expect_cq_empty(s.rcq, "shapes");
    check_bytes(s.buf + 4 * SLOT, 8, 0, "shape 0");
    CHECK((unsigned char)s.buf[4 * SLOT + 8] == 0xee, "shape 0 wrote past its length");
    char joined[100];
    memcpy(joined, s.buf + SLOT, 10);
    memcpy(joined + 10, s.buf + 2 * SLOT, 90);
    check_bytes(joined, 100, 1, "shape 1 (two SGEs)");
    CHECK((unsigned char)s.buf[SLOT + 10] == 0xee && (unsigned char)s.buf[2 * SLOT + 90] == 0xee,
          "shape 1 wrote past its SGEs");
    for (uint32_t i = 3; i < SHAPES; i++)
        check_bytes(s.buf + (size_t)(4 + i) * SLOT, SHAPE_LEN[i], i, "shape");
    step('d');
    close_side(&s);
}

static void shapes_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    for (uint32_t i = 0; i < SHAPES; i++) {
        fill(s.buf + (size_t)i * SLOT, SHAPE_LEN[i], i);
        if (i == 1) {
            /* Inline, from a stack buffer the WR does not name afterwards. */
            char bytes[100];
            fill(bytes, 100, 1);
            struct ibv_sge sge = { .addr = (uintptr_t)bytes, .length = 100 };
            struct ibv_send_wr wr = { .wr_id = i, .sg_list = &sge, .num_sge = 1,
                                      .opcode = IBV_WR_SEND_WITH_IMM,
                                      .send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE,
                                      .imm_data = htonl(0x12345678) }, *bad;
            CHECK(ibv_post_send(s.qp, &wr, &bad) == 0, "inline send");
            memset(bytes, 0, sizeof bytes);
        } else {
            post_send(&s, i, (size_t)i * SLOT, SHAPE_LEN[i], 0, IBV_SEND_SIGNALED);
        }
        expect_send(&s, i, IBV_WC_SUCCESS);
    }
    expect_cq_empty(s.scq, "shapes sender");
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ stream */

static int stream_message(uint32_t i) { return i >= STREAM / 2 && i % 7 == 6; }
static uint32_t stream_len(uint32_t i)
{
    return stream_message(i) ? 1000 : i % 11 == 10 ? 700 : 64;
}
/* The receive WR for SEND `i`: two SGEs where it must come as a message. */
static void post_stream_recv(struct side *s, uint32_t i, uint32_t slot)
{
    if (stream_message(i))
        post_recv_for_message(s, i, slot, SLOT);
    else
        post_recv_slot(s, i, slot, SLOT);
}
static uint32_t stream_imm(uint32_t i) { return i % 5 == 0 ? 0x5000000 + i : 0; }

static void stream_receiver(void)
{
    struct side s;
    open_side(&s);
    for (uint32_t i = 0; i < POSTED; i++)
        post_stream_recv(&s, i, i);
    step('r');
    struct ibv_wc wc[32];
    for (uint32_t got = 0; got < STREAM;) {
        int n = ibv_poll_cq(s.rcq, 32, wc);
        CHECK(n >= 0, "poll");
        for (int k = 0; k < n; k++, got++) {
            uint32_t slot = got % POSTED;
            CHECK(wc[k].status == IBV_WC_SUCCESS && wc[k].wr_id == got &&
                      wc[k].opcode == IBV_WC_RECV && wc[k].byte_len == stream_len(got) &&
                      wc[k].qp_num == s.qp->qp_num && wc[k].src_qp == s.peer_qpn &&
                      wc[k].slid == s.peer_lid &&
                      wc[k].wc_flags == (stream_imm(got) ? IBV_WC_WITH_IMM : 0) &&
                      (!stream_imm(got) || ntohl(wc[k].imm_data) == stream_imm(got)),
                  "stream message %u: status %s wr_id %" PRIu64 " len %u flags %u imm %#x", got,
                  ibv_wc_status_str(wc[k].status), wc[k].wr_id, wc[k].byte_len,
                  wc[k].wc_flags, ntohl(wc[k].imm_data));
            uint32_t number;
            memcpy(&number, s.buf + (size_t)slot * SLOT, 4);
            CHECK(number == got, "stream: slot of message %u holds %u", got, number);
            check_bytes(s.buf + (size_t)slot * SLOT + 4, stream_len(got) - 4, got, "stream");
            if (got + POSTED < STREAM)
                post_stream_recv(&s, got + POSTED, slot);
        }
    }
    expect_cq_empty(s.rcq, "stream");
    step('d');
    close_side(&s);
}

static void stream_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    uint32_t posted = 0, completed = 0;
    while (completed < STREAM) {
        while (posted < STREAM && posted - completed < WINDOW) {
            size_t at = (size_t)(posted % (2 * WINDOW)) * SLOT;
            memcpy(s.buf + at, &posted, 4);
            fill(s.buf + at + 4, stream_len(posted) - 4, posted);
            int last = posted == STREAM - 1 || posted % 16 == 15;
            post_send(&s, posted, at, stream_len(posted), stream_imm(posted),
                      last ? IBV_SEND_SIGNALED : 0);
            posted++;
        }
        struct ibv_wc wc;
        int n = ibv_poll_cq(s.scq, 1, &wc);
        CHECK(n >= 0, "poll");
        if (n == 1) {
            CHECK(wc.status == IBV_WC_SUCCESS && wc.opcode == IBV_WC_SEND &&
                      (wc.wr_id % 16 == 15 || wc.wr_id == STREAM - 1),
                  "stream send %" PRIu64 ": %s", wc.wr_id, ibv_wc_status_str(wc.status));
            CHECK(wc.wr_id + 1 > completed, "send completions out of order");
            completed = (uint32_t)wc.wr_id + 1;
        }
    }
    expect_cq_empty(s.scq, "stream sender");
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ errors */

static void short_receiver(void)
{
    struct side s;
    open_side(&s);
    post_recv_slot(&s, 7, 0, 8);
    step('r');
    expect_recv_status(&s, 7, IBV_WC_LOC_LEN_ERR);
    step('d');
    close_side(&s);
}

static void short_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    post_send(&s, 1, 0, 16, 0, IBV_SEND_SIGNALED);
    expect_send(&s, 1, IBV_WC_REM_INV_REQ_ERR);
    await_step('d');
    close_side(&s);
}

/* A receive WR `wr_id` of 64 bytes in a second MR (of 8 KiB at *mem), which it returns. */
static struct ibv_mr *post_recv_in_second_mr(struct side *s, uint64_t wr_id, char **mem)
{
    *mem = calloc(1, 8192);
    struct ibv_mr *mr = ibv_reg_mr(s->pd, *mem, 8192, IBV_ACCESS_LOCAL_WRITE);
    CHECK(*mem && mr, "reg_mr");
    struct ibv_sge sge = { .addr = (uintptr_t)*mem, .length = 64, .lkey = mr->lkey };
    post_recv(s, wr_id, &sge, 1);
    return mr;
}

/* Receive WR `wr_id`, whose MR (at `other`) was deregistered, completes with LOC_PROT_ERR and
 * nothing landed there; then the scenario ends. */
static void end_refused(struct side *s, uint64_t wr_id, char *other)
{
    expect_recv_status(s, wr_id, IBV_WC_LOC_PROT_ERR);
    for (int k = 0; k < 64; k++)
        CHECK(other[k] == 0, "a SEND landed in deregistered memory");
    step('d');
    close_side(s);
    free(other);
}

/* The receive WR names a second MR, deregistered before the SEND comes. */
static void dereg_receiver(void)
{
    struct side s;
    open_side(&s);
    char *other;
    struct ibv_mr *mr = post_recv_in_second_mr(&s, 9, &other);
    CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
    step('r');
    end_refused(&s, 9, other);
}

/* Once the receiver is ready, one signaled 64-byte SEND of bytes `seed`, which must complete
 * with `status`; then step `then` (0: none) and wait for the receiver's end. */
static void send_one(uint64_t wr_id, uint32_t seed, enum ibv_wc_status status, char then)
{
    struct side s;
    open_side(&s);
    await_step('r');
    send_filled(&s, wr_id, 0, 64, seed, status);
    if (then)
        step(then);
    await_step('d');
    close_side(&s);
}

static void dereg_sender(void)
{
    send_one(2, 3, IBV_WC_REM_OP_ERR, 0);
}

static void ahead_receiver(void)
{
    struct side s;
    open_side(&s);
    post_recv_slot(&s, 30, 0, SLOT);
    char *other;
    struct ibv_mr *mr = post_recv_in_second_mr(&s, 31, &other);
    step('r');
    expect_recv(&s, 30, 64, 0);
    check_bytes(s.buf, 64, 5, "ahead");
    CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
    step('x');
    end_refused(&s, 31, other);
}

static void ahead_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    send_filled(&s, 4, 0, 64, 5, IBV_WC_SUCCESS);
    await_step('x');
    send_filled(&s, 5, 0, 64, 6, IBV_WC_REM_OP_ERR);
    await_step('d');
    close_side(&s);
}

static void queued_receiver(void)
{
    struct side s;
    open_side(&s);
    post_recv_for_message(&s, 40, 0, SLOT);
    post_recv_slot(&s, 41, 1, SLOT);
    step('r');
    await_step('s');
    struct ibv_wc wc[2];
    int got = 0;
    for (int tries = 0; got < 2 && tries < 10000000; tries++) {
        int n = ibv_poll_cq(s.rcq, 2 - got, wc + got);
        CHECK(n >= 0, "poll");
        got += n;
    }
    CHECK(got == 2, "queued: %d receive completions", got);
    for (int k = 0; k < 2; k++)
        CHECK(wc[k].status == IBV_WC_SUCCESS && wc[k].wr_id == 40u + k &&
                  wc[k].byte_len == (k ? 64u : 1000u) && wc[k].opcode == IBV_WC_RECV &&
                  wc[k].qp_num == s.qp->qp_num && wc[k].src_qp == s.peer_qpn,
              "queued: completion %d is wr_id %" PRIu64 " (%u bytes, %s)", k, wc[k].wr_id,
              wc[k].byte_len, ibv_wc_status_str(wc[k].status));
    check_bytes(s.buf, 1000, 7, "queued message");
    check_bytes(s.buf + SLOT, 64, 8, "queued placed");
    expect_cq_empty(s.rcq, "queued");
    step('d');
    close_side(&s);
}

static void queued_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    send_filled(&s, 6, 0, 1000, 7, IBV_WC_SUCCESS);
    send_filled(&s, 7, SLOT, 64, 8, IBV_WC_SUCCESS);
    step('s');
    await_step('d');
    close_side(&s);
}

static void arrived_receiver(void)
{
    struct side s;
    open_side(&s);
    char *other;
    struct ibv_mr *mr = post_recv_in_second_mr(&s, 11, &other);
    step('r');
    await_step('s'); /* the SEND completed at the sender: it arrived */
    CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
    expect_recv(&s, 11, 64, 0);
    check_bytes(other, 64, 4, "arrived");
    step('d');
    close_side(&s);
    free(other);
}

static void arrived_sender(void)
{
    send_one(3, 4, IBV_WC_SUCCESS, 's');
}

static void flush_receiver(void)
{
    struct side s;
    open_side(&s);
    for (uint32_t i = 0; i < 5; i++)
        post_recv_slot(&s, 20 + i, i, SLOT);
    step('r');
    await_step('s');
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_ERR };
    CHECK(ibv_modify_qp(s.qp, &a, IBV_QP_STATE) == 0, "to ERR");
    for (uint32_t i = 0; i < 3; i++) {
        expect_recv(&s, 20 + i, 32, 0);
        check_bytes(s.buf + (size_t)i * SLOT, 32, 10 + i, "flush");
    }
    expect_recv_status(&s, 23, IBV_WC_WR_FLUSH_ERR);
    expect_recv_status(&s, 24, IBV_WC_WR_FLUSH_ERR);
    expect_cq_empty(s.rcq, "flush");
    step('d');
    close_side(&s);
}

static void flush_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    for (uint32_t i = 0; i < 3; i++) {
        fill(s.buf + (size_t)i * SLOT, 32, 10 + i);
        post_send(&s, 30 + i, (size_t)i * SLOT, 32, 0, IBV_SEND_SIGNALED);
        expect_send(&s, 30 + i, IBV_WC_SUCCESS);
    }
    step('s');
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ ack */

/* The parent sends a 1000-byte SEND (a message: two SGEs) and waits for its completion polling only
 * its send CQ; the child answers each with a 16-byte SEND, placed in the parent's ring and
 * carrying the ACK the child owes. The parent must get its completion without polling its
 * receive CQ, as from a HCA: with a local ACK timeout of ~4.3 s, a completion that waited
 * for the transport timer (the ACK left unread in the ring) takes seconds. */
#define ACK_ROUNDS 200

static double now_s(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void ack_receiver(void)
{
    struct side s;
    open_side(&s);
    post_recv_for_message(&s, 0, 0, SLOT);
    step('r');
    for (uint32_t i = 0; i < ACK_ROUNDS; i++) {
        expect_recv(&s, i, 1000, 0);
        post_recv_for_message(&s, i + 1, 0, SLOT);
        post_send(&s, 1000 + i, SLOT, 16, 0, IBV_SEND_SIGNALED);
        expect_send(&s, 1000 + i, IBV_WC_SUCCESS);
    }
    await_step('d');
    close_side(&s);
}

static void ack_sender(void)
{
    ack_timeout = 20;
    struct side s;
    open_side(&s);
    ack_timeout = 14;
    await_step('r');
    for (uint32_t i = 0; i < ACK_ROUNDS; i++) {
        post_recv_slot(&s, 2000 + i, 1, SLOT);
        double start = now_s();
        post_send(&s, i, 0, 1000, 0, IBV_SEND_SIGNALED);
        expect_send(&s, i, IBV_WC_SUCCESS);
        double took = now_s() - start;
        CHECK(took < 1.0, "round %u: the send completion waited %.3f s for its ACK", i, took);
        expect_recv(&s, 2000 + i, 16, 0);
    }
    step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ catchup */

static int direct_path_on(void)
{
    const char *d = getenv("UGDR_DIRECT");
    return !d || strcmp(d, "off") != 0;
}

static void catchup_receiver(void)
{
    struct side s;
    qp_access = IBV_ACCESS_REMOTE_WRITE;
    open_side(&s);
    qp_access = 0;
    char *target = calloc(1, 4096);
    struct ibv_mr *mr = ibv_reg_mr(s.pd, target, 4096,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(target && mr, "reg_mr for the WRITE");
    uint64_t where[2] = { (uintptr_t)target, mr->rkey };
    put(where, sizeof where);
    for (uint32_t round = 0; round < CATCHUP_ROUNDS; round++) {
        uint64_t id = 100 * round;
        memset(s.buf, 0, 5 * SLOT);
        memset(target, 0, 4096);
        for (uint32_t i = 0; i < 5; i++)
            (i < 3 ? post_recv_for_message : post_recv_slot)(&s, id + 40 + i, i, SLOT);
        step('r');
        for (uint32_t i = 0; i < 3; i++)
            expect_recv(&s, id + 40 + i, 1000, 0);
        /* Delivered, and their ACK not yet sent, most rounds: stop before it leaves. The
         * sender's waitpid sees the stop. */
        raise(SIGSTOP);
        for (uint32_t i = 3; i < 5; i++)
            expect_recv(&s, id + 40 + i, 16, 0);
        expect_cq_empty(s.rcq, "catchup");
        for (uint32_t i = 0; i < 5; i++)
            check_bytes(s.buf + (size_t)i * SLOT, i < 3 ? 1000 : 16, round + 50 + i, "catchup");
        check_bytes(target, 64, round + 70, "catchup WRITE");
        CHECK(target[64] == 0, "the catchup WRITE wrote past its length");
        step('n');
    }
    step('d');
    CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
    free(target);
    close_side(&s);
}

static void catchup_sender(pid_t receiver)
{
    ack_timeout = 20;
    struct side s;
    open_side(&s);
    ack_timeout = 14;
    uint64_t where[2];
    get(where, sizeof where);
    for (uint32_t round = 0; round < CATCHUP_ROUNDS; round++) {
        uint64_t id = 100 * round;
        for (uint32_t i = 0; i < 5; i++)
            fill(s.buf + (size_t)i * SLOT, i < 3 ? 1000 : 16, round + 50 + i);
        fill(s.buf + 8 * SLOT, 64, round + 70);
        await_step('r');
        for (uint32_t i = 0; i < 3; i++)
            post_send(&s, id + 60 + i, (size_t)i * SLOT, 1000, 0, 0);
        int status;
        CHECK(waitpid(receiver, &status, WUNTRACED) == receiver && WIFSTOPPED(status),
              "the receiver did not stop (status %d)", status);
        struct ibv_sge sge = { .addr = (uintptr_t)s.buf + 8 * SLOT, .length = 64,
                               .lkey = s.mr->lkey };
        struct ibv_send_wr write = { .wr_id = id + 65, .sg_list = &sge, .num_sge = 1,
                                     .opcode = IBV_WR_RDMA_WRITE,
                                     .send_flags = IBV_SEND_SIGNALED,
                                     .wr.rdma = { .remote_addr = where[0],
                                                  .rkey = (uint32_t)where[1] } }, *bad;
        CHECK(ibv_post_send(s.qp, &write, &bad) == 0, "post the catchup WRITE");
        for (uint32_t i = 3; i < 5; i++)
            post_send(&s, id + 60 + i, (size_t)i * SLOT, 16, 0, IBV_SEND_SIGNALED);
        const uint64_t order[] = { id + 65, id + 63, id + 64 };
        struct ibv_wc wc[4];
        int n = 0;
        if (direct_path_on()) {
            /* Carried out at post: the three completions are there now, the receiver
             * stopped. */
            n = ibv_poll_cq(s.scq, 4, wc);
            CHECK(n == 3,
                  "catchup round %u: %d send completions at post, wanted 3 (the receiver is "
                  "stopped)",
                  round, n);
            CHECK(kill(receiver, SIGCONT) == 0, "SIGCONT");
        } else {
            CHECK(kill(receiver, SIGCONT) == 0, "SIGCONT");
            for (; n < 3; n++)
                CHECK(poll_one(s.scq, &wc[n]) == 1, "catchup round %u: no completion %d", round,
                      n);
        }
        for (int k = 0; k < 3; k++)
            CHECK(wc[k].status == IBV_WC_SUCCESS && wc[k].wr_id == order[k] &&
                      wc[k].opcode == (k == 0 ? IBV_WC_RDMA_WRITE : IBV_WC_SEND) &&
                      wc[k].wc_flags == 0 && wc[k].qp_num == s.qp->qp_num &&
                      (k > 0 || wc[k].byte_len == 64),
                  "catchup round %u, completion %d: %s wr_id %" PRIu64 " opcode %d flags %u "
                  "len %u",
                  round, k, ibv_wc_status_str(wc[k].status), wc[k].wr_id, wc[k].opcode,
                  wc[k].wc_flags, wc[k].byte_len);
        expect_cq_empty(s.scq, "catchup sender");
        await_step('n');
    }
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ in place */

/* SENDs above 256 bytes into receive WRs of one SGE, written in place by the sender: each
 * WR's room is larger than its SEND (bytes past the SEND must stay untouched), except the
 * last, exactly as large. */
static const uint32_t BIG_LEN[] = { 257, 4096, 65536, 1 << 20, 3000 };
static const size_t BIG_AT[] = { 0, 4096, 16384, 2 << 20, 90000 };
static const uint32_t BIG_ROOM[] = { 1024, 8192, 65536 + 64, (1 << 20) + 64, 3000 };
#define BIGS 5

static uint32_t big_imm(uint32_t i) { return i == 1 || i == 3 ? 0xabc00000 + i : 0; }

static void inplace_receiver(void)
{
    struct side s;
    open_side(&s);
    memset(s.buf, 0xee, 4 << 20);
    for (uint32_t i = 0; i < BIGS; i++) {
        struct ibv_sge sge = { .addr = (uintptr_t)s.buf + BIG_AT[i], .length = BIG_ROOM[i],
                               .lkey = s.mr->lkey };
        post_recv(&s, 300 + i, &sge, 1);
    }
    /* Too small for the 2000-byte SEND that follows: it is not written in place, and the
     * message path fails it (LOC_LEN_ERR here, REM_INV_REQ_ERR at the sender). */
    post_recv_slot(&s, 310, 3100, 1000);
    step('r');
    for (uint32_t i = 0; i < BIGS; i++) {
        expect_recv(&s, 300 + i, BIG_LEN[i], big_imm(i));
        check_bytes(s.buf + BIG_AT[i], BIG_LEN[i], 200 + i, "in place");
        CHECK((unsigned char)s.buf[BIG_AT[i] + BIG_LEN[i]] == 0xee,
              "in place: SEND %u wrote past its length", i);
    }
    expect_recv_status(&s, 310, IBV_WC_LOC_LEN_ERR);
    for (size_t k = 0; k < 1000; k++)
        CHECK((unsigned char)s.buf[(size_t)3100 * SLOT + k] == 0xee,
              "in place: byte %zu of the short WR changed", k);
    expect_cq_empty(s.rcq, "in place");
    step('d');
    close_side(&s);
}

static void inplace_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    for (uint32_t i = 0; i < BIGS; i++) {
        fill(s.buf + BIG_AT[i], BIG_LEN[i], 200 + i);
        post_send(&s, 320 + i, BIG_AT[i], BIG_LEN[i], big_imm(i), IBV_SEND_SIGNALED);
        expect_send(&s, 320 + i, IBV_WC_SUCCESS);
    }
    post_send(&s, 330, 0, 2000, 0, IBV_SEND_SIGNALED);
    expect_send(&s, 330, IBV_WC_REM_INV_REQ_ERR);
    expect_cq_empty(s.scq, "in place sender");
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ race */

/* A stream of 16 KiB SENDs written in place into receive WRs of a second MR, which the
 * receiver deregisters in the middle of it: every receive before completes with its data,
 * then one LOC_PROT_ERR (a SEND for a WR whose MR is gone; the receiver posts one such WR
 * after the deregistration, so that one is there whatever the sender filled before), then
 * flushes; the sender gets REM_OP_ERR; and from the moment ibv_dereg_mr returned, no byte of
 * that memory changes. */
#define RACE_WRS 32
#define RACE_LEN 16384
#define RACE_AFTER 300

static void race_receiver(void)
{
    struct side s;
    open_side(&s);
    size_t size = (size_t)RACE_WRS * RACE_LEN;
    char *mem = aligned_alloc(4096, size), *snap = malloc(size);
    CHECK(mem && snap, "race memory");
    memset(mem, 0, size);
    struct ibv_mr *mr = ibv_reg_mr(s.pd, mem, size, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr, "reg_mr");
    uint32_t posted = 0, done = 0, errors = 0;
    for (; posted < RACE_WRS; posted++) {
        struct ibv_sge sge = { .addr = (uintptr_t)mem + (size_t)posted * RACE_LEN,
                               .length = RACE_LEN, .lkey = mr->lkey };
        post_recv(&s, posted, &sge, 1);
    }
    step('r');
    struct ibv_wc wc;
    while (done < posted) {
        if (done == RACE_AFTER) {
            uint32_t lkey = mr->lkey;
            CHECK(ibv_dereg_mr(mr) == 0, "race dereg_mr");
            memcpy(snap, mem, size);
            struct ibv_sge sge = { .addr = (uintptr_t)mem, .length = RACE_LEN, .lkey = lkey };
            post_recv(&s, posted++, &sge, 1);
        }
        CHECK(poll_one(s.rcq, &wc) == 1, "race: no receive completion for %u", done);
        CHECK(wc.wr_id == done && wc.qp_num == s.qp->qp_num, "race: wr_id %" PRIu64 " for %u",
              wc.wr_id, done);
        char *at = mem + (size_t)(done % RACE_WRS) * RACE_LEN;
        if (wc.status == IBV_WC_SUCCESS) {
            CHECK(errors == 0 && wc.byte_len == RACE_LEN && wc.opcode == IBV_WC_RECV &&
                      wc.src_qp == s.peer_qpn,
                  "race: receive %u succeeded after an error, or its fields are wrong", done);
            uint32_t number;
            memcpy(&number, at, 4);
            CHECK(number == done, "race: receive %u holds SEND %u", done, number);
            check_bytes(at + 4, RACE_LEN - 4, done, "race");
        } else if (wc.status == IBV_WC_LOC_PROT_ERR) {
            CHECK(done >= RACE_AFTER && errors++ == 0, "race: LOC_PROT_ERR for receive %u",
                  done);
        } else {
            CHECK(wc.status == IBV_WC_WR_FLUSH_ERR && errors == 1,
                  "race: receive %u: %s", done, ibv_wc_status_str(wc.status));
        }
        done++;
        if (done < RACE_AFTER && posted < RACE_AFTER + RACE_WRS - 1) {
            struct ibv_sge sge = { .addr = (uintptr_t)mem + (size_t)(posted % RACE_WRS) * RACE_LEN,
                                   .length = RACE_LEN, .lkey = mr->lkey };
            post_recv(&s, posted++, &sge, 1);
        }
    }
    CHECK(errors == 1, "race: %u receives failed, wanted 1", errors);
    expect_cq_empty(s.rcq, "race");
    await_step('e');
    struct timespec pause = { 0, 100 * 1000 * 1000 };
    nanosleep(&pause, NULL);
    for (size_t k = 0; k < size; k++)
        CHECK(mem[k] == snap[k], "race: byte %zu changed after ibv_dereg_mr returned", k);
    step('d');
    close_side(&s);
    free(mem);
    free(snap);
}

static void race_sender(void)
{
    struct side s;
    open_side(&s);
    await_step('r');
    struct ibv_wc wc;
    for (uint32_t i = 0;; i++) {
        CHECK(i < RACE_AFTER + RACE_WRS + 10, "race: SEND %u still succeeded", i);
        size_t at = (size_t)(i % 2) * RACE_LEN;
        memcpy(s.buf + at, &i, 4);
        fill(s.buf + at + 4, RACE_LEN - 4, i);
        post_send(&s, i, at, RACE_LEN, 0, IBV_SEND_SIGNALED);
        CHECK(poll_one(s.scq, &wc) == 1 && wc.wr_id == i, "race: no completion for SEND %u", i);
        if (wc.status != IBV_WC_SUCCESS) {
            CHECK(wc.status == IBV_WC_REM_OP_ERR && i >= RACE_AFTER,
                  "race: SEND %u completed with %s", i, ibv_wc_status_str(wc.status));
            break;
        }
    }
    step('e');
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ write_imm */

/* RDMA WRITE_WITH_IMM to a same-host peer: its bytes land where it names (placed by the
 * requester, checked as a direct WRITE), and the receiver's next receive WR takes its
 * completion (RECV_RDMA_WITH_IMM, the WRITE's length and immediate data), its buffer
 * untouched. Then one whose rkey grants no remote writing: REM_ACCESS_ERR at the sender, the
 * receiver's QP to ERR with IBV_EVENT_QP_ACCESS_ERR, the receive WR it took completed with
 * REM_ACCESS_ERR and the next one flushed. */
static const uint32_t WIMM_LEN[] = { 8, 300, 4096, 1 << 20 };
#define WIMMS 4

static void write_imm_receiver(void)
{
    struct side s;
    qp_access = IBV_ACCESS_REMOTE_WRITE;
    open_side(&s);
    qp_access = 0;
    size_t size = 2 << 20;
    char *target = aligned_alloc(4096, size);
    CHECK(target, "target");
    memset(target, 0, size);
    struct ibv_mr *mr = ibv_reg_mr(s.pd, target, size,
                                   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    CHECK(mr, "reg_mr for WRITE_WITH_IMM");
    /* The target's key, and a key of memory registered for local writing only. */
    uint64_t where[3] = { (uintptr_t)target, mr->rkey, s.mr->rkey };
    put(where, sizeof where);
    memset(s.buf, 0xee, 8 * SLOT);
    for (uint32_t i = 0; i <= WIMMS + 1; i++)
        post_recv_slot(&s, 500 + i, i, SLOT);
    step('r');
    struct ibv_wc wc;
    for (uint32_t i = 0; i < WIMMS; i++) {
        CHECK(poll_one(s.rcq, &wc) == 1, "write_imm: no receive completion %u", i);
        CHECK(wc.status == IBV_WC_SUCCESS && wc.wr_id == 500 + i &&
                  wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM && wc.byte_len == WIMM_LEN[i] &&
                  wc.wc_flags == IBV_WC_WITH_IMM && ntohl(wc.imm_data) == 0x77000000 + i &&
                  wc.qp_num == s.qp->qp_num && wc.src_qp == s.peer_qpn &&
                  wc.slid == s.peer_lid,
              "write_imm %u: %s wr_id %" PRIu64 " opcode %d len %u flags %u imm %#x", i,
              ibv_wc_status_str(wc.status), wc.wr_id, wc.opcode, wc.byte_len, wc.wc_flags,
              ntohl(wc.imm_data));
        /* Its bytes are there when its completion is seen. */
        check_bytes(target + (size_t)i * 8192, WIMM_LEN[i], 600 + i, "write_imm");
    }
    for (size_t k = 0; k < 8 * SLOT; k++)
        CHECK((unsigned char)s.buf[k] == 0xee, "write_imm: byte %zu of a receive WR changed", k);
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(s.ctx, &ev) == 0, "async event");
    CHECK(ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == s.qp,
          "async event %d, wanted IBV_EVENT_QP_ACCESS_ERR on the QP", ev.event_type);
    ibv_ack_async_event(&ev);
    /* The refused WRITE took its receive WR (as rxe's responder fetches it before the key
     * check): that one completes with the error, the next is flushed. */
    expect_recv_status(&s, 500 + WIMMS, IBV_WC_REM_ACCESS_ERR);
    expect_recv_status(&s, 501 + WIMMS, IBV_WC_WR_FLUSH_ERR);
    expect_cq_empty(s.rcq, "write_imm");
    step('d');
    CHECK(ibv_dereg_mr(mr) == 0, "dereg_mr");
    free(target);
    close_side(&s);
}

static void write_imm_sender(void)
{
    struct side s;
    open_side(&s);
    uint64_t where[3];
    get(where, sizeof where);
    await_step('r');
    for (uint32_t i = 0; i <= WIMMS; i++) {
        uint32_t len = i < WIMMS ? WIMM_LEN[i] : 64;
        size_t at = i < WIMMS ? (size_t)i * 8192 : 0;
        char *src = s.buf + (size_t)(i % WIMMS) * (1 << 20);
        fill(src, len, 600 + i);
        struct ibv_sge sge = { .addr = (uintptr_t)src, .length = len, .lkey = s.mr->lkey };
        struct ibv_send_wr wr = { .wr_id = 700 + i, .sg_list = &sge, .num_sge = 1,
                                  .opcode = IBV_WR_RDMA_WRITE_WITH_IMM,
                                  .send_flags = IBV_SEND_SIGNALED,
                                  .imm_data = htonl(0x77000000 + i),
                                  .wr.rdma = { .remote_addr = where[0] + at,
                                               .rkey = (uint32_t)where[i < WIMMS ? 1 : 2] } },
                           *bad;
        CHECK(ibv_post_send(s.qp, &wr, &bad) == 0, "post WRITE_WITH_IMM %u", i);
        struct ibv_wc wc;
        CHECK(poll_one(s.scq, &wc) == 1, "write_imm: no send completion %u", i);
        enum ibv_wc_status want = i < WIMMS ? IBV_WC_SUCCESS : IBV_WC_REM_ACCESS_ERR;
        CHECK(wc.wr_id == 700 + i && wc.status == want && wc.qp_num == s.qp->qp_num &&
                  (want != IBV_WC_SUCCESS || (wc.opcode == IBV_WC_RDMA_WRITE && wc.wc_flags == 0)),
              "write_imm send %u: %s opcode %d (wanted %s)", i, ibv_wc_status_str(wc.status),
              wc.opcode, ibv_wc_status_str(want));
    }
    expect_cq_empty(s.scq, "write_imm sender");
    await_step('d');
    close_side(&s);
}

/* ------------------------------------------------------------------------------ refused */

static void refused_receiver(void)
{
    struct side s;
    qp_access = IBV_ACCESS_REMOTE_WRITE;
    open_side(&s);
    qp_access = 0;
    /* Registered for local writing only: a WRITE naming it is refused by the responder. */
    uint64_t where[2] = { (uintptr_t)s.buf + 8 * SLOT, s.mr->rkey };
    put(where, sizeof where);
    memset(s.buf, 0xee, 10 * SLOT);
    for (uint32_t i = 0; i < 2; i++)
        post_recv_slot(&s, 80 + i, i, SLOT);
    step('r');
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(s.ctx, &ev) == 0, "async event");
    CHECK(ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == s.qp,
          "async event %d, wanted IBV_EVENT_QP_ACCESS_ERR on the QP", ev.event_type);
    ibv_ack_async_event(&ev);
    expect_recv_status(&s, 80, IBV_WC_WR_FLUSH_ERR);
    expect_recv_status(&s, 81, IBV_WC_WR_FLUSH_ERR);
    expect_cq_empty(s.rcq, "refused");
    for (size_t k = 0; k < 10 * SLOT; k++)
        CHECK((unsigned char)s.buf[k] == 0xee, "refused: byte %zu of the buffer changed", k);
    step('d');
    close_side(&s);
}

static void refused_sender(void)
{
    struct side s;
    open_side(&s);
    uint64_t where[2];
    get(where, sizeof where);
    await_step('r');
    fill(s.buf, 64, 90);
    fill(s.buf + SLOT, 16, 91);
    struct ibv_sge sge = { .addr = (uintptr_t)s.buf, .length = 64, .lkey = s.mr->lkey };
    struct ibv_send_wr write = { .wr_id = 85, .sg_list = &sge, .num_sge = 1,
                                 .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
                                 .wr.rdma = { .remote_addr = where[0],
                                              .rkey = (uint32_t)where[1] } }, *bad;
    CHECK(ibv_post_send(s.qp, &write, &bad) == 0, "post the refused WRITE");
    post_send(&s, 86, SLOT, 16, 0, IBV_SEND_SIGNALED);
    struct ibv_wc wc;
    CHECK(poll_one(s.scq, &wc) == 1 && wc.wr_id == 85 && wc.status == IBV_WC_REM_ACCESS_ERR &&
              wc.qp_num == s.qp->qp_num,
          "refused WRITE: wr_id %" PRIu64 " %s", wc.wr_id, ibv_wc_status_str(wc.status));
    expect_send(&s, 86, IBV_WC_WR_FLUSH_ERR);
    expect_cq_empty(s.scq, "refused sender");
    await_step('d');
    close_side(&s);
}

int main(void)
{
    void (*scenario[][2])(void) = {
        { shapes_receiver, shapes_sender },   { stream_receiver, stream_sender },
        { short_receiver, short_sender },     { dereg_receiver, dereg_sender },
        { ahead_receiver, ahead_sender },     { queued_receiver, queued_sender },
        { arrived_receiver, arrived_sender }, { flush_receiver, flush_sender },
        { ack_receiver, ack_sender },         { refused_receiver, refused_sender },
        { inplace_receiver, inplace_sender }, { race_receiver, race_sender },
        { write_imm_receiver, write_imm_sender },
    };
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0, "pipe");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    is_child = child == 0;
    /* Each side keeps only its own ends: when the other side dies, a read ends at once. */
    close(is_child ? to_child[1] : to_child[0]);
    close(is_child ? to_parent[0] : to_parent[1]);
    for (size_t i = 0; i < sizeof scenario / sizeof scenario[0]; i++)
        scenario[i][is_child ? 0 : 1]();
    if (is_child) {
        catchup_receiver();
        exit(0);
    }
    catchup_sender(child);
    int status;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0,
          "receiver failed (status %d)", status);
    printf("direct_send: ok\n");
    return 0;
}
