"""`tensorwasm new | build`, and `deploy` with no arguments: a guest from an empty directory to a
deployed function, described by its `tensorwasm.toml` (app/cli/manifest.py)."""

from __future__ import annotations

import importlib.resources
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import click

from app.cli import manifest as mf
from app.cli.context import CliError, Config, emit, status

# What `new` writes for each language. The C guest uses only libc; the ABI header sits beside it
# for guests that launch kernels (docs/guest-abi.md).
C_SOURCE = """\
/* {name}: a TensorWasm guest. stdin is the request body, stdout the response, the exit status
 * 0 for success; lines written to stderr show in `tensorwasm logs {name}`.
 * tensorwasm.h declares the GPU calls of the guest ABI (docs/guest-abi.md in the project).
 */
#include <stdio.h>
#include <stdlib.h>

#include "tensorwasm.h"

int main(void) {{
    static char body[65536];
    size_t n = fread(body, 1, sizeof body, stdin);
    const char *greeting = getenv("GREETING");
    printf("%s, %.*s\\n", greeting ? greeting : "hello", (int)n, body);
    fprintf(stderr, "{name}: answered a body of %zu bytes\\n", n);
    return 0;
}}
"""

WAT_SOURCE = """\
;; {name}: a TensorWasm guest in WebAssembly text. It answers "hello, " and the request body
;; (stdin) on stdout, and writes one line to stderr, shown by `tensorwasm logs {name}`.
(module
  (import "wasi_snapshot_preview1" "fd_read" (func $fd_read (param i32 i32 i32 i32) (result i32)))
  (import "wasi_snapshot_preview1" "fd_write" (func $fd_write (param i32 i32 i32 i32) (result i32)))
  (memory (export "memory") 2)
  (data (i32.const 64) "hello, ")
  (data (i32.const 128) "{line}")
  ;; write len bytes at ptr to fd (iovec at 0, bytes written at 8)
  (func $write (param $fd i32) (param $ptr i32) (param $len i32)
    (i32.store (i32.const 0) (local.get $ptr))
    (i32.store (i32.const 4) (local.get $len))
    (drop (call $fd_write (local.get $fd) (i32.const 0) (i32.const 1) (i32.const 8))))
  (func (export "_start") (local $n i32)
    (call $write (i32.const 1) (i32.const 64) (i32.const 7))
    (loop $copy
      ;; read up to 64 KiB at 1024 (iovec at 16, bytes read at 24), write it out, until EOF
      (i32.store (i32.const 16) (i32.const 1024))
      (i32.store (i32.const 20) (i32.const 65536))
      (drop (call $fd_read (i32.const 0) (i32.const 16) (i32.const 1) (i32.const 24)))
      (local.set $n (i32.load (i32.const 24)))
      (if (i32.gt_u (local.get $n) (i32.const 0))
        (then
          (call $write (i32.const 1) (i32.const 1024) (local.get $n))
          (br $copy))))
    (call $write (i32.const 2) (i32.const 128) (i32.const {line_len}))))
"""


def abi_header() -> str:
    """The project's own copy of the guest header (examples/tensorwasm.h, shipped in the wheel as
    app.examples): never a second copy to keep in step."""
    return (importlib.resources.files("app.examples") / "tensorwasm.h").read_text()


@click.command()
@click.argument("name")
@click.option("--lang", type=click.Choice(["c", "wat"]), default="c", show_default=True, help="the guest's language")
@click.option("--dir", "where", type=click.Path(file_okay=False, path_type=Path), help="the directory to write (default: ./NAME)")
def new(name: str, lang: str, where: Path | None) -> None:
    """Write a new guest NAME: its source, the ABI header and tensorwasm.toml, in ./NAME."""
    if not mf.NAME_RE.match(name):
        raise click.BadParameter(f"{name!r}: a function name is 1-63 letters, digits, '_' or '-'", param_hint="NAME")
    target = where or Path(name)
    if target.exists() and any(target.iterdir()):
        raise CliError(f"{target} exists and is not empty: choose another NAME or --dir")
    target.mkdir(parents=True, exist_ok=True)
    if lang == "c":
        source, output = f"{name}.c", f"{name}.wasm"
        (target / source).write_text(C_SOURCE.format(name=name))
        (target / "tensorwasm.h").write_text(abi_header())
        build = mf.C_BUILD.format(source=source, output=output)
    else:
        source, output, build = f"{name}.wat", f"{name}.wasm", None
        line = f"{name}: called\n"
        (target / source).write_text(WAT_SOURCE.format(name=name, line=line.replace("\n", "\\n"), line_len=len(line.encode())))
        (target / "tensorwasm.h").write_text(abi_header())
    (target / mf.MANIFEST).write_text(mf.render(name, source, output, build))
    status(f"wrote {target}/: {source}, tensorwasm.h, {mf.MANIFEST}")
    status(f"next: cd {target} && tensorwasm build && tensorwasm deploy && echo world | tensorwasm invoke {name}")
    click.echo(str(target))


def load_here(directory: Path) -> mf.Manifest:
    try:
        return mf.load(mf.find(directory))
    except mf.ManifestError as exc:
        raise CliError(str(exc)) from None


def build_manifest(m: mf.Manifest, quiet: bool = False) -> Path:
    """Compile the guest of `m` and return its module's path."""
    if m.build:
        argv = [sys.executable if a == "python3" and i == 0 else a for i, a in enumerate(m.build)]
        if "ziglang" in argv and importlib.util.find_spec("ziglang") is None:
            raise CliError("zig is not installed for this Python: pip install 'tensorwasm[guest]' (the ziglang package)")
        if not quiet:
            status("building: " + " ".join(m.build))
        try:
            res = subprocess.run(argv, cwd=m.dir, capture_output=True, text=True)
        except OSError as exc:
            raise CliError(f"the build command could not start ({exc.strerror}: {argv[0]}); fix `build` in {mf.MANIFEST}") from None
        if res.returncode != 0:
            tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-20:])
            raise CliError(f"the build failed (exit status {res.returncode}):\n{tail}")
    elif m.source.endswith(".wat"):
        import wasmtime

        try:
            m.output_path.write_bytes(wasmtime.wat2wasm(m.source_path.read_text()))
        except OSError as exc:
            raise CliError(f"cannot read or write the module: {exc}") from None
        except Exception as exc:  # wasmtime reports a syntax error as a generic error with its position
            raise CliError(f"{m.source} is not valid WebAssembly text: {exc}") from None
    if not m.output_path.is_file():
        raise CliError(f"the build made no {m.output}: check `build` and `output` in {mf.MANIFEST}")
    if not quiet:
        status(f"built {m.output} ({m.output_path.stat().st_size} bytes)")
    return m.output_path


@click.command()
@click.argument("directory", type=click.Path(file_okay=False, exists=True, path_type=Path), default=".")
@click.option("-q", "--quiet", is_flag=True, help="no progress on stderr")
def build(directory: Path, quiet: bool) -> None:
    """Build the guest of DIRECTORY's tensorwasm.toml (default: here); prints the module's path."""
    click.echo(str(build_manifest(load_here(directory), quiet)))


def deploy_manifest(cfg: Config, quiet: bool) -> None:
    """`tensorwasm deploy` with no arguments: build the manifest here and deploy it as its name,
    with its env, secrets, content type and time limit."""
    m = load_here(Path.cwd())
    module = build_manifest(m, quiet).read_bytes()
    with cfg.tenant() as c:
        params: dict[str, Any] = {"env": m.env, "content_type": m.content_type, "timeout_ms": m.timeout_ms}
        if m.secrets:  # each a `secret=NAME` deploy parameter: the guest gets env NAME
            params["secrets"] = m.secrets
        result = c.deploy(m.name, module, **params)
    fn = result.function
    if not quiet:
        status(f"deployed {fn.name} version {fn.version}" + (" (new function)" if result.created else ""))
    emit(fn)
