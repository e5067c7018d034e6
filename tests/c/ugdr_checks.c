/*
 * Checks of the ugdr_* API from C, one scenario per argument (tests/ugdr_api.rs runs each):
 *   devices   prints the device list ("name numa_node gpu,gpu,..." per line)
 *   errors    every error path: NULL and bad arguments, EBUSY, EFAULT, bad_wr, SGE counts
 *             far above the limit (refused before the list is read)
 *   states    the QP state machine (all or nothing) and flush on ERR
 *   loopback  two QPs of this process: SEND with several SGEs, RDMA WRITE/READ, and the
 *             error completions (REM_ACCESS_ERR, LOC_LEN_ERR, LOC_PROT_ERR)
 *   gpu       ugdr_reg_mr on a "device pointer" (UGDR_CUDA_LIBRARY names a stand-in driver)
 * Prints "<scenario>: N checks ok" and exits 0, or names the failing check and exits 1.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <ugdr.h>

/* The header's layout on LP64, as src/capi/ugdr_api.rs asserts it. */
_Static_assert(sizeof(struct ugdr_device) == 136, "ugdr_device");
_Static_assert(sizeof(struct ugdr_addr) == 32, "ugdr_addr");
_Static_assert(sizeof(struct ugdr_mr) == 48 && offsetof(struct ugdr_mr, lkey) == 36, "ugdr_mr");
_Static_assert(sizeof(struct ugdr_qp_init_attr) == 48, "ugdr_qp_init_attr");
_Static_assert(offsetof(struct ugdr_qp_init_attr, qp_type) == 36, "qp_type");
_Static_assert(sizeof(struct ugdr_qp_attr) == 44, "ugdr_qp_attr");
_Static_assert(sizeof(struct ugdr_wc) == 24, "ugdr_wc");
_Static_assert(sizeof(struct ugdr_sge) == 16, "ugdr_sge");
_Static_assert(sizeof(struct ugdr_recv_wr) == 32, "ugdr_recv_wr");
_Static_assert(sizeof(struct ugdr_send_wr) == 56 && offsetof(struct ugdr_send_wr, rdma) == 40,
	       "ugdr_send_wr");

#include "checks.h"

struct res {
	struct ugdr_context *ctx;
	struct ugdr_pd *pd;
	struct ugdr_cq *cq;
	struct ugdr_addr addr;
	uint8_t *buf;
	struct ugdr_mr *mr;
};

static struct res open_res(void)
{
	struct res r;
	int n = 0;
	memset(&r, 0, sizeof(r));
	struct ugdr_device **list = ugdr_get_device_list(&n);
	CHECK(list && n >= 1 && list[n] == NULL, "device list");
	r.ctx = ugdr_open_device(list[0]);
	CHECK(r.ctx, "ugdr_open_device");
	ugdr_free_device_list(list);
	CHECK((r.pd = ugdr_alloc_pd(r.ctx)) != NULL, "alloc_pd");
	CHECK((r.cq = ugdr_create_cq(r.ctx, 256)) != NULL, "create_cq");
	CHECK(ugdr_query_addr(r.ctx, &r.addr) == 0, "query_addr");
	r.buf = aligned_alloc(4096, 65536);
	memset(r.buf, 0, 65536);
	r.mr = ugdr_reg_mr(r.pd, r.buf, 65536,
			   UGDR_ACCESS_LOCAL_WRITE | UGDR_ACCESS_REMOTE_WRITE | UGDR_ACCESS_REMOTE_READ);
	CHECK(r.mr && r.mr->addr == r.buf && r.mr->length == 65536 && r.mr->pd == r.pd &&
		      r.mr->context == r.ctx && r.mr->lkey != 0 && r.mr->rkey != 0,
	      "reg_mr and its public fields");
	return r;
}

static struct ugdr_qp *new_qp(struct res *r, uint32_t depth, uint32_t max_sge)
{
	struct ugdr_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = r->cq;
	a.recv_cq = r->cq;
	a.max_send_wr = depth;
	a.max_recv_wr = depth;
	a.max_sge = max_sge;
	a.qp_type = UGDR_QPT_RC;
	struct ugdr_qp *qp = ugdr_create_qp(r->pd, &a);
	CHECK(qp != NULL, "create_qp");
	CHECK(a.max_send_wr >= depth && a.max_recv_wr >= depth && a.max_sge >= max_sge,
	      "granted caps written back");
	return qp;
}

static int modify(struct ugdr_qp *qp, enum ugdr_qp_state to, int mask, uint32_t dqpn,
		  const struct ugdr_addr *daddr)
{
	struct ugdr_qp_attr a;
	memset(&a, 0, sizeof(a));
	a.qp_state = to;
	a.dest_qp_num = dqpn;
	if (daddr)
		a.dest_addr = *daddr;
	return ugdr_modify_qp(qp, &a, mask);
}

static void connect_qp(struct res *r, struct ugdr_qp *qp, uint32_t peer)
{
	CHECK(modify(qp, UGDR_QPS_INIT, UGDR_QP_STATE, 0, NULL) == 0, "to INIT");
	CHECK(modify(qp, UGDR_QPS_RTR, UGDR_QP_STATE | UGDR_QP_DEST_QPN | UGDR_QP_DEST_ADDR, peer,
		     &r->addr) == 0,
	      "to RTR");
	CHECK(modify(qp, UGDR_QPS_RTS, UGDR_QP_STATE, 0, NULL) == 0, "to RTS");
}

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* The next completion (10 s at most), checked field by field. */
static void expect(struct ugdr_cq *cq, uint64_t wr_id, enum ugdr_wc_status status,
		   enum ugdr_wc_opcode opcode, uint32_t byte_len, uint32_t qpn)
{
	struct ugdr_wc wc;
	double until = now_s() + 10;
	int n;
	memset(&wc, 0xa5, sizeof(wc));
	while ((n = ugdr_poll_cq(cq, 1, &wc)) == 0)
		CHECK(now_s() < until, "no completion for wr_id %llu", (unsigned long long)wr_id);
	CHECK(n == 1, "poll returned %d", n);
	CHECK(wc.wr_id == wr_id && wc.status == status && wc.opcode == opcode &&
		      wc.byte_len == byte_len && wc.qp_num == qpn,
	      "got {wr_id %llu status %d opcode %d byte_len %u qp_num %#x}, expected "
	      "{%llu %d %d %u %#x}",
	      (unsigned long long)wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num,
	      (unsigned long long)wr_id, status, opcode, byte_len, qpn);
}

static void expect_none(struct ugdr_cq *cq)
{
	struct ugdr_wc wc;
	for (int i = 0; i < 200; i++) {
		CHECK(ugdr_poll_cq(cq, 1, &wc) == 0, "unexpected completion wr_id %llu status %d",
		      (unsigned long long)wc.wr_id, wc.status);
		nanosleep(&(struct timespec){0, 1000000}, NULL);
	}
}

static int post_recv(struct ugdr_qp *qp, uint64_t wr_id, struct ugdr_sge *sge, int n)
{
	struct ugdr_recv_wr wr = {.wr_id = wr_id, .sg_list = sge, .num_sge = n}, *bad = NULL;
	return ugdr_post_recv(qp, &wr, &bad);
}

static int post_send(struct ugdr_qp *qp, uint64_t wr_id, enum ugdr_wr_opcode op,
		     struct ugdr_sge *sge, int n, uint64_t raddr, uint32_t rkey)
{
	struct ugdr_send_wr wr = {.wr_id = wr_id, .sg_list = sge, .num_sge = n, .opcode = op,
				  .send_flags = UGDR_SEND_SIGNALED},
			    *bad = NULL;
	wr.rdma.remote_addr = raddr;
	wr.rdma.rkey = rkey;
	return ugdr_post_send(qp, &wr, &bad);
}

/* ---------------------------------------------------------------- scenarios */

static void devices(void)
{
	int n = -1;
	struct ugdr_device **list = ugdr_get_device_list(&n);
	CHECK(list != NULL, "ugdr_get_device_list");
	printf("%d devices\n", n);
	for (int i = 0; i < n; i++) {
		struct ugdr_device *d = list[i];
		CHECK(d != NULL && d->num_gpu >= 0 && d->num_gpu <= UGDR_MAX_GPUS_PER_DEV, "device");
		printf("%s %d ", d->name, d->numa_node);
		for (int g = 0; g < d->num_gpu; g++)
			printf("%s%d", g ? "," : "", d->gpus[g]);
		printf("%s\n", d->num_gpu ? "" : "-");
	}
	CHECK(list[n] == NULL, "NULL-terminated");
	/* Every listed device opens; a copy of one does too (it is named, not registered). */
	for (int i = 0; i < n; i++) {
		struct ugdr_device copy = *list[i];
		struct ugdr_context *c = ugdr_open_device(&copy);
		CHECK(c != NULL, "open %s", copy.name);
		CHECK(ugdr_close_device(c) == 0, "close");
	}
	ugdr_free_device_list(list);
	CHECK(ugdr_get_device_list(NULL) != NULL, "num_devices is optional");
}

static void errors(void)
{
	struct res r = open_res();
	struct ugdr_device bogus;
	memset(&bogus, 0, sizeof(bogus));
	strcpy(bogus.name, "ugdr999");
	NULL_WITH(ugdr_open_device(&bogus), ENODEV);
	NULL_WITH(ugdr_open_device(NULL), EINVAL);
	memset(bogus.name, 'x', sizeof(bogus.name));
	NULL_WITH(ugdr_open_device(&bogus), EINVAL); /* name not terminated */
	FAILS_WITH(ugdr_close_device(NULL), EINVAL);
	FAILS_WITH(ugdr_query_addr(NULL, &r.addr), EINVAL);
	FAILS_WITH(ugdr_query_addr(r.ctx, NULL), EINVAL);
	NULL_WITH(ugdr_alloc_pd(NULL), EINVAL);
	FAILS_WITH(ugdr_dealloc_pd(NULL), EINVAL);

	/* ugdr_reg_mr */
	NULL_WITH(ugdr_reg_mr(NULL, r.buf, 64, 0), EINVAL);
	NULL_WITH(ugdr_reg_mr(r.pd, NULL, 64, 0), EINVAL);
	NULL_WITH(ugdr_reg_mr(r.pd, r.buf, 0, 0), EINVAL);
	NULL_WITH(ugdr_reg_mr(r.pd, r.buf, 64, 1 << 3), EINVAL);  /* no remote atomics */
	NULL_WITH(ugdr_reg_mr(r.pd, r.buf, 64, -1), EINVAL);
	NULL_WITH(ugdr_reg_mr(r.pd, r.buf, 64, UGDR_ACCESS_REMOTE_WRITE), EINVAL); /* no LOCAL_WRITE */
	long page = sysconf(_SC_PAGESIZE);
	uint8_t *gone = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(gone != MAP_FAILED, "mmap");
	CHECK(munmap(gone, 2 * page) == 0, "munmap");
	NULL_WITH(ugdr_reg_mr(r.pd, gone, 64, 0), EFAULT); /* unmapped */
	uint8_t *ro = mmap(NULL, 2 * page, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(ro != MAP_FAILED, "mmap");
	NULL_WITH(ugdr_reg_mr(r.pd, ro, page, UGDR_ACCESS_LOCAL_WRITE), EFAULT); /* read-only */
	struct ugdr_mr *ro_mr = ugdr_reg_mr(r.pd, ro, page, UGDR_ACCESS_REMOTE_READ);
	CHECK(ro_mr != NULL, "read-only memory registers for reading");
	CHECK(mprotect(ro + page, page, PROT_NONE) == 0, "mprotect");
	NULL_WITH(ugdr_reg_mr(r.pd, ro, 2 * page, 0), EFAULT); /* runs into PROT_NONE */
	NULL_WITH(ugdr_reg_mr(r.pd, r.buf + 65536 - 8, (size_t)1 << 40, 0), EFAULT); /* runs off */
	FAILS_WITH(ugdr_dereg_mr(NULL), EINVAL);

	/* CQs */
	NULL_WITH(ugdr_create_cq(NULL, 16), EINVAL);
	NULL_WITH(ugdr_create_cq(r.ctx, 0), EINVAL);
	NULL_WITH(ugdr_create_cq(r.ctx, -5), EINVAL);
	FAILS_WITH(ugdr_destroy_cq(NULL), EINVAL);
	struct ugdr_wc wc[2];
	errno = 0;
	CHECK(ugdr_poll_cq(NULL, 1, wc) < 0 && errno == EINVAL, "poll NULL cq");
	errno = 0;
	CHECK(ugdr_poll_cq(r.cq, -1, wc) < 0 && errno == EINVAL, "poll negative count");
	errno = 0;
	CHECK(ugdr_poll_cq(r.cq, 1, NULL) < 0 && errno == EINVAL, "poll NULL array");
	CHECK(ugdr_poll_cq(r.cq, 0, NULL) == 0, "poll of nothing");

	/* QPs */
	struct ugdr_qp_init_attr a;
	memset(&a, 0, sizeof(a));
	a.send_cq = r.cq;
	a.recv_cq = r.cq;
	a.max_send_wr = 4;
	a.max_recv_wr = 4;
	a.max_sge = 1;
	NULL_WITH(ugdr_create_qp(NULL, &a), EINVAL);
	NULL_WITH(ugdr_create_qp(r.pd, NULL), EINVAL);
	a.qp_type = 1;
	NULL_WITH(ugdr_create_qp(r.pd, &a), EINVAL);
	a.qp_type = UGDR_QPT_RC;
	a.max_sge = 33;
	NULL_WITH(ugdr_create_qp(r.pd, &a), EINVAL);
	a.max_sge = 1;
	a.max_send_wr = 1 << 20;
	NULL_WITH(ugdr_create_qp(r.pd, &a), EINVAL);
	a.max_send_wr = 4;
	a.recv_cq = NULL;
	NULL_WITH(ugdr_create_qp(r.pd, &a), EINVAL);
	errno = 0;
	CHECK(ugdr_qp_num(NULL) == 0 && errno == EINVAL, "qp_num(NULL)");
	FAILS_WITH(ugdr_destroy_qp(NULL), EINVAL);
	FAILS_WITH(ugdr_modify_qp(NULL, NULL, UGDR_QP_STATE), EINVAL);

	struct ugdr_qp *qp = new_qp(&r, 2, 2);
	uint32_t qpn = ugdr_qp_num(qp);
	CHECK(qpn > 1 && qpn <= 0xffffff, "qp_num %#x", qpn);
	FAILS_WITH(ugdr_modify_qp(qp, NULL, UGDR_QP_STATE), EINVAL);

	/* Posting before the QP can: EINVAL, *bad_wr = the WR. */
	struct ugdr_sge sge = {(uintptr_t)r.buf, 8, r.mr->lkey};
	struct ugdr_send_wr s1 = {.wr_id = 1, .sg_list = &sge, .num_sge = 1, .opcode = UGDR_WR_SEND};
	struct ugdr_send_wr *bad = NULL;
	FAILS_WITH(ugdr_post_send(qp, &s1, &bad), EINVAL);
	CHECK(bad == &s1, "bad_wr in RESET");
	struct ugdr_recv_wr r1 = {.wr_id = 1, .sg_list = &sge, .num_sge = 1}, *rbad = NULL;
	FAILS_WITH(ugdr_post_recv(qp, &r1, &rbad), EINVAL);
	CHECK(rbad == &r1, "recv bad_wr in RESET");
	FAILS_WITH(ugdr_post_send(NULL, &s1, &bad), EINVAL);
	FAILS_WITH(ugdr_post_recv(NULL, &r1, &rbad), EINVAL);

	/* Lists: the first bad WR is reported, the ones before it stay posted. */
	connect_qp(&r, qp, qpn); /* to itself */
	struct ugdr_recv_wr r3 = {.wr_id = 3, .sg_list = &sge, .num_sge = 3}; /* > max_sge */
	struct ugdr_recv_wr r2 = {.wr_id = 2, .next = &r3, .sg_list = &sge, .num_sge = 1};
	rbad = NULL;
	FAILS_WITH(ugdr_post_recv(qp, &r2, &rbad), EINVAL);
	CHECK(rbad == &r3, "recv bad_wr is the WR over max_sge");
	/* A count far above max_sge with one SGE in front of an unmapped page: refused before
	 * anything past the limit is read. */
	uint8_t *guarded = mmap(NULL, 2 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(guarded != MAP_FAILED && mprotect(guarded + page, page, PROT_NONE) == 0, "guard page");
	struct ugdr_sge *last = (struct ugdr_sge *)(guarded + page) - 1;
	*last = sge;
	struct ugdr_recv_wr rhuge = {.wr_id = 5, .sg_list = last, .num_sge = 1 << 20};
	rbad = NULL;
	FAILS_WITH(ugdr_post_recv(qp, &rhuge, &rbad), EINVAL);
	CHECK(rbad == &rhuge, "recv bad_wr with a huge num_sge");
	struct ugdr_send_wr shuge = {.wr_id = 15, .sg_list = last, .num_sge = 1 << 20,
				     .opcode = UGDR_WR_SEND, .send_flags = UGDR_SEND_INLINE};
	bad = NULL;
	FAILS_WITH(ugdr_post_send(qp, &shuge, &bad), EINVAL);
	CHECK(bad == &shuge, "send bad_wr with a huge num_sge");
	struct ugdr_recv_wr rneg = {.wr_id = 4, .sg_list = &sge, .num_sge = -1};
	FAILS_WITH(ugdr_post_recv(qp, &rneg, &rbad), EINVAL);
	struct ugdr_send_wr s_bad_op = {.wr_id = 12, .sg_list = &sge, .num_sge = 1, .opcode = 7};
	struct ugdr_send_wr s_ok = {.wr_id = 11, .next = &s_bad_op, .sg_list = &sge, .num_sge = 1,
				    .opcode = UGDR_WR_SEND, .send_flags = UGDR_SEND_SIGNALED};
	bad = NULL;
	FAILS_WITH(ugdr_post_send(qp, &s_ok, &bad), EINVAL);
	CHECK(bad == &s_bad_op, "send bad_wr is the WR with the bad opcode");
	struct ugdr_send_wr s_flags = {.wr_id = 13, .sg_list = &sge, .num_sge = 1, .send_flags = 1 << 5};
	FAILS_WITH(ugdr_post_send(qp, &s_flags, &bad), EINVAL);
	CHECK(bad == &s_flags, "unknown send flag");
	struct ugdr_send_wr s_inline_read = {.wr_id = 14, .sg_list = &sge, .num_sge = 1,
					     .opcode = UGDR_WR_RDMA_READ, .send_flags = UGDR_SEND_INLINE};
	FAILS_WITH(ugdr_post_send(qp, &s_inline_read, &bad), EINVAL);
	/* The SEND before the bad WR was posted: it lands in recv 2 of the same QP. */
	expect(r.cq, 2, UGDR_WC_SUCCESS, UGDR_WC_RECV, 8, qpn);
	expect(r.cq, 11, UGDR_WC_SUCCESS, UGDR_WC_SEND, 8, qpn);
	/* A full send queue is ENOMEM (max_send_wr 2, nothing completes without receives). */
	struct ugdr_send_wr q3 = {.wr_id = 23, .sg_list = &sge, .num_sge = 1, .opcode = UGDR_WR_SEND};
	struct ugdr_send_wr q2 = {.wr_id = 22, .next = &q3, .sg_list = &sge, .num_sge = 1, .opcode = UGDR_WR_SEND};
	struct ugdr_send_wr q1 = {.wr_id = 21, .next = &q2, .sg_list = &sge, .num_sge = 1, .opcode = UGDR_WR_SEND};
	FAILS_WITH(ugdr_post_send(qp, &q1, &bad), ENOMEM);
	CHECK(bad == &q3, "bad_wr is the WR that found the queue full");

	/* Busy parents. */
	FAILS_WITH(ugdr_destroy_cq(r.cq), EBUSY);
	FAILS_WITH(ugdr_dealloc_pd(r.pd), EBUSY);
	FAILS_WITH(ugdr_close_device(r.ctx), EBUSY);
	CHECK(ugdr_destroy_qp(qp) == 0, "destroy_qp");
	CHECK(ugdr_dereg_mr(r.mr) == 0 && ugdr_dereg_mr(ro_mr) == 0, "dereg");
	FAILS_WITH(ugdr_close_device(r.ctx), EBUSY);
	CHECK(ugdr_destroy_cq(r.cq) == 0, "destroy_cq");
	CHECK(ugdr_dealloc_pd(r.pd) == 0, "dealloc_pd");
	CHECK(ugdr_close_device(r.ctx) == 0, "close_device");
}

static void states(void)
{
	struct res r = open_res();
	struct ugdr_qp *qp = new_qp(&r, 8, 1);
	uint32_t qpn = ugdr_qp_num(qp);
	const int S = UGDR_QP_STATE, Q = UGDR_QP_DEST_QPN, A = UGDR_QP_DEST_ADDR;
	struct ugdr_addr garbage;
	memset(&garbage, 0x11, sizeof(garbage));

	/* RESET: only INIT (STATE alone) or ERR. Each refusal leaves the QP in RESET. */
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q | A, qpn, &r.addr), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTS, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RESET, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, S | Q, qpn, NULL), EINVAL); /* extra attribute */
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, 0, 0, NULL), EINVAL);       /* no STATE */
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, S | 16, 0, NULL), EINVAL);  /* unknown bit */
	FAILS_WITH(modify(qp, (enum ugdr_qp_state)7, S, 0, NULL), EINVAL);
	struct ugdr_qp_attr cur;
	memset(&cur, 0, sizeof(cur));
	cur.qp_state = UGDR_QPS_INIT;
	cur.cur_qp_state = UGDR_QPS_RTS;
	FAILS_WITH(ugdr_modify_qp(qp, &cur, S | UGDR_QP_CUR_STATE), EINVAL); /* wrong claim */
	cur.cur_qp_state = UGDR_QPS_RESET;
	CHECK(ugdr_modify_qp(qp, &cur, S | UGDR_QP_CUR_STATE) == 0, "RESET -> INIT, claim right");

	/* INIT: only RTR with both destination attributes, or ERR. */
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTS, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q, qpn, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | A, 0, &r.addr), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q | A, qpn, &garbage), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q | A, 1u << 24, &r.addr), EINVAL);
	struct ugdr_addr nobody = r.addr; /* a well-formed address of no live process */
	nobody.raw[7] ^= 0x55;
	nobody.raw[19] ^= 0x55;
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q | A, qpn, &nobody), EINVAL);
	/* Receives may be posted from INIT on. */
	struct ugdr_sge sge = {(uintptr_t)r.buf, 64, r.mr->lkey};
	CHECK(post_recv(qp, 100, &sge, 1) == 0, "post_recv in INIT");
	CHECK(modify(qp, UGDR_QPS_RTR, S | Q | A, qpn, &r.addr) == 0, "INIT -> RTR");

	/* RTR: only RTS or ERR; sends are refused until RTS. */
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S | Q | A, qpn, &r.addr), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTS, S | Q, qpn, NULL), EINVAL);
	FAILS_WITH(post_send(qp, 1, UGDR_WR_SEND, &sge, 1, 0, 0), EINVAL);
	CHECK(post_recv(qp, 101, &sge, 1) == 0, "post_recv in RTR");
	CHECK(modify(qp, UGDR_QPS_RTS, S, 0, NULL) == 0, "RTR -> RTS");

	/* RTS: only ERR. A SEND to itself proves it is connected. */
	FAILS_WITH(modify(qp, UGDR_QPS_RTR, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RTS, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_RESET, S, 0, NULL), EINVAL);
	memcpy(r.buf + 1000, "state", 5);
	struct ugdr_sge out = {(uintptr_t)(r.buf + 1000), 5, r.mr->lkey};
	CHECK(post_send(qp, 7, UGDR_WR_SEND, &out, 1, 0, 0) == 0, "send in RTS");
	expect(r.cq, 100, UGDR_WC_SUCCESS, UGDR_WC_RECV, 5, qpn);
	expect(r.cq, 7, UGDR_WC_SUCCESS, UGDR_WC_SEND, 5, qpn);
	CHECK(memcmp(r.buf, "state", 5) == 0, "received bytes");

	/* Outstanding receives, then ERR: each completes with WR_FLUSH_ERR, in order. */
	CHECK(post_recv(qp, 102, &sge, 1) == 0, "post_recv");
	CHECK(modify(qp, UGDR_QPS_ERR, S, 0, NULL) == 0, "RTS -> ERR");
	expect(r.cq, 101, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_RECV, 0, qpn);
	expect(r.cq, 102, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_RECV, 0, qpn);
	expect_none(r.cq);
	/* In ERR, new WRs complete at once with WR_FLUSH_ERR (as verbs). */
	CHECK(post_send(qp, 8, UGDR_WR_RDMA_WRITE, &out, 1, (uintptr_t)r.buf, r.mr->rkey) == 0,
	      "post_send in ERR");
	expect(r.cq, 8, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_RDMA_WRITE, 0, qpn);
	CHECK(post_recv(qp, 103, &sge, 1) == 0, "post_recv in ERR");
	expect(r.cq, 103, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_RECV, 0, qpn);
	FAILS_WITH(modify(qp, UGDR_QPS_RESET, S, 0, NULL), EINVAL);
	FAILS_WITH(modify(qp, UGDR_QPS_INIT, S, 0, NULL), EINVAL);
	CHECK(modify(qp, UGDR_QPS_ERR, S, 0, NULL) == 0, "ERR -> ERR");

	/* RESET -> ERR and INIT -> ERR are allowed too. */
	struct ugdr_qp *q2 = new_qp(&r, 4, 1);
	CHECK(modify(q2, UGDR_QPS_ERR, S, 0, NULL) == 0, "RESET -> ERR");
	struct ugdr_qp *q3 = new_qp(&r, 4, 1);
	CHECK(modify(q3, UGDR_QPS_INIT, S, 0, NULL) == 0, "RESET -> INIT");
	CHECK(post_recv(q3, 300, &sge, 1) == 0, "post_recv in INIT");
	CHECK(modify(q3, UGDR_QPS_ERR, S, 0, NULL) == 0, "INIT -> ERR");
	expect(r.cq, 300, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_RECV, 0, ugdr_qp_num(q3));
	CHECK(ugdr_destroy_qp(qp) == 0 && ugdr_destroy_qp(q2) == 0 && ugdr_destroy_qp(q3) == 0,
	      "destroy");
}

static void fill(uint8_t *p, size_t n, unsigned seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(seed + i * 13 + (i >> 7));
}

static void loopback(void)
{
	struct res r = open_res();
	struct ugdr_qp *a = new_qp(&r, 16, 4), *b = new_qp(&r, 16, 4);
	uint32_t qa = ugdr_qp_num(a), qb = ugdr_qp_num(b);
	CHECK(qa != qb, "distinct QP numbers");
	connect_qp(&r, a, qb);
	connect_qp(&r, b, qa);
	uint8_t *buf = r.buf;
	uint32_t lkey = r.mr->lkey, rkey = r.mr->rkey;

	/* SEND: three SGEs gathered, scattered into two receive SGEs. */
	fill(buf, 300, 1);
	struct ugdr_sge rs[2] = {{(uintptr_t)(buf + 4096), 100, lkey}, {(uintptr_t)(buf + 8192), 400, lkey}};
	CHECK(post_recv(b, 50, rs, 2) == 0, "recv with 2 SGEs");
	struct ugdr_sge ss[3] = {{(uintptr_t)buf, 50, lkey}, {(uintptr_t)(buf + 50), 150, lkey},
				 {(uintptr_t)(buf + 200), 100, lkey}};
	CHECK(post_send(a, 60, UGDR_WR_SEND, ss, 3, 0, 0) == 0, "send with 3 SGEs");
	expect(r.cq, 50, UGDR_WC_SUCCESS, UGDR_WC_RECV, 300, qb);
	expect(r.cq, 60, UGDR_WC_SUCCESS, UGDR_WC_SEND, 300, qa);
	CHECK(memcmp(buf + 4096, buf, 100) == 0 && memcmp(buf + 8192, buf + 100, 200) == 0,
	      "scattered bytes");

	/* Inline SEND (lkey unused). */
	char msg[] = "inline!";
	struct ugdr_sge is = {(uintptr_t)msg, sizeof(msg), 0};
	CHECK(post_recv(b, 51, rs, 1) == 0, "recv");
	struct ugdr_send_wr iw = {.wr_id = 61, .sg_list = &is, .num_sge = 1, .opcode = UGDR_WR_SEND,
				  .send_flags = UGDR_SEND_SIGNALED | UGDR_SEND_INLINE},
			    *bad = NULL;
	CHECK(ugdr_post_send(a, &iw, &bad) == 0, "inline send");
	memset(msg, 0, sizeof(msg)); /* the bytes were copied at post time */
	expect(r.cq, 51, UGDR_WC_SUCCESS, UGDR_WC_RECV, 8, qb);
	expect(r.cq, 61, UGDR_WC_SUCCESS, UGDR_WC_SEND, 8, qa);
	CHECK(memcmp(buf + 4096, "inline!", 8) == 0, "inline bytes");

	/* Unsignaled SEND: no completion on the send side; sq_sig_all is 0. */
	CHECK(post_recv(b, 52, rs, 1) == 0, "recv");
	struct ugdr_send_wr uw = {.wr_id = 62, .sg_list = ss, .num_sge = 1, .opcode = UGDR_WR_SEND};
	CHECK(ugdr_post_send(a, &uw, &bad) == 0, "unsignaled send");
	expect(r.cq, 52, UGDR_WC_SUCCESS, UGDR_WC_RECV, 50, qb);

	/* RDMA WRITE from two SGEs into b's memory; READ it back into two SGEs. */
	fill(buf + 16384, 5000, 7);
	memset(buf + 32768, 0, 5000);
	struct ugdr_sge ws[2] = {{(uintptr_t)(buf + 16384), 3000, lkey},
				 {(uintptr_t)(buf + 16384 + 3000), 2000, lkey}};
	CHECK(post_send(a, 70, UGDR_WR_RDMA_WRITE, ws, 2, (uintptr_t)(buf + 32768), rkey) == 0,
	      "rdma write");
	expect(r.cq, 70, UGDR_WC_SUCCESS, UGDR_WC_RDMA_WRITE, 5000, qa);
	CHECK(memcmp(buf + 32768, buf + 16384, 5000) == 0, "written bytes");
	memset(buf + 40960, 0, 5000);
	struct ugdr_sge rds[2] = {{(uintptr_t)(buf + 40960), 1000, lkey},
				  {(uintptr_t)(buf + 40960 + 1000), 4000, lkey}};
	CHECK(post_send(b, 71, UGDR_WR_RDMA_READ, rds, 2, (uintptr_t)(buf + 32768), rkey) == 0,
	      "rdma read");
	expect(r.cq, 71, UGDR_WC_SUCCESS, UGDR_WC_RDMA_READ, 5000, qb);
	CHECK(memcmp(buf + 40960, buf + 16384, 5000) == 0, "read bytes");
	expect_none(r.cq);

	/* RDMA to an MR without remote access: REM_ACCESS_ERR, and the requester goes to ERR. */
	uint8_t *plain = aligned_alloc(4096, 4096);
	memset(plain, 0x33, 4096);
	struct ugdr_mr *local_only = ugdr_reg_mr(r.pd, plain, 4096, UGDR_ACCESS_LOCAL_WRITE);
	CHECK(local_only != NULL, "reg local-only");
	CHECK(post_send(a, 80, UGDR_WR_RDMA_WRITE, ws, 1, (uintptr_t)plain, local_only->rkey) == 0,
	      "rdma write to a local-only MR");
	expect(r.cq, 80, UGDR_WC_REM_ACCESS_ERR, UGDR_WC_RDMA_WRITE, 0, qa);
	CHECK(plain[0] == 0x33 && plain[4095] == 0x33, "target untouched");
	CHECK(post_send(a, 81, UGDR_WR_SEND, ws, 1, 0, 0) == 0, "post after the error");
	expect(r.cq, 81, UGDR_WC_WR_FLUSH_ERR, UGDR_WC_SEND, 0, qa);

	/* A bad lkey: LOC_PROT_ERR at the requester. */
	struct ugdr_qp *c = new_qp(&r, 4, 1), *d = new_qp(&r, 4, 1);
	uint32_t qc = ugdr_qp_num(c), qd = ugdr_qp_num(d);
	connect_qp(&r, c, qd);
	connect_qp(&r, d, qc);
	struct ugdr_sge badkey = {(uintptr_t)buf, 8, lkey ^ 0x5a5a};
	CHECK(post_send(c, 90, UGDR_WR_SEND, &badkey, 1, 0, 0) == 0, "send with a bad lkey");
	expect(r.cq, 90, UGDR_WC_LOC_PROT_ERR, UGDR_WC_SEND, 0, qc);

	/* A message longer than the receive: LOC_LEN_ERR at the receiver, an error at the sender. */
	struct ugdr_qp *e = new_qp(&r, 4, 1), *f = new_qp(&r, 4, 1);
	uint32_t qe = ugdr_qp_num(e), qf = ugdr_qp_num(f);
	connect_qp(&r, e, qf);
	connect_qp(&r, f, qe);
	struct ugdr_sge small = {(uintptr_t)(buf + 4096), 4, lkey};
	CHECK(post_recv(f, 91, &small, 1) == 0, "small recv");
	CHECK(post_send(e, 92, UGDR_WR_SEND, ss, 1, 0, 0) == 0, "50-byte send");
	struct ugdr_wc wc[2];
	int got = 0;
	double until = now_s() + 10;
	while (got < 2 && now_s() < until) {
		int n = ugdr_poll_cq(r.cq, 2 - got, wc + got);
		CHECK(n >= 0, "poll");
		got += n;
	}
	CHECK(got == 2, "two error completions, got %d", got);
	for (int i = 0; i < 2; i++) {
		if (wc[i].wr_id == 91)
			CHECK(wc[i].status == UGDR_WC_LOC_LEN_ERR && wc[i].opcode == UGDR_WC_RECV &&
				      wc[i].byte_len == 0 && wc[i].qp_num == qf,
			      "receiver: status %d opcode %d len %u qp %#x", wc[i].status, wc[i].opcode,
			      wc[i].byte_len, wc[i].qp_num);
		else
			CHECK(wc[i].wr_id == 92 && wc[i].status == UGDR_WC_GENERAL_ERR &&
				      wc[i].opcode == UGDR_WC_SEND && wc[i].byte_len == 0 && wc[i].qp_num == qe,
			      "sender: wr_id %llu status %d opcode %d len %u qp %#x",
			      (unsigned long long)wc[i].wr_id, wc[i].status, wc[i].opcode, wc[i].byte_len,
			      wc[i].qp_num);
	}
	expect_none(r.cq);
	free(plain);
}

static void gpu(void)
{
	struct res r = open_res();
	long page = sysconf(_SC_PAGESIZE);
	uint8_t *dev = mmap(NULL, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	CHECK(dev != MAP_FAILED, "mmap");
	memset(dev, 0x5a, 4 * page);
	char hex[32];
	snprintf(hex, sizeof(hex), "%llx", (unsigned long long)(uintptr_t)dev);
	setenv("FAKE_CUDA_DEVICE_PTR", hex, 1); /* the stand-in driver calls it device memory */
	NULL_WITH(ugdr_reg_mr(r.pd, dev, 4 * page, UGDR_ACCESS_LOCAL_WRITE | UGDR_ACCESS_REMOTE_WRITE),
		  EOPNOTSUPP);
	NULL_WITH(ugdr_reg_mr(r.pd, dev, page, 0), EOPNOTSUPP);
	long changed = 0;
	for (long i = 0; i < 4 * page; i++)
		changed += dev[i] != 0x5a;
	CHECK(changed == 0, "%ld bytes of the device range changed", changed);
	struct ugdr_mr *host = ugdr_reg_mr(r.pd, r.buf + 4096, 4096, UGDR_ACCESS_LOCAL_WRITE);
	CHECK(host != NULL, "host memory still registers");
	CHECK(ugdr_dereg_mr(host) == 0, "dereg");
}

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s devices|errors|states|loopback|gpu\n", argv[0]);
		return 2;
	}
	scenario = argv[1];
	if (!strcmp(scenario, "devices"))
		devices();
	else if (!strcmp(scenario, "errors"))
		errors();
	else if (!strcmp(scenario, "states"))
		states();
	else if (!strcmp(scenario, "loopback"))
		loopback();
	else if (!strcmp(scenario, "gpu"))
		gpu();
	else {
		fprintf(stderr, "unknown scenario %s\n", scenario);
		return 2;
	}
	printf("%s: %d checks ok\n", scenario, checks);
	return 0;
}
