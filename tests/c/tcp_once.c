/* A one-shot TCP server and client for testing the test harness itself (tests/harness_selftest.rs):
 * ordinary sockets, no verbs, no ugdr.
 *
 *   tcp_once listen ADDR PORT DELAY_MS [hang]
 *       prints "pid N", sleeps DELAY_MS, then listens on ADDR:PORT, accepts one connection,
 *       reads it to EOF and prints "got: <data>". With "hang" it never returns after accepting.
 *   tcp_once connect ADDR PORT MESSAGE
 *       connects once (no retry: a refused connection exits 1), sends MESSAGE, closes.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

static int die(const char *what)
{
	perror(what);
	return 1;
}

static int parse_addr(const char *addr, const char *port, struct sockaddr_in *sa)
{
	memset(sa, 0, sizeof(*sa));
	sa->sin_family = AF_INET;
	sa->sin_port = htons((unsigned short)atoi(port));
	return inet_pton(AF_INET, addr, &sa->sin_addr) == 1 ? 0 : -1;
}

static int serve(const struct sockaddr_in *sa, long delay_ms, int hang)
{
	struct timespec delay = { delay_ms / 1000, (delay_ms % 1000) * 1000000L };
	char buf[4096];
	size_t len = 0;
	ssize_t n;
	int one = 1, fd, conn;

	printf("pid %d\n", (int)getpid());
	fflush(stdout);
	nanosleep(&delay, NULL);
	fd = socket(AF_INET, SOCK_STREAM, 0);
	if (fd < 0)
		return die("socket");
	setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	if (bind(fd, (const struct sockaddr *)sa, sizeof(*sa)) || listen(fd, 1))
		return die("bind/listen");
	conn = accept(fd, NULL, NULL);
	if (conn < 0)
		return die("accept");
	while (hang)
		pause();
	while (len < sizeof(buf) - 1 && (n = read(conn, buf + len, sizeof(buf) - 1 - len)) > 0)
		len += (size_t)n;
	if (n < 0)
		return die("read");
	buf[len] = '\0';
	printf("got: %s\n", buf);
	return 0;
}

static int send_once(const struct sockaddr_in *sa, const char *message)
{
	size_t len = strlen(message);
	int fd = socket(AF_INET, SOCK_STREAM, 0);

	if (fd < 0)
		return die("socket");
	if (connect(fd, (const struct sockaddr *)sa, sizeof(*sa)))
		return die("connect");
	if (write(fd, message, len) != (ssize_t)len)
		return die("write");
	close(fd);
	printf("sent\n");
	return 0;
}

int main(int argc, char **argv)
{
	struct sockaddr_in sa;

	if (argc >= 5 && !strcmp(argv[1], "listen") && !parse_addr(argv[2], argv[3], &sa))
		return serve(&sa, atol(argv[4]), argc > 5 && !strcmp(argv[5], "hang"));
	if (argc == 5 && !strcmp(argv[1], "connect") && !parse_addr(argv[2], argv[3], &sa))
		return send_once(&sa, argv[4]);
	fprintf(stderr, "usage: tcp_once listen ADDR PORT DELAY_MS [hang] | connect ADDR PORT MESSAGE\n");
	return 2;
}
