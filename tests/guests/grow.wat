;; Tries to grow memory by 64 MiB (1024 pages); prints "grew" or "refused".
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "grew")
  (data (i32.const 200) "refused")
  (func (export "_start")
    (if (i32.eq (memory.grow (i32.const 1024)) (i32.const -1))
      (then (i32.store (i32.const 0) (i32.const 200)) (i32.store (i32.const 4) (i32.const 7)))
      (else (i32.store (i32.const 0) (i32.const 100)) (i32.store (i32.const 4) (i32.const 4))))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))))
