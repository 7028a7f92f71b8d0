;; Does nothing: the cheapest possible invocation (benchmarks).
(module
  (memory (export "memory") 1)
  (func (export "_start")))
