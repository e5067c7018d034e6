/* ugdr's progress thread and the application's CPU pinning.
 *   pinned_app reactor   as DPDK and SPDK: a control thread keeps the CPUs the process started
 *                        on, the thread that opens the device (a reactor) is pinned to one;
 *                        the progress thread, which that thread starts, must run on all the
 *                        process's CPUs (where it can take an idle core), not on the reactor's
 *   pinned_app bound     the whole process bound to one CPU (as taskset or an MPI launcher
 *                        binds it): the progress thread stays within the binding
 * In both the application's own pinning must stay as it set it. Prints "pinned_app: ok" and
 * exits 0 when all holds; "pinned_app: one cpu" when the process starts on a single CPU
 * (nothing to tell apart). */
#define _GNU_SOURCE
#include "checks.h"
#include <infiniband/verbs.h>
#include <dirent.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

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

/* A control thread (DPDK's eal-intr-thread): keeps the CPUs it was started with, waits. */
static void *control_thread(void *arg)
{
    (void)arg;
    for (;;)
        pause();
    return NULL;
}

int main(int argc, char **argv)
{
    CHECK(argc == 2 && (!strcmp(argv[1], "reactor") || !strcmp(argv[1], "bound")),
          "usage: pinned_app reactor|bound");
    scenario = argv[1];
    int reactor = !strcmp(argv[1], "reactor");
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
    if (reactor) {
        pthread_t control;
        CHECK(pthread_create(&control, NULL, control_thread, NULL) == 0, "pthread_create");
    }
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0, "pin to cpu %d", first);
    /* What the progress thread must get: all the process's CPUs, or the binding. */
    cpu_set_t *want = reactor ? &launch : &one;

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
            same = CPU_EQUAL(&progress, want);
        }
        if (same)
            break;
        clock_gettime(CLOCK_MONOTONIC, &now);
        CHECK(now.tv_sec - start.tv_sec < 5, "progress thread %d may use %d CPUs, not %d (%s)",
              tid, tid ? CPU_COUNT(&progress) : 0, CPU_COUNT(want),
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
