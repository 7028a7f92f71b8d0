"""One node (docs/architecture.md, "The node"): HTTP fronts, one supervisor holding the scheduler, workers.

`local` is the node of one process (`TENSORWASM_PROCESSES=1`); `supervisor`, `front` and
`client` make the node of several fronts; `serve` starts either.
"""
