/* A program that uses UCX itself (its own ucp context, tag messages between two workers)
 * and ugdr's verbs in the same process, run with libugdr.so preloaded:
 *   1. UCX first: its modules (ib, rdmacm) load in this namespace and call ibv_* / rdma_*;
 *      ugdr must send them to the real libraries, without starting its engine (the test reads
 *      ugdr's log: "engine up" may appear only after the "verbs:" line below).
 *   2. ibv_get_device_list and rdma_get_devices: ugdr0 first, then what the real libraries
 *      list; the real libraries must be asked (counted: rdma-core's device discovery opens a
 *      NETLINK_RDMA socket, which this program's socket() sees for every library of its
 *      namespace; ugdr's own UCX lives in another namespace and is not seen).
 *   3. ugdr verbs traffic: rc_loopback's whole program (two RC QPs on ugdr0).
 *   4. UCX tag traffic again, beside ugdr's running engine.
 * With "exhaust" as argument it first uses up the link-map namespaces (dlmopen of libc until
 * the loader refuses), so ugdr's UCX must share this namespace, and runs only step 3.
 * Prints "ucx_beside_ugdr: ok" when everything held. */
#define _GNU_SOURCE
#define main rc_loopback_main
#include "rc_loopback.c"
#undef main

#include <dlfcn.h>
#include <link.h>
#include <linux/netlink.h>
#include <rdma/rdma_cma.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

static int rdma_netlink_sockets;

/* Interposes libc's socket() for this namespace (the executable comes first). */
int socket(int domain, int type, int protocol)
{
    static int (*real_socket)(int, int, int);
    if (!real_socket)
        real_socket = (int (*)(int, int, int))dlsym(RTLD_NEXT, "socket");
    if (domain == AF_NETLINK && protocol == NETLINK_RDMA)
        rdma_netlink_sockets++;
    return real_socket(domain, type, protocol);
}

static void progress_until(ucp_worker_h a, ucp_worker_h b, void *req)
{
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    while (ucp_request_check_status(req) == UCS_INPROGRESS) {
        ucp_worker_progress(a);
        ucp_worker_progress(b);
        clock_gettime(CLOCK_MONOTONIC, &now);
        CHECK(now.tv_sec - start.tv_sec < 10, "UCX request not done in 10 s");
    }
    CHECK(ucp_request_check_status(req) == UCS_OK, "UCX request: %s",
          ucs_status_string(ucp_request_check_status(req)));
    ucp_request_free(req);
}

struct app_ucx {
    ucp_context_h ctx;
    ucp_worker_h w1, w2;
    ucp_ep_h ep;
};

static void ucx_start(struct app_ucx *u)
{
    ucp_params_t params = { .field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_TAG };
    CHECK(ucp_init(&params, NULL, &u->ctx) == UCS_OK, "ucp_init");
    ucp_worker_params_t wp = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                               .thread_mode = UCS_THREAD_MODE_SINGLE };
    CHECK(ucp_worker_create(u->ctx, &wp, &u->w1) == UCS_OK, "worker 1");
    CHECK(ucp_worker_create(u->ctx, &wp, &u->w2) == UCS_OK, "worker 2");
    ucp_address_t *addr;
    size_t len;
    CHECK(ucp_worker_get_address(u->w2, &addr, &len) == UCS_OK, "worker address");
    ucp_ep_params_t ep = { .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = addr };
    CHECK(ucp_ep_create(u->w1, &ep, &u->ep) == UCS_OK, "ucp_ep_create");
    ucp_worker_release_address(u->w2, addr);
}

/* Tag messages of several sizes (eager and rendezvous) from worker 1 to worker 2. */
static void ucx_traffic(struct app_ucx *u, int round)
{
    static const size_t sizes[] = { 8, 4096, 65536, 1 << 20 };
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        size_t n = sizes[i];
        unsigned char *src = malloc(n), *dst = calloc(1, n);
        CHECK(src && dst, "malloc");
        for (size_t k = 0; k < n; k++)
            src[k] = (unsigned char)(k * 13 + round + i);
        ucp_tag_t tag = 0x5500 + i;
        ucp_request_param_t none = { .op_attr_mask = 0 };
        void *r = ucp_tag_recv_nbx(u->w2, dst, n, tag, (ucp_tag_t)-1, &none);
        CHECK(!UCS_PTR_IS_ERR(r) && r != NULL, "tag_recv");
        void *s = ucp_tag_send_nbx(u->ep, src, n, tag, &none);
        CHECK(!UCS_PTR_IS_ERR(s), "tag_send");
        if (s)
            progress_until(u->w1, u->w2, s);
        progress_until(u->w1, u->w2, r);
        CHECK(memcmp(src, dst, n) == 0, "UCX tag message of %zu bytes arrived wrong", n);
        free(src);
        free(dst);
    }
}

static void ucx_stop(struct app_ucx *u)
{
    ucp_request_param_t force = { .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE };
    void *r = ucp_ep_close_nbx(u->ep, &force);
    if (r && !UCS_PTR_IS_ERR(r)) {
        while (ucp_request_check_status(r) == UCS_INPROGRESS) {
            ucp_worker_progress(u->w1);
            ucp_worker_progress(u->w2);
        }
        ucp_request_free(r);
    }
    ucp_worker_destroy(u->w1);
    ucp_worker_destroy(u->w2);
    ucp_cleanup(u->ctx);
}

static void device_lists(void)
{
    int before = rdma_netlink_sockets, n = -1;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1 && strcmp(ibv_get_device_name(list[0]), "ugdr0") == 0, "ibv list");
    for (int i = 1; i < n; i++)
        CHECK(strcmp(ibv_get_device_name(list[i]), "ugdr0") != 0, "ugdr0 listed twice");
    CHECK(list[n] == NULL, "ibv list not NULL-terminated");
    CHECK(rdma_netlink_sockets > before, "ibv_get_device_list did not ask the real libibverbs");
    fprintf(stderr, "ibv devices: %d (ugdr0 and %d real)\n", n, n - 1);
    ibv_free_device_list(list);

    before = rdma_netlink_sockets;
    int m = -1;
    struct ibv_context **contexts = rdma_get_devices(&m);
    CHECK(contexts && m >= 1, "rdma_get_devices: %s", strerror(errno));
    CHECK(strcmp(ibv_get_device_name(contexts[0]->device), "ugdr0") == 0, "rdma list starts with %s",
          ibv_get_device_name(contexts[0]->device));
    CHECK(contexts[m] == NULL, "rdma list not NULL-terminated");
    CHECK(rdma_netlink_sockets > before, "rdma_get_devices did not ask the real librdmacm");
    fprintf(stderr, "rdma devices: %d (ugdr0 and %d real)\n", m, m - 1);
    rdma_free_devices(contexts);
}

static int loaded_here(struct dl_phdr_info *info, size_t size, void *name)
{
    (void)size;
    return info->dlpi_name && strstr(info->dlpi_name, (const char *)name) != NULL;
}

int main(int argc, char **argv)
{
    if (argc > 1 && strcmp(argv[1], "exhaust") == 0) {
        int taken = 0;
        while (dlmopen(LM_ID_NEWLM, "libc.so.6", RTLD_NOW | RTLD_LOCAL) != NULL)
            taken++;
        fprintf(stderr, "namespaces taken: %d (%s)\nverbs:\n", taken, dlerror());
        CHECK(rc_loopback_main() == 0, "rc_loopback");
        CHECK(dl_iterate_phdr(loaded_here, "libucp.so"), "ugdr's UCX is not in this namespace");
        printf("ucx_beside_ugdr: ok\n");
        return 0;
    }

    struct app_ucx u;
    int before = rdma_netlink_sockets;
    ucx_start(&u);
    CHECK(dl_iterate_phdr(loaded_here, "libuct_ib.so"), "UCX's ib module not loaded here");
    CHECK(rdma_netlink_sockets > before, "UCX's ib module did not reach the real libibverbs");
    ucx_traffic(&u, 1);
    fprintf(stderr, "ucx: tag traffic ok\n");

    fprintf(stderr, "verbs:\n"); /* rdma_get_devices opens ugdr0 */
    device_lists();
    CHECK(rc_loopback_main() == 0, "rc_loopback");

    ucx_traffic(&u, 2);
    ucx_stop(&u);
    fprintf(stderr, "ucx: tag traffic beside ugdr ok\n");
    printf("ucx_beside_ugdr: ok\n");
    return 0;
}
