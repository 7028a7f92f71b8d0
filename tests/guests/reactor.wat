;; A WASI reactor, not a command: no _start.
(module
  (memory (export "memory") 1)
  (func (export "_initialize")))
