/* Datagram rsockets (SOCK_DGRAM) under ugdr: the API on data and its error cases, in one
 * process with several sockets on 127.0.0.1.
 *
 * A: creation, bind (port chosen, EINVAL bound twice, EADDRINUSE), calls a datagram socket
 *    refuses (rlisten, raccept, riomap: EOPNOTSUPP; rsend unconnected EDESTADDRREQ;
 *    rgetpeername, rshutdown unconnected: ENOTCONN).
 * B: 128 datagrams of random sizes (0 to the largest, 4080 bytes) A -> B, each received
 *    whole, in its own receive, verified byte for byte, with A's address as the source.
 * C: truncation (rest discarded; MSG_TRUNC returns the full length; rrecvmsg sets MSG_TRUNC),
 *    MSG_PEEK, EMSGSIZE above 4080 bytes, rsendmsg/rrecvmsg with iovecs and names.
 * D: non-blocking (MSG_DONTWAIT, O_NONBLOCK via rfcntl) EAGAIN; rpoll and rselect readiness.
 * E: rconnect: rsend/rrecv, rgetpeername, datagrams from another socket are not received;
 *    rshutdown(SHUT_WR) then rsend is EPIPE.
 * F: rclose frees the port at once; a datagram to a port nobody listens on is sent (its
 *    length) and silently lost.
 * G: hostile bytes on B's UDP port (junk, malformed or forged resolution messages, a large
 *    datagram) change nothing; a well-formed REQ gets exactly one well-formed answer.
 * H: rclose, then EBADF. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <rdma/rsocket.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "checks.h"

#define MAXD 4080

static double now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

static uint8_t pattern(uint32_t i, uint32_t seed) { return (uint8_t)((i * 2654435761u) >> 13 ^ seed); }

static uint32_t rnd(uint32_t *s)
{
	*s = *s * 1103515245u + 12345u;
	return *s >> 8;
}

static struct sockaddr_in loopback(int port)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port) };
	a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	return a;
}

static int dgram_on(struct sockaddr_in *bound)
{
	int s = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(s >= 0, "rsocket");
	struct sockaddr_in a = loopback(0);
	CHECK(rbind(s, (struct sockaddr *)&a, sizeof a) == 0, "rbind");
	socklen_t len = sizeof *bound;
	CHECK(rgetsockname(s, (struct sockaddr *)bound, &len) == 0, "rgetsockname");
	CHECK(len == sizeof *bound && bound->sin_port != 0, "a port was chosen");
	return s;
}

static int same(const struct sockaddr_in *a, const struct sockaddr_in *b)
{
	return a->sin_family == b->sin_family && a->sin_port == b->sin_port &&
	       a->sin_addr.s_addr == b->sin_addr.s_addr;
}

/* Receives one datagram on `s` (waiting at most 5 s): its length, source in `from`. */
static ssize_t recv_one(int s, void *buf, size_t len, int flags, struct sockaddr_in *from)
{
	struct pollfd p = { .fd = s, .events = POLLIN };
	CHECK(rpoll(&p, 1, 5000) == 1 && (p.revents & POLLIN), "a datagram within 5 s");
	socklen_t fl = sizeof *from;
	ssize_t n = rrecvfrom(s, buf, len, flags, (struct sockaddr *)from, &fl);
	CHECK(n < 0 || fl == sizeof *from, "source length %u", fl);
	return n;
}

int main(void)
{
	static uint8_t buf[8192], got[8192];
	struct sockaddr_in aaddr, baddr, from;

	scenario = "A";
	int a = dgram_on(&aaddr), b = dgram_on(&baddr);
	errno = 0;
	CHECK(rsocket(AF_INET, SOCK_DGRAM, IPPROTO_TCP) == -1 && errno == EPROTONOSUPPORT, "TCP");
	errno = 0;
	CHECK(rsocket(AF_UNIX, SOCK_DGRAM, 0) == -1 && errno == EAFNOSUPPORT, "AF_UNIX");
	struct sockaddr_in any = loopback(0);
	errno = 0;
	CHECK(rbind(a, (struct sockaddr *)&any, sizeof any) == -1 && errno == EINVAL, "bound twice");
	int c = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(c >= 0, "rsocket");
	errno = 0;
	CHECK(rbind(c, (struct sockaddr *)&baddr, sizeof baddr) == -1 && errno == EADDRINUSE,
	      "B's port is taken");
	struct sockaddr_in caddr = loopback(0);
	CHECK(rbind(c, (struct sockaddr *)&caddr, sizeof caddr) == 0, "rbind c");
	socklen_t cl = sizeof caddr;
	CHECK(rgetsockname(c, (struct sockaddr *)&caddr, &cl) == 0, "rgetsockname c");
	errno = 0;
	CHECK(rlisten(a, 1) == -1 && errno == EOPNOTSUPP, "rlisten");
	errno = 0;
	CHECK(raccept(a, NULL, NULL) == -1 && errno == EOPNOTSUPP, "raccept");
	errno = 0;
	CHECK(riomap(a, buf, 4096, PROT_WRITE, 0, -1) == -1 && errno == EOPNOTSUPP, "riomap");
	errno = 0;
	CHECK(rsend(a, "x", 1, 0) == -1 && errno == EDESTADDRREQ, "rsend unconnected");
	socklen_t pl = sizeof from;
	errno = 0;
	CHECK(rgetpeername(a, (struct sockaddr *)&from, &pl) == -1 && errno == ENOTCONN,
	      "rgetpeername unconnected");
	errno = 0;
	CHECK(rshutdown(a, SHUT_WR) == -1 && errno == ENOTCONN, "rshutdown unconnected");
	int type = 0;
	socklen_t tl = sizeof type;
	CHECK(rgetsockopt(a, SOL_SOCKET, SO_TYPE, &type, &tl) == 0 && type == SOCK_DGRAM, "SO_TYPE");

	scenario = "B";
	uint32_t r = 7;
	enum { COUNT = 128 };
	uint32_t sizes[COUNT];
	for (int i = 0; i < COUNT; i++) {
		sizes[i] = i == 0 ? 0 : i == 1 ? MAXD : rnd(&r) % (MAXD + 1);
		buf[0] = (uint8_t)i;
		for (uint32_t k = 0; k < sizes[i]; k++)
			buf[k] = k == 0 ? (uint8_t)i : pattern(k, i);
		ssize_t n = rsendto(a, buf, sizes[i], 0, (struct sockaddr *)&baddr, sizeof baddr);
		CHECK(n == (ssize_t)sizes[i], "datagram %d: sent %zd of %u", i, n, sizes[i]);
		if (i % 16 == 15) {
			/* Keep within B's ring: take what arrived so far. */
			for (int j = i - 15; j <= i; j++) {
				memset(got, 0xEE, sizeof got);
				n = recv_one(b, got, sizeof got, 0, &from);
				CHECK(n == (ssize_t)sizes[j], "datagram %d: %zd bytes, sent %u", j, n, sizes[j]);
				CHECK(same(&from, &aaddr), "datagram %d from A", j);
				for (uint32_t k = 0; k < sizes[j]; k++)
					CHECK(got[k] == (k == 0 ? (uint8_t)j : pattern(k, j)),
					      "datagram %d byte %u", j, k);
				CHECK(got[sizes[j]] == 0xEE, "datagram %d: nothing beyond it", j);
			}
		}
	}
	errno = 0;
	CHECK(rrecv(b, got, sizeof got, MSG_DONTWAIT) == -1 && errno == EAGAIN, "all taken");

	scenario = "C";
	memset(buf, 0x5A, 1000);
	CHECK(rsendto(a, buf, 1000, 0, (struct sockaddr *)&baddr, sizeof baddr) == 1000, "1000");
	CHECK(rsendto(a, "next", 4, 0, (struct sockaddr *)&baddr, sizeof baddr) == 4, "next");
	CHECK(recv_one(b, got, 100, MSG_PEEK, &from) == 100, "peek 100 of 1000");
	CHECK(recv_one(b, got, 100, MSG_PEEK | MSG_TRUNC, &from) == 1000, "MSG_TRUNC: full length");
	memset(got, 0, sizeof got);
	CHECK(recv_one(b, got, 100, 0, &from) == 100, "100 of 1000, the rest discarded");
	CHECK(got[0] == 0x5A && got[99] == 0x5A && got[100] == 0, "the first 100 bytes only");
	CHECK(recv_one(b, got, sizeof got, 0, &from) == 4 && !memcmp(got, "next", 4),
	      "the next datagram is whole");
	errno = 0;
	CHECK(rsendto(a, buf, MAXD + 1, 0, (struct sockaddr *)&baddr, sizeof baddr) == -1 &&
		      errno == EMSGSIZE,
	      "EMSGSIZE above %d", MAXD);
	struct iovec iov[3] = { { (void *)"abc", 3 }, { (void *)"", 0 }, { (void *)"defgh", 5 } };
	struct msghdr m = { .msg_name = &baddr, .msg_namelen = sizeof baddr, .msg_iov = iov,
			    .msg_iovlen = 3 };
	CHECK(rsendmsg(a, &m, 0) == 8, "rsendmsg");
	char p1[2], p2[3];
	struct iovec in[2] = { { p1, 2 }, { p2, 3 } };
	struct sockaddr_in name;
	struct msghdr rm = { .msg_name = &name, .msg_namelen = sizeof name, .msg_iov = in,
			     .msg_iovlen = 2 };
	struct pollfd pb = { .fd = b, .events = POLLIN };
	CHECK(rpoll(&pb, 1, 5000) == 1, "rpoll");
	CHECK(rrecvmsg(b, &rm, 0) == 5, "rrecvmsg 5 of 8");
	CHECK(!memcmp(p1, "ab", 2) && !memcmp(p2, "cde", 3), "scattered");
	CHECK(rm.msg_flags & MSG_TRUNC, "MSG_TRUNC in msg_flags");
	CHECK(rm.msg_namelen == sizeof name && same(&name, &aaddr), "msg_name is A");

	scenario = "D";
	errno = 0;
	CHECK(rrecv(b, got, sizeof got, MSG_DONTWAIT) == -1 && errno == EAGAIN, "MSG_DONTWAIT");
	CHECK(rfcntl(b, F_SETFL, O_NONBLOCK) == 0, "O_NONBLOCK");
	CHECK(rfcntl(b, F_GETFL) & O_NONBLOCK, "F_GETFL");
	errno = 0;
	CHECK(rrecvfrom(b, got, sizeof got, 0, NULL, NULL) == -1 && errno == EAGAIN, "O_NONBLOCK");
	struct pollfd ps[2] = { { .fd = b, .events = POLLIN }, { .fd = a, .events = POLLOUT } };
	CHECK(rpoll(ps, 2, 0) == 1 && ps[0].revents == 0 && ps[1].revents == POLLOUT,
	      "B not readable, A writable");
	/* Timeouts are waited out in full, as poll(2) and select(2) wait: a 1 ms rpoll once
	 * returned at once (udpong resends on every 1 ms timeout, and then read its own
	 * duplicate echoes). */
	for (int ms = 1; ms <= 3; ms++) {
		double t0 = now_ms();
		CHECK(rpoll(ps, 1, ms) == 0, "rpoll %d ms: nothing", ms);
		CHECK(now_ms() - t0 >= ms, "rpoll waited %d ms (%.3f)", ms, now_ms() - t0);
	}
	{
		fd_set none;
		FD_ZERO(&none);
		FD_SET(b, &none);
		struct timeval half = { .tv_usec = 500 };
		double t0 = now_ms();
		CHECK(rselect(b + 1, &none, NULL, NULL, &half) == 0, "rselect 0.5 ms: nothing");
		CHECK(now_ms() - t0 >= 0.5, "rselect waited 0.5 ms (%.3f)", now_ms() - t0);
	}
	CHECK(rsendto(a, "ping", 4, 0, (struct sockaddr *)&baddr, sizeof baddr) == 4, "ping");
	fd_set rd;
	FD_ZERO(&rd);
	FD_SET(b, &rd);
	struct timeval tv = { .tv_sec = 5 };
	CHECK(rselect(b + 1, &rd, NULL, NULL, &tv) == 1 && FD_ISSET(b, &rd), "rselect: readable");
	CHECK(rpoll(ps, 1, 0) == 1 && ps[0].revents == POLLIN, "rpoll: readable");
	CHECK(rrecv(b, got, sizeof got, 0) == 4, "ping taken");
	CHECK(rfcntl(b, F_SETFL, 0) == 0, "blocking again");

	scenario = "E";
	CHECK(rconnect(a, (struct sockaddr *)&baddr, sizeof baddr) == 0, "rconnect");
	pl = sizeof from;
	CHECK(rgetpeername(a, (struct sockaddr *)&from, &pl) == 0 && same(&from, &baddr),
	      "rgetpeername");
	CHECK(rsend(a, "to-b", 4, 0) == 4, "rsend connected");
	CHECK(recv_one(b, got, sizeof got, 0, &from) == 4 && same(&from, &aaddr), "from A");
	CHECK(rsendto(c, "from-c", 6, 0, (struct sockaddr *)&aaddr, sizeof aaddr) == 6, "c -> a");
	CHECK(rsendto(b, "from-b", 6, 0, (struct sockaddr *)&aaddr, sizeof aaddr) == 6, "b -> a");
	memset(got, 0, sizeof got);
	CHECK(recv_one(a, got, sizeof got, 0, &from) == 6 && !memcmp(got, "from-b", 6) &&
		      same(&from, &baddr),
	      "A hears B only");
	struct pollfd pa = { .fd = a, .events = POLLIN };
	CHECK(rpoll(&pa, 1, 300) == 0, "nothing from C");
	CHECK(rshutdown(a, SHUT_WR) == 0, "rshutdown");
	errno = 0;
	CHECK(rsend(a, "x", 1, 0) == -1 && errno == EPIPE, "EPIPE after SHUT_WR");

	scenario = "F";
	int gone = rsocket(AF_INET, SOCK_DGRAM, 0);
	struct sockaddr_in gaddr;
	CHECK(gone >= 0, "rsocket");
	CHECK(rclose(gone) == 0, "rclose an unbound socket");
	gone = dgram_on(&gaddr);
	usleep(20000); /* the resolution service watches it now (C still asks A: it sleeps) */
	CHECK(rclose(gone) == 0, "rclose");
	/* rclose frees the port at once, as close(2) does. */
	int again = rsocket(AF_INET, SOCK_DGRAM, 0);
	CHECK(again >= 0 && rbind(again, (struct sockaddr *)&gaddr, sizeof gaddr) == 0,
	      "the port is free again after rclose");
	CHECK(rclose(again) == 0, "rclose");
	CHECK(rsendto(b, "lost", 4, 0, (struct sockaddr *)&gaddr, sizeof gaddr) == 4,
	      "sent to nobody");
	CHECK(rsendto(b, "kept", 4, 0, (struct sockaddr *)&caddr, sizeof caddr) == 4, "b -> c");
	CHECK(recv_one(c, got, sizeof got, 0, &from) == 4 && !memcmp(got, "kept", 4), "c hears b");

	scenario = "G";
	int u = socket(AF_INET, SOCK_DGRAM, 0);
	CHECK(u >= 0, "a plain UDP socket");
	struct timeval rto = { .tv_sec = 2 };
	CHECK(setsockopt(u, SOL_SOCKET, SO_RCVTIMEO, &rto, sizeof rto) == 0, "SO_RCVTIMEO");
	uint8_t req[48] = { 0 };
	uint32_t magic = 0x55475251, qpn = 0x123456;
	uint64_t token = 0x0102030405060708ull, zero = 0;
	memcpy(req, &magic, 4);
	req[4] = 1; /* version */
	req[5] = 1; /* REQ */
	memcpy(req + 8, &qpn, 4);
	memcpy(req + 16, &token, 8);
	uint8_t gid[16] = { 0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0x02, 0x55, 0x01, 0x02, 127, 0, 0, 1 };
	memcpy(req + 32, gid, 16);
	struct {
		const uint8_t *p;
		size_t n;
	} junk[8];
	uint8_t bad_magic[48], short_req[47], bad_kind[48], forged_ans[48], zero_token[48];
	memcpy(bad_magic, req, 48);
	bad_magic[0] ^= 1;
	memcpy(short_req, req, 47);
	memcpy(bad_kind, req, 48);
	bad_kind[5] = 9;
	memcpy(forged_ans, req, 48);
	forged_ans[5] = 2; /* ANS echoing a token B never sent */
	memcpy(forged_ans + 24, &token, 8);
	memcpy(zero_token, req, 48);
	memcpy(zero_token + 16, &zero, 8);
	static uint8_t big[60000];
	memset(big, 0xFF, sizeof big);
	junk[0].p = bad_magic, junk[0].n = 48;
	junk[1].p = short_req, junk[1].n = 47;
	junk[2].p = bad_kind, junk[2].n = 48;
	junk[3].p = forged_ans, junk[3].n = 48;
	junk[4].p = zero_token, junk[4].n = 48;
	junk[5].p = big, junk[5].n = sizeof big;
	junk[6].p = big, junk[6].n = 0;
	junk[7].p = req, junk[7].n = 48; /* well-formed: answered */
	for (int i = 0; i < 8; i++)
		CHECK(sendto(u, junk[i].p, junk[i].n, 0, (struct sockaddr *)&caddr, sizeof caddr) ==
			      (ssize_t)junk[i].n,
		      "junk %d", i);
	/* C takes them when it is next called; then answers the one REQ. */
	CHECK(rsendto(b, "after", 5, 0, (struct sockaddr *)&caddr, sizeof caddr) == 5, "b -> c");
	CHECK(recv_one(c, got, sizeof got, 0, &from) == 5 && !memcmp(got, "after", 5) &&
		      same(&from, &baddr),
	      "C still hears B");
	uint8_t ans[64];
	ssize_t an = recv(u, ans, sizeof ans, 0);
	CHECK(an == 48, "one answer of 48 bytes, got %zd", an);
	uint32_t am;
	uint64_t echo;
	memcpy(&am, ans, 4);
	memcpy(&echo, ans + 24, 8);
	CHECK(am == magic && ans[4] == 1 && ans[5] == 2 && echo == token, "an ANS echoing the token");
	CHECK(recv(u, ans, sizeof ans, MSG_DONTWAIT) == -1 && errno == EAGAIN, "nothing else");
	close(u);

	scenario = "H";
	CHECK(rclose(a) == 0 && rclose(b) == 0 && rclose(c) == 0, "rclose");
	errno = 0;
	CHECK(rsendto(a, "x", 1, 0, (struct sockaddr *)&baddr, sizeof baddr) == -1 && errno == EBADF,
	      "EBADF after rclose");
	printf("rsocket_dgram: %d checks\nrsocket_dgram: ok\n", checks);
	return 0;
}
