/* What the two-process C tests share (fence.c, initiator_depth.c): a forked responder that
 * the parent talks to over two pipes, and counting bytes. */
#ifndef UGDR_RESPONDER_PROCESS_H
#define UGDR_RESPONDER_PROCESS_H

#include "verbs_test.h"
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

/* The forked responder, killed when the parent exits (it may be stopped); 0 once it ended. */
static pid_t responder;

static void kill_responder(void)
{
    if (responder > 0)
        kill(responder, SIGKILL);
}

/* Forks the responder: the child's pid in the parent, 0 in the child; `in` and `out` are this
 * side's ends of the pipes from and to the other. */
static inline pid_t fork_responder(int *in, int *out)
{
    int to_child[2], to_parent[2];
    CHECK(pipe(to_child) == 0 && pipe(to_parent) == 0, "pipe");
    pid_t child = fork();
    CHECK(child >= 0, "fork");
    *in = child == 0 ? to_child[0] : to_parent[0];
    *out = child == 0 ? to_parent[1] : to_child[1];
    close(child == 0 ? to_child[1] : to_parent[1]);
    close(child == 0 ? to_parent[0] : to_child[0]);
    if (child > 0) {
        responder = child;
        atexit(kill_responder);
    }
    return child;
}

/* This side's verbs objects: port 1's attributes in `port`, a PD, and one CQ of 64 entries in
 * `cq`. */
static inline struct ibv_pd *open_pd_and_cq(struct ibv_port_attr *port, struct ibv_cq **cq)
{
    struct ibv_context *ctx = open_first_device(port);
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    *cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
    CHECK(pd && *cq, "pd/cq");
    return pd;
}

/* An RC QP with `cq` for both queues, 16 WRs of one SGE each way. */
static inline struct ibv_qp *rc_qp(struct ibv_pd *pd, struct ibv_cq *cq)
{
    struct ibv_qp_init_attr init = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
        .cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 1, .max_recv_sge = 1 } };
    struct ibv_qp *qp = ibv_create_qp(pd, &init);
    CHECK(qp, "create_qp");
    return qp;
}

/* Both sides: wait until the other side's QPs are at RTS too. */
static inline void both_at_rts(int in, int out)
{
    char c = 'r';
    CHECK(write(out, &c, 1) == 1 && read(in, &c, 1) == 1, "both at RTS");
}

/* The child: ugdr answers its peer's requests on its own. Asked ('?'), it reports the first
 * and last of the `len` bytes at `target`, until told to end; returns its exit status. */
static inline int serve_reports(int in, int out, const char *target, size_t len)
{
    char c;
    while (read(in, &c, 1) == 1 && c == '?') {
        unsigned char b[2] = { (unsigned char)target[0], (unsigned char)target[len - 1] };
        CHECK(write(out, b, 2) == 2, "report");
    }
    return 0;
}

/* The parent: stops the responder (SIGSTOP) and waits until it is stopped. */
static inline void stop_responder(void)
{
    CHECK(kill(responder, SIGSTOP) == 0, "SIGSTOP");
    int stopped = 0;
    CHECK(waitpid(responder, &stopped, WUNTRACED) == responder && WIFSTOPPED(stopped),
          "the responder stopped");
}

/* The parent: lets the stopped responder run again, gives what UCX held for it time to reach
 * it, and asks it for its first and last target bytes. */
static inline void resume_and_report(int in, int out, unsigned char bytes[2])
{
    CHECK(kill(responder, SIGCONT) == 0, "SIGCONT");
    usleep(500 * 1000);
    char c = '?';
    CHECK(write(out, &c, 1) == 1 && read(in, bytes, 2) == 2, "the responder's report");
}

/* The parent: tells the responder to end and checks that it exited 0. */
static inline void end_responder(int out)
{
    char c = 'e';
    CHECK(write(out, &c, 1) == 1, "end");
    int status = 0;
    CHECK(waitpid(responder, &status, 0) == responder && WIFEXITED(status) &&
              WEXITSTATUS(status) == 0,
          "the responder's exit: %#x", status);
    responder = 0;
}

/* How many of the `n` bytes at `p` are `byte`. */
static inline size_t count_of(const char *p, size_t n, unsigned char byte)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += (unsigned char)p[i] == byte;
    return k;
}

#endif
