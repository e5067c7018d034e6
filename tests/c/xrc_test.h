/* What the XRC test programs (xrc.c, xrc_rdma.c) share: one device context and its LID, and
 * the XRC objects made as ibv_xsrq_pingpong makes them. */
#ifndef UGDR_XRC_TEST_H
#define UGDR_XRC_TEST_H

#include "verbs_test.h"
#include <arpa/inet.h>
#include <fcntl.h>
#include <stdint.h>
#include <unistd.h>

static struct ibv_context *ctx;
static uint16_t lid;

/* Opens the first device (into `ctx`, its port's LID into `lid`), which must say XRC; the
 * device list, to free at the end. */
static struct ibv_device **open_xrc_device(void)
{
    int n;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n > 0, "device list");
    ctx = ibv_open_device(list[0]);
    CHECK(ctx, "open_device");
    struct ibv_device_attr dattr;
    CHECK(ibv_query_device(ctx, &dattr) == 0 && (dattr.device_cap_flags & IBV_DEVICE_XRC), "IBV_DEVICE_XRC");
    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
    lid = port.lid;
    return list;
}

static struct ibv_xrcd *open_xrcd(int fd, int oflags)
{
    struct ibv_xrcd_init_attr a = { .comp_mask = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS,
                                    .fd = fd, .oflags = oflags };
    return ibv_open_xrcd(ctx, &a);
}

static struct ibv_srq *xrc_srq(struct ibv_xrcd *xrcd, struct ibv_pd *pd, struct ibv_cq *cq)
{
    struct ibv_srq_init_attr_ex a = {
        .attr = { .max_wr = 8, .max_sge = 1 },
        .comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ |
                     IBV_SRQ_INIT_ATTR_PD,
        .srq_type = IBV_SRQT_XRC, .xrcd = xrcd, .cq = cq, .pd = pd };
    struct ibv_srq *srq = ibv_create_srq_ex(ctx, &a);
    CHECK(srq, "create XRC SRQ");
    return srq;
}

static struct ibv_qp *target_qp(struct ibv_xrcd *xrcd)
{
    struct ibv_qp_init_attr_ex a = { .qp_type = IBV_QPT_XRC_RECV, .comp_mask = IBV_QP_INIT_ATTR_XRCD,
                                     .xrcd = xrcd };
    struct ibv_qp *qp = ibv_create_qp_ex(ctx, &a);
    CHECK(qp && qp->qp_type == IBV_QPT_XRC_RECV && qp->srq == NULL, "create XRC_RECV QP");
    return qp;
}

static struct ibv_qp *send_qp(struct ibv_pd *pd, struct ibv_cq *cq, uint64_t send_ops)
{
    struct ibv_qp_init_attr_ex a = { .qp_type = IBV_QPT_XRC_SEND, .send_cq = cq,
        .cap = { .max_send_wr = 8, .max_send_sge = 1, .max_inline_data = 64 },
        .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = pd,
        .send_ops_flags = send_ops };
    struct ibv_qp *qp = ibv_create_qp_ex(ctx, &a);
    CHECK(qp && qp->qp_type == IBV_QPT_XRC_SEND, "create XRC_SEND QP");
    return qp;
}

/* INIT (a target with `access` as its remote access) → RTR (towards dqpn on this port) → RTS,
 * with xsrq_pingpong's attributes and one READ/atomic in flight. */
static void connect_qp_access(struct ibv_qp *qp, uint32_t dqpn, int target, int access)
{
    struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
                             .qp_access_flags = target ? access : 0 };
    CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0, "INIT");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTR; a.dest_qp_num = dqpn; a.path_mtu = IBV_MTU_1024; a.rq_psn = 7;
    a.min_rnr_timer = 12; a.ah_attr.dlid = lid; a.ah_attr.port_num = 1; a.max_dest_rd_atomic = 1;
    int mask = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
    if (target)
        mask |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    CHECK(ibv_modify_qp(qp, &a, mask) == 0, "RTR");
    memset(&a, 0, sizeof a);
    a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.sq_psn = 7;
    a.max_rd_atomic = 1;
    mask = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_SQ_PSN;
    if (!target)
        mask |= IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    CHECK(ibv_modify_qp(qp, &a, mask) == 0, "RTS");
}

static void connect_qp(struct ibv_qp *qp, uint32_t dqpn, int target)
{
    connect_qp_access(qp, dqpn, target, IBV_ACCESS_REMOTE_WRITE);
}

static void post_srq(struct ibv_srq *srq, struct ibv_mr *mr, char *buf, uint32_t len, uint64_t wr_id)
{
    struct ibv_sge sge = { .addr = (uintptr_t)buf, .length = len, .lkey = mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = wr_id, .sg_list = &sge, .num_sge = 1 }, *bad;
    CHECK(ibv_post_srq_recv(srq, &wr, &bad) == 0, "post_srq_recv");
}

static void expect_empty(struct ibv_cq *cq, const char *what)
{
    struct ibv_wc wc;
    usleep(100 * 1000);
    CHECK(ibv_poll_cq(cq, 1, &wc) == 0, "%s: no completion expected", what);
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr i;
    CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE, &i) == 0, "query_qp");
    return a.qp_state;
}

/* The next async event is `type` about `qp`. */
static void expect_qp_event(enum ibv_event_type type, struct ibv_qp *qp)
{
    struct ibv_async_event ev;
    CHECK(ibv_get_async_event(ctx, &ev) == 0, "get_async_event");
    CHECK(ev.event_type == type && ev.element.qp == qp, "async event %s on %p, expected %s on %p",
          ibv_event_type_str(ev.event_type), (void *)ev.element.qp, ibv_event_type_str(type), (void *)qp);
    ibv_ack_async_event(&ev);
}

#endif
