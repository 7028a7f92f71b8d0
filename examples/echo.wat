;; Example guest (WAT): echoes the request body. Deploy with
;;   python3 -c "import wasmtime,sys; sys.stdout.buffer.write(wasmtime.wat2wasm(open('examples/echo.wat').read()))" > echo.wasm
(module
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (func (export "_start") (local $n i32)
    (loop $l
      ;; iovec at 0: buffer at 1024, 64 KiB; bytes read at 8
      (i32.store (i32.const 0) (i32.const 1024))
      (i32.store (i32.const 4) (i32.const 65536))
      (drop (call $fd_read (i32.const 0) (i32.const 0) (i32.const 1) (i32.const 8)))
      (local.set $n (i32.load (i32.const 8)))
      (if (i32.gt_u (local.get $n) (i32.const 0))
        (then
          (i32.store (i32.const 4) (local.get $n))
          (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 12)))
          (br $l))))))
