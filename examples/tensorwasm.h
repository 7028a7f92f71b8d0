/* tensorwasm.h: the guest header for the TensorWasm guest ABI, version 1.
 * The reference for every declaration below is docs/guest-abi.md.
 *
 * Include it in a WASI command built for wasm32-wasi, e.g.
 *   python3 -m ziglang cc -target wasm32-wasi -O2 -s -Iexamples my_guest.c -o my_guest.wasm
 */
#ifndef TENSORWASM_H
#define TENSORWASM_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TW_IMPORT(name) __attribute__((import_module("tensorwasm"), import_name(#name)))

/* ---- return codes (section 3): every function returns >= 0 on success, one of these on failure ---- */
enum {
    TW_OK = 0,
    TW_UNAVAILABLE = -1,      /* no GPU here, the tenant may not use it, or CPU worker */
    TW_INVALID_POINTER = -2,  /* a (pointer, length) range falls outside linear memory */
    TW_INVALID_HANDLE = -3,   /* unknown, freed, or foreign handle */
    TW_COMPILE_FAILED = -4,   /* kernel source or PTX rejected by the compiler */
    TW_LAUNCH_FAILED = -5,    /* the launch was refused by the device */
    TW_QUOTA_EXCEEDED = -6,   /* GPU memory cap or a per-instance count limit */
    TW_INVALID_ARGUMENT = -7, /* malformed argument */
    TW_NOT_FOUND = -8,        /* no module or kernel function of that name */
    TW_DEVICE_ERROR = -9,     /* the device failed; stop */
    TW_INTERNAL = -10,
};

enum { TW_FORMAT_CUDA = 0, TW_FORMAT_PTX = 1 };

/* ---- device and errors (docs/guest-abi.md 4.1) ---- */
TW_IMPORT(device_count) int32_t tw_device_count(void);
TW_IMPORT(device_info) int32_t tw_device_info(char *dst, int32_t dst_len);
TW_IMPORT(last_error) int32_t tw_last_error(char *dst, int32_t dst_len);

/* ---- buffers (4.2) ---- */
TW_IMPORT(buffer_alloc) int32_t tw_buffer_alloc(int64_t size);
TW_IMPORT(buffer_free) int32_t tw_buffer_free(int32_t buf);
TW_IMPORT(buffer_size) int64_t tw_buffer_size(int32_t buf);
TW_IMPORT(buffer_write) int32_t tw_buffer_write(int32_t buf, int64_t offset, const void *src, int32_t len);
TW_IMPORT(buffer_read) int32_t tw_buffer_read(int32_t buf, int64_t offset, void *dst, int32_t len);
TW_IMPORT(buffer_copy) int32_t tw_buffer_copy(int32_t dst, int64_t dst_offset, int32_t src, int64_t src_offset, int64_t len);

/* ---- kernel modules, functions and launches (4.3) ---- */
TW_IMPORT(module_load) int32_t tw_module_load(const void *src, int32_t src_len, int32_t format);
TW_IMPORT(module_get) int32_t tw_module_get(const char *name, int32_t name_len);
TW_IMPORT(function_get) int32_t tw_function_get(int32_t module, const char *name, int32_t name_len);
TW_IMPORT(launch) int32_t tw_launch(int32_t fn, int32_t gx, int32_t gy, int32_t gz, int32_t bx, int32_t by, int32_t bz,
                                    int32_t shared_bytes, const void *args, int32_t args_len);
TW_IMPORT(synchronize) int32_t tw_synchronize(void);

/* ---- kernel argument records (section 5): tag byte + little-endian payload, no padding ---- */
enum { TW_ARG_I32 = 0x01, TW_ARG_I64 = 0x02, TW_ARG_F32 = 0x03, TW_ARG_F64 = 0x04, TW_ARG_BUFFER = 0x10 };
#define TW_MAX_ARG_BYTES 4096
#define TW_MAX_ARG_RECORDS 128

typedef struct {
    uint8_t bytes[TW_MAX_ARG_BYTES];
    int32_t len;
    int overflow; /* set when a record did not fit; the launch would be refused */
} tw_args;

static inline void tw_args_init(tw_args *a) { a->len = 0; a->overflow = 0; }

static inline void tw__put(tw_args *a, uint8_t tag, const void *payload, int32_t n) {
    if (a->len + 1 + n > TW_MAX_ARG_BYTES) { a->overflow = 1; return; }
    a->bytes[a->len++] = tag;
    memcpy(a->bytes + a->len, payload, (size_t)n); /* wasm32 is little-endian */
    a->len += n;
}
static inline void tw_arg_i32(tw_args *a, int32_t v) { tw__put(a, TW_ARG_I32, &v, 4); }
static inline void tw_arg_i64(tw_args *a, int64_t v) { tw__put(a, TW_ARG_I64, &v, 8); }
static inline void tw_arg_f32(tw_args *a, float v) { tw__put(a, TW_ARG_F32, &v, 4); }
static inline void tw_arg_f64(tw_args *a, double v) { tw__put(a, TW_ARG_F64, &v, 8); }
static inline void tw_arg_buffer(tw_args *a, int32_t buf, int64_t offset) {
    uint8_t p[12];
    memcpy(p, &buf, 4);
    memcpy(p + 4, &offset, 8);
    tw__put(a, TW_ARG_BUFFER, p, 12);
}

/* Launch with a prepared record list (refuses an overflowed list before calling the host). */
static inline int32_t tw_launch_args(int32_t fn, int32_t gx, int32_t gy, int32_t gz, int32_t bx, int32_t by, int32_t bz,
                                     int32_t shared_bytes, const tw_args *a) {
    if (a->overflow) return TW_INVALID_ARGUMENT;
    return tw_launch(fn, gx, gy, gz, bx, by, bz, shared_bytes, a->bytes, a->len);
}

/* Grid size for one thread per element. */
static inline int32_t tw_blocks_for(int64_t n, int32_t block) { return n <= 0 ? 1 : (int32_t)((n + block - 1) / block); }

static inline int32_t tw_module_get_str(const char *name) { return tw_module_get(name, (int32_t)strlen(name)); }
static inline int32_t tw_function_get_str(int32_t module, const char *name) { return tw_function_get(module, name, (int32_t)strlen(name)); }

#endif
