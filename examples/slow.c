/* Example guest (C): a slow job for the async queue. It reads its stdin, waits (1500 ms, or the
 * `ms` query parameter: ?ms=3000; WASI's poll_oneoff, through nanosleep), then writes the lines,
 * words and bytes of its stdin as `wc` does. An empty stdin fails (exit status 2).
 * Build: python3 -m ziglang cc -target wasm32-wasi -O2 -s examples/slow.c -o slow.wasm
 */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static long query_ms(void) {
    const char *q = getenv("QUERY_STRING");
    const char *p = q ? strstr(q, "ms=") : NULL;
    if (p == NULL || (p != q && p[-1] != '&'))
        return 1500;
    long ms = atol(p + 3);
    return ms < 0 ? 0 : ms > 60000 ? 60000 : ms;
}

int main(void) {
    long lines = 0, words = 0, bytes = 0;
    int c, in_word = 0;
    while ((c = getchar()) != EOF) {
        bytes++;
        if (c == '\n')
            lines++;
        if (isspace(c)) {
            in_word = 0;
        } else if (!in_word) {
            in_word = 1;
            words++;
        }
    }
    if (bytes == 0) {
        fprintf(stderr, "nothing to count: send the text as the request body\n");
        return 2;
    }
    long ms = query_ms();
    struct timespec wait = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&wait, NULL);
    printf("%ld %ld %ld\n", lines, words, bytes);
    return 0;
}
