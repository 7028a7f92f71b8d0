;; Never returns.
(module
  (memory (export "memory") 1)
  (func (export "_start") (loop $l (br $l))))
