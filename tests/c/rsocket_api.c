/* rsockets' API edge cases and data integrity under ugdr: a server (the parent) and a client
 * (a child forked before either touches RDMA) on 127.0.0.1:PORT (argv[1]); nobody listens on
 * argv[2].
 *
 * A: connection refused on a port nobody listens on; calls before a connection (ENOTCONN).
 * B: 8 MiB client -> server in random-sized pieces through rsend/rwrite/rwritev/rsendmsg,
 *    read back in random-sized pieces through rrecv/rread/rreadv/rrecvmsg, verified; then
 *    8 MiB server -> client the same way; MSG_PEEK leaves the bytes in place.
 * C: the server's non-blocking rrecv with nothing there is EAGAIN; rpoll on a pipe and the
 *    rsocket wakes for the rsocket only, then for both; the client fills the peer without it
 *    reading until EAGAIN, then says how much it sent; the server counts it all.
 * D: rshutdown(SHUT_WR) is a half-close (the server reads 0, still sends, the client still
 *    receives); after the client's rclose the server's rrecv is 0, rpoll reports POLLHUP
 *    without POLLERR, and rsend fails EPIPE.
 * E: a peer that sends and closes before the server reads: the bytes come first. While they
 *    are unread rpoll reports POLLIN without POLLHUP (rstream -T a polls before each read and
 *    takes POLLHUP as a failure); once they are read, rrecv is 0 and rpoll reports POLLHUP. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <rdma/rsocket.h>
#include <stdint.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "checks.h"

#define TOTAL (8u << 20)
#define FILL 0xAB
#define MARK 0xCD
#define TAIL 32768

static uint8_t pattern(uint32_t i, uint32_t seed) { return (uint8_t)((i * 2654435761u) >> 13 ^ seed); }

static uint32_t rnd(uint32_t *s)
{
	*s = *s * 1103515245u + 12345u;
	return *s >> 8;
}

static struct sockaddr_in addr_of(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

/* Sends TOTAL pattern bytes in random pieces, rotating through the four send calls. */
static void send_stream(int rs, uint32_t seed)
{
	static uint8_t buf[300000];
	uint32_t r = seed, off = 0, k = 0;
	while (off < TOTAL) {
		uint32_t n = 1 + rnd(&r) % sizeof buf;
		if (n > TOTAL - off)
			n = TOTAL - off;
		for (uint32_t i = 0; i < n; i++)
			buf[i] = pattern(off + i, seed);
		ssize_t got;
		struct iovec iov[2] = { { buf, n / 2 }, { buf + n / 2, n - n / 2 } };
		struct msghdr msg = { .msg_iov = iov, .msg_iovlen = 2 };
		switch (k++ % 4) {
		case 0: got = rsend(rs, buf, n, 0); break;
		case 1: got = rwrite(rs, buf, n); break;
		case 2: got = rwritev(rs, iov, 2); break;
		default: got = rsendmsg(rs, &msg, 0); break;
		}
		CHECK(got == (ssize_t)n, "blocking send of %u bytes sent %zd", n, got);
		off += n;
	}
}

/* Receives TOTAL bytes in random pieces through the four receive calls and verifies them. */
static void recv_stream(int rs, uint32_t seed)
{
	static uint8_t buf[300000];
	uint32_t r = seed ^ 0x5555, off = 0, k = 0;
	uint8_t peek[4];
	CHECK(rrecv(rs, peek, sizeof peek, MSG_PEEK | MSG_WAITALL) > 0, "peek");
	CHECK(peek[0] == pattern(0, seed), "peeked byte");
	while (off < TOTAL) {
		uint32_t n = 1 + rnd(&r) % sizeof buf;
		if (n > TOTAL - off)
			n = TOTAL - off;
		ssize_t got;
		struct iovec iov[2] = { { buf, n / 3 }, { buf + n / 3, n - n / 3 } };
		struct msghdr msg = { .msg_iov = iov, .msg_iovlen = 2 };
		switch (k++ % 4) {
		case 0: got = rrecv(rs, buf, n, 0); break;
		case 1: got = rread(rs, buf, n); break;
		case 2: got = rreadv(rs, iov, 2); break;
		default: got = rrecvmsg(rs, &msg, 0); break;
		}
		CHECK(got > 0 && got <= (ssize_t)n, "receive of up to %u bytes gave %zd", n, got);
		for (ssize_t i = 0; i < got; i++)
			CHECK(buf[i] == pattern(off + i, seed), "byte %zd of the stream", off + i);
		off += got;
	}
}

static int client(int port, int unused)
{
	scenario = "client A";
	struct sockaddr_in none = addr_of(unused), srv = addr_of(port);
	int rs = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(rs >= 0, "rsocket");
	char b[16];
	CHECK(rrecv(rs, b, sizeof b, 0) == -1 && errno == ENOTCONN, "rrecv before connecting");
	CHECK(rsend(rs, b, sizeof b, 0) == -1 && errno == ENOTCONN, "rsend before connecting");
	socklen_t len = sizeof none;
	CHECK(rgetpeername(rs, (struct sockaddr *)&none, &len) == -1 && errno == ENOTCONN, "rgetpeername");
	none = addr_of(unused);
	CHECK(rconnect(rs, (struct sockaddr *)&none, sizeof none) == -1 && errno == ECONNREFUSED,
	      "connecting where nobody listens");
	CHECK(rclose(rs) == 0, "rclose");

	for (int tries = 0;; tries++) {
		rs = rsocket(AF_INET, SOCK_STREAM, 0);
		CHECK(rs >= 0, "rsocket");
		if (rconnect(rs, (struct sockaddr *)&srv, sizeof srv) == 0)
			break;
		CHECK(errno == ECONNREFUSED && tries < 200, "rconnect");
		rclose(rs);
		usleep(50000);
	}
	struct sockaddr_in peer;
	len = sizeof peer;
	CHECK(rgetpeername(rs, (struct sockaddr *)&peer, &len) == 0 && peer.sin_port == htons(port), "peer");

	scenario = "client B";
	send_stream(rs, 1);
	recv_stream(rs, 2);

	scenario = "client C";
	usleep(300000); /* the server waits in rpoll first */
	CHECK(rsend(rs, "x", 1, 0) == 1, "wake the server");
	usleep(300000);
	CHECK(rfcntl(rs, F_SETFL, O_NONBLOCK) == 0 && (rfcntl(rs, F_GETFL) & O_NONBLOCK), "O_NONBLOCK");
	static uint8_t fill[65536];
	memset(fill, FILL, sizeof fill);
	uint32_t sent = 0;
	for (;;) {
		ssize_t n = rsend(rs, fill, sizeof fill, 0);
		if (n < 0) {
			CHECK(errno == EAGAIN, "non-blocking send into a full window");
			break;
		}
		sent += n;
		CHECK(sent < (64u << 20), "the window never filled");
	}
	CHECK(rfcntl(rs, F_SETFL, 0) == 0, "blocking again");
	uint8_t mark[8] = { MARK, MARK, MARK, MARK };
	memcpy(mark + 4, &sent, 4);
	CHECK(rsend(rs, mark, sizeof mark, 0) == sizeof mark, "mark");
	printf("client: filled %u bytes before EAGAIN\n", sent);

	scenario = "client D";
	CHECK(rshutdown(rs, SHUT_WR) == 0, "rshutdown");
	CHECK(rsend(rs, "y", 1, 0) == -1 && errno == EPIPE, "send after SHUT_WR");
	char bye[4] = { 0 };
	CHECK(rrecv(rs, bye, 3, MSG_WAITALL) == 3 && !memcmp(bye, "bye", 3), "half-close still receives");
	CHECK(rclose(rs) == 0, "rclose");
	CHECK(rsend(rs, "y", 1, 0) == -1 && errno == EBADF, "closed descriptor");

	scenario = "client E";
	rs = rsocket(AF_INET, SOCK_STREAM, 0);
	CHECK(rs >= 0 && rconnect(rs, (struct sockaddr *)&srv, sizeof srv) == 0, "second rconnect");
	static uint8_t tail[TAIL];
	for (uint32_t i = 0; i < TAIL; i++)
		tail[i] = pattern(i, 5);
	CHECK(rsend(rs, tail, TAIL, 0) == TAIL, "the bytes before the close");
	CHECK(rclose(rs) == 0, "rclose after sending");
	return 0;
}

static int server(int port, pid_t child)
{
	scenario = "server A";
	int lrs = rsocket(AF_INET, SOCK_STREAM, 0), one = 1;
	CHECK(lrs >= 0, "rsocket");
	CHECK(rsetsockopt(lrs, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0, "SO_REUSEADDR");
	int v = 1 << 19, got = 0;
	socklen_t len = sizeof got;
	CHECK(rsetsockopt(lrs, SOL_SOCKET, SO_RCVBUF, &v, sizeof v) == 0, "SO_RCVBUF");
	CHECK(rgetsockopt(lrs, SOL_SOCKET, SO_RCVBUF, &got, &len) == 0 && got == v, "SO_RCVBUF back");
	CHECK(rsetsockopt(lrs, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one) == 0, "TCP_NODELAY");
	CHECK(rgetsockopt(lrs, SOL_RDMA, RDMA_RQSIZE, &got, &len) == 0 && got == 8, "RDMA_RQSIZE from SO_RCVBUF");
	CHECK(rsetsockopt(lrs, SOL_SOCKET, SO_BROADCAST, &one, sizeof one) == -1 && errno == ENOPROTOOPT, "unknown option");
	struct sockaddr_in a = addr_of(port);
	CHECK(rbind(lrs, (struct sockaddr *)&a, sizeof a) == 0, "rbind");
	CHECK(rlisten(lrs, 4) == 0, "rlisten");
	struct sockaddr_in from;
	len = sizeof from;
	int rs = raccept(lrs, (struct sockaddr *)&from, &len);
	CHECK(rs >= 0 && from.sin_family == AF_INET, "raccept");
	struct sockaddr_in me;
	len = sizeof me;
	CHECK(rgetsockname(rs, (struct sockaddr *)&me, &len) == 0 && me.sin_port == htons(port), "rgetsockname");
	int err = -1;
	len = sizeof err;
	CHECK(rgetsockopt(rs, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0, "SO_ERROR");

	scenario = "server B";
	recv_stream(rs, 1);
	send_stream(rs, 2);

	scenario = "server C";
	char c;
	CHECK(rrecv(rs, &c, 1, MSG_DONTWAIT) == -1 && errno == EAGAIN, "nothing there yet");
	int p[2];
	CHECK(pipe(p) == 0, "pipe");
	struct pollfd pf[2] = { { .fd = p[0], .events = POLLIN }, { .fd = rs, .events = POLLIN } };
	CHECK(rpoll(pf, 2, 5000) == 1 && pf[1].revents == POLLIN && pf[0].revents == 0, "rpoll wakes for the rsocket");
	CHECK(write(p[1], "z", 1) == 1, "write");
	CHECK(rpoll(pf, 2, 5000) == 2 && pf[0].revents == POLLIN && pf[1].revents == POLLIN, "rpoll: both");
	CHECK(rrecv(rs, &c, 1, 0) == 1 && c == 'x', "the wake-up byte");
	usleep(600000); /* the client fills the window meanwhile */
	static uint8_t buf[100000];
	uint32_t fills = 0;
	uint8_t tail[8];
	int tail_len = 0;
	for (;;) {
		ssize_t n = rrecv(rs, buf, sizeof buf, 0);
		CHECK(n > 0, "fill data");
		for (ssize_t i = 0; i < n; i++) {
			if (tail_len == 0 && buf[i] == FILL) {
				fills++;
				continue;
			}
			CHECK(tail_len < 8, "bytes after the mark");
			tail[tail_len++] = buf[i];
		}
		if (tail_len == 8)
			break;
	}
	uint32_t sent;
	memcpy(&sent, tail + 4, 4);
	CHECK(tail[0] == MARK && sent == fills && fills > 0, "the client sent %u, the server counted %u", sent, fills);

	scenario = "server D";
	CHECK(rrecv(rs, buf, sizeof buf, 0) == 0, "end of stream after SHUT_WR");
	CHECK(rsend(rs, "bye", 3, 0) == 3, "send after the peer's half-close");
	CHECK(rrecv(rs, buf, sizeof buf, 0) == 0, "end of stream after rclose");
	/* A hang-up, not an error, as librdmacm's rsockets report it (its receives, flushed when
	 * the connection went, are no failure of the connection). The client's rclose may still
	 * be on its way: rpoll waits for it. */
	struct pollfd hup = { .fd = rs, .events = POLLIN | POLLOUT };
	for (int i = 0; i < 500; i++) {
		CHECK(rpoll(&hup, 1, 5000) == 1 && !(hup.revents & POLLERR),
		      "rpoll after the peer's close: revents %#x", hup.revents);
		if (hup.revents & POLLHUP)
			break;
		usleep(10000);
	}
	CHECK(hup.revents & POLLHUP, "rpoll after the peer closed: revents %#x", hup.revents);
	ssize_t n = 0;
	for (int i = 0; i < 300 && (n = rsend(rs, "q", 1, 0)) == 1; i++)
		usleep(10000);
	CHECK(n == -1 && errno == EPIPE, "send after the peer closed");
	CHECK(rclose(rs) == 0, "rclose");

	scenario = "server E";
	rs = raccept(lrs, NULL, NULL);
	CHECK(rs >= 0, "second raccept");
	int status;
	CHECK(waitpid(child, &status, 0) == child, "waitpid");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "client exited %d", status);
	usleep(200000); /* the client's rclose returned: its disconnect is here or nearly */
	struct pollfd in = { .fd = rs, .events = POLLIN };
	CHECK(rpoll(&in, 1, 5000) == 1 && in.revents == POLLIN,
	      "rpoll with the peer's bytes unread: revents %#x", in.revents);
	uint32_t have = 0;
	while (have < TAIL) {
		CHECK(rpoll(&in, 1, 5000) == 1 && in.revents == POLLIN,
		      "rpoll with %u of the peer's bytes unread: revents %#x", TAIL - have, in.revents);
		n = rrecv(rs, buf, sizeof buf, 0);
		CHECK(n > 0 && have + n <= TAIL, "the bytes before the close: rrecv gave %zd", n);
		for (ssize_t i = 0; i < n; i++)
			CHECK(buf[i] == pattern(have + i, 5), "byte %u before the close", have + (uint32_t)i);
		have += n;
	}
	CHECK(rrecv(rs, buf, sizeof buf, 0) == 0, "end of stream once the bytes are read");
	CHECK(rpoll(&in, 1, 5000) == 1 && (in.revents & POLLHUP) && !(in.revents & POLLERR),
	      "rpoll once the bytes are read: revents %#x", in.revents);
	CHECK(rclose(rs) == 0 && rclose(lrs) == 0, "rclose");
	close(p[0]);
	close(p[1]);
	return 0;
}

int main(int argc, char **argv)
{
	CHECK(argc == 3, "usage: rsocket_api PORT UNUSED_PORT");
	int port = atoi(argv[1]);
	setvbuf(stdout, NULL, _IONBF, 0);
	pid_t child = fork();
	CHECK(child >= 0, "fork");
	if (child == 0)
		return client(port, atoi(argv[2]));
	server(port, child);
	printf("rsocket_api: %d checks\n", checks);
	printf("rsocket_api: ok\n");
	return 0;
}
