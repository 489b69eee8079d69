/* libfaketime (0.9.10) with FAKETIME_DONT_FAKE_MONOTONIC=1 turns an absolute CLOCK_MONOTONIC
 * clock_nanosleep (what Python's time.sleep calls) into EINVAL. Preloaded before libfaketime, this
 * sends CLOCK_MONOTONIC sleeps straight to the kernel (the monotonic clock is not faked anyway)
 * and every other clock on to libfaketime. Test infrastructure only (tests/test_disagg_stack.py). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

int clock_nanosleep(clockid_t clock, int flags, const struct timespec *req, struct timespec *rem) {
    if (clock == CLOCK_MONOTONIC) {
        return syscall(SYS_clock_nanosleep, clock, flags, req, rem) == -1 ? errno : 0;
    }
    int (*next)(clockid_t, int, const struct timespec *, struct timespec *) = dlsym(RTLD_NEXT, "clock_nanosleep");
    return next(clock, flags, req, rem);
}
