"""Host paths out of the messages a tenant reads.

An error from wasmtime, the compiler or the OS may name a file of the node (the compiled cache
in the data dir, the interpreter, a traceback's sources): where the node keeps its files is the
operator's business, so every such message passes through `without_host_paths` first.
"""

from __future__ import annotations

import re

# an absolute path: a slash not inside a word, a URL or a relative path, up to a space, a quote
# or the punctuation that ends a clause
_PATH = re.compile(r"(?<![\w.:/~-])/[^\s'\"`<>|;,)]*")


def without_host_paths(text: str) -> str:
    return _PATH.sub("<path>", text)
