;; Writes a line to stderr and one to stdout, then exits with status 3.
(module
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "proc_exit" (func $exit (param i32)))
  (memory (export "memory") 1)
  (data (i32.const 100) "something went wrong\n")
  (data (i32.const 200) "partial output\n")
  (func (export "_start")
    (i32.store (i32.const 0) (i32.const 100)) (i32.store (i32.const 4) (i32.const 21))
    (drop (call $fd_write (i32.const 2) (i32.const 0) (i32.const 1) (i32.const 8)))
    (i32.store (i32.const 0) (i32.const 200)) (i32.store (i32.const 4) (i32.const 15))
    (drop (call $fd_write (i32.const 1) (i32.const 0) (i32.const 1) (i32.const 8)))
    (call $exit (i32.const 3))))
