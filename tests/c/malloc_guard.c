/* Preloaded after libugdr.so into a program that starts no thread itself: counts the calls
 * of malloc, calloc and realloc that a thread other than the main one makes while this libc
 * still believes the process single-threaded (`__libc_single_threaded`). glibc's malloc takes
 * no lock then, so each such call races the main thread's. The dynamic linker allocates TLS
 * with this malloc too, from whichever thread first touches a library's thread-locals (UCX's
 * async thread, started through the libc of UCX's own namespace, does at once). Prints the
 * count at exit: "malloc_guard: N unlocked calls". */
#define _GNU_SOURCE
#include <stddef.h>
#include <stdio.h>
#include <sys/single_threaded.h>
#include <sys/syscall.h>
#include <unistd.h>

extern void *__libc_malloc(size_t size);
extern void *__libc_calloc(size_t n, size_t size);
extern void *__libc_realloc(void *p, size_t size);

static unsigned long unlocked_calls;

static void note_call(void) {
    if (__libc_single_threaded && syscall(SYS_gettid) != getpid())
        __atomic_add_fetch(&unlocked_calls, 1, __ATOMIC_RELAXED);
}

void *malloc(size_t size) { note_call(); return __libc_malloc(size); }
void *calloc(size_t n, size_t size) { note_call(); return __libc_calloc(n, size); }
void *realloc(void *p, size_t size) { note_call(); return __libc_realloc(p, size); }

__attribute__((destructor)) static void report(void) {
    char line[80];
    int n = snprintf(line, sizeof line, "malloc_guard: %lu unlocked calls\n",
                     __atomic_load_n(&unlocked_calls, __ATOMIC_RELAXED));
    if (n > 0 && write(2, line, (size_t)n) < 0) {
    }
}
