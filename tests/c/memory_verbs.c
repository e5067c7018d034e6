/* The memory verbs beyond ibv_reg_mr, as applications call them: the real <infiniband/verbs.h>
 * (ibv_advise_mr, ibv_alloc_dm, ibv_memcpy_to/from_dm, ibv_reg_dm_mr, ibv_alloc_td,
 * ibv_alloc_parent_domain, ibv_create_cq_ex are inline there), linked against libibverbs and
 * run with libugdr.so preloaded. Two RC QPs of this process talk to each other; every
 * completion's fields and the bytes moved are checked, and the error cases rdma-core
 * documents. Sections: rereg, odp, dm, parent (argv[1] picks one; none runs all). Exit 0 and
 * "memory_verbs: ok" only if every check holds. */
#include "verbs_test.h"
#include <stdint.h>
#include <sys/mman.h>
#include <unistd.h>

static struct ibv_context *ctx;
static uint16_t lid;
static long page;

/* ------------------------------------------------------------------ two connected QPs */

struct pair {
    struct ibv_cq *cq_a, *cq_b;
    struct ibv_qp *a, *b; /* a sends; b is the target */
};

static const int qp_access = IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

static struct ibv_qp *rc_qp(struct ibv_pd *pd, struct ibv_cq *cq)
{
    struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 2 } };
    struct ibv_qp *qp = ibv_create_qp(pd, &init);
    CHECK(qp, "create_qp");
    return qp;
}

/* QP a on pd_a, QP b on pd_b, connected. */
static struct pair pair_new(struct ibv_pd *pd_a, struct ibv_pd *pd_b)
{
    struct pair p;
    p.cq_a = ibv_create_cq(ctx, 32, NULL, NULL, 0);
    p.cq_b = ibv_create_cq(ctx, 32, NULL, NULL, 0);
    CHECK(p.cq_a && p.cq_b, "create_cq");
    p.a = rc_qp(pd_a, p.cq_a);
    p.b = rc_qp(pd_b, p.cq_b);
    to_rts(p.a, lid, p.b->qp_num, qp_access);
    to_rts(p.b, lid, p.a->qp_num, qp_access);
    return p;
}

static void pair_free(struct pair *p)
{
    CHECK(ibv_destroy_qp(p->a) == 0 && ibv_destroy_qp(p->b) == 0, "destroy_qp");
    CHECK(ibv_destroy_cq(p->cq_a) == 0 && ibv_destroy_cq(p->cq_b) == 0, "destroy_cq");
}

static enum ibv_qp_state qp_state(struct ibv_qp *qp)
{
    struct ibv_qp_attr a;
    struct ibv_qp_init_attr i;
    CHECK(ibv_query_qp(qp, &a, IBV_QP_STATE, &i) == 0, "query_qp");
    return a.qp_state;
}

/* Posts one signaled WR on `qp` and checks its completion: status, opcode, wr_id, qp_num,
 * byte_len (for READ), no flags. */
static void one_sided(struct pair *p, enum ibv_wr_opcode op, uint64_t laddr, uint32_t len, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, enum ibv_wc_status want, const char *what)
{
    static uint64_t next_id = 1000;
    uint64_t id = next_id++;
    struct ibv_sge sge = { laddr, len, lkey };
    struct ibv_send_wr wr = { .wr_id = id, .sg_list = &sge, .num_sge = 1, .opcode = op,
                              .send_flags = IBV_SEND_SIGNALED }, *bad = NULL;
    wr.wr.rdma.remote_addr = raddr;
    wr.wr.rdma.rkey = rkey;
    CHECK(ibv_post_send(p->a, &wr, &bad) == 0, "%s: post_send", what);
    struct ibv_wc wc;
    CHECK(poll_one(p->cq_a, &wc) == 1, "%s: no completion", what);
    CHECK(wc.wr_id == id && wc.status == want && wc.qp_num == p->a->qp_num,
          "%s: wr_id %llu status %s qp_num %u", what, (unsigned long long)wc.wr_id,
          ibv_wc_status_str(wc.status), wc.qp_num);
    if (want == IBV_WC_SUCCESS) {
        enum ibv_wc_opcode wop = op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE;
        CHECK(wc.opcode == wop && wc.wc_flags == 0, "%s: opcode %d flags %u", what, wc.opcode, wc.wc_flags);
        if (op == IBV_WR_RDMA_READ)
            CHECK(wc.byte_len == len, "%s: byte_len %u", what, wc.byte_len);
    } else {
        CHECK(qp_state(p->a) == IBV_QPS_ERR, "%s: requester not in ERR", what);
        if (want == IBV_WC_REM_ACCESS_ERR) {
            /* A refused request moves the responder to ERR too (its class C error). */
            for (int i = 0; i < 1000 && qp_state(p->b) != IBV_QPS_ERR; i++)
                usleep(1000);
            CHECK(qp_state(p->b) == IBV_QPS_ERR, "%s: responder not in ERR", what);
        } else {
            CHECK(qp_state(p->b) == IBV_QPS_RTS, "%s: a local error reached the responder", what);
        }
    }
}

static void fill(void *buf, size_t len, unsigned seed)
{
    for (size_t i = 0; i < len; i++)
        ((unsigned char *)buf)[i] = (unsigned char)(i * 31 + seed);
}

static void *map_pages(size_t n)
{
    void *p = mmap(NULL, n * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED, "mmap");
    return p;
}

/* ------------------------------------------------------------------ ibv_rereg_mr */

static void rereg(struct ibv_pd *pd)
{
    const int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    char *src = map_pages(1), *t1 = map_pages(1), *t2 = map_pages(2);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, page, IBV_ACCESS_LOCAL_WRITE);
    struct ibv_mr *mr = ibv_reg_mr(pd, t1, page, rw);
    CHECK(smr && mr, "reg_mr");
    fill(src, page, 1);

    /* libibverbs' input checks: IBV_REREG_MR_ERR_INPUT, errno EINVAL, MR untouched. */
    uint32_t lkey = mr->lkey, rkey = mr->rkey;
    FAILS_WITH(ibv_rereg_mr(mr, 1 << 3, NULL, NULL, 0, 0), IBV_REREG_MR_ERR_INPUT, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, NULL, page, 0), IBV_REREG_MR_ERR_INPUT, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION, NULL, t2, 0, 0), IBV_REREG_MR_ERR_INPUT, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd, NULL, 0, rw), IBV_REREG_MR_ERR_INPUT, EINVAL);
    /* The device's checks: IBV_REREG_MR_ERR_CMD with errno, MR still valid. */
    FAILS_WITH(ibv_rereg_mr(mr, 0, NULL, NULL, 0, 0), IBV_REREG_MR_ERR_CMD, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_REMOTE_WRITE),
               IBV_REREG_MR_ERR_CMD, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, 1 << 15), IBV_REREG_MR_ERR_CMD, EINVAL);
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, NULL, NULL, 0, 0), IBV_REREG_MR_ERR_CMD, EINVAL);
    struct ibv_context *ctx2 = NULL;
    {
        struct ibv_device **list = ibv_get_device_list(NULL);
        ctx2 = ibv_open_device(list[0]);
        ibv_free_device_list(list);
    }
    struct ibv_pd *other_ctx_pd = ibv_alloc_pd(ctx2);
    CHECK(other_ctx_pd, "alloc_pd on a second context");
    FAILS_WITH(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, other_ctx_pd, NULL, 0, 0), IBV_REREG_MR_ERR_CMD, EINVAL);
    CHECK(mr->lkey == lkey && mr->rkey == rkey && mr->addr == t1 && mr->length == (size_t)page && mr->pd == pd,
          "failed rereg changed the MR");

    struct pair p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 256, smr->lkey, (uintptr_t)t1 + 8, mr->rkey,
              IBV_WC_SUCCESS, "write before rereg");
    CHECK(memcmp(t1 + 8, src, 256) == 0, "write before rereg: data");

    /* Access: remote write taken away, remote read kept. */
    CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ) == 0, "rereg access");
    CHECK(mr->addr == t1 && mr->length == (size_t)page && mr->pd == pd, "rereg access: mr fields");
    /* The keys stay across every re-registration, as rxe's and mlx5's (peers keep using them). */
    CHECK(mr->lkey == lkey && mr->rkey == rkey, "rereg access changed the keys");
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src + 1024, 256, smr->lkey, (uintptr_t)t1 + 8, mr->rkey,
              IBV_WC_SUCCESS, "read after access rereg");
    CHECK(memcmp(src + 1024, src, 256) == 0, "read after access rereg: data");
    fill(src, page, 2);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)t1, mr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write without remote write");
    CHECK(t1[0] == 0, "the refused write landed");
    pair_free(&p);

    /* Translation (and access back): the MR now covers t2, two pages; t1 is out of it. */
    CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_TRANSLATION | IBV_REREG_MR_CHANGE_ACCESS, NULL, t2, 2 * page, rw) == 0,
          "rereg translation");
    CHECK(mr->addr == t2 && mr->length == (size_t)(2 * page) && mr->pd == pd, "rereg translation: mr fields");
    CHECK(mr->lkey == lkey && mr->rkey == rkey, "rereg translation changed the keys");
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, page, smr->lkey, (uintptr_t)t2 + page, mr->rkey,
              IBV_WC_SUCCESS, "write to the new range");
    CHECK(memcmp(t2 + page, src, page) == 0, "write to the new range: data");
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)t1, mr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write to the old range");
    CHECK(t1[0] == 0, "the write to the old range landed");
    pair_free(&p);

    /* PD: the MR moves to pd2; a QP of pd can no longer use it, one of pd2 can. */
    struct ibv_pd *pd2 = ibv_alloc_pd(ctx);
    CHECK(pd2, "alloc_pd");
    CHECK(ibv_rereg_mr(mr, IBV_REREG_MR_CHANGE_PD, pd2, NULL, 0, 0) == 0, "rereg pd");
    CHECK(mr->pd == pd2 && mr->addr == t2, "rereg pd: mr fields");
    CHECK(mr->lkey == lkey && mr->rkey == rkey, "rereg pd changed the keys");
    FAILS_WITH(ibv_dealloc_pd(pd2), EBUSY, EBUSY);
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)t2, mr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write through a QP of the old PD");
    pair_free(&p);
    struct ibv_mr *smr2 = ibv_reg_mr(pd2, src, page, IBV_ACCESS_LOCAL_WRITE);
    CHECK(smr2, "reg_mr on pd2");
    fill(src, page, 3);
    p = pair_new(pd2, pd2);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 512, smr2->lkey, (uintptr_t)t2, mr->rkey,
              IBV_WC_SUCCESS, "write through a QP of the new PD");
    CHECK(memcmp(t2, src, 512) == 0, "write through a QP of the new PD: data");
    /* The MR's lkey as a local SGE follows the PD too. */
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)t2, 64, mr->lkey, (uintptr_t)t2 + 4096, mr->rkey,
              IBV_WC_SUCCESS, "the MR's own lkey on the new PD");
    CHECK(memcmp(t2 + 4096, src, 64) == 0, "own lkey write: data");
    pair_free(&p);

    /* Remote write granted afterwards to an MR registered without remote access: the rkey
     * handed out at registration reaches it (rdma-core's test_mr_rereg_access). */
    struct ibv_mr *late = ibv_reg_mr(pd, t1, page, IBV_ACCESS_LOCAL_WRITE);
    CHECK(late, "reg_mr without remote access");
    uint32_t late_rkey = late->rkey;
    CHECK(ibv_rereg_mr(late, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, rw) == 0, "rereg to remote write");
    CHECK(late->rkey == late_rkey, "rereg to remote write changed the rkey");
    fill(src, page, 4);
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 128, smr->lkey, (uintptr_t)t1 + 64, late_rkey,
              IBV_WC_SUCCESS, "write through the rkey given before the rereg");
    CHECK(memcmp(t1 + 64, src, 128) == 0, "write through the rkey given before the rereg: data");
    pair_free(&p);

    CHECK(ibv_dereg_mr(late) == 0, "dereg late");
    CHECK(ibv_dereg_mr(mr) == 0 && ibv_dereg_mr(smr) == 0 && ibv_dereg_mr(smr2) == 0, "dereg");
    CHECK(ibv_dealloc_pd(pd2) == 0 && ibv_dealloc_pd(other_ctx_pd) == 0 && ibv_close_device(ctx2) == 0, "teardown");
    munmap(src, page); munmap(t1, page); munmap(t2, 2 * page);
    printf("rereg: ok\n");
}

/* ------------------------------------------------------------------ on-demand paging */

static void odp(struct ibv_pd *pd)
{
    struct ibv_device_attr_ex dx;
    CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0, "query_device_ex");
    CHECK((dx.odp_caps.general_caps & (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT)) ==
          (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT), "odp general caps %llx",
          (unsigned long long)dx.odp_caps.general_caps);
    uint32_t rc = IBV_ODP_SUPPORT_SEND | IBV_ODP_SUPPORT_RECV | IBV_ODP_SUPPORT_WRITE |
                  IBV_ODP_SUPPORT_READ | IBV_ODP_SUPPORT_ATOMIC | IBV_ODP_SUPPORT_SRQ_RECV |
                  (1 << 7) /* IBV_ODP_SUPPORT_ATOMIC_WRITE (rdma-core after v44) */;
    CHECK(dx.odp_caps.per_transport_caps.rc_odp_caps == rc, "rc odp caps %x", dx.odp_caps.per_transport_caps.rc_odp_caps);
    CHECK(dx.odp_caps.per_transport_caps.ud_odp_caps & IBV_ODP_SUPPORT_SEND, "ud odp caps");

    const int odp_rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
                       IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_ON_DEMAND;
    char *src = map_pages(1);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, page, IBV_ACCESS_LOCAL_WRITE);
    CHECK(smr, "reg_mr");

    /* Explicit ODP: a malloc'd buffer, its pages never touched before the first access. */
    char *heap = malloc(3 * page);
    struct ibv_mr *emr = ibv_reg_mr(pd, heap, 3 * page, odp_rw);
    CHECK(emr && emr->addr == heap && emr->length == (size_t)(3 * page), "explicit odp reg_mr");
    struct pair p = pair_new(pd, pd);
    fill(src, page, 7);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, page, smr->lkey, (uintptr_t)heap + 100, emr->rkey,
              IBV_WC_SUCCESS, "write to explicit odp");
    CHECK(memcmp(heap + 100, src, page) == 0, "write to explicit odp: data");
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src + 2048, 1000, smr->lkey, (uintptr_t)heap + 100, emr->rkey,
              IBV_WC_SUCCESS, "read from explicit odp");
    CHECK(memcmp(src + 2048, src, 1000) == 0, "read from explicit odp: data");
    /* The ODP MR as a local SGE (a WRITE out of it). */
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)heap + 100, 512, emr->lkey, (uintptr_t)heap + 2 * page, emr->rkey,
              IBV_WC_SUCCESS, "write from explicit odp");
    CHECK(memcmp(heap + 2 * page, heap + 100, 512) == 0, "write from explicit odp: data");
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)heap + 3 * page - 32, emr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write past an explicit odp MR");
    pair_free(&p);

    /* ibv_advise_mr on it. */
    struct ibv_sge sg = { (uintptr_t)heap, (uint32_t)page, emr->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, IBV_ADVISE_MR_FLAG_FLUSH, &sg, 1) == 0, "advise prefetch");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &sg, 1) == 0, "advise prefetch write");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &sg, 1) == 0, "advise no fault");
    CHECK(ibv_advise_mr(pd, (enum ibv_advise_mr_advice)7, 0, &sg, 1) == EOPNOTSUPP, "advise: unknown advice");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 2, &sg, 1) == EINVAL, "advise: unknown flag");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &sg, 0) == EINVAL, "advise: no sge");
    struct ibv_sge pinned = { (uintptr_t)src, 64, smr->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &pinned, 1) == ENOENT, "advise: pinned MR");
    struct ibv_sge past = { (uintptr_t)heap + 2 * page, (uint32_t)(2 * page), emr->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &past, 1) == EFAULT, "advise: past the MR");
    struct ibv_mr *ro = ibv_reg_mr(pd, heap, page, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ON_DEMAND);
    CHECK(ro, "read-only odp MR");
    struct ibv_sge rosg = { (uintptr_t)heap, 64, ro->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &rosg, 1) == 0, "advise read-only");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_WRITE, 0, &rosg, 1) == ENOENT, "advise write on read-only");
    CHECK(ibv_dereg_mr(ro) == 0, "dereg ro");

    /* Implicit ODP: the whole address space under one key. */
    FAILS_WITH(ibv_reg_mr(pd, NULL, SIZE_MAX, IBV_ACCESS_LOCAL_WRITE), NULL, EINVAL);
    FAILS_WITH(ibv_reg_mr(pd, NULL, 4096, odp_rw), NULL, EINVAL);
    FAILS_WITH(ibv_reg_mr_iova(pd, NULL, SIZE_MAX, 4096, odp_rw), NULL, EINVAL);
    struct ibv_mr *imr = ibv_reg_mr(pd, NULL, SIZE_MAX, odp_rw);
    CHECK(imr && imr->addr == NULL && imr->length == SIZE_MAX, "implicit odp reg_mr");
    char *any = map_pages(4);
    p = pair_new(pd, pd);
    fill(src, page, 9);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, page, smr->lkey, (uintptr_t)any + 3 * page, imr->rkey,
              IBV_WC_SUCCESS, "write through implicit odp");
    CHECK(memcmp(any + 3 * page, src, page) == 0, "write through implicit odp: data");
    static char in_data[300] = "static data, readable through the implicit key";
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src, sizeof in_data, smr->lkey, (uintptr_t)in_data, imr->rkey,
              IBV_WC_SUCCESS, "read through implicit odp");
    CHECK(memcmp(src, in_data, sizeof in_data) == 0, "read through implicit odp: data");
    /* The implicit key as a local SGE: a READ into the stack. */
    char stack_buf[128] = { 0 };
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)stack_buf, sizeof stack_buf, imr->lkey, (uintptr_t)any + 3 * page,
              imr->rkey, IBV_WC_SUCCESS, "read into the stack through the implicit lkey");
    CHECK(memcmp(stack_buf, any + 3 * page, sizeof stack_buf) == 0, "implicit lkey read: data");
    /* Read-only memory: READ works, WRITE is a remote access error. */
    CHECK(mprotect(any + page, page, PROT_READ) == 0, "mprotect");
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src, 64, smr->lkey, (uintptr_t)any + page, imr->rkey,
              IBV_WC_SUCCESS, "read from a read-only page");
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)any + page, imr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write to a read-only page");
    pair_free(&p);
    /* An unmapped page: a remote access error, never a crash; a READ spanning into it too. */
    CHECK(munmap(any + 2 * page, page) == 0, "munmap");
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)any + 2 * page + 8, imr->rkey,
              IBV_WC_REM_ACCESS_ERR, "write to an unmapped page");
    pair_free(&p);
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src, 256, smr->lkey, (uintptr_t)any + 3 * page + 100, imr->rkey,
              IBV_WC_SUCCESS, "read right after the hole");
    CHECK(memcmp(src, any + 3 * page + 100, 256) == 0, "read right after the hole: data");
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src, 256, smr->lkey, (uintptr_t)any + 2 * page - 128, imr->rkey,
              IBV_WC_REM_ACCESS_ERR, "read spanning into the hole");
    pair_free(&p);
    /* An unmapped local SGE under the implicit lkey: a local protection error. */
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)any + 2 * page, 64, imr->lkey, (uintptr_t)any, imr->rkey,
              IBV_WC_LOC_PROT_ERR, "write from an unmapped page");
    pair_free(&p);
    struct ibv_sge hole = { (uintptr_t)any + 2 * page, 64, imr->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &hole, 1) == EFAULT, "advise an unmapped range");
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH_NO_FAULT, 0, &hole, 1) == 0, "no-fault advise, unmapped");
    /* Mapped again later: reachable again, as with ODP hardware. */
    CHECK(mmap(any + 2 * page, page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
          any + 2 * page, "mmap again");
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, (uintptr_t)any + 2 * page + 8, imr->rkey,
              IBV_WC_SUCCESS, "write to the page mapped again");
    CHECK(memcmp(any + 2 * page + 8, src, 64) == 0, "page mapped again: data");
    pair_free(&p);

    /* rereg between pinned and on-demand. */
    CHECK(ibv_rereg_mr(emr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0,
                       IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE) == 0, "rereg odp to pinned");
    struct ibv_sge esg = { (uintptr_t)heap, 64, emr->lkey };
    CHECK(ibv_advise_mr(pd, IBV_ADVISE_MR_ADVICE_PREFETCH, 0, &esg, 1) == ENOENT, "advise a pinned-again MR");
    FAILS_WITH(ibv_rereg_mr(imr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE),
               IBV_REREG_MR_ERR_CMD, EINVAL);

    CHECK(ibv_dereg_mr(imr) == 0 && ibv_dereg_mr(emr) == 0 && ibv_dereg_mr(smr) == 0, "dereg");
    free(heap);
    munmap(any, 4 * page);
    munmap(src, page);
    printf("odp: ok\n");
}

/* ------------------------------------------------------------------ device memory */

static void dm(struct ibv_pd *pd)
{
    struct ibv_device_attr_ex dx;
    CHECK(ibv_query_device_ex(ctx, NULL, &dx) == 0, "query_device_ex");
    CHECK(dx.max_dm_size >= 65536, "max_dm_size %llu", (unsigned long long)dx.max_dm_size);

    struct ibv_alloc_dm_attr attr = { .length = 8192, .log_align_req = 6 };
    struct ibv_dm *d = ibv_alloc_dm(ctx, &attr);
    CHECK(d && d->context == ctx, "alloc_dm");
    char host[8192], back[8192];
    fill(host, sizeof host, 5);
    CHECK(ibv_memcpy_to_dm(d, 0, host, sizeof host) == 0, "memcpy_to_dm");
    memset(back, 0, sizeof back);
    CHECK(ibv_memcpy_from_dm(back, d, 0, sizeof back) == 0 && memcmp(back, host, sizeof host) == 0, "roundtrip");
    CHECK(ibv_memcpy_from_dm(back, d, 8000, 192) == 0 && memcmp(back, host + 8000, 192) == 0, "tail");
    /* Out of bounds: EFAULT; not in 4-byte words: EINVAL (as mlx5); nothing copied either way. */
    char zeros[64] = { 0 };
    CHECK(ibv_memcpy_to_dm(d, 8192 - 32, zeros, 64) == EFAULT, "to_dm past the end");
    CHECK(ibv_memcpy_to_dm(d, 8192, zeros, 1) == EFAULT, "to_dm at the end");
    CHECK(ibv_memcpy_to_dm(d, UINT64_MAX - 8, zeros, 64) == EFAULT, "to_dm offset wraps");
    CHECK(ibv_memcpy_to_dm(d, 2, zeros, 4) == EINVAL, "to_dm at an unaligned offset");
    CHECK(ibv_memcpy_to_dm(d, 4, zeros, 3) == EINVAL, "to_dm of an unaligned length");
    memset(back, 0x77, sizeof back);
    CHECK(ibv_memcpy_from_dm(back, d, 8100, 100) == EFAULT, "from_dm past the end");
    CHECK(ibv_memcpy_from_dm(back, d, 3, 4) == EINVAL, "from_dm at an unaligned offset");
    CHECK(ibv_memcpy_from_dm(back, d, 0, 6) == EINVAL, "from_dm of an unaligned length");
    CHECK((unsigned char)back[0] == 0x77, "failed from_dm copied");
    CHECK(ibv_memcpy_from_dm(back, d, 0, sizeof back) == 0 && memcmp(back, host, sizeof host) == 0,
          "out-of-bounds copies changed the DM");
    CHECK(ibv_memcpy_to_dm(d, 8192, zeros, 0) == 0, "zero-length copy at the end");

    /* Allocation limits. */
    struct ibv_alloc_dm_attr bad = { .length = 0 };
    FAILS_WITH(ibv_alloc_dm(ctx, &bad), NULL, EINVAL);
    bad.length = dx.max_dm_size + 1;
    FAILS_WITH(ibv_alloc_dm(ctx, &bad), NULL, EINVAL);
    bad.length = 64; bad.log_align_req = 20;
    FAILS_WITH(ibv_alloc_dm(ctx, &bad), NULL, EINVAL);
    bad.log_align_req = 0; bad.comp_mask = 1;
    FAILS_WITH(ibv_alloc_dm(ctx, &bad), NULL, EINVAL);
    struct ibv_alloc_dm_attr rest = { .length = dx.max_dm_size - 8192 };
    struct ibv_dm *d2 = ibv_alloc_dm(ctx, &rest);
    CHECK(d2, "alloc the rest of max_dm_size");
    struct ibv_alloc_dm_attr one = { .length = 64 };
    FAILS_WITH(ibv_alloc_dm(ctx, &one), NULL, ENOMEM);
    CHECK(ibv_free_dm(d2) == 0, "free_dm");

    /* Registration: zero-based, inside the DM. */
    const unsigned rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    FAILS_WITH(ibv_reg_dm_mr(pd, d, 0, 4096, rw), NULL, EINVAL);
    FAILS_WITH(ibv_reg_dm_mr(pd, d, 4096, 8192, rw | IBV_ACCESS_ZERO_BASED), NULL, EINVAL);
    FAILS_WITH(ibv_reg_dm_mr(pd, d, 0, 4096, rw | IBV_ACCESS_ZERO_BASED | IBV_ACCESS_ON_DEMAND), NULL, EINVAL);
    struct ibv_mr *dmr = ibv_reg_dm_mr(pd, d, 4096, 4096, rw | IBV_ACCESS_ZERO_BASED);
    CHECK(dmr && dmr->addr == NULL && dmr->length == 4096 && dmr->pd == pd, "reg_dm_mr");
    /* Length 0 at the very end: an MR covering nothing (the kernel and mlx5 register it). */
    struct ibv_mr *empty = ibv_reg_dm_mr(pd, d, 8192, 0, rw | IBV_ACCESS_ZERO_BASED);
    CHECK(empty && empty->length == 0 && empty->rkey != dmr->rkey, "reg_dm_mr of length 0");
    FAILS_WITH(ibv_rereg_mr(dmr, IBV_REREG_MR_CHANGE_ACCESS, NULL, NULL, 0, IBV_ACCESS_LOCAL_WRITE),
               IBV_REREG_MR_ERR_CMD, EINVAL);
    CHECK(ibv_free_dm(d) == EBUSY, "free_dm with an MR");

    /* RDMA into and out of it (addresses are offsets in the MR). */
    char *src = map_pages(1);
    struct ibv_mr *smr = ibv_reg_mr(pd, src, page, IBV_ACCESS_LOCAL_WRITE);
    CHECK(smr, "reg_mr");
    fill(src, page, 11);
    struct pair p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 1000, smr->lkey, 24, dmr->rkey, IBV_WC_SUCCESS,
              "write into device memory");
    CHECK(ibv_memcpy_from_dm(back, d, 4096 + 24, 1000) == 0 && memcmp(back, src, 1000) == 0,
          "write into device memory: data");
    CHECK(ibv_memcpy_from_dm(back, d, 4096, 24) == 0 && memcmp(back, host + 4096, 24) == 0,
          "write into device memory: bytes before");
    one_sided(&p, IBV_WR_RDMA_READ, (uintptr_t)src + 2048, 1024, smr->lkey, 0, dmr->rkey, IBV_WC_SUCCESS,
              "read from device memory");
    CHECK(memcmp(src + 2048, host + 4096, 24) == 0 && memcmp(src + 2048 + 24, src, 1000) == 0,
          "read from device memory: data");
    /* Device memory as the local side (an lkey with zero-based addresses). */
    one_sided(&p, IBV_WR_RDMA_WRITE, 24, 100, dmr->lkey, 3000, dmr->rkey, IBV_WC_SUCCESS,
              "write out of device memory");
    CHECK(ibv_memcpy_from_dm(back, d, 4096 + 3000, 100) == 0 && memcmp(back, src, 100) == 0,
          "write out of device memory: data");
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 64, smr->lkey, 4096 - 32, dmr->rkey, IBV_WC_REM_ACCESS_ERR,
              "write past the DM MR");
    pair_free(&p);
    p = pair_new(pd, pd);
    one_sided(&p, IBV_WR_RDMA_WRITE, (uintptr_t)src, 4, smr->lkey, 0, empty->rkey, IBV_WC_REM_ACCESS_ERR,
              "write into the zero-length DM MR");
    pair_free(&p);

    CHECK(ibv_dereg_mr(empty) == 0 && ibv_dereg_mr(dmr) == 0 && ibv_dereg_mr(smr) == 0, "dereg");
    CHECK(ibv_free_dm(d) == 0, "free_dm");
    munmap(src, page);
    printf("dm: ok\n");
}

/* ------------------------------------------------------------------ parent domains */

struct allocs {
    int alloc_calls, free_calls, default_next;
    void *ptrs[16];
    size_t sizes[16];
    uint64_t types[16];
    int n;
};

static void *my_alloc(struct ibv_pd *pd, void *pd_context, size_t size, size_t alignment, uint64_t resource_type)
{
    struct allocs *a = pd_context;
    (void)pd;
    a->alloc_calls++;
    if (a->default_next) {
        a->default_next = 0;
        return IBV_ALLOCATOR_USE_DEFAULT;
    }
    void *p = NULL;
    if (posix_memalign(&p, alignment < sizeof(void *) ? sizeof(void *) : alignment, size) != 0)
        return NULL;
    memset(p, 0, size);
    a->ptrs[a->n] = p;
    a->sizes[a->n] = size;
    a->types[a->n] = resource_type;
    a->n++;
    return p;
}

static void my_free(struct ibv_pd *pd, void *pd_context, void *ptr, uint64_t resource_type)
{
    struct allocs *a = pd_context;
    (void)pd;
    for (int i = 0; i < a->n; i++) {
        if (a->ptrs[i] == ptr) {
            CHECK(a->types[i] == resource_type, "freed with another resource type");
            a->ptrs[i] = NULL;
            a->free_calls++;
            free(ptr);
            return;
        }
    }
    CHECK(0, "free of a pointer the allocator never gave");
}

static void *null_alloc(struct ibv_pd *pd, void *pd_context, size_t size, size_t alignment, uint64_t resource_type)
{
    (void)pd; (void)pd_context; (void)size; (void)alignment; (void)resource_type;
    return NULL;
}

static int owns(struct allocs *a, void *p, uint64_t type)
{
    for (int i = 0; i < a->n; i++)
        if (a->ptrs[i] == p && a->types[i] == type && a->sizes[i] > 0)
            return 1;
    return 0;
}

static void parent(struct ibv_pd *pd)
{
    /* Thread domains. */
    struct ibv_td_init_attr tda = { .comp_mask = 1 };
    FAILS_WITH(ibv_alloc_td(ctx, &tda), NULL, EINVAL);
    tda.comp_mask = 0;
    struct ibv_td *td = ibv_alloc_td(ctx, &tda);
    CHECK(td && td->context == ctx, "alloc_td");

    /* Parent domain argument checks. */
    struct allocs al = { 0 };
    struct ibv_parent_domain_init_attr pa = { .pd = NULL, .td = td };
    FAILS_WITH(ibv_alloc_parent_domain(ctx, &pa), NULL, EINVAL);
    pa.pd = pd;
    pa.comp_mask = 1 << 2;
    FAILS_WITH(ibv_alloc_parent_domain(ctx, &pa), NULL, EINVAL);
    pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS; /* callbacks missing */
    FAILS_WITH(ibv_alloc_parent_domain(ctx, &pa), NULL, EINVAL);

    pa.comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS | IBV_PARENT_DOMAIN_INIT_ATTR_PD_CONTEXT;
    pa.alloc = my_alloc;
    pa.free = my_free;
    pa.pd_context = &al;
    struct ibv_pd *ppd = ibv_alloc_parent_domain(ctx, &pa);
    CHECK(ppd && ppd != pd && ppd->context == ctx, "alloc_parent_domain");
    struct ibv_parent_domain_init_attr nested = { .pd = ppd };
    FAILS_WITH(ibv_alloc_parent_domain(ctx, &nested), NULL, EINVAL);
    CHECK(ibv_dealloc_td(td) == EBUSY, "dealloc_td under a parent domain");
    CHECK(ibv_dealloc_pd(pd) == EBUSY, "dealloc_pd under a parent domain");

    /* A CQ through the parent domain: its object comes from the allocator. */
    struct ibv_cq_init_attr_ex cqa = { .cqe = 32, .wc_flags = IBV_WC_STANDARD_FLAGS,
        .comp_mask = IBV_CQ_INIT_ATTR_MASK_PD | IBV_CQ_INIT_ATTR_MASK_FLAGS,
        .flags = IBV_CREATE_CQ_ATTR_SINGLE_THREADED, .parent_domain = pd };
    FAILS_WITH(ibv_create_cq_ex(ctx, &cqa), NULL, EINVAL); /* a plain PD is no parent domain */
    cqa.parent_domain = ppd;
    struct ibv_cq_ex *cqx = ibv_create_cq_ex(ctx, &cqa);
    CHECK(cqx, "create_cq_ex on the parent domain");
    CHECK(al.alloc_calls == 1 && owns(&al, cqx, 2), "the CQ lives in the allocator's memory (type 2)");
    struct ibv_cq *pcq = ibv_cq_ex_to_cq(cqx);
    /* QPs on the parent domain: both in the allocator's memory (type 1). */
    struct ibv_qp *a = rc_qp(ppd, pcq), *b = rc_qp(ppd, pcq);
    CHECK(al.alloc_calls == 3 && owns(&al, a, 1) && owns(&al, b, 1) && a->pd == ppd, "QPs in the allocator's memory");
    /* IBV_ALLOCATOR_USE_DEFAULT: ugdr allocates; the QP still counts in the parent domain. */
    al.default_next = 1;
    struct ibv_qp *c = rc_qp(ppd, pcq);
    CHECK(al.alloc_calls == 4 && al.n == 3, "USE_DEFAULT");
    CHECK(ibv_destroy_qp(c) == 0 && al.free_calls == 0, "destroy a default-allocated QP");
    to_rts(a, lid, b->qp_num, qp_access);
    to_rts(b, lid, a->qp_num, qp_access);

    /* Traffic: an MR of the parent domain and one of its PD, interchangeable. */
    char *buf = map_pages(1);
    struct ibv_mr *pmr = ibv_reg_mr(ppd, buf, page / 2, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
    struct ibv_mr *bmr = ibv_reg_mr(pd, buf + page / 2, page / 2, IBV_ACCESS_LOCAL_WRITE);
    CHECK(pmr && bmr && pmr->pd == ppd && bmr->pd == pd, "reg_mr on parent and base");
    fill(buf + page / 2, 512, 13);
    struct ibv_sge rsge = { (uintptr_t)buf, 512, pmr->lkey };
    struct ibv_recv_wr rwr = { .wr_id = 5, .sg_list = &rsge, .num_sge = 1 }, *rbad = NULL;
    CHECK(ibv_post_recv(b, &rwr, &rbad) == 0, "post_recv");
    struct ibv_sge ssge = { (uintptr_t)buf + page / 2, 512, bmr->lkey };
    struct ibv_send_wr swr = { .wr_id = 6, .sg_list = &ssge, .num_sge = 1, .opcode = IBV_WR_SEND,
                               .send_flags = IBV_SEND_SIGNALED }, *sbad = NULL;
    CHECK(ibv_post_send(a, &swr, &sbad) == 0, "post_send");
    int got_send = 0, got_recv = 0;
    while (!(got_send && got_recv)) {
        struct ibv_wc wc;
        CHECK(poll_one(pcq, &wc) == 1, "no completion");
        CHECK(wc.status == IBV_WC_SUCCESS, "status %s", ibv_wc_status_str(wc.status));
        if (wc.wr_id == 5) {
            CHECK(wc.opcode == IBV_WC_RECV && wc.byte_len == 512 && wc.qp_num == b->qp_num &&
                  wc.src_qp == a->qp_num && wc.slid == lid && wc.wc_flags == 0, "recv fields");
            got_recv = 1;
        } else {
            CHECK(wc.wr_id == 6 && wc.opcode == IBV_WC_SEND && wc.qp_num == a->qp_num, "send fields");
            got_send = 1;
        }
    }
    CHECK(memcmp(buf, buf + page / 2, 512) == 0, "send through the parent domain: data");
    /* An RDMA WRITE with the parent domain's rkey through the QP (same PD underneath). */
    struct ibv_sge wsge = { (uintptr_t)buf + page / 2 + 512, 256, bmr->lkey };
    struct ibv_send_wr wwr = { .wr_id = 7, .sg_list = &wsge, .num_sge = 1, .opcode = IBV_WR_RDMA_WRITE,
                               .send_flags = IBV_SEND_SIGNALED }, *wbad = NULL;
    wwr.wr.rdma.remote_addr = (uintptr_t)buf + 1024;
    wwr.wr.rdma.rkey = pmr->rkey;
    CHECK(ibv_post_send(a, &wwr, &wbad) == 0, "post write");
    struct ibv_wc wc;
    CHECK(poll_one(pcq, &wc) == 1 && wc.wr_id == 7 && wc.status == IBV_WC_SUCCESS &&
          wc.opcode == IBV_WC_RDMA_WRITE && wc.qp_num == a->qp_num, "write completion");
    CHECK(memcmp(buf + 1024, buf + page / 2 + 512, 256) == 0, "write with the parent domain's rkey: data");

    /* Teardown order: busy while QPs/CQs live; each object's memory freed with its type. */
    CHECK(ibv_dealloc_pd(ppd) == EBUSY, "dealloc parent domain with QPs");
    CHECK(ibv_dereg_mr(pmr) == 0 && ibv_dereg_mr(bmr) == 0, "dereg");
    CHECK(ibv_destroy_qp(a) == 0 && ibv_destroy_qp(b) == 0, "destroy_qp");
    CHECK(al.free_calls == 2, "QP memory freed (%d)", al.free_calls);
    CHECK(ibv_dealloc_pd(ppd) == EBUSY, "dealloc parent domain with a CQ");
    CHECK(ibv_destroy_cq(pcq) == 0 && al.free_calls == 3, "CQ memory freed");
    CHECK(ibv_dealloc_pd(ppd) == 0, "dealloc parent domain");
    CHECK(ibv_dealloc_td(td) == 0, "dealloc_td");
    CHECK(al.alloc_calls == 4 && al.free_calls == 3, "allocator calls %d/%d", al.alloc_calls, al.free_calls);

    /* A failing allocator fails the creation (ENOMEM) and leaves nothing behind. */
    struct ibv_parent_domain_init_attr pb = { .pd = pd, .comp_mask = IBV_PARENT_DOMAIN_INIT_ATTR_ALLOCATORS,
                                              .alloc = null_alloc, .free = my_free };
    struct ibv_pd *failing = ibv_alloc_parent_domain(ctx, &pb);
    CHECK(failing, "alloc_parent_domain without memory");
    struct ibv_cq *plain_cq = ibv_create_cq(ctx, 4, NULL, NULL, 0);
    struct ibv_qp_init_attr init = { .send_cq = plain_cq, .recv_cq = plain_cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
    FAILS_WITH(ibv_create_qp(failing, &init), NULL, ENOMEM);
    cqa.parent_domain = failing;
    FAILS_WITH(ibv_create_cq_ex(ctx, &cqa), NULL, ENOMEM);
    CHECK(ibv_dealloc_pd(failing) == 0, "nothing counted in a parent domain after failures");
    CHECK(ibv_destroy_cq(plain_cq) == 0, "destroy_cq");
    munmap(buf, page);
    printf("parent: ok\n");
}

int main(int argc, char **argv)
{
    page = sysconf(_SC_PAGESIZE);
    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1 && strcmp(ibv_get_device_name(list[0]), "ugdr0") == 0, "no ugdr0");
    ctx = ibv_open_device(list[0]);
    ibv_free_device_list(list);
    CHECK(ctx, "open");
    struct ibv_port_attr port;
    CHECK(ibv_query_port(ctx, 1, &port) == 0, "query_port");
    lid = port.lid;
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc_pd");
    const char *only = argc > 1 ? argv[1] : NULL;
    if (!only || !strcmp(only, "rereg"))
        rereg(pd);
    if (!only || !strcmp(only, "odp"))
        odp(pd);
    if (!only || !strcmp(only, "dm"))
        dm(pd);
    if (!only || !strcmp(only, "parent"))
        parent(pd);
    CHECK(ibv_dealloc_pd(pd) == 0 && ibv_close_device(ctx) == 0, "teardown");
    printf("memory_verbs: ok\n");
    return 0;
}
