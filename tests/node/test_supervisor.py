"""The supervisor as a program: what it loads."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import checkout_pythonpath


def test_the_supervisor_and_scheduler_import_no_database_layer() -> None:
    """The control plane holds no database session: what it needs of a tenant comes in its
    messages, so SQLAlchemy (and its import time and memory) stays out of it."""
    code = (
        "import sys, app.node.supervisor, app.scheduler.scheduler; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.startswith(('sqlalchemy', 'aiosqlite', 'psycopg'))}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONPATH": checkout_pythonpath()})
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
