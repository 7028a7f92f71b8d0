"""`tensorwasm.toml`: what `tensorwasm build` compiles and `tensorwasm deploy` (no arguments)
ships, read with tomllib; written once, by `tensorwasm new`, from a template (comments stay
where the author sees them)."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

MANIFEST = "tensorwasm.toml"
NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,63}$")  # the API's function names
ENV_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ManifestError(ValueError):
    """A manifest that cannot be used, with what to fix."""


@dataclass(frozen=True)
class Manifest:
    dir: Path
    name: str
    source: str
    output: str  # the module deploy uploads, relative to dir
    build: list[str] | None  # argv run in dir; None: built in-process (WAT text), or nothing to build
    env: dict[str, str] = field(default_factory=dict)
    secrets: list[str] = field(default_factory=list)  # names of the tenant's secrets the guest gets as env
    content_type: str | None = None
    timeout_ms: int | None = None

    @property
    def output_path(self) -> Path:
        return self.dir / self.output

    @property
    def source_path(self) -> Path:
        return self.dir / self.source


def find(start: Path) -> Path:
    path = start / MANIFEST
    if not path.is_file():
        raise ManifestError(
            f"no {MANIFEST} in {start}: run this in a directory made by `tensorwasm new NAME`, or deploy a module with "
            "`tensorwasm deploy NAME FILE`"
        )
    return path


def load(path: Path) -> Manifest:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ManifestError(f"{path} is not valid TOML: {exc}") from None

    def text(key: str, required: bool = True) -> str | None:
        value = data.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value:
            raise ManifestError(f"{path}: `{key}` must be a non-empty string")
        return value

    name = text("name") or ""
    if not NAME_RE.match(name):
        raise ManifestError(f"{path}: name {name!r} must be 1-63 letters, digits, '_' or '-'")
    source = text("source") or ""
    output = text("output", required=False) or (source if source.endswith(".wasm") else f"{Path(source).stem}.wasm")
    build_cmd = data.get("build")
    if build_cmd is not None and not isinstance(build_cmd, str | list):
        raise ManifestError(f"{path}: `build` must be a command line (a string) or a list of arguments")
    argv = (shlex.split(build_cmd) if isinstance(build_cmd, str) else [str(a) for a in build_cmd]) if build_cmd else None
    env = data.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(k, str) and ENV_RE.match(k) and isinstance(v, str) for k, v in env.items()):
        raise ManifestError(f"{path}: [env] must map names like GREETING (letters, digits, '_') to strings")
    secrets = data.get("secrets", [])
    if not isinstance(secrets, list) or not all(isinstance(s, str) and ENV_RE.match(s) for s in secrets):
        raise ManifestError(f"{path}: `secrets` must be a list of secret names like [\"API_KEY\"]")
    timeout = data.get("timeout_ms")
    if timeout is not None and (not isinstance(timeout, int) or isinstance(timeout, bool) or timeout < 1):
        raise ManifestError(f"{path}: `timeout_ms` must be a positive integer")
    return Manifest(
        dir=path.parent, name=name, source=source, output=output, build=argv, env=dict(env), secrets=list(secrets),
        content_type=text("content_type", required=False), timeout_ms=timeout,
    )


# The build line of a C guest: zig from the `guest` extra (pip install 'tensorwasm[guest]'),
# run through the Python that runs tensorwasm ("python3" in a build line means that one).
C_BUILD = "python3 -m ziglang cc -target wasm32-wasi -O2 -s -I. {source} -o {output}"

TEMPLATE = """\
# {name}: a TensorWasm function. `tensorwasm build` compiles it, `tensorwasm deploy` (no
# arguments, in this directory) builds and deploys it, `tensorwasm invoke {name}` calls it.
name = "{name}"
source = "{source}"
# the module `deploy` uploads
output = "{output}"
{build}
# the Content-Type of its responses, and its time limit per call (at most the tenant's quota)
content_type = "text/plain; charset=utf-8"
timeout_ms = 5000
# names of the tenant's secrets (`tensorwasm secrets set NAME`) the guest gets as environment variables
secrets = []

# the guest's environment (replaces the deployed function's at each deploy)
[env]
GREETING = "hello"
"""


def render(name: str, source: str, output: str, build: str | None) -> str:
    line = (
        f"# run in this directory (\"python3\" is the Python running tensorwasm)\nbuild = \"{build}\""
        if build else "# WAT text is compiled by `tensorwasm build` itself (wasmtime); no build command"
    )
    return TEMPLATE.format(name=name, source=source, output=output, build=line)
