"""Async invocations: the durable queue in the database and the runner that drains it.

The runner depends only on the scheduler's `run` path (through an executor) and repositories,
so it can move into a supervisor process unchanged.
"""
