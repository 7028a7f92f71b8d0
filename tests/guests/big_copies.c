/* Large buffer_write / buffer_read checks (the sizes that take the page-locked path on a GPU
 * worker): two writes from the same guest memory with different contents in between (a write
 * must copy at the call), reads at unaligned offsets into unaligned guest addresses that cross
 * 2 MiB boundaries, and a device-side copy. Prints "ok" or the first mismatch. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensorwasm.h"

#define N (9 << 20)

static uint8_t pattern(uint32_t i, uint32_t seed) { return (uint8_t)((i * 2654435761u + seed) >> 13); }

static int fail(const char *what, long at) {
    char err[256] = {0};
    tw_last_error(err, sizeof err - 1);
    printf("%s failed at %ld: %s", what, at, err);
    return 0;
}

int main(void) {
    uint8_t *host = malloc(N + 64);
    uint8_t *back = malloc(N + 64);
    int32_t a = tw_buffer_alloc(N), b = tw_buffer_alloc(N), c = tw_buffer_alloc(N);
    if (a < 0 || b < 0 || c < 0) return fail("buffer_alloc", 0);

    for (uint32_t i = 0; i < N; i++) host[i] = pattern(i, 1);
    if (tw_buffer_write(a, 0, host, N)) return fail("buffer_write a", 0);
    for (uint32_t i = 0; i < N; i++) host[i] = pattern(i, 2);  /* same memory, new contents */
    if (tw_buffer_write(b, 0, host, N)) return fail("buffer_write b", 0);
    if (tw_buffer_copy(c, 0, a, 0, N)) return fail("buffer_copy", 0);

    if (tw_buffer_read(a, 0, back, N)) return fail("buffer_read a", 0);
    for (uint32_t i = 0; i < N; i++)
        if (back[i] != pattern(i, 1)) return fail("a holds what was written first", i);
    if (tw_buffer_read(b, 0, back, N)) return fail("buffer_read b", 0);
    for (uint32_t i = 0; i < N; i++)
        if (back[i] != pattern(i, 2)) return fail("b holds what was written second", i);

    /* unaligned: 3 MiB + 777 bytes from offset 12345 into back + 7 */
    const uint32_t off = 12345, len = (3 << 20) + 777;
    memset(back, 0xEE, N + 64);
    if (tw_buffer_read(c, off, back + 7, len)) return fail("buffer_read c", 0);
    for (uint32_t i = 0; i < len; i++)
        if (back[7 + i] != pattern(off + i, 1)) return fail("unaligned read", i);
    if (back[6] != 0xEE || back[7 + len] != 0xEE) return fail("read stayed inside its range", len);

    /* unaligned write into the middle of b, then read b back whole */
    for (uint32_t i = 0; i < len; i++) host[5 + i] = pattern(i, 3);
    if (tw_buffer_write(b, off, host + 5, len)) return fail("unaligned write", 0);
    if (tw_buffer_read(b, 0, back, N)) return fail("buffer_read b again", 0);
    for (uint32_t i = 0; i < N; i++) {
        uint8_t want = (i >= off && i < off + len) ? pattern(i - off, 3) : pattern(i, 2);
        if (back[i] != want) return fail("b after the unaligned write", i);
    }
    printf("ok");
    return 0;
}
