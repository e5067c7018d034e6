/*
 * What an application may do to ugdr without harming the process (tests/trust.rs runs each
 * scenario with libugdr.so preloaded; prints "<scenario>: N checks ok" and exits 0, or names
 * the failing check and exits 1):
 *   counts         SGE/buffer counts far above the QP's or SRQ's limit, with a one-entry list
 *                  in front of an unmapped page: EINVAL (ENOSPC for the ibv_wr_* builders)
 *                  before any entry past the limit is read
 *   cancel         pthread_cancel of threads blocked in ibv_get_cq_event, ibv_get_async_event
 *                  and rdma_get_cm_event: each thread ends (cleanup handlers run), the process
 *                  lives, and the channel, CQ, context and CM channel still work and destroy
 *   cancel_pending a thread whose cancel is pending calls into ugdr (which writes its log, a
 *                  cancellation point): the call completes, the thread is cancelled after it
 *   reg_mr         EFAULT for unmapped, PROT_NONE, read-only-with-write-access and
 *                  straddling ranges; read-only memory registers without write access
 *   local_remap    MRs whose range is unmapped, remapped (munmap, mmap MAP_FIXED, mremap,
 *                  madvise DONTNEED, shmdt) or made read-only (mprotect): a local SEND from
 *                  one is LOC_PROT_ERR, an RDMA WRITE to one is REM_ACCESS_ERR, and the new
 *                  mapping's bytes never change
 *   ucm            local_remap with UCX's own memory hooks installed: both see every unmap
 *   remap_target PORT / remap_requester PORT
 *                  the same across two processes: the target registers, the requester WRITEs
 *                  once (it lands), the target munmaps and maps new memory at the address, the
 *                  requester WRITEs again (REM_ACCESS_ERR), the target checks its new bytes
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <rdma/rdma_cma.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/shm.h>
#include <sys/socket.h>
#include <time.h>
#include <ucm/api/ucm.h>
#include <unistd.h>

#include "checks.h"

static long page;

/* ---------------------------------------------------------------- a loopback pair */

struct dev {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	uint16_t lid;
};

static struct dev open_dev(struct ibv_comp_channel **channel)
{
	struct dev d;
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	CHECK(list && n >= 1 && !strcmp(ibv_get_device_name(list[0]), "ugdr0"), "ugdr0");
	d.ctx = ibv_open_device(list[0]);
	ibv_free_device_list(list);
	CHECK(d.ctx != NULL, "open");
	struct ibv_port_attr port;
	CHECK(ibv_query_port(d.ctx, 1, &port) == 0, "query_port");
	d.lid = port.lid;
	CHECK((d.pd = ibv_alloc_pd(d.ctx)) != NULL, "alloc_pd");
	struct ibv_comp_channel *ch = NULL;
	if (channel) {
		CHECK((ch = ibv_create_comp_channel(d.ctx)) != NULL, "comp channel");
		*channel = ch;
	}
	CHECK((d.cq = ibv_create_cq(d.ctx, 64, NULL, ch, 0)) != NULL, "create_cq");
	return d;
}

static struct ibv_qp *new_qp(struct dev *d, uint32_t max_sge)
{
	struct ibv_qp_init_attr init = {.send_cq = d->cq, .recv_cq = d->cq, .qp_type = IBV_QPT_RC,
					.cap = {.max_send_wr = 16, .max_recv_wr = 16,
						.max_send_sge = max_sge, .max_recv_sge = max_sge}};
	struct ibv_qp *qp = ibv_create_qp(d->pd, &init);
	CHECK(qp != NULL, "create_qp");
	return qp;
}

static void to_init(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1,
				.qp_access_flags = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ};
	CHECK(ibv_modify_qp(qp, &a,
			    IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0,
	      "INIT");
}

static void to_rtr(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn)
{
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTR, .path_mtu = IBV_MTU_1024,
				.dest_qp_num = dqpn, .max_dest_rd_atomic = 1, .min_rnr_timer = 12,
				.ah_attr = {.dlid = dlid, .port_num = 1}};
	CHECK(ibv_modify_qp(qp, &a,
			    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				    IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) == 0,
	      "RTR");
}

static void to_rts(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_RTS, .timeout = 14, .retry_cnt = 7,
				.rnr_retry = 7, .max_rd_atomic = 1};
	CHECK(ibv_modify_qp(qp, &a,
			    IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				    IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0,
	      "RTS");
}

static void connect_qp(struct ibv_qp *qp, uint16_t dlid, uint32_t dqpn)
{
	to_init(qp);
	to_rtr(qp, dlid, dqpn);
	to_rts(qp);
}

/* Connects two QPs of one device to each other. */
static void connect_pair(struct dev *d, struct ibv_qp *a, struct ibv_qp *b)
{
	connect_qp(a, d->lid, b->qp_num);
	connect_qp(b, d->lid, a->qp_num);
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The next completion of `cq` (10 s at most). */
static struct ibv_wc next_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	double until = now_s() + 10;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		CHECK(now_s() < until, "no completion in 10 s");
	CHECK(n == 1, "poll_cq returned %d", n);
	return wc;
}

static void expect_wc(struct ibv_cq *cq, uint64_t wr_id, enum ibv_wc_status status,
		      enum ibv_wc_opcode opcode, uint32_t qp_num)
{
	struct ibv_wc wc = next_wc(cq);
	CHECK(wc.wr_id == wr_id && wc.status == status && wc.qp_num == qp_num &&
		      (status != IBV_WC_SUCCESS || wc.opcode == opcode),
	      "got {wr_id %llu status %s opcode %d qp %#x}, expected {%llu %s %d %#x}",
	      (unsigned long long)wc.wr_id, ibv_wc_status_str(wc.status), wc.opcode, wc.qp_num,
	      (unsigned long long)wr_id, ibv_wc_status_str(status), opcode, qp_num);
}

static int post_rdma(struct ibv_qp *qp, uint64_t wr_id, enum ibv_wr_opcode op, struct ibv_sge *sge,
		     uint64_t raddr, uint32_t rkey)
{
	struct ibv_send_wr wr = {.wr_id = wr_id, .sg_list = sge, .num_sge = 1, .opcode = op,
				 .send_flags = IBV_SEND_SIGNALED},
			   *bad = NULL;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	return ibv_post_send(qp, &wr, &bad);
}

/* Two successful completions, in either order. */
static void expect_two(struct ibv_cq *cq, uint64_t id1, enum ibv_wc_opcode op1, uint32_t qp1,
		       uint64_t id2, enum ibv_wc_opcode op2, uint32_t qp2)
{
	int seen1 = 0, seen2 = 0;
	for (int i = 0; i < 2; i++) {
		struct ibv_wc wc = next_wc(cq);
		CHECK(wc.status == IBV_WC_SUCCESS, "wr_id %llu: %s", (unsigned long long)wc.wr_id,
		      ibv_wc_status_str(wc.status));
		if (wc.wr_id == id1 && wc.opcode == op1 && wc.qp_num == qp1)
			seen1++;
		else if (wc.wr_id == id2 && wc.opcode == op2 && wc.qp_num == qp2)
			seen2++;
		else
			CHECK(0, "unexpected completion wr_id %llu opcode %d qp %#x",
			      (unsigned long long)wc.wr_id, wc.opcode, wc.qp_num);
	}
	CHECK(seen1 == 1 && seen2 == 1, "completions %d %d", seen1, seen2);
}

/* An anonymous mapping of `pages` pages followed by one PROT_NONE page. */
static uint8_t *guarded(long pages)
{
	uint8_t *p = mmap(NULL, (pages + 1) * page, PROT_READ | PROT_WRITE,
			  MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(p != MAP_FAILED, "mmap");
	CHECK(mprotect(p + pages * page, page, PROT_NONE) == 0, "guard page");
	return p;
}

/* ---------------------------------------------------------------- counts */

static void counts(void)
{
	struct dev d = open_dev(NULL);
	struct ibv_qp *a = new_qp(&d, 2), *b = new_qp(&d, 2);
	connect_pair(&d, a, b);
	uint8_t *buf = calloc(1, 4096);
	struct ibv_mr *mr = ibv_reg_mr(d.pd, buf, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "reg_mr");

	/* One SGE, the last thing before an unmapped page: reading a second one faults. */
	uint8_t *g = guarded(1);
	struct ibv_sge *one = (struct ibv_sge *)(g + page) - 1;
	*one = (struct ibv_sge){(uintptr_t)buf, 8, mr->lkey};
	int huge = 1 << 20;

	struct ibv_recv_wr r1 = {.wr_id = 1, .sg_list = one, .num_sge = 1};
	struct ibv_recv_wr r0 = {.wr_id = 2, .next = &r1, .sg_list = one, .num_sge = huge};
	struct ibv_recv_wr *bad_r = NULL;
	CHECK(ibv_post_recv(b, &r0, &bad_r) == EINVAL && bad_r == &r0, "post_recv, huge num_sge");
	r0.num_sge = 3; /* just above max_recv_sge */
	bad_r = NULL;
	CHECK(ibv_post_recv(b, &r0, &bad_r) == EINVAL && bad_r == &r0, "post_recv, 3 > max 2");
	r0.num_sge = -1;
	bad_r = NULL;
	CHECK(ibv_post_recv(b, &r0, &bad_r) == EINVAL && bad_r == &r0, "post_recv, negative");
	/* The first WR of a list is posted, the second refused: bad_wr names the second. */
	r0.num_sge = 1;
	r1.num_sge = huge;
	bad_r = NULL;
	CHECK(ibv_post_recv(b, &r0, &bad_r) == EINVAL && bad_r == &r1, "post_recv list");

	struct ibv_send_wr s1 = {.wr_id = 4, .sg_list = one, .num_sge = huge, .opcode = IBV_WR_SEND,
				 .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr s0 = {.wr_id = 3, .next = &s1, .sg_list = one, .num_sge = 1,
				 .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED};
	struct ibv_send_wr *bad_s = NULL;
	CHECK(ibv_post_send(a, &s0, &bad_s) == EINVAL && bad_s == &s1, "post_send list");
	s0.num_sge = huge;
	s0.send_flags |= IBV_SEND_INLINE;
	bad_s = NULL;
	CHECK(ibv_post_send(a, &s0, &bad_s) == EINVAL && bad_s == &s0, "inline post_send");
	/* What was posted before the refused WRs went through. */
	expect_two(d.cq, 2, IBV_WC_RECV, b->qp_num, 3, IBV_WC_SEND, a->qp_num);

	/* An SRQ's limit. */
	struct ibv_srq_init_attr sattr = {.attr = {.max_wr = 4, .max_sge = 2}};
	struct ibv_srq *srq = ibv_create_srq(d.pd, &sattr);
	CHECK(srq != NULL, "create_srq");
	r0.num_sge = huge;
	bad_r = NULL;
	CHECK(ibv_post_srq_recv(srq, &r0, &bad_r) == EINVAL && bad_r == &r0, "post_srq_recv");
	r0.num_sge = 1;
	r0.next = NULL;
	CHECK(ibv_post_srq_recv(srq, &r0, &bad_r) == 0, "post_srq_recv within the limit");

	/* The ibv_wr_* builders: ENOSPC at ibv_wr_complete, as rxe. */
	struct ibv_qp_init_attr_ex xattr = {
		.send_cq = d.cq, .recv_cq = d.cq, .qp_type = IBV_QPT_RC,
		.cap = {.max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2},
		.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS, .pd = d.pd,
		.send_ops_flags = IBV_QP_EX_WITH_SEND};
	struct ibv_qp *c = ibv_create_qp_ex(d.ctx, &xattr), *e = new_qp(&d, 2);
	CHECK(c != NULL, "create_qp_ex");
	CHECK(xattr.cap.max_inline_data == 64, "granted max_inline_data %u", xattr.cap.max_inline_data);
	connect_pair(&d, c, e);
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(c);
	ibv_wr_start(x);
	x->wr_id = 5;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge_list(x, (size_t)1 << 40, one);
	CHECK(ibv_wr_complete(x) == ENOSPC, "wr_set_sge_list, huge count");
	uint8_t *g2 = guarded(1);
	struct ibv_data_buf *db = (struct ibv_data_buf *)(g2 + page) - 1;
	*db = (struct ibv_data_buf){buf, 8};
	ibv_wr_start(x);
	ibv_wr_send(x);
	ibv_wr_set_inline_data_list(x, (size_t)1 << 40, db);
	CHECK(ibv_wr_complete(x) == ENOSPC, "wr_set_inline_data_list, huge count");
	db->length = 100; /* above max_inline_data: the second buffer is never read */
	ibv_wr_start(x);
	ibv_wr_send(x);
	ibv_wr_set_inline_data_list(x, 2, db);
	CHECK(ibv_wr_complete(x) == ENOSPC, "wr_set_inline_data_list, too many bytes");
	/* The QP still posts. */
	struct ibv_recv_wr er = {.wr_id = 6, .sg_list = one, .num_sge = 1};
	CHECK(ibv_post_recv(e, &er, &bad_r) == 0, "post_recv");
	memcpy(buf, "countsok", 8);
	ibv_wr_start(x);
	x->wr_id = 7;
	x->wr_flags = IBV_SEND_SIGNALED;
	ibv_wr_send(x);
	ibv_wr_set_sge_list(x, 1, one);
	CHECK(ibv_wr_complete(x) == 0, "a valid batch");
	expect_two(d.cq, 6, IBV_WC_RECV, e->qp_num, 7, IBV_WC_SEND, c->qp_num);

	CHECK(ibv_destroy_srq(srq) == 0, "destroy_srq");
	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_qp(c) == 0 &&
		      ibv_destroy_qp(e) == 0,
	      "destroy_qp");
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(d.cq) == 0 && ibv_dealloc_pd(d.pd) == 0 &&
		      ibv_close_device(d.ctx) == 0,
	      "teardown");
}

/* ---------------------------------------------------------------- cancel */

static volatile int cleaned_up[3];

static void mark(void *flag)
{
	*(volatile int *)flag = 1;
}

static void *cq_waiter(void *arg)
{
	struct ibv_cq *cq;
	void *cq_ctx;
	pthread_cleanup_push(mark, (void *)&cleaned_up[0]);
	ibv_get_cq_event(arg, &cq, &cq_ctx);
	pthread_cleanup_pop(0);
	return (void *)"returned";
}

static void *async_waiter(void *arg)
{
	struct ibv_async_event ev;
	pthread_cleanup_push(mark, (void *)&cleaned_up[1]);
	ibv_get_async_event(arg, &ev);
	pthread_cleanup_pop(0);
	return (void *)"returned";
}

static void *cm_waiter(void *arg)
{
	struct rdma_cm_event *ev;
	pthread_cleanup_push(mark, (void *)&cleaned_up[2]);
	rdma_get_cm_event(arg, &ev);
	pthread_cleanup_pop(0);
	return (void *)"returned";
}

/* Cancels a thread blocked in `fn(arg)`: it must end as cancelled, its cleanup handler run. */
static void cancel_blocked(void *(*fn)(void *), void *arg, int which)
{
	pthread_t t;
	CHECK(pthread_create(&t, NULL, fn, arg) == 0, "pthread_create");
	nanosleep(&(struct timespec){0, 300 * 1000 * 1000}, NULL); /* let it block */
	CHECK(pthread_cancel(t) == 0, "pthread_cancel");
	struct timespec until;
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += 10;
	void *ret = NULL;
	CHECK(pthread_timedjoin_np(t, &ret, &until) == 0, "thread %d still blocked", which);
	CHECK(ret == PTHREAD_CANCELED, "thread %d was not cancelled: %s", which, (char *)ret);
	CHECK(cleaned_up[which] == 1, "cleanup handler %d ran", which);
}

static void cancel(void)
{
	struct ibv_comp_channel *ch;
	struct dev d = open_dev(&ch);
	struct rdma_event_channel *cm = rdma_create_event_channel();
	CHECK(cm != NULL, "rdma_create_event_channel");
	CHECK(ibv_req_notify_cq(d.cq, 0) == 0, "req_notify_cq");
	cancel_blocked(cq_waiter, ch, 0);
	cancel_blocked(async_waiter, d.ctx, 1);
	cancel_blocked(cm_waiter, cm, 2);

	/* The completion channel and CQ still deliver an event. */
	struct ibv_qp *a = new_qp(&d, 1), *b = new_qp(&d, 1);
	connect_pair(&d, a, b);
	uint8_t *buf = calloc(1, 64);
	struct ibv_mr *mr = ibv_reg_mr(d.pd, buf, 64, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "reg_mr");
	struct ibv_sge sge = {(uintptr_t)buf, 8, mr->lkey};
	struct ibv_recv_wr rwr = {.wr_id = 1, .sg_list = &sge, .num_sge = 1}, *bad_r;
	struct ibv_send_wr swr = {.wr_id = 2, .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_SEND,
				  .send_flags = IBV_SEND_SIGNALED},
			   *bad_s;
	CHECK(ibv_post_recv(b, &rwr, &bad_r) == 0 && ibv_post_send(a, &swr, &bad_s) == 0, "post");
	struct ibv_cq *ev_cq = NULL;
	void *ev_ctx;
	CHECK(ibv_get_cq_event(ch, &ev_cq, &ev_ctx) == 0 && ev_cq == d.cq, "CQ event after cancel");
	ibv_ack_cq_events(d.cq, 1);
	expect_two(d.cq, 1, IBV_WC_RECV, b->qp_num, 2, IBV_WC_SEND, a->qp_num);

	/* The context still delivers an async event: COMM_EST, a message to a QP in RTR. */
	struct ibv_qp *e = new_qp(&d, 1), *f = new_qp(&d, 1);
	connect_qp(e, d.lid, f->qp_num);
	to_init(f);
	to_rtr(f, d.lid, e->qp_num);
	rwr.wr_id = 3;
	swr.wr_id = 4;
	CHECK(ibv_post_recv(f, &rwr, &bad_r) == 0 && ibv_post_send(e, &swr, &bad_s) == 0, "post");
	struct ibv_async_event aev;
	CHECK(ibv_get_async_event(d.ctx, &aev) == 0, "async event after cancel");
	CHECK(aev.event_type == IBV_EVENT_COMM_EST && aev.element.qp == f, "COMM_EST, got %d",
	      aev.event_type);
	ibv_ack_async_event(&aev);
	expect_two(d.cq, 3, IBV_WC_RECV, f->qp_num, 4, IBV_WC_SEND, e->qp_num);

	/* The CM channel still delivers an event. */
	struct rdma_cm_id *listener, *client;
	struct sockaddr_in sin = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	CHECK(rdma_create_id(cm, &listener, NULL, RDMA_PS_TCP) == 0, "create listener");
	CHECK(rdma_bind_addr(listener, (struct sockaddr *)&sin) == 0 && rdma_listen(listener, 1) == 0,
	      "listen");
	sin.sin_port = rdma_get_src_port(listener);
	CHECK(rdma_create_id(cm, &client, NULL, RDMA_PS_TCP) == 0, "create client");
	CHECK(rdma_resolve_addr(client, NULL, (struct sockaddr *)&sin, 2000) == 0, "resolve_addr");
	struct rdma_cm_event *cev;
	CHECK(rdma_get_cm_event(cm, &cev) == 0, "CM event after cancel");
	CHECK(cev->event == RDMA_CM_EVENT_ADDR_RESOLVED && cev->id == client, "ADDR_RESOLVED, got %s",
	      rdma_event_str(cev->event));
	CHECK(rdma_ack_cm_event(cev) == 0, "ack");
	CHECK(rdma_destroy_id(client) == 0 && rdma_destroy_id(listener) == 0, "destroy ids");
	rdma_destroy_event_channel(cm);

	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_qp(e) == 0 &&
		      ibv_destroy_qp(f) == 0,
	      "destroy_qp");
	CHECK(ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(d.cq) == 0 && ibv_destroy_comp_channel(ch) == 0 &&
		      ibv_dealloc_pd(d.pd) == 0 && ibv_close_device(d.ctx) == 0,
	      "teardown");
}

/* ---------------------------------------------------------------- cancel_pending */

static volatile int go, survived;

static void *pending_caller(void *arg)
{
	while (!go)
		; /* no cancellation point here: the cancel stays pending */
	struct ibv_recv_wr wr = {.wr_id = 9, .num_sge = -1}, *bad = NULL;
	/* Refused; with UGDR_LOG=debug ugdr writes why to stderr: a cancellation point. */
	survived = ibv_post_recv(arg, &wr, &bad) == EINVAL && bad == &wr;
	pthread_testcancel();
	survived = 2;
	return NULL;
}

static void cancel_pending(void)
{
	struct dev d = open_dev(NULL);
	struct ibv_qp *qp = new_qp(&d, 1);
	to_init(qp);
	pthread_t t;
	CHECK(pthread_create(&t, NULL, pending_caller, qp) == 0, "pthread_create");
	CHECK(pthread_cancel(t) == 0, "pthread_cancel");
	go = 1;
	void *ret = NULL;
	CHECK(pthread_join(t, &ret) == 0 && ret == PTHREAD_CANCELED, "cancelled");
	CHECK(survived == 1, "the call inside ugdr completed before the cancel acted (%d)", survived);
	CHECK(ibv_destroy_qp(qp) == 0 && ibv_destroy_cq(d.cq) == 0 && ibv_dealloc_pd(d.pd) == 0 &&
		      ibv_close_device(d.ctx) == 0,
	      "teardown");
}

/* ---------------------------------------------------------------- reg_mr */

static void reg_mr(void)
{
	struct dev d = open_dev(NULL);
	const int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;

	/* Unmapped. */
	uint8_t *gone = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(gone != MAP_FAILED && munmap(gone, 2 * page) == 0, "mmap/munmap");
	NULL_WITH(ibv_reg_mr(d.pd, gone, 64, rw), EFAULT);
	NULL_WITH(ibv_reg_mr(d.pd, gone, 64, 0), EFAULT);
	NULL_WITH(ibv_reg_mr_iova(d.pd, gone, 64, 0x1000, IBV_ACCESS_LOCAL_WRITE), EFAULT);
	NULL_WITH(ibv_reg_mr_iova2(d.pd, gone, 64, 0x1000, IBV_ACCESS_LOCAL_WRITE), EFAULT);

	/* PROT_NONE: not even readable. */
	uint8_t *none = mmap(NULL, page, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(none != MAP_FAILED, "mmap");
	NULL_WITH(ibv_reg_mr(d.pd, none, page, IBV_ACCESS_REMOTE_READ), EFAULT);

	/* Read-only: every flag that lets anyone write needs writable memory (the kernel's
	 * ib_access_writable); reading alone does not. */
	uint8_t *ro = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(ro != MAP_FAILED, "mmap");
	memset(ro, 0x77, 2 * page);
	CHECK(mprotect(ro, 2 * page, PROT_READ) == 0, "mprotect");
	NULL_WITH(ibv_reg_mr(d.pd, ro, page, IBV_ACCESS_LOCAL_WRITE), EFAULT);
	NULL_WITH(ibv_reg_mr(d.pd, ro, page, rw), EFAULT);
	NULL_WITH(ibv_reg_mr(d.pd, ro, page, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC), EFAULT);
	NULL_WITH(ibv_reg_mr(d.pd, ro, page, IBV_ACCESS_MW_BIND), EFAULT);
	NULL_WITH(ibv_reg_mr_iova2(d.pd, ro, page, 0, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_RELAXED_ORDERING),
		  EFAULT);
	struct ibv_mr *ro_mr = ibv_reg_mr(d.pd, ro, 2 * page, IBV_ACCESS_REMOTE_READ);
	CHECK(ro_mr != NULL, "read-only memory registers for remote reads");
	struct ibv_mr *ro_local = ibv_reg_mr(d.pd, ro, page, 0);
	CHECK(ro_local != NULL, "read-only memory registers for local reads");

	/* Straddling the end of a mapping. */
	uint8_t *two = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(two != MAP_FAILED && munmap(two + page, page) == 0, "mmap/munmap");
	NULL_WITH(ibv_reg_mr(d.pd, two, page + 1, IBV_ACCESS_LOCAL_WRITE), EFAULT);
	NULL_WITH(ibv_reg_mr(d.pd, two + page - 8, 16, 0), EFAULT);
	struct ibv_mr *fits = ibv_reg_mr(d.pd, two, page, IBV_ACCESS_LOCAL_WRITE);
	CHECK(fits != NULL, "the mapped page registers");

	/* The argument checks still come first (EINVAL). */
	NULL_WITH(ibv_reg_mr(d.pd, gone, 0, 0), EINVAL);
	NULL_WITH(ibv_reg_mr(d.pd, gone, 64, IBV_ACCESS_REMOTE_WRITE), EINVAL);

	/* The read-only MR works: an RDMA READ from it returns its bytes. */
	struct ibv_qp *a = new_qp(&d, 1), *b = new_qp(&d, 1);
	connect_pair(&d, a, b);
	struct ibv_sge sge = {(uintptr_t)two, 64, fits->lkey};
	CHECK(post_rdma(a, 1, IBV_WR_RDMA_READ, &sge, (uintptr_t)ro + page, ro_mr->rkey) == 0, "read");
	expect_wc(d.cq, 1, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, a->qp_num);
	CHECK(two[0] == 0x77 && two[63] == 0x77, "bytes read from read-only memory");

	CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
	CHECK(ibv_dereg_mr(ro_mr) == 0 && ibv_dereg_mr(ro_local) == 0 && ibv_dereg_mr(fits) == 0,
	      "dereg");
	CHECK(ibv_destroy_cq(d.cq) == 0 && ibv_dealloc_pd(d.pd) == 0 && ibv_close_device(d.ctx) == 0,
	      "teardown");
}

/* ---------------------------------------------------------------- local_remap, ucm */

enum remap { MUNMAP, MAP_FIXED_OVER, MREMAP_AWAY, MADV_DROP, SHMDT, READ_ONLY, N_REMAPS };
static const char *remap_name[] = {"munmap", "mmap MAP_FIXED", "mremap", "madvise DONTNEED",
				   "shmdt", "mprotect PROT_READ"};

static int shm_id(size_t len)
{
	int id = shmget(IPC_PRIVATE, len, IPC_CREAT | 0600);
	CHECK(id >= 0, "shmget");
	return id;
}

/* 2 pages of memory at a fixed place for `how` (a SysV segment for SHMDT). */
static uint8_t *region_for(enum remap how)
{
	if (how == SHMDT) {
		int id = shm_id(2 * page);
		uint8_t *p = shmat(id, NULL, 0);
		CHECK(p != (void *)-1, "shmat");
		shmctl(id, IPC_RMID, NULL);
		return p;
	}
	uint8_t *p = mmap(NULL, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(p != MAP_FAILED, "mmap");
	CHECK(mprotect(p + 2 * page, page, PROT_READ) == 0, "a neighbour page");
	return p;
}

/* New anonymous memory at `r`, where nothing is mapped now. */
static void map_again(uint8_t *r)
{
	CHECK(mmap(r, 2 * page, PROT_READ | PROT_WRITE,
		   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0) == r,
	      "new mapping at the old address");
}

/* Takes the region's pages away as `how` does and puts new memory, filled with 0x5a, at the
 * same address (or, for READ_ONLY, fills it and takes write access away). */
static void remap(uint8_t *r, enum remap how)
{
	switch (how) {
	case MUNMAP:
		CHECK(munmap(r, 2 * page) == 0, "munmap");
		map_again(r);
		break;
	case MAP_FIXED_OVER:
		CHECK(mmap(r, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
			   -1, 0) == r,
		      "MAP_FIXED over the region");
		break;
	case MREMAP_AWAY: {
		/* Grown while the page after it is taken (region_for keeps a third page there), so
		 * the pages must move. (Not MREMAP_FIXED: UCX 1.13's own mremap hook, which ugdr's
		 * UCX installs, drops that call's fifth argument: openucx/ucx#8820.) */
		uint8_t *moved = mremap(r, 2 * page, 4 * page, MREMAP_MAYMOVE);
		CHECK(moved != MAP_FAILED && moved != r, "mremap away: %p", (void *)moved);
		CHECK(munmap(moved, 4 * page) == 0, "munmap the moved pages");
		map_again(r);
		break;
	}
	case MADV_DROP:
		CHECK(madvise(r, 2 * page, MADV_DONTNEED) == 0, "madvise");
		break;
	case SHMDT: {
		CHECK(shmdt(r) == 0, "shmdt");
		int id = shm_id(2 * page);
		CHECK(shmat(id, r, 0) == r, "a new segment at the old address");
		shmctl(id, IPC_RMID, NULL);
		break;
	}
	case READ_ONLY: /* the same pages, no longer writable: a copy into them would fault */
		memset(r, 0x5a, 2 * page);
		CHECK(mprotect(r, 2 * page, PROT_READ) == 0, "mprotect");
		return;
	default:
		break;
	}
	memset(r, 0x5a, 2 * page);
}

static int all_5a(const uint8_t *r)
{
	for (long i = 0; i < 2 * page; i++)
		if (r[i] != 0x5a)
			return 0;
	return 1;
}

static int unmapped_events; /* ucm's VM_UNMAPPED events that covered the region */
static uint8_t *watched;

static void local_remap(void)
{
	struct dev d = open_dev(NULL);
	const int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	uint8_t *src = calloc(1, 4096);
	struct ibv_mr *src_mr = ibv_reg_mr(d.pd, src, 4096, IBV_ACCESS_LOCAL_WRITE);
	CHECK(src_mr != NULL, "reg_mr");
	const char *only = getenv("UGDR_TEST_ONLY");
	for (enum remap how = 0; how < N_REMAPS; how++) {
		if (only && strcmp(only, remap_name[how]))
			continue;
		uint8_t *r = region_for(how);
		watched = r;
		struct ibv_mr *mr = ibv_reg_mr(d.pd, r, 2 * page, rw);
		CHECK(mr != NULL, "%s: reg_mr", remap_name[how]);
		struct ibv_qp *a = new_qp(&d, 1), *b = new_qp(&d, 1), *c = new_qp(&d, 1),
			      *e = new_qp(&d, 1);
		connect_pair(&d, a, b);
		connect_pair(&d, c, e);
		/* Before: a WRITE lands. */
		memset(src, 0x11, 64);
		struct ibv_sge sge = {(uintptr_t)src, 64, src_mr->lkey};
		CHECK(post_rdma(c, 1, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)r + 8, mr->rkey) == 0, "write");
		expect_wc(d.cq, 1, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, c->qp_num);
		CHECK(r[8] == 0x11 && r[71] == 0x11, "%s: the first write landed", remap_name[how]);
		int before = unmapped_events;

		remap(r, how);

		/* A WRITE to it now: a remote access error, and the new memory keeps its bytes. */
		CHECK(post_rdma(c, 2, IBV_WR_RDMA_WRITE, &sge, (uintptr_t)r + 8, mr->rkey) == 0, "write");
		expect_wc(d.cq, 2, IBV_WC_REM_ACCESS_ERR, IBV_WC_RDMA_WRITE, c->qp_num);
		/* A SEND from it: a local protection error. */
		struct ibv_sge local = {(uintptr_t)r, 64, mr->lkey};
		struct ibv_send_wr swr = {.wr_id = 3, .sg_list = &local, .num_sge = 1,
					  .opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED},
				   *bad;
		CHECK(ibv_post_send(a, &swr, &bad) == 0, "send");
		expect_wc(d.cq, 3, IBV_WC_LOC_PROT_ERR, IBV_WC_SEND, a->qp_num);
		nanosleep(&(struct timespec){0, 50 * 1000 * 1000}, NULL);
		CHECK(all_5a(r), "%s: the new memory changed", remap_name[how]);
		if (getenv("UGDR_TEST_UCM") && how != READ_ONLY) /* nothing is unmapped there */
			CHECK(unmapped_events > before, "%s: ucm's hook did not see it", remap_name[how]);
		struct ibv_wc wc;
		while (ibv_poll_cq(d.cq, 1, &wc) > 0)
			; /* the flushes and the responder's view */
		CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0 && ibv_destroy_qp(c) == 0 &&
			      ibv_destroy_qp(e) == 0,
		      "destroy_qp");
		CHECK(ibv_dereg_mr(mr) == 0, "%s: dereg", remap_name[how]);
		if (how == SHMDT)
			CHECK(shmdt(r) == 0, "shmdt");
		else
			CHECK(munmap(r, 3 * page) == 0, "munmap");
	}
	CHECK(ibv_dereg_mr(src_mr) == 0 && ibv_destroy_cq(d.cq) == 0 && ibv_dealloc_pd(d.pd) == 0 &&
		      ibv_close_device(d.ctx) == 0,
	      "teardown");
}

static void on_unmapped(ucm_event_type_t type, ucm_event_t *ev, void *arg)
{
	(void)type;
	(void)arg;
	uint8_t *a = ev->vm_unmapped.address;
	if (watched && a <= watched && watched < a + ev->vm_unmapped.size)
		unmapped_events++;
}

/* local_remap with UCX's memory hooks installed in the same process (UCX_MEM_MMAP_HOOK_MODE
 * picks how ucm hooks): both ucm and ugdr must see every unmap. */
static void ucm(void)
{
	CHECK(ucm_set_event_handler(UCM_EVENT_VM_UNMAPPED, 0, on_unmapped, NULL) == UCS_OK,
	      "ucm_set_event_handler");
	setenv("UGDR_TEST_UCM", "1", 1);
	local_remap();
}

/* ---------------------------------------------------------------- remap_target, remap_requester */

struct peer_info {
	uint16_t lid;
	uint32_t qpn;
	uint64_t addr;
	uint32_t rkey;
};

static void send_all(int fd, const void *p, size_t n)
{
	CHECK(send(fd, p, n, MSG_NOSIGNAL) == (ssize_t)n, "send");
}

static void recv_all(int fd, void *p, size_t n)
{
	CHECK(recv(fd, p, n, MSG_WAITALL) == (ssize_t)n, "recv");
}

static void say(int fd, char what)
{
	send_all(fd, &what, 1);
}

static void hear(int fd, char what)
{
	char got = 0;
	recv_all(fd, &got, 1);
	CHECK(got == what, "expected '%c', got '%c'", what, got);
}

static void remap_target(int port)
{
	struct dev d = open_dev(NULL);
	struct ibv_qp *qp = new_qp(&d, 1);
	uint8_t *r = region_for(MUNMAP);
	memset(r, 0, 2 * page);
	struct ibv_mr *mr = ibv_reg_mr(d.pd, r, 2 * page,
				       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
	CHECK(mr != NULL, "reg_mr");

	int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(port),
				  .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	CHECK(bind(ls, (struct sockaddr *)&sin, sizeof(sin)) == 0 && listen(ls, 1) == 0, "listen");
	int fd = accept(ls, NULL, NULL);
	CHECK(fd >= 0, "accept");
	struct peer_info mine = {d.lid, qp->qp_num, (uintptr_t)r, mr->rkey}, theirs;
	send_all(fd, &mine, sizeof(mine));
	recv_all(fd, &theirs, sizeof(theirs));
	connect_qp(qp, theirs.lid, theirs.qpn);
	say(fd, 'c');

	hear(fd, '1'); /* the first WRITE completed at the requester */
	CHECK(!memcmp(r + 8, "first write", 11), "the first write landed");
	remap(r, MUNMAP);
	say(fd, 'r');

	hear(fd, '2'); /* the second WRITE failed with REM_ACCESS_ERR at the requester */
	nanosleep(&(struct timespec){0, 100 * 1000 * 1000}, NULL);
	CHECK(all_5a(r), "the new mapping changed");
	/* The responder's QP refused the request: QP_ACCESS_ERR, and it is in ERR. */
	struct ibv_async_event ev;
	CHECK(ibv_get_async_event(d.ctx, &ev) == 0, "async event");
	CHECK(ev.event_type == IBV_EVENT_QP_ACCESS_ERR && ev.element.qp == qp, "QP_ACCESS_ERR, got %d",
	      ev.event_type);
	ibv_ack_async_event(&ev);
	say(fd, 'k');
	close(fd);
	close(ls);
	CHECK(ibv_destroy_qp(qp) == 0 && ibv_dereg_mr(mr) == 0 && munmap(r, 3 * page) == 0, "cleanup");
	CHECK(ibv_destroy_cq(d.cq) == 0 && ibv_dealloc_pd(d.pd) == 0 && ibv_close_device(d.ctx) == 0,
	      "teardown");
}

static void remap_requester(int port)
{
	struct dev d = open_dev(NULL);
	struct ibv_qp *qp = new_qp(&d, 1);
	uint8_t *src = calloc(1, 64);
	struct ibv_mr *mr = ibv_reg_mr(d.pd, src, 64, IBV_ACCESS_LOCAL_WRITE);
	CHECK(mr != NULL, "reg_mr");
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	struct sockaddr_in sin = {.sin_family = AF_INET, .sin_port = htons(port),
				  .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	CHECK(connect(fd, (struct sockaddr *)&sin, sizeof(sin)) == 0, "connect");
	struct peer_info theirs, mine = {d.lid, qp->qp_num, 0, 0};
	recv_all(fd, &theirs, sizeof(theirs));
	send_all(fd, &mine, sizeof(mine));
	connect_qp(qp, theirs.lid, theirs.qpn);
	hear(fd, 'c');

	memcpy(src, "first write", 11);
	struct ibv_sge sge = {(uintptr_t)src, 11, mr->lkey};
	CHECK(post_rdma(qp, 1, IBV_WR_RDMA_WRITE, &sge, theirs.addr + 8, theirs.rkey) == 0, "write");
	expect_wc(d.cq, 1, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE, qp->qp_num);
	say(fd, '1');

	hear(fd, 'r'); /* the target unmapped the region and mapped new memory there */
	memcpy(src, "second writ", 11);
	CHECK(post_rdma(qp, 2, IBV_WR_RDMA_WRITE, &sge, theirs.addr + 8, theirs.rkey) == 0, "write");
	expect_wc(d.cq, 2, IBV_WC_REM_ACCESS_ERR, IBV_WC_RDMA_WRITE, qp->qp_num);
	say(fd, '2');
	hear(fd, 'k');
	close(fd);
	CHECK(ibv_destroy_qp(qp) == 0 && ibv_dereg_mr(mr) == 0 && ibv_destroy_cq(d.cq) == 0 &&
		      ibv_dealloc_pd(d.pd) == 0 && ibv_close_device(d.ctx) == 0,
	      "teardown");
}

int main(int argc, char **argv)
{
	if (argc < 2) {
		fprintf(stderr, "usage: %s SCENARIO [PORT]\n", argv[0]);
		return 2;
	}
	scenario = argv[1];
	page = sysconf(_SC_PAGESIZE);
	if (!strcmp(scenario, "counts"))
		counts();
	else if (!strcmp(scenario, "cancel"))
		cancel();
	else if (!strcmp(scenario, "cancel_pending"))
		cancel_pending();
	else if (!strcmp(scenario, "reg_mr"))
		reg_mr();
	else if (!strcmp(scenario, "local_remap"))
		local_remap();
	else if (!strcmp(scenario, "ucm"))
		ucm();
	else if (!strcmp(scenario, "remap_target") && argc == 3)
		remap_target(atoi(argv[2]));
	else if (!strcmp(scenario, "remap_requester") && argc == 3)
		remap_requester(atoi(argv[2]));
	else {
		fprintf(stderr, "unknown scenario %s\n", scenario);
		return 2;
	}
	printf("%s: %d checks ok\n", scenario, checks);
	return 0;
}
