/* Example guest: probes the bad inputs the guest ABI (version 1, docs/guest-abi.md) refuses,
 * printing "probe=result" lines.
 * Every probe must come back as the documented error code, and the guest keeps running.
 */
#include <stdio.h>
#include <string.h>
#include "tensorwasm.h"

#define P(label, expr) printf("%s=%lld\n", label, (long long)(expr))

/* std.scale_f32's records: (buffer, offset), f32 scale, i32 n */
static void scale_args(tw_args *a, int32_t buf, int64_t offset, int32_t n) {
    tw_args_init(a);
    tw_arg_buffer(a, buf, offset);
    tw_arg_f32(a, 2.0f);
    tw_arg_i32(a, n);
}

int main(void) {
    char text[2048];
    uint8_t raw[64];
    P("device_count", tw_device_count());
    int32_t n = tw_device_info(text, sizeof text - 1);
    text[n > 0 && n < (int32_t)sizeof text ? n : 0] = 0;
    printf("device_info_json=%s\n", text);
    P("last_error_none", tw_last_error(text, sizeof text));

    /* buffers */
    P("alloc_zero", tw_buffer_alloc(0));
    P("alloc_negative", tw_buffer_alloc(-5));
    P("alloc_over_cap", tw_buffer_alloc((int64_t)1 << 40));
    n = tw_last_error(text, sizeof text - 1);
    text[n > 0 ? n : 0] = 0;
    printf("alloc_over_cap_error=%s\n", text);
    P("last_error_truncated_len", tw_last_error(text, 4));
    int32_t buf = tw_buffer_alloc(64);
    P("alloc_ok", buf > 0);
    P("size", tw_buffer_size(buf));
    memset(raw, 0xAB, sizeof raw);
    P("read_new_is_zero", tw_buffer_read(buf, 0, raw, 64));
    int zero = 1;
    for (int i = 0; i < 64; i++) zero &= raw[i] == 0;
    P("new_buffer_zeroed", zero);
    P("write_src_outside_memory", tw_buffer_write(buf, 0, (void *)0xFFFFFF00u, 1024));
    P("write_range_outside_buffer", tw_buffer_write(buf, 60, raw, 8));
    P("write_negative_offset", tw_buffer_write(buf, -1, raw, 4));
    P("write_negative_len", tw_buffer_write(buf, 0, raw, -4));
    P("read_dst_outside_memory", tw_buffer_read(buf, 0, (void *)0xFFFFFFF0u, 64));
    P("read_past_end", tw_buffer_read(buf, 32, raw, 64));
    int32_t other = tw_buffer_alloc(16);
    P("copy_ok", tw_buffer_copy(other, 0, buf, 0, 16));
    P("copy_out_of_range", tw_buffer_copy(other, 8, buf, 0, 16));
    P("copy_bad_handle", tw_buffer_copy(other, 0, 424242, 0, 4));
    P("free_bad_handle", tw_buffer_free(424242));
    P("free_ok", tw_buffer_free(other));
    P("free_twice", tw_buffer_free(other));
    P("size_after_free", tw_buffer_size(other));

    /* modules and functions */
    P("module_get_unknown", tw_module_get_str("no-such-module"));
    P("module_get_name_outside_memory", tw_module_get((const char *)0xFFFFFFF0u, 64));
    P("module_load_bad_format", tw_module_load("x", 1, 7));
    P("module_load_cuda", tw_module_load("extern \"C\" __global__ void k() {}", 34, TW_FORMAT_CUDA));
    int32_t std = tw_module_get_str("std");
    P("module_get_std", std > 0);
    P("function_get_unknown", tw_function_get_str(std, "no_such_kernel"));
    P("function_get_bad_module", tw_function_get_str(424242, "vector_add_f32"));
    P("function_get_buffer_as_module", tw_function_get_str(buf, "vector_add_f32"));
    int32_t fn = tw_function_get_str(std, "scale_f32");
    P("function_get_ok", fn > 0);

    /* launches */
    tw_args a;
    scale_args(&a, buf, 0, 16);
    P("launch_ok", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    P("launch_zero_grid", tw_launch_args(fn, 0, 1, 1, 16, 1, 1, 0, &a));
    P("launch_block_too_big", tw_launch_args(fn, 1, 1, 1, 2048, 1, 1, 0, &a));
    P("launch_negative_shared", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, -1, &a));
    P("launch_bad_function", tw_launch_args(424242, 1, 1, 1, 16, 1, 1, 0, &a));
    P("launch_args_outside_memory", tw_launch(fn, 1, 1, 1, 16, 1, 1, 0, (void *)0xFFFFFFF0u, 64));
    P("launch_args_too_long", tw_launch(fn, 1, 1, 1, 16, 1, 1, 0, a.bytes, 5000));
    uint8_t bad_tag[] = {0x7F, 0, 0, 0, 0};
    P("launch_unknown_tag", tw_launch(fn, 1, 1, 1, 16, 1, 1, 0, bad_tag, sizeof bad_tag));
    P("launch_truncated_record", tw_launch(fn, 1, 1, 1, 16, 1, 1, 0, a.bytes, 7));
    scale_args(&a, 424242, 0, 16);
    P("launch_bad_buffer_handle", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    scale_args(&a, buf, 65, 0);
    P("launch_offset_past_end", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    tw_args_init(&a);
    tw_arg_buffer(&a, buf, 0);
    tw_arg_i32(&a, 2);
    tw_arg_i32(&a, 16);
    P("launch_wrong_arg_types", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    scale_args(&a, buf, 0, 17); /* 17 floats do not fit in 64 bytes */
    P("launch_n_past_buffer", tw_launch_args(fn, 1, 1, 1, 32, 1, 1, 0, &a));
    scale_args(&a, buf, 0, -1);
    P("launch_negative_n", tw_launch_args(fn, 1, 1, 1, 32, 1, 1, 0, &a));
    /* a repeated launch naming a buffer freed in between is refused, not replayed */
    int32_t tmp = tw_buffer_alloc(64);
    scale_args(&a, tmp, 0, 16);
    P("launch_cached_ok", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    P("launch_cached_again", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    tw_buffer_free(tmp);
    P("launch_after_free", tw_launch_args(fn, 1, 1, 1, 16, 1, 1, 0, &a));
    P("synchronize", tw_synchronize());
    P("module_get_std_again", tw_module_get_str("std") > 0);
    return 0;
}
