/* Prints when it started and ended (CLOCK_REALTIME, nanoseconds: "START END"), busy-waiting the
 * milliseconds given on stdin in between: how many calls of a tenant ran at once, as the guests
 * themselves saw it. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long long now_ns(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

int main(void) {
    char buf[32] = {0};
    fread(buf, 1, sizeof buf - 1, stdin);
    long long ms = atol(buf);
    long long start = now_ns(CLOCK_REALTIME), t0 = now_ns(CLOCK_MONOTONIC);
    while (now_ns(CLOCK_MONOTONIC) - t0 < ms * 1000000LL) {
    }
    printf("%lld %lld", start, now_ns(CLOCK_REALTIME));
    return 0;
}
