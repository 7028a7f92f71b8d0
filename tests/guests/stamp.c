/* Prints when it started (CLOCK_REALTIME, nanoseconds), after busy-waiting the milliseconds given
 * on stdin: the order a worker took calls in, as the guests saw it. */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(void) {
    char buf[32] = {0};
    fread(buf, 1, sizeof buf - 1, stdin);
    long ms = atol(buf);
    struct timespec start, t0, t;
    clock_gettime(CLOCK_REALTIME, &start);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < ms);
    printf("%lld", (long long)start.tv_sec * 1000000000LL + start.tv_nsec);
    return 0;
}
