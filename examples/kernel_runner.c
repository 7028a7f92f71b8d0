/* Example, test and benchmark guest: runs one kernel described on stdin and writes chosen buffers back.
 *
 * stdin (little-endian):
 *   u8 kind (0: module_get by name, 1: module_load CUDA source, 2: module_load PTX), u32 len, bytes
 *   u32 len, kernel function name
 *   u32 nbufs, then per buffer: u64 size, u32 init_len, init bytes (repeated to fill the buffer)
 *   u32 grid[3], u32 block[3], u32 shared_bytes
 *   u32 args_len, argument records (a 0x10 record's handle field holds a buffer *index*)
 *   u32 repeat (launches), u32 flags (bit 0: prefix stdout with u64 ns spent launching+syncing,
 *       bit 1: prefix with u64 ns of the whole write-launch-read path, bit 2: then with u64 ns
 *       of each step of that path: alloc, write, module and function, launch+sync, the output's
 *       malloc, read)
 *   u32 nout, u32 buffer indices to write to stdout
 * On an ABI failure: prints "<call> <code> <last_error>" to stderr and exits with 64 - code.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "tensorwasm.h"

static unsigned char *in;
static size_t in_len, pos;

static void need(size_t n) { if (pos + n > in_len) { fprintf(stderr, "truncated input\n"); exit(2); } }
static uint32_t u32(void) { uint32_t v; need(4); memcpy(&v, in + pos, 4); pos += 4; return v; }
static uint64_t u64(void) { uint64_t v; need(8); memcpy(&v, in + pos, 8); pos += 8; return v; }
static unsigned char *take(size_t n) { need(n); unsigned char *p = in + pos; pos += n; return p; }

static int32_t check(const char *what, int32_t rc) {
    if (rc < 0) {
        char m[1100] = {0};
        tw_last_error(m, 1024);
        fprintf(stderr, "%s %d %s\n", what, rc, m);
        exit(64 - rc);
    }
    return rc;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

int main(void) {
    size_t cap = 1 << 16;
    in = malloc(cap);
    size_t got;
    while ((got = fread(in + in_len, 1, cap - in_len, stdin)) > 0) {
        in_len += got;
        if (in_len == cap) in = realloc(in, cap *= 2);
    }
    uint8_t kind = *take(1);
    uint32_t mlen = u32();
    unsigned char *mname = take(mlen);
    uint32_t flen = u32();
    unsigned char *fname = take(flen);

    uint32_t nbufs = u32();
    int32_t *h = calloc(nbufs + 1, sizeof *h);
    int64_t *sizes = calloc(nbufs + 1, sizeof *sizes);
    unsigned char **init = calloc(nbufs + 1, sizeof *init);
    uint32_t *init_len = calloc(nbufs + 1, sizeof *init_len);
    for (uint32_t i = 0; i < nbufs; i++) {
        sizes[i] = (int64_t)u64();
        init_len[i] = u32();
        init[i] = take(init_len[i]);
    }
    uint32_t g[3] = {u32(), u32(), u32()}, b[3] = {u32(), u32(), u32()}, shared = u32();
    uint32_t alen = u32();
    unsigned char *args = take(alen);
    uint32_t repeat = u32(), flags = u32();
    uint32_t nout = u32();
    uint32_t *outs = calloc(nout + 1, sizeof *outs);
    for (uint32_t i = 0; i < nout; i++) outs[i] = u32();

    uint64_t steps[7];
    uint64_t t_all = steps[0] = now_ns();
    for (uint32_t i = 0; i < nbufs; i++) h[i] = check("buffer_alloc", tw_buffer_alloc(sizes[i]));
    steps[1] = now_ns();
    for (uint32_t i = 0; i < nbufs; i++) {
        for (int64_t off = 0; init_len[i] && off < sizes[i]; off += init_len[i]) {
            int64_t n = sizes[i] - off < init_len[i] ? sizes[i] - off : init_len[i];
            check("buffer_write", tw_buffer_write(h[i], off, init[i], (int32_t)n));
        }
    }
    /* patch buffer indices into handles */
    for (uint32_t p = 0; p < alen;) {
        uint8_t tag = args[p++];
        if (tag == TW_ARG_BUFFER) {
            uint32_t idx;
            memcpy(&idx, args + p, 4);
            if (idx < nbufs) memcpy(args + p, &h[idx], 4);
            p += 12;
        } else if (tag == TW_ARG_I32 || tag == TW_ARG_F32) p += 4;
        else if (tag == TW_ARG_I64 || tag == TW_ARG_F64) p += 8;
        else break; /* let the host refuse it */
    }
    steps[2] = now_ns();
    int32_t mod;
    if (kind == 0) mod = check("module_get", tw_module_get((const char *)mname, (int32_t)mlen));
    else mod = check("module_load", tw_module_load(mname, (int32_t)mlen, kind - 1));
    int32_t fn = check("function_get", tw_function_get(mod, (const char *)fname, (int32_t)flen));

    uint64_t t0 = steps[3] = now_ns();
    for (uint32_t r = 0; r < repeat; r++)
        check("launch", tw_launch(fn, (int32_t)g[0], (int32_t)g[1], (int32_t)g[2], (int32_t)b[0], (int32_t)b[1], (int32_t)b[2],
                                  (int32_t)shared, args, (int32_t)alen));
    check("synchronize", tw_synchronize());
    uint64_t t_launch = (steps[4] = now_ns()) - t0;

    size_t total = 0;
    for (uint32_t i = 0; i < nout; i++) total += (size_t)sizes[outs[i]];
    unsigned char *out = malloc(total + 1);
    steps[5] = now_ns();
    size_t off = 0;
    for (uint32_t i = 0; i < nout; i++) {
        check("buffer_read", tw_buffer_read(h[outs[i]], 0, out + off, (int32_t)sizes[outs[i]]));
        off += (size_t)sizes[outs[i]];
    }
    uint64_t t_total = (steps[6] = now_ns()) - t_all;
    if (flags & 1) fwrite(&t_launch, 8, 1, stdout);
    if (flags & 2) fwrite(&t_total, 8, 1, stdout);
    for (int i = 0; (flags & 4) && i < 6; i++) {
        uint64_t d = steps[i + 1] - steps[i];
        fwrite(&d, 8, 1, stdout);
    }
    fwrite(out, 1, total, stdout);
    return 0;
}
