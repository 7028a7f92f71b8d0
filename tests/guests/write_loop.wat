;; writes 4 KiB to stderr forever: every moment is spent in the host's fd_write or next to it
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $w (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 100)) (i32.store (i32.const 4) (i32.const 4096))
    (loop $l (drop (call $w (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8))) (br $l))))
