;; Traps with `unreachable`.
(module
  (memory (export "memory") 1)
  (func $boom unreachable)
  (func (export "_start") (call $boom)))
