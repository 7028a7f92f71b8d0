"""The environment of the processes that run tenant code: workers, their fork server (whose
environment every forked worker inherits) and compile processes.

An allow-list, not a deny-list: such a process gets only what the interpreter, the C libraries
and the GPU stack read, never the node's own settings (`TENSORWASM_*`: the admin token, the
database URL, the metrics token) nor anything else the operator's shell happened to export.
None of these processes reads a setting from its environment: what they need comes as
arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

# the interpreter (PYTHONPATH: a checkout or a target directory of dependencies), the C library
# (locale, time zone, temporary files), and the loader (a CUDA install outside the default path)
_NAMES = frozenset({
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "TEMP", "TMP",
    "XDG_RUNTIME_DIR", "XDG_CACHE_HOME", "LD_LIBRARY_PATH",
    "PYTHONPATH", "PYTHONHOME", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED",
    "PYTHONFAULTHANDLER", "PYTHONMALLOC", "PYTHONWARNINGS",
})
# locale categories; glibc's allocator knobs (MALLOC_ARENA_MAX, MALLOC_MMAP_THRESHOLD_); the CUDA
# driver, runtime and container toolkit; CuPy's kernel cache
_PREFIXES = ("LC_", "MALLOC_", "CUDA_", "NVIDIA_", "CUPY_")


def tenant_process_env(extra: Mapping[str, str] | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The allowed part of `base` (default: this process's environment), then `extra`."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k in _NAMES or k.startswith(_PREFIXES)}
    env.update(extra or {})
    return env
