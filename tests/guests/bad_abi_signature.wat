;; buffer_alloc takes an i64 in the ABI; this declares i32.
(module
  (import "tensorwasm" "buffer_alloc" (func $alloc (param i32) (result i32)))
  (memory (export "memory") 1)
  (func (export "_start")))
