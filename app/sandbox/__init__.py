"""Compiles of tenant code (Wasm modules, CUDA sources) in child processes with limits.

A tenant's upload is never compiled inside a serving process: each compile runs in a fresh
child (`app.sandbox.child`) under an address-space limit and a wall-clock limit, at most
`compile_concurrency` at once per node and one per tenant (`FairLimiter`). `Sandbox` is the
api process's side; `app.runtime.compiler` is what services call.
"""

# Nothing is imported here: compile processes import `app.sandbox.child`, and every module
# this package pulls in is start-up time of each of them (asyncio alone ~0.25 s on a busy VM).
