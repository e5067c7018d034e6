/* rdma_cm multicast (rdma_join_multicast(3), librdmacm's cma.c): the argument and state
 * checks, the MULTICAST_JOIN event's UD parameters on a synchronous id, the QP attached as
 * the event is read (full member) or not (send-only member), and leaving.
 * Prints "multicast_cm: ok". */
#include "verbs_test.h"
#include <arpa/inet.h>
#include <rdma/rdma_cma.h>

#define GROUP "239.1.3.7"

static struct sockaddr_in addr_of(const char *ip)
{
    struct sockaddr_in a = { .sin_family = AF_INET };
    CHECK(inet_pton(AF_INET, ip, &a.sin_addr) == 1, "inet_pton %s", ip);
    return a;
}

/* A synchronous UD id bound to 127.0.0.1 with a UD QP on its own PD and CQ. */
static struct rdma_cm_id *ud_id(void *context)
{
    struct rdma_cm_id *id;
    CHECK(rdma_create_id(NULL, &id, context, RDMA_PS_UDP) == 0, "create_id");
    struct sockaddr_in lo = addr_of("127.0.0.1");
    CHECK(rdma_bind_addr(id, (struct sockaddr *)&lo) == 0, "bind");
    struct ibv_cq *cq = ibv_create_cq(id->verbs, 8, NULL, NULL, 0);
    CHECK(cq, "cq");
    struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_UD,
                                   .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
    CHECK(rdma_create_qp(id, NULL, &ia) == 0, "create_qp");
    return id;
}

static char buf[2][4096];

static void post_recv(struct rdma_cm_id *id, struct ibv_mr *mr, int i)
{
    struct ibv_sge sge = { .addr = (uintptr_t)buf[i], .length = 1024, .lkey = mr->lkey };
    struct ibv_recv_wr wr = { .wr_id = (uintptr_t)i, .sg_list = &sge, .num_sge = 1 }, *bad;
    CHECK(ibv_post_recv(id->qp, &wr, &bad) == 0, "post_recv");
}

int main(void)
{
    setvbuf(stdout, NULL, _IONBF, 0);
    struct sockaddr_in group = addr_of(GROUP), lo = addr_of("127.0.0.1");

    /* Only UD ids join; only once bound or resolved; librdmacm's checks of the _ex form. */
    struct rdma_cm_id *tcp, *idle;
    CHECK(rdma_create_id(NULL, &tcp, NULL, RDMA_PS_TCP) == 0, "tcp id");
    CHECK(rdma_bind_addr(tcp, (struct sockaddr *)&lo) == 0, "bind tcp");
    FAILS_WITH(rdma_join_multicast(tcp, (struct sockaddr *)&group, NULL), -1, EINVAL);
    CHECK(rdma_create_id(NULL, &idle, NULL, RDMA_PS_UDP) == 0, "udp id");
    FAILS_WITH(rdma_join_multicast(idle, (struct sockaddr *)&group, NULL), -1, EINVAL);
    CHECK(rdma_bind_addr(idle, (struct sockaddr *)&lo) == 0, "bind udp");
    struct rdma_cm_join_mc_attr_ex x = { .comp_mask = RDMA_CM_JOIN_MC_ATTR_RESERVED, .addr = (struct sockaddr *)&group };
    FAILS_WITH(rdma_join_multicast_ex(idle, &x, NULL), -1, ENOTSUP);
    x.comp_mask = RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS;
    FAILS_WITH(rdma_join_multicast_ex(idle, &x, NULL), -1, EINVAL);
    x.comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS;
    x.join_flags = RDMA_MC_JOIN_FLAG_RESERVED;
    FAILS_WITH(rdma_join_multicast_ex(idle, &x, NULL), -1, EINVAL);
    FAILS_WITH(rdma_leave_multicast(idle, (struct sockaddr *)&group), -1, EADDRNOTAVAIL);
    CHECK(rdma_destroy_id(tcp) == 0 && rdma_destroy_id(idle) == 0, "destroy");

    /* A full member: the synchronous join returns with MULTICAST_JOIN in id->event. */
    int ctx_mark;
    struct rdma_cm_id *member = ud_id(NULL), *sender = ud_id(NULL), *send_only = ud_id(NULL);
    CHECK(rdma_join_multicast(member, (struct sockaddr *)&group, &ctx_mark) == 0, "join");
    struct rdma_cm_event *ev = member->event;
    CHECK(ev && ev->event == RDMA_CM_EVENT_MULTICAST_JOIN && ev->status == 0, "join event");
    struct rdma_ud_param ud = ev->param.ud;
    CHECK(ud.private_data == &ctx_mark && ud.private_data_len == 0, "context as private_data");
    CHECK(ud.qp_num == 0xffffff && ud.qkey == RDMA_UDP_QKEY, "qp_num %#x qkey %#x", ud.qp_num, ud.qkey);
    const uint8_t want[16] = { 0xff, 0x12, 0x40, 0x01, 0xff, 0xff, 0, 0, 0, 0, 0, 0, 0x0f, 1, 3, 7 };
    CHECK(ud.ah_attr.is_global && memcmp(ud.ah_attr.grh.dgid.raw, want, 16) == 0, "MGID");
    CHECK(ud.ah_attr.dlid >= 0xc000 && ud.ah_attr.dlid < 0xffff && ud.ah_attr.port_num == 1, "MLID %#x", ud.ah_attr.dlid);
    CHECK(rdma_ack_cm_event(ev) == 0, "ack");
    /* The QP was attached as the event was read: attaching again is harmless, and the
     * group now keeps it from being destroyed. */
    CHECK(ibv_attach_mcast(member->qp, &ud.ah_attr.grh.dgid, ud.ah_attr.dlid) == 0, "attached");

    /* A send-only member's QP is not attached: it gets nothing. */
    x.comp_mask = RDMA_CM_JOIN_MC_ATTR_ADDRESS | RDMA_CM_JOIN_MC_ATTR_JOIN_FLAGS;
    x.join_flags = RDMA_MC_JOIN_FLAG_SENDONLY_FULLMEMBER;
    CHECK(rdma_join_multicast_ex(send_only, &x, NULL) == 0, "join send-only");
    rdma_ack_cm_event(send_only->event);
    CHECK(ibv_detach_mcast(send_only->qp, &ud.ah_attr.grh.dgid, ud.ah_attr.dlid) == EINVAL, "send-only attached");

    struct ibv_pd *pd = member->qp->pd;
    struct ibv_mr *mr = ibv_reg_mr(pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *smr = ibv_reg_mr(sender->qp->pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *omr = ibv_reg_mr(send_only->qp->pd, buf, sizeof buf, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr && smr && omr, "reg_mr");
    post_recv(member, mr, 0);
    post_recv(send_only, omr, 1);
    struct ibv_ah *ah = ibv_create_ah(sender->qp->pd, &ud.ah_attr);
    CHECK(ah, "create_ah");
    strcpy(buf[1] + 2048, "to the group");
    struct ibv_sge sge = { .addr = (uintptr_t)(buf[1] + 2048), .length = 13, .lkey = smr->lkey };
    struct ibv_send_wr wr = { .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
    wr.wr.ud.ah = ah; wr.wr.ud.remote_qpn = ud.qp_num; wr.wr.ud.remote_qkey = ud.qkey;
    CHECK(ibv_post_send(sender->qp, &wr, &bad) == 0, "post_send");
    struct ibv_wc wc;
    CHECK(poll_one(sender->qp->send_cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS, "send completion");
    CHECK(poll_one(member->qp->recv_cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS && wc.byte_len == 40 + 13 &&
          wc.src_qp == sender->qp->qp_num && (wc.wc_flags & IBV_WC_GRH), "member's datagram");
    CHECK(memcmp(buf[0] + 40, "to the group", 13) == 0, "data");
    struct timespec t = { 0, 200000000 };
    nanosleep(&t, NULL);
    CHECK(ibv_poll_cq(send_only->qp->recv_cq, 1, &wc) == 0, "the send-only member got a datagram");

    /* Leaving detaches: nothing more arrives, and the QP can go. */
    CHECK(rdma_leave_multicast(member, (struct sockaddr *)&group) == 0, "leave");
    FAILS_WITH(rdma_leave_multicast(member, (struct sockaddr *)&group), -1, EADDRNOTAVAIL);
    post_recv(member, mr, 0);
    CHECK(ibv_post_send(sender->qp, &wr, &bad) == 0, "post_send");
    CHECK(poll_one(sender->qp->send_cq, &wc) == 1 && wc.status == IBV_WC_SUCCESS, "send completion");
    nanosleep(&t, NULL);
    CHECK(ibv_poll_cq(member->qp->recv_cq, 1, &wc) == 0, "a datagram after leaving");
    CHECK(rdma_leave_multicast(send_only, (struct sockaddr *)&group) == 0, "leave send-only");
    ibv_destroy_ah(ah);
    ibv_dereg_mr(mr); ibv_dereg_mr(smr); ibv_dereg_mr(omr);
    rdma_destroy_qp(member);
    rdma_destroy_id(member);
    printf("multicast_cm: ok\n");
    return 0;
}
