/* An application that pins the thread which opens the device to one CPU, as DPDK and SPDK
 * pin their reactors: ugdr's progress thread, which that thread starts, must run on the CPUs
 * the process started on (where it can take an idle core), not on the reactor's one core, and
 * the application's own pinning must stay as the application set it.
 * Prints "pinned_app: ok" and exits 0 when both hold; "pinned_app: one cpu" when the process
 * starts on a single CPU (nothing to tell apart). */
#define _GNU_SOURCE
#include <infiniband/verbs.h>
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define CHECK(cond, ...) do { if (!(cond)) { fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
    fprintf(stderr, __VA_ARGS__); fprintf(stderr, " (errno %d)\n", errno); exit(1); } } while (0)

/* The thread id of this process's thread named `name`, or 0. */
static pid_t thread_named(const char *name)
{
    DIR *d = opendir("/proc/self/task");
    CHECK(d, "opendir /proc/self/task");
    struct dirent *e;
    pid_t found = 0;
    while (!found && (e = readdir(d))) {
        if (e->d_name[0] == '.')
            continue;
        char path[300], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%s/comm", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f)
            continue;
        if (fgets(comm, sizeof comm, f) && strncmp(comm, name, strlen(name)) == 0 &&
            comm[strlen(name)] == '\n')
            found = atoi(e->d_name);
        fclose(f);
    }
    closedir(d);
    return found;
}

int main(void)
{
    cpu_set_t launch, one, mine, progress;
    CHECK(sched_getaffinity(0, sizeof launch, &launch) == 0, "sched_getaffinity");
    if (CPU_COUNT(&launch) < 2) {
        printf("pinned_app: one cpu\n");
        return 0;
    }
    int first = 0;
    while (!CPU_ISSET(first, &launch))
        first++;
    CPU_ZERO(&one);
    CPU_SET(first, &one);
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0, "pin to cpu %d", first);

    int n = 0;
    struct ibv_device **list = ibv_get_device_list(&n);
    CHECK(list && n >= 1, "ibv_get_device_list");
    struct ibv_context *ctx = ibv_open_device(list[0]);
    CHECK(ctx, "ibv_open_device");
    struct ibv_pd *pd = ibv_alloc_pd(ctx);
    CHECK(pd, "ibv_alloc_pd");

    /* The progress thread moves itself when it starts: give it up to 5 s. */
    struct timespec start, now;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (;;) {
        pid_t tid = thread_named("ugdr-progress");
        int same = 0;
        if (tid) {
            CHECK(sched_getaffinity(tid, sizeof progress, &progress) == 0, "affinity of %d", tid);
            same = CPU_EQUAL(&progress, &launch);
        }
        if (same)
            break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        CHECK(now.tv_sec - start.tv_sec < 5,
              "progress thread %d: %d CPUs allowed, the process started on %d (it has %s)", tid,
              tid ? CPU_COUNT(&progress) : 0, CPU_COUNT(&launch),
              tid && CPU_EQUAL(&progress, &one) ? "its creator's one CPU" : "other CPUs");
        usleep(10000);
    }
    CHECK(sched_getaffinity(0, sizeof mine, &mine) == 0 && CPU_EQUAL(&mine, &one),
          "the application's own pinning changed");
    CHECK(ibv_dealloc_pd(pd) == 0, "ibv_dealloc_pd");
    CHECK(ibv_close_device(ctx) == 0, "ibv_close_device");
    ibv_free_device_list(list);
    printf("pinned_app: ok\n");
    return 0;
}
