;; Counts to 2^25 and returns: a call that keeps its worker busy a few milliseconds (handoffs).
(module
  (memory (export "memory") 1)
  (func (export "_start") (local $i i32)
    (loop $l
      (local.set $i (i32.add (local.get $i) (i32.const 1)))
      (br_if $l (i32.lt_u (local.get $i) (i32.const 33554432))))))
