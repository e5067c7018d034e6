/* The target of tests/auth.rs's stranger: a verbs program (run under ugdr) with two RC QPs
 * of this process connected to each other, an MR that allows remote writes, and one posted
 * receive on QP a.
 *
 *   auth_victim
 *       prints "victim lid 0xLLLL qpn_a 0xQQQQQQ qpn_b 0xQQQQQQ addr 0xAAAA rkey 0xKKKKKKKK",
 *       then waits for a line on stdin (the stranger has sent its messages). For 500 ms it
 *       watches: any completion, a changed byte in the MR or in the receive buffer fails.
 *       Then QP b (the real peer) WRITEs 64 bytes into the MR and SENDs 32 bytes to a: both
 *       must land, the SEND in the receive that was posted first, with every completion
 *       field as expected. Prints "untouched" and "legit ok"; exit 0 only if all hold. */
#include <infiniband/verbs.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(cond, ...) do { if (!(cond)) { printf("FAIL %s:%d: ", __FILE__, __LINE__); \
    printf(__VA_ARGS__); printf("\n"); exit(1); } } while (0)

#define MR_LEN 4096
#define RECV_LEN 256
#define WRITE_LEN 64
#define SEND_LEN 32

static double now_s(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void to_rts(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn)
{
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1,
				 .qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ };
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
			    IBV_QP_ACCESS_FLAGS) == 0, "INIT");
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = dqpn;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = dlid;
	a.ah_attr.port_num = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
	      "RTR: %s", strerror(errno));
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.max_rd_atomic = 1;
	CHECK(ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT |
			    IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0, "RTS");
}

static void all_bytes(const unsigned char *p, size_t n, unsigned char v, const char *what)
{
	for (size_t i = 0; i < n; i++)
		CHECK(p[i] == v, "%s: byte %zu is 0x%02x, not 0x%02x", what, i, p[i], v);
}

int main(void)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n >= 1, "no device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	CHECK(ctx, "open: %s", strerror(errno));
	struct ibv_port_attr port;
	CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	CHECK(pd && cq, "pd/cq");
	struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *a = ibv_create_qp(pd, &init), *b = ibv_create_qp(pd, &init);
	CHECK(a && b, "create_qp: %s", strerror(errno));
	to_rts(a, port.lid, b->qp_num);
	to_rts(b, port.lid, a->qp_num);

	unsigned char *target = aligned_alloc(4096, MR_LEN), *recv = aligned_alloc(4096, 4096);
	unsigned char *src = aligned_alloc(4096, 4096);
	memset(target, 0x5a, MR_LEN);
	memset(recv, 0, RECV_LEN);
	memset(src, 0xa5, WRITE_LEN);
	memcpy(src + WRITE_LEN, "legit SEND from the real peer QP", SEND_LEN);
	struct ibv_mr *tmr = ibv_reg_mr(pd, target, MR_LEN, IBV_ACCESS_LOCAL_WRITE |
					IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ);
	struct ibv_mr *rmr = ibv_reg_mr(pd, recv, RECV_LEN, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_mr *smr = ibv_reg_mr(pd, src, 4096, 0);
	CHECK(tmr && rmr && smr, "reg_mr: %s", strerror(errno));
	struct ibv_sge rs = { (uintptr_t)recv, RECV_LEN, rmr->lkey };
	struct ibv_recv_wr rwr = { .wr_id = 1, .sg_list = &rs, .num_sge = 1 }, *bad_r = NULL;
	CHECK(ibv_post_recv(a, &rwr, &bad_r) == 0, "post_recv");

	printf("victim lid 0x%04x qpn_a 0x%06x qpn_b 0x%06x addr 0x%llx rkey 0x%08x\n", port.lid,
	       a->qp_num, b->qp_num, (unsigned long long)(uintptr_t)target, tmr->rkey);
	fflush(stdout);
	char line[64];
	CHECK(fgets(line, sizeof line, stdin), "no go-ahead on stdin");

	struct ibv_wc wc;
	for (double end = now_s() + 0.5; now_s() < end;) {
		int got = ibv_poll_cq(cq, 1, &wc);
		CHECK(got == 0, "a completion after the stranger: wr_id %llu status %s opcode %d "
		      "byte_len %u", (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status),
		      wc.opcode, wc.byte_len);
		all_bytes(target, MR_LEN, 0x5a, "the MR after the stranger");
		all_bytes(recv, RECV_LEN, 0, "the receive buffer after the stranger");
	}
	printf("untouched\n");
	fflush(stdout);

	/* The real peer: its WRITE and SEND land, the SEND in the receive posted above. */
	struct ibv_sge ws = { (uintptr_t)src, WRITE_LEN, smr->lkey };
	struct ibv_sge ss = { (uintptr_t)src + WRITE_LEN, SEND_LEN, smr->lkey };
	struct ibv_send_wr send = { .wr_id = 3, .sg_list = &ss, .num_sge = 1,
				    .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED };
	struct ibv_send_wr write = { .wr_id = 2, .next = &send, .sg_list = &ws, .num_sge = 1,
				     .opcode = IBV_WR_RDMA_WRITE, .send_flags = IBV_SEND_SIGNALED,
				     .wr = { .rdma = { .remote_addr = (uintptr_t)target,
						       .rkey = tmr->rkey } } };
	struct ibv_send_wr *bad_s = NULL;
	CHECK(ibv_post_send(b, &write, &bad_s) == 0, "post_send");
	int seen = 0;
	for (double end = now_s() + 10; seen != 7 && now_s() < end;) {
		if (ibv_poll_cq(cq, 1, &wc) != 1)
			continue;
		CHECK(wc.status == IBV_WC_SUCCESS, "wr_id %llu: %s", (unsigned long long)wc.wr_id,
		      ibv_wc_status_str(wc.status));
		CHECK(wc.wr_id >= 1 && wc.wr_id <= 3 && !(seen & (1 << (wc.wr_id - 1))),
		      "unexpected wr_id %llu", (unsigned long long)wc.wr_id);
		seen |= 1 << (wc.wr_id - 1);
		if (wc.wr_id == 1) {
			CHECK(wc.opcode == IBV_WC_RECV && wc.byte_len == SEND_LEN && wc.qp_num == a->qp_num &&
			      wc.src_qp == b->qp_num && wc.slid == port.lid && wc.wc_flags == 0,
			      "receive: opcode %d byte_len %u qp 0x%x src_qp 0x%x slid 0x%x flags %d",
			      wc.opcode, wc.byte_len, wc.qp_num, wc.src_qp, wc.slid, wc.wc_flags);
		} else {
			CHECK(wc.qp_num == b->qp_num && wc.opcode == (wc.wr_id == 2 ? IBV_WC_RDMA_WRITE :
								    IBV_WC_SEND),
			      "send completion: qp 0x%x opcode %d", wc.qp_num, wc.opcode);
		}
	}
	CHECK(seen == 7, "the real peer's WRITE and SEND did not complete (seen %d)", seen);
	all_bytes(target, WRITE_LEN, 0xa5, "the MR after the real peer's WRITE");
	all_bytes(target + WRITE_LEN, MR_LEN - WRITE_LEN, 0x5a, "the MR beyond the WRITE");
	CHECK(memcmp(recv, src + WRITE_LEN, SEND_LEN) == 0, "the real peer's SEND data");
	all_bytes(recv + SEND_LEN, RECV_LEN - SEND_LEN, 0, "the receive buffer beyond the SEND");
	printf("legit ok\n");
	return 0;
}
