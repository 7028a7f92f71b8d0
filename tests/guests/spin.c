/* Busy-waits for the number of milliseconds given on stdin, then prints "done". */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

int main(void) {
    char buf[32] = {0};
    fread(buf, 1, sizeof buf - 1, stdin);
    long ms = atol(buf);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    do {
        clock_gettime(CLOCK_MONOTONIC, &t);
    } while ((t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000 < ms);
    printf("done");
    return 0;
}
