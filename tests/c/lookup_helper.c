/* Helpers for tests/lookup.rs (the LID lookup service and the per-host directory).
 *
 *   lookup_helper open [hold]
 *       opens the first verbs device (ugdr0 under ugdr); prints "open ok: lid 0x...." or
 *       "open failed: errno N" and exits 0 or 1. With "hold" it keeps the device open until
 *       killed (its lookup service keeps answering).
 *   lookup_helper bind PORT [hold]
 *       binds and listens on 0.0.0.0:PORT with SO_REUSEADDR and SO_REUSEPORT, as a process
 *       that wants to share ugdr's lookup port would; prints "bind ok" or
 *       "bind failed: errno N" and exits 0 or 1. With "hold" it keeps listening (and never
 *       accepts) until killed.
 *   lookup_helper connect LID
 *       opens the first verbs device and moves an RC QP to RTR towards port LID (QP number
 *       0x100): ugdr resolves the LID then (the directory, or the LID's host's lookup
 *       service). Prints "rtr ok" or "rtr failed: errno N" and exits 0 or 1.
 */
#include <errno.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int open_device(int hold)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	if (!list || n == 0) {
		printf("no device\n");
		return 2;
	}
	errno = 0;
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx) {
		printf("open failed: errno %d\n", errno);
		ibv_free_device_list(list);
		return 1;
	}
	struct ibv_port_attr port;
	if (ibv_query_port(ctx, 1, &port)) {
		printf("query_port failed: errno %d\n", errno);
		return 1;
	}
	printf("open ok: lid 0x%04x\n", port.lid);
	fflush(stdout);
	while (hold)
		pause();
	ibv_close_device(ctx);
	ibv_free_device_list(list);
	return 0;
}

static int connect_lid(const char *lid)
{
	int n = 0;
	struct ibv_device **list = ibv_get_device_list(&n);
	struct ibv_context *ctx = list && n > 0 ? ibv_open_device(list[0]) : NULL;
	if (!ctx) {
		printf("open failed: errno %d\n", errno);
		return 1;
	}
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = pd ? ibv_create_cq(ctx, 4, NULL, NULL, 0) : NULL;
	struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 1, .max_recv_wr = 1, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = cq ? ibv_create_qp(pd, &init) : NULL;
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1 };
	if (!qp || ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT |
				 IBV_QP_ACCESS_FLAGS)) {
		printf("setup failed: errno %d\n", errno);
		return 2;
	}
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = IBV_MTU_1024;
	a.dest_qp_num = 0x100;
	a.max_dest_rd_atomic = 1;
	a.min_rnr_timer = 12;
	a.ah_attr.dlid = (uint16_t)strtoul(lid, NULL, 0);
	a.ah_attr.port_num = 1;
	int rc = ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU |
			       IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC |
			       IBV_QP_MIN_RNR_TIMER);
	if (rc) {
		printf("rtr failed: errno %d\n", rc);
		return 1;
	}
	printf("rtr ok\n");
	return 0;
}

static int bind_port(const char *port, int hold)
{
	int one = 1;
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) ||
	    setsockopt(fd, SOL_SOCKET, SO_REUSEPORT, &one, sizeof one)) {
		printf("socket failed: errno %d\n", errno);
		return 2;
	}
	struct sockaddr_in sa;
	memset(&sa, 0, sizeof sa);
	sa.sin_family = AF_INET;
	sa.sin_port = htons((unsigned short)atoi(port));
	sa.sin_addr.s_addr = htonl(INADDR_ANY);
	if (bind(fd, (struct sockaddr *)&sa, sizeof sa) || listen(fd, 4)) {
		printf("bind failed: errno %d\n", errno);
		return 1;
	}
	printf("bind ok\n");
	fflush(stdout);
	while (hold)
		pause();
	close(fd);
	return 0;
}

int main(int argc, char **argv)
{
	if (argc >= 2 && !strcmp(argv[1], "open"))
		return open_device(argc >= 3 && !strcmp(argv[2], "hold"));
	if (argc == 3 && !strcmp(argv[1], "connect"))
		return connect_lid(argv[2]);
	if (argc >= 3 && !strcmp(argv[1], "bind"))
		return bind_port(argv[2], argc >= 4 && !strcmp(argv[3], "hold"));
	fprintf(stderr, "usage: lookup_helper open [hold] | bind PORT [hold] | connect LID\n");
	return 2;
}
