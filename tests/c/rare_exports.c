/* The rarely used libibverbs/librdmacm entry points, called with ugdr's objects, linked
 * against the real libraries and run with libugdr.so preloaded. Each must answer as rdma-core
 * answers (for a device without the feature, where ugdr has none); none may reach the real
 * library (which would read ugdr's objects as its own and crash). Importing (a second
 * context on a dup of the command fd, sharing PDs, MRs and DMs by handle) is carried.
 * Exit 0 only if every check holds. */
#include <infiniband/verbs.h>
#include <rdma/rsocket.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <unistd.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, " (errno %d)\n", errno); exit(1); } } while (0)

/* errno must be exactly `e` after a call that failed. */
#define FAILS_WITH(call, bad, e) do { errno = 0; CHECK((call) == (bad) && errno == (e), "%s", #call); } while (0)

static void data_in_order(struct ibv_qp *qp, const char *what)
{
    /* ugdr copies received data with memcpy, whose stores may become visible out of order:
     * a reader must poll the completion, not the data (0, as rdma-core's default). */
    enum ibv_wr_opcode ops[] = { IBV_WR_SEND, IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_WRITE,
                                 IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_RDMA_READ };
    for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
        CHECK(ibv_query_qp_data_in_order(qp, ops[i], 0) == 0, "%s data in order, op %d", what, ops[i]);
        /* rdma-core 45+ callers pass IBV_QUERY_QP_DATA_IN_ORDER_RETURN_CAPS (1): no caps. */
        CHECK(ibv_query_qp_data_in_order(qp, ops[i], 1) == 0, "%s in-order caps, op %d", what, ops[i]);
    }
}

static void imports(struct ibv_context *ctx, struct ibv_pd *pd, struct ibv_mr *mr)
{
    /* The command fd is a file of the context's own; a duplicate of it opens a second context
     * on the same device, where the first one's PDs, MRs and DMs are found by their handles. */
    CHECK(ctx->cmd_fd >= 0 && pd->handle && mr->handle && mr->handle != pd->handle,
          "cmd_fd %d pd handle %u mr handle %u", ctx->cmd_fd, pd->handle, mr->handle);
    FAILS_WITH(ibv_import_device(-1), NULL, EINVAL);
    int fd = dup(ctx->cmd_fd);
    CHECK(fd >= 0, "dup cmd_fd");
    struct ibv_context *ictx = ibv_import_device(fd);
    CHECK(ictx && ictx != ctx && ictx->cmd_fd == fd && ictx->device == ctx->device, "import_device");
    struct ibv_pd *ipd = ibv_import_pd(ictx, pd->handle);
    CHECK(ipd && ipd != pd && ipd->context == ictx && ipd->handle == pd->handle, "import_pd");
    struct ibv_mr *imr = ibv_import_mr(ipd, mr->handle);
    CHECK(imr && imr != mr && imr->context == ictx && imr->pd == ipd && imr->addr == NULL &&
          imr->length == mr->length && imr->lkey == mr->lkey && imr->rkey == mr->rkey &&
          imr->handle == mr->handle, "import_mr");
    /* Handles naming nothing, or an object of another kind: ENOENT. */
    FAILS_WITH(ibv_import_pd(ictx, 0), NULL, ENOENT);
    FAILS_WITH(ibv_import_pd(ictx, mr->handle), NULL, ENOENT);
    FAILS_WITH(ibv_import_mr(ipd, pd->handle), NULL, ENOENT);
    FAILS_WITH(ibv_import_dm(ictx, 0), NULL, ENOENT);
    /* Another device context's objects are not found, nor an MR through another PD. */
    struct ibv_context *other = ibv_open_device(ctx->device);
    CHECK(other && other->cmd_fd >= 0 && other->cmd_fd != ctx->cmd_fd, "second context");
    struct ibv_pd *opd = ibv_alloc_pd(other);
    CHECK(opd && opd->handle != pd->handle, "alloc_pd on the second context");
    FAILS_WITH(ibv_import_pd(ictx, opd->handle), NULL, ENOENT);
    FAILS_WITH(ibv_import_pd(other, pd->handle), NULL, ENOENT);
    FAILS_WITH(ibv_import_mr(opd, mr->handle), NULL, ENOENT);
    /* The imported PD is the PD: busy while the MR is registered on it. */
    errno = 0;
    CHECK(ibv_dealloc_pd(ipd) == EBUSY && errno == EBUSY, "dealloc of the imported PD under an MR");
    /* Device memory: written through one struct, read through the other. */
    struct ibv_alloc_dm_attr da = { .length = 4096 };
    struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
    CHECK(dm && dm->handle && dm->handle != mr->handle, "alloc_dm");
    struct ibv_dm *idm = ibv_import_dm(ictx, dm->handle);
    CHECK(idm && idm != dm && idm->context == ictx && idm->handle == dm->handle, "import_dm");
    FAILS_WITH(ibv_import_dm(other, dm->handle), NULL, ENOENT);
    unsigned char in[256], out[256];
    for (int i = 0; i < 256; i++)
        in[i] = (unsigned char)(i * 7 + 3);
    memset(out, 0, sizeof out);
    CHECK(ibv_memcpy_to_dm(dm, 512, in, sizeof in) == 0 && ibv_memcpy_from_dm(out, idm, 512, sizeof out) == 0 &&
          memcmp(in, out, sizeof in) == 0, "data through the imported DM");
    /* Freeing through the imported struct frees the DM; the original struct may only be
     * unimported from then on. */
    CHECK(ibv_free_dm(idm) == 0, "free_dm through the imported struct");
    errno = 0;
    CHECK(ibv_free_dm(dm) == EINVAL && errno == EINVAL, "free_dm of a freed DM");
    FAILS_WITH(ibv_import_dm(ictx, dm->handle), NULL, ENOENT);
    ibv_unimport_dm(dm);
    /* Unimporting frees one struct: the objects stay, importable again. */
    ibv_unimport_mr(imr);
    ibv_unimport_pd(ipd);
    CHECK(mr->pd == pd && mr->context == ctx, "mr after unimport");
    struct ibv_pd *again = ibv_import_pd(ictx, pd->handle);
    CHECK(again && again != pd, "import_pd after unimport");
    ibv_unimport_pd(again);
    CHECK(ibv_close_device(ictx) == 0, "close the imported context");
    errno = 0;
    CHECK(fcntl(fd, F_GETFD) == -1 && errno == EBADF, "the imported context kept its cmd_fd open");
    CHECK(ibv_dealloc_pd(opd) == 0 && ibv_close_device(other) == 0, "second context teardown");
    /* A character device that is no uverbs node: the real library searches its own devices
     * only (not ugdr0, whose private tail it cannot read) and finds none. */
    int nfd = open("/dev/null", O_RDWR);
    CHECK(nfd >= 0, "open /dev/null");
    FAILS_WITH(ibv_import_device(nfd), NULL, ENODEV);
    close(nfd);
}

static void eth_l2(struct ibv_context *ctx)
{
    union ibv_gid gid;
    CHECK(ibv_query_gid(ctx, 1, 0, &gid) == 0, "query_gid");
    struct ibv_ah_attr ah = { .is_global = 1, .port_num = 1 };
    ah.grh.dgid = gid;
    ah.grh.sgid_index = 0;
    uint8_t mac[6] = { 0xa5, 0xa5, 0xa5, 0xa5, 0xa5, 0xa5 };
    uint16_t vid = 0xa5a5;
    /* An InfiniBand port has no Ethernet neighbour: -EINVAL, as rdma-core answers when no
     * interface holds the GID's address; nothing written. */
    errno = 0;
    CHECK(ibv_resolve_eth_l2_from_gid(ctx, &ah, mac, &vid) == -EINVAL && errno == EINVAL, "resolve_eth_l2");
    CHECK(mac[0] == 0xa5 && mac[5] == 0xa5 && vid == 0xa5a5, "resolve_eth_l2 wrote its outputs");
    /* A GID index the port does not have: the ibv_query_gid failure, as rdma-core. */
    ah.grh.sgid_index = 7;
    CHECK(ibv_resolve_eth_l2_from_gid(ctx, &ah, mac, &vid) == -1 && errno == EINVAL, "resolve_eth_l2 bad sgid");
}

static void rsockets(void)
{
    /* Stream and datagram rsockets are ugdr's own (tests/rsocket.rs). A descriptor that is no
     * rsocket is EBADF for every call, and real descriptors are left alone. */
    int rs = rsocket(AF_INET, SOCK_STREAM, 0);
    CHECK(rs >= 0, "rsocket(SOCK_STREAM)");
    CHECK(rclose(rs) == 0, "rclose");
    FAILS_WITH(rclose(rs), -1, EBADF);
    rs = rsocket(AF_INET6, SOCK_DGRAM, 0);
    CHECK(rs >= 0, "rsocket(SOCK_DGRAM)");
    CHECK(rclose(rs) == 0, "rclose");
    FAILS_WITH(rclose(rs), -1, EBADF);
    FAILS_WITH(rsocket(AF_INET6, SOCK_DGRAM, IPPROTO_TCP), -1, EPROTONOSUPPORT);
    FAILS_WITH(rsocket(AF_UNIX, SOCK_STREAM, 0), -1, EAFNOSUPPORT);
    struct sockaddr_in sin = { .sin_family = AF_INET, .sin_port = htons(1) };
    sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct sockaddr *sa = (struct sockaddr *)&sin;
    socklen_t len = sizeof sin;
    char buf[16] = "x";
    struct iovec iov = { .iov_base = buf, .iov_len = sizeof buf };
    struct msghdr msg = { .msg_iov = &iov, .msg_iovlen = 1 };
    int val = 1;
    int fds[] = { 0, 1, 2, 1000 };
    for (size_t i = 0; i < sizeof fds / sizeof fds[0]; i++) {
        int s = fds[i];
        FAILS_WITH(rbind(s, sa, len), -1, EBADF);
        FAILS_WITH(rlisten(s, 1), -1, EBADF);
        FAILS_WITH(raccept(s, sa, &len), -1, EBADF);
        FAILS_WITH(rconnect(s, sa, len), -1, EBADF);
        FAILS_WITH(rshutdown(s, SHUT_RDWR), -1, EBADF);
        FAILS_WITH(rrecv(s, buf, sizeof buf, 0), -1, EBADF);
        FAILS_WITH(rrecvfrom(s, buf, sizeof buf, 0, sa, &len), -1, EBADF);
        FAILS_WITH(rrecvmsg(s, &msg, 0), -1, EBADF);
        FAILS_WITH(rread(s, buf, sizeof buf), -1, EBADF);
        FAILS_WITH(rreadv(s, &iov, 1), -1, EBADF);
        FAILS_WITH(rsend(s, buf, 1, 0), -1, EBADF);
        FAILS_WITH(rsendto(s, buf, 1, 0, sa, len), -1, EBADF);
        FAILS_WITH(rsendmsg(s, &msg, 0), -1, EBADF);
        FAILS_WITH(rwrite(s, buf, 1), -1, EBADF);
        FAILS_WITH(rwritev(s, &iov, 1), -1, EBADF);
        FAILS_WITH(rgetpeername(s, sa, &len), -1, EBADF);
        FAILS_WITH(rgetsockname(s, sa, &len), -1, EBADF);
        FAILS_WITH(rsetsockopt(s, SOL_SOCKET, SO_REUSEADDR, &val, sizeof val), -1, EBADF);
        FAILS_WITH(rgetsockopt(s, SOL_SOCKET, SO_REUSEADDR, &val, &len), -1, EBADF);
        FAILS_WITH(rfcntl(s, F_GETFL), -1, EBADF);
        FAILS_WITH(riomap(s, buf, sizeof buf, PROT_WRITE, 0, -1), (off_t)-1, EBADF);
        FAILS_WITH(riounmap(s, buf, sizeof buf), -1, EBADF);
        FAILS_WITH(riowrite(s, buf, 1, 0, 0), (size_t)-1, EBADF);
        FAILS_WITH(rclose(s), -1, EBADF);
    }
    /* rclose(1) did not close stdout. */
    CHECK(fcntl(1, F_GETFD) != -1, "stdout closed");
    /* rpoll/rselect on plain descriptors behave as poll/select (rsockets' own rule). */
    int p[2];
    CHECK(pipe(p) == 0, "pipe");
    struct pollfd pfd[2] = { { .fd = p[0], .events = POLLIN }, { .fd = p[1], .events = POLLOUT } };
    CHECK(rpoll(pfd, 1, 0) == 0 && pfd[0].revents == 0, "rpoll on an empty pipe");
    CHECK(write(p[1], "y", 1) == 1, "write");
    CHECK(rpoll(pfd, 2, 1000) == 2 && pfd[0].revents == POLLIN && pfd[1].revents == POLLOUT, "rpoll");
    fd_set r;
    FD_ZERO(&r);
    FD_SET(p[0], &r);
    struct timeval tv = { .tv_sec = 1 };
    CHECK(rselect(p[0] + 1, &r, NULL, NULL, &tv) == 1 && FD_ISSET(p[0], &r), "rselect");
    close(p[0]);
    close(p[1]);
}

int main(void)
{
    struct ibv_device **list = ibv_get_device_list(NULL);
    CHECK(list, "no device list");
    struct ibv_context *ctx = NULL;
    for (struct ibv_device **d = list; *d && !ctx; d++)
        if (strcmp(ibv_get_device_name(*d), "ugdr0") == 0)
            ctx = ibv_open_device(*d);
    ibv_free_device_list(list);
    CHECK(ctx, "ugdr0 not listed or not opened");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd, "alloc_pd");
    static char mem[4096];
    struct ibv_mr *mr = ibv_reg_mr(pd, mem, sizeof mem, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr, "reg_mr");
    struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
    CHECK(cq, "create_cq");
    enum ibv_qp_type types[] = { IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD };
    const char *names[] = { "RC", "UC", "UD" };
    for (int i = 0; i < 3; i++) {
        struct ibv_qp_init_attr ia = { .send_cq = cq, .recv_cq = cq, .qp_type = types[i],
                                       .cap = { .max_send_wr = 4, .max_recv_wr = 4,
                                                .max_send_sge = 1, .max_recv_sge = 1 } };
        struct ibv_qp *qp = ibv_create_qp(pd, &ia);
        CHECK(qp, "create_qp %s", names[i]);
        data_in_order(qp, names[i]);
        CHECK(ibv_destroy_qp(qp) == 0, "destroy_qp");
    }
    imports(ctx, pd, mr);
    eth_l2(ctx);
    rsockets();
    /* Everything is still ugdr's and still works. */
    struct ibv_mr *mr2 = ibv_reg_mr(pd, mem, 64, IBV_ACCESS_LOCAL_WRITE);
    CHECK(mr2 && ibv_dereg_mr(mr2) == 0, "reg_mr after unimport_pd");
    /* Deregistering through an imported struct deregisters the MR: the original struct may
     * only be unimported; the PD then goes through its imported struct. */
    int fd = dup(ctx->cmd_fd);
    struct ibv_context *ictx = ibv_import_device(fd);
    struct ibv_pd *ipd = ictx ? ibv_import_pd(ictx, pd->handle) : NULL;
    struct ibv_mr *imr = ipd ? ibv_import_mr(ipd, mr->handle) : NULL;
    CHECK(imr && ibv_dereg_mr(imr) == 0, "dereg_mr through the imported struct");
    errno = 0;
    CHECK(ibv_dereg_mr(mr) == EINVAL && errno == EINVAL, "dereg_mr of a deregistered MR");
    ibv_unimport_mr(mr);
    CHECK(ibv_dealloc_pd(ipd) == 0, "dealloc_pd through the imported struct");
    errno = 0;
    CHECK(ibv_dealloc_pd(pd) == EINVAL && errno == EINVAL, "dealloc_pd of a deallocated PD");
    ibv_unimport_pd(pd);
    CHECK(ibv_close_device(ictx) == 0, "close the imported context");
    CHECK(ibv_destroy_cq(cq) == 0, "destroy_cq");
    CHECK(ibv_close_device(ctx) == 0, "close_device");
    printf("rare_exports: ok\n");
    return 0;
}
