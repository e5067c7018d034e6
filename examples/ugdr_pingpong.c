/*
 * ugdr_pingpong: two processes, one RC queue pair each, through the ugdr_* API only.
 *
 *   server:  ugdr_pingpong [-p port] [-n iters] [-s size]
 *   client:  ugdr_pingpong [-p port] [-n iters] [-s size] HOST
 *
 * The two exchange their ugdr_addr, QP number and an RDMA window (address, rkey) over a TCP
 * socket, then:
 *   1. ping-pong: the client sends `size` bytes from two SGEs, the server checks them and
 *      sends them back, the client checks them; `iters` round trips, timed;
 *   2. RDMA WRITE: the client writes a pattern into the server's window (two SGEs), then
 *      SENDs "written"; the server checks its window;
 *   3. RDMA READ: the server fills its window with another pattern and SENDs "ready"; the
 *      client reads the window (two SGEs) and checks it, then SENDs "done".
 * Every completion's fields are checked (wr_id, status, opcode, byte_len, qp_num).
 *
 * Build: cc -std=c11 -O2 ugdr_pingpong.c $(pkg-config --cflags --libs ugdr)
 */
#define _POSIX_C_SOURCE 200809L
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <ugdr.h>

#define DIE(...)                                                                      \
	do {                                                                          \
		fprintf(stderr, "ugdr_pingpong: " __VA_ARGS__);                       \
		fprintf(stderr, " (line %d)\n", __LINE__);                            \
		exit(1);                                                              \
	} while (0)

enum { WR_SEND = 1, WR_RECV = 2, WR_WRITE = 3, WR_READ = 4 };

/* What each side tells the other, in a fixed big-endian layout. */
struct peer_info {
	struct ugdr_addr addr;
	uint32_t qpn;
	uint32_t rkey;
	uint64_t window;
};

struct side {
	struct ugdr_context *ctx;
	struct ugdr_pd *pd;
	struct ugdr_cq *send_cq, *recv_cq;
	struct ugdr_qp *qp;
	struct ugdr_mr *mr;
	uint8_t *buf; /* [send | recv | window | scratch], `size` bytes each */
	uint32_t size;
	uint32_t qpn;
};

static double now_us(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e6 + ts.tv_nsec / 1e3;
}

static uint64_t be64(uint64_t v)
{
	return ((uint64_t)htonl((uint32_t)v) << 32) | htonl((uint32_t)(v >> 32));
}

static void xfer(int fd, void *p, size_t n, int out)
{
	uint8_t *b = p;
	while (n > 0) {
		ssize_t r = out ? write(fd, b, n) : read(fd, b, n);
		if (r <= 0)
			DIE("socket %s failed: %s", out ? "write" : "read", r ? strerror(errno) : "eof");
		b += r;
		n -= (size_t)r;
	}
}

static void exchange(int fd, const struct peer_info *mine, struct peer_info *theirs)
{
	uint8_t out[48], in[48];
	uint32_t qpn = htonl(mine->qpn), rkey = htonl(mine->rkey);
	uint64_t window = be64(mine->window);
	memcpy(out, mine->addr.raw, UGDR_ADDR_LEN);
	memcpy(out + 32, &qpn, 4);
	memcpy(out + 36, &rkey, 4);
	memcpy(out + 40, &window, 8);
	xfer(fd, out, sizeof(out), 1);
	xfer(fd, in, sizeof(in), 0);
	memcpy(theirs->addr.raw, in, UGDR_ADDR_LEN);
	memcpy(&qpn, in + 32, 4);
	memcpy(&rkey, in + 36, 4);
	memcpy(&window, in + 40, 8);
	theirs->qpn = ntohl(qpn);
	theirs->rkey = ntohl(rkey);
	theirs->window = be64(window);
}

static int tcp_connect(const char *host, const char *port)
{
	struct addrinfo hints = {.ai_family = AF_INET, .ai_socktype = SOCK_STREAM}, *res;
	int fd = -1;
	if (getaddrinfo(host, port, &hints, &res) != 0)
		DIE("cannot resolve %s", host);
	for (int tries = 0; tries < 200 && fd < 0; tries++) {
		fd = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(fd, res->ai_addr, res->ai_addrlen) != 0) {
			close(fd);
			fd = -1;
			nanosleep(&(struct timespec){0, 50000000}, NULL); /* the server may not listen yet */
		}
	}
	freeaddrinfo(res);
	if (fd < 0)
		DIE("cannot connect to %s:%s", host, port);
	return fd;
}

static int tcp_accept(const char *port)
{
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(port))};
	int one = 1, lfd = socket(AF_INET, SOCK_STREAM, 0), fd;
	setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(lfd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(lfd, 1) != 0)
		DIE("cannot listen on port %s: %s", port, strerror(errno));
	fd = accept(lfd, NULL, NULL);
	if (fd < 0)
		DIE("accept: %s", strerror(errno));
	close(lfd);
	return fd;
}

/* Waits (10 s at most) for the next completion on `cq` and checks every field. */
static void expect(struct ugdr_cq *cq, uint64_t wr_id, enum ugdr_wc_opcode opcode, uint32_t byte_len,
		   uint32_t qpn)
{
	struct ugdr_wc wc;
	double until = now_us() + 10e6;
	int n;
	while ((n = ugdr_poll_cq(cq, 1, &wc)) == 0) {
		if (now_us() > until)
			DIE("no completion for wr_id %llu in 10 s", (unsigned long long)wr_id);
	}
	if (n < 0)
		DIE("ugdr_poll_cq: %d", n);
	if (wc.wr_id != wr_id || wc.status != UGDR_WC_SUCCESS || wc.opcode != opcode ||
	    wc.byte_len != byte_len || wc.qp_num != qpn)
		DIE("completion {wr_id %llu status %d opcode %d byte_len %u qp_num %#x}, expected "
		    "{%llu 0 %d %u %#x}",
		    (unsigned long long)wc.wr_id, wc.status, wc.opcode, wc.byte_len, wc.qp_num,
		    (unsigned long long)wr_id, opcode, byte_len, qpn);
}

static void post_recv(struct side *s)
{
	struct ugdr_sge sge = {(uintptr_t)(s->buf + s->size), s->size, s->mr->lkey};
	struct ugdr_recv_wr wr = {.wr_id = WR_RECV, .sg_list = &sge, .num_sge = 1}, *bad = NULL;
	int rc = ugdr_post_recv(s->qp, &wr, &bad);
	if (rc)
		DIE("ugdr_post_recv: %s", strerror(rc));
}

/* Sends `len` bytes of the send area, from two SGEs when there are at least two bytes. */
static void post_send(struct side *s, enum ugdr_wr_opcode op, uint8_t *from, uint32_t len,
		      uint64_t remote_addr, uint32_t rkey, uint64_t wr_id)
{
	uint32_t first = len / 2;
	struct ugdr_sge sge[2] = {{(uintptr_t)from, first, s->mr->lkey},
				  {(uintptr_t)(from + first), len - first, s->mr->lkey}};
	struct ugdr_send_wr wr = {.wr_id = wr_id,
				  .sg_list = first ? sge : sge + 1,
				  .num_sge = first ? 2 : 1,
				  .opcode = op,
				  .send_flags = UGDR_SEND_SIGNALED};
	struct ugdr_send_wr *bad = NULL;
	wr.rdma.remote_addr = remote_addr;
	wr.rdma.rkey = rkey;
	int rc = ugdr_post_send(s->qp, &wr, &bad);
	if (rc)
		DIE("ugdr_post_send: %s", strerror(rc));
}

static void fill(uint8_t *p, uint32_t n, uint32_t seed)
{
	for (uint32_t i = 0; i < n; i++)
		p[i] = (uint8_t)(seed * 131 + i * 7 + (i >> 8));
}

static void check(const uint8_t *p, uint32_t n, uint32_t seed, const char *what)
{
	for (uint32_t i = 0; i < n; i++)
		if (p[i] != (uint8_t)(seed * 131 + i * 7 + (i >> 8)))
			DIE("%s: byte %u is %#x, expected %#x", what, i, p[i],
			    (uint8_t)(seed * 131 + i * 7 + (i >> 8)));
}

static void modify(struct side *s, enum ugdr_qp_state to, const struct peer_info *peer)
{
	struct ugdr_qp_attr attr;
	int mask = UGDR_QP_STATE;
	memset(&attr, 0, sizeof(attr));
	attr.qp_state = to;
	if (peer) {
		attr.dest_qp_num = peer->qpn;
		attr.dest_addr = peer->addr;
		mask |= UGDR_QP_DEST_QPN | UGDR_QP_DEST_ADDR;
	}
	int rc = ugdr_modify_qp(s->qp, &attr, mask);
	if (rc)
		DIE("ugdr_modify_qp to %d: %s", to, strerror(rc));
}

int main(int argc, char **argv)
{
	const char *port = "18601";
	int iters = 1000, opt;
	struct side s;
	memset(&s, 0, sizeof(s));
	s.size = 4096;
	while ((opt = getopt(argc, argv, "p:n:s:")) != -1) {
		switch (opt) {
		case 'p': port = optarg; break;
		case 'n': iters = atoi(optarg); break;
		case 's': s.size = (uint32_t)atoi(optarg); break;
		default: DIE("usage: %s [-p port] [-n iters] [-s size] [server]", argv[0]);
		}
	}
	const char *host = optind < argc ? argv[optind] : NULL;
	int client = host != NULL;
	const char *me = client ? "client" : "server";
	if (s.size < 16 || iters < 1)
		DIE("size must be >= 16 and iters >= 1");

	int num = 0;
	struct ugdr_device **list = ugdr_get_device_list(&num);
	if (!list || num < 1)
		DIE("no ugdr device: %s", strerror(errno));
	s.ctx = ugdr_open_device(list[0]);
	if (!s.ctx)
		DIE("ugdr_open_device(%s): %s", list[0]->name, strerror(errno));
	printf("%s: device %s (numa node %d, %d GPUs)\n", me, list[0]->name, list[0]->numa_node,
	       list[0]->num_gpu);
	ugdr_free_device_list(list);

	if (!(s.pd = ugdr_alloc_pd(s.ctx)))
		DIE("ugdr_alloc_pd: %s", strerror(errno));
	if (posix_memalign((void **)&s.buf, 4096, 4 * (size_t)s.size))
		DIE("out of memory");
	memset(s.buf, 0, 4 * (size_t)s.size);
	s.mr = ugdr_reg_mr(s.pd, s.buf, 4 * (size_t)s.size,
			   UGDR_ACCESS_LOCAL_WRITE | UGDR_ACCESS_REMOTE_WRITE | UGDR_ACCESS_REMOTE_READ);
	if (!s.mr)
		DIE("ugdr_reg_mr: %s", strerror(errno));
	s.send_cq = ugdr_create_cq(s.ctx, 64);
	s.recv_cq = ugdr_create_cq(s.ctx, 64);
	if (!s.send_cq || !s.recv_cq)
		DIE("ugdr_create_cq: %s", strerror(errno));
	struct ugdr_qp_init_attr init;
	memset(&init, 0, sizeof(init));
	init.send_cq = s.send_cq;
	init.recv_cq = s.recv_cq;
	init.max_send_wr = 16;
	init.max_recv_wr = 16;
	init.max_sge = 2;
	init.qp_type = UGDR_QPT_RC;
	if (!(s.qp = ugdr_create_qp(s.pd, &init)))
		DIE("ugdr_create_qp: %s", strerror(errno));
	s.qpn = ugdr_qp_num(s.qp);
	modify(&s, UGDR_QPS_INIT, NULL);
	post_recv(&s);

	struct peer_info mine, peer;
	memset(&mine, 0, sizeof(mine));
	if (ugdr_query_addr(s.ctx, &mine.addr))
		DIE("ugdr_query_addr: %s", strerror(errno));
	mine.qpn = s.qpn;
	mine.rkey = s.mr->rkey;
	mine.window = (uintptr_t)(s.buf + 2 * (size_t)s.size);
	int fd = client ? tcp_connect(host, port) : tcp_accept(port);
	exchange(fd, &mine, &peer);
	modify(&s, UGDR_QPS_RTR, &peer);
	modify(&s, UGDR_QPS_RTS, NULL);
	char sync = 's';
	xfer(fd, &sync, 1, 1); /* both sides are in RTS before the first message */
	xfer(fd, &sync, 1, 0);

	uint8_t *send_area = s.buf, *recv_area = s.buf + s.size;
	uint8_t *window = s.buf + 2 * (size_t)s.size, *scratch = s.buf + 3 * (size_t)s.size;

	/* 1. ping-pong */
	double start = now_us();
	for (int i = 0; i < iters; i++) {
		if (client) {
			fill(send_area, s.size, (uint32_t)i);
			post_send(&s, UGDR_WR_SEND, send_area, s.size, 0, 0, WR_SEND);
			expect(s.send_cq, WR_SEND, UGDR_WC_SEND, s.size, s.qpn);
			expect(s.recv_cq, WR_RECV, UGDR_WC_RECV, s.size, s.qpn);
			check(recv_area, s.size, (uint32_t)i, "pong");
			post_recv(&s);
		} else {
			expect(s.recv_cq, WR_RECV, UGDR_WC_RECV, s.size, s.qpn);
			check(recv_area, s.size, (uint32_t)i, "ping");
			post_recv(&s);
			memcpy(send_area, recv_area, s.size);
			post_send(&s, UGDR_WR_SEND, send_area, s.size, 0, 0, WR_SEND);
			expect(s.send_cq, WR_SEND, UGDR_WC_SEND, s.size, s.qpn);
		}
	}
	double rtt = (now_us() - start) / iters;
	printf("%s: %d round trips of %u bytes (2 SGEs), %.2f us each\n", me, iters, s.size, rtt);

	/* 2. RDMA WRITE into the server's window, then "written" */
	if (client) {
		fill(send_area, s.size, 1000);
		post_send(&s, UGDR_WR_RDMA_WRITE, send_area, s.size, peer.window, peer.rkey, WR_WRITE);
		expect(s.send_cq, WR_WRITE, UGDR_WC_RDMA_WRITE, s.size, s.qpn);
		memcpy(send_area, "written", 8);
		post_send(&s, UGDR_WR_SEND, send_area, 8, 0, 0, WR_SEND);
		expect(s.send_cq, WR_SEND, UGDR_WC_SEND, 8, s.qpn);
	} else {
		expect(s.recv_cq, WR_RECV, UGDR_WC_RECV, 8, s.qpn);
		if (memcmp(recv_area, "written", 8))
			DIE("expected \"written\"");
		check(window, s.size, 1000, "RDMA WRITE target");
		printf("%s: RDMA WRITE of %u bytes checked\n", me, s.size);
		post_recv(&s);
	}

	/* 3. RDMA READ of the server's window */
	if (client) {
		expect(s.recv_cq, WR_RECV, UGDR_WC_RECV, 6, s.qpn);
		if (memcmp(recv_area, "ready", 6))
			DIE("expected \"ready\"");
		post_recv(&s);
		post_send(&s, UGDR_WR_RDMA_READ, scratch, s.size, peer.window, peer.rkey, WR_READ);
		expect(s.send_cq, WR_READ, UGDR_WC_RDMA_READ, s.size, s.qpn);
		check(scratch, s.size, 2000, "RDMA READ result");
		printf("%s: RDMA READ of %u bytes checked\n", me, s.size);
		memcpy(send_area, "done", 5);
		post_send(&s, UGDR_WR_SEND, send_area, 5, 0, 0, WR_SEND);
		expect(s.send_cq, WR_SEND, UGDR_WC_SEND, 5, s.qpn);
	} else {
		fill(window, s.size, 2000);
		memcpy(send_area, "ready", 6);
		post_send(&s, UGDR_WR_SEND, send_area, 6, 0, 0, WR_SEND);
		expect(s.send_cq, WR_SEND, UGDR_WC_SEND, 6, s.qpn);
		expect(s.recv_cq, WR_RECV, UGDR_WC_RECV, 5, s.qpn);
		if (memcmp(recv_area, "done", 5))
			DIE("expected \"done\"");
	}
	xfer(fd, &sync, 1, 1); /* neither side tears down while the other still needs it */
	xfer(fd, &sync, 1, 0);
	close(fd);

	if (ugdr_destroy_qp(s.qp) || ugdr_destroy_cq(s.send_cq) || ugdr_destroy_cq(s.recv_cq) ||
	    ugdr_dereg_mr(s.mr) || ugdr_dealloc_pd(s.pd) || ugdr_close_device(s.ctx))
		DIE("teardown failed: %s", strerror(errno));
	free(s.buf);
	printf("%s: ok\n", me);
	return 0;
}
