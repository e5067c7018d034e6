/* The check macros of the C test programs (tests/c/ugdr_checks.c, tests/c/trust.c): each
 * CHECK counts, and a failed one names the scenario, the line and errno, then exits 1. */
#ifndef UGDR_TEST_CHECKS_H
#define UGDR_TEST_CHECKS_H

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int checks;
static const char *scenario = "?";

#define CHECK(cond, ...)                                                                   \
	do {                                                                               \
		checks++;                                                                  \
		if (!(cond)) {                                                             \
			fprintf(stderr, "%s: line %d: check failed: %s: ", scenario, __LINE__, \
				#cond);                                                    \
			fprintf(stderr, __VA_ARGS__);                                      \
			fprintf(stderr, " (errno %d %s)\n", errno, strerror(errno));       \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

/* An int call that must fail with `e`, both as its return value and in errno. */
#define FAILS_WITH(call, e)                                                                \
	do {                                                                               \
		errno = 0;                                                                 \
		int rc_ = (call);                                                          \
		CHECK(rc_ == (e) && errno == (e), "%s returned %d, expected %d", #call, rc_, (e)); \
	} while (0)

/* A pointer call that must return NULL with errno `e`. */
#define NULL_WITH(call, e)                                                                 \
	do {                                                                               \
		errno = 0;                                                                 \
		void *p_ = (void *)(call);                                                 \
		CHECK(p_ == NULL && errno == (e), "%s gave %p, expected NULL/%d", #call, p_, (e)); \
	} while (0)

#endif
