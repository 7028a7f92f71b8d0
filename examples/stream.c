/* Example guest (C): output produced over time, for streamed calls. It writes each word of its
 * stdin on a line of its own, one every 200 ms (the `ms` query parameter: ?ms=50), then `done`.
 * Each line is one write(2) to stdout, so a streamed call (`Accept: text/event-stream`,
 * `?stream=raw`, `tensorwasm invoke --stream`) gets it as one chunk, as it is written (stdio's
 * printf and fflush may split a line into several writes).
 * Build: python3 -m ziglang cc -target wasm32-wasi -O2 -s examples/stream.c -o stream.wasm
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void write_line(const char *word) {
    char line[1024];
    int n = snprintf(line, sizeof line, "%s\n", word);
    if (n > (int)sizeof line - 1)
        n = sizeof line - 1;
    write(1, line, (size_t)n);
}

static long query_ms(void) {
    const char *q = getenv("QUERY_STRING");
    const char *p = q ? strstr(q, "ms=") : NULL;
    if (p == NULL || (p != q && p[-1] != '&'))
        return 200;
    long ms = atol(p + 3);
    return ms < 0 ? 0 : ms > 10000 ? 10000 : ms;
}

int main(void) {
    static char text[65536];
    size_t n = fread(text, 1, sizeof text - 1, stdin);
    text[n] = 0;
    long ms = query_ms();
    struct timespec wait = {ms / 1000, (ms % 1000) * 1000000L};
    for (char *word = strtok(text, " \t\r\n"); word != NULL; word = strtok(NULL, " \t\r\n")) {
        write_line(word);
        nanosleep(&wait, NULL);
    }
    write_line("done");
    return 0;
}
