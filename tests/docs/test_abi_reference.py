"""The guest ABI reference (docs/guest-abi.md) and the guest header (examples/tensorwasm.h) agree
with what the platform defines: every function and its wasm signature, every code, every record
tag and limit, every `std` kernel and its parameters, the settings the limits cite. The
reference's example guests are built and run, and its claim about WAT bodies is checked."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from app.gpu import abi
from app.gpu.signatures import (
    FORMAT_CUDA,
    FORMAT_PTX,
    LAST_ERROR_MAX_BYTES,
    MAX_ARG_BYTES,
    MAX_ARG_RECORDS,
    SIGNATURES,
    Code,
    Tag,
)
from app.settings import Settings
from tests.helpers import EXAMPLES, ROOT, build_c, deploy, new_tenant

REFERENCE = ROOT / "docs" / "guest-abi.md"
HEADER = EXAMPLES / "tensorwasm.h"
STD = abi.STD  # the table the ABI host dispatches `std` launches with
_PAYLOAD_BYTES = {Tag.I32: 4, Tag.I64: 8, Tag.F32: 4, Tag.F64: 8, Tag.BUFFER: 12}


def _reference() -> str:
    return REFERENCE.read_text()


def _section(text: str, title: str) -> str:
    """The body of the `## N. title` section (up to the next level-2 heading)."""
    m = re.search(rf"^## \d+\. {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert m, f"the reference has no section {title!r}"
    return m.group(1)


def _c_to_wasm(decl: str) -> str:
    decl = decl.strip()
    if "*" in decl:
        return "i32"  # wasm32 pointers
    ctype = decl.replace("const ", "").split()[0]
    return {"int32_t": "i32", "int64_t": "i64"}[ctype]


def _header_imports() -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    text = HEADER.read_text()
    found: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for m in re.finditer(r"TW_IMPORT\((\w+)\)\s+(\w+)\s+tw_(\w+)\(([^)]*)\)\s*;", text, re.S):
        name, ret, cname, params = m.groups()
        assert name == cname, f"tw_{cname} imports {name}"
        assert name not in found, f"{name} is declared twice"
        plist = [p for p in params.split(",") if p.strip() and p.strip() != "void"]
        found[name] = (tuple(_c_to_wasm(p) for p in plist), (_c_to_wasm(ret),))
    return found


def _header_constants() -> dict[str, int]:
    text = HEADER.read_text()
    consts = {n: int(v, 0) for n, v in re.findall(r"\b(TW_\w+)\s*=\s*(-?(?:0x[0-9A-Fa-f]+|\d+))", text)}
    consts.update({n: int(v, 0) for n, v in re.findall(r"#define\s+(TW_\w+)\s+(0x[0-9A-Fa-f]+|\d+)\b", text)})
    return consts


# ---- the header ------------------------------------------------------------------------------


def test_header_declares_exactly_the_abi_functions_with_their_wasm_signatures() -> None:
    assert _header_imports() == SIGNATURES


def test_header_codes_tags_formats_and_limits_match_the_platform() -> None:
    consts = _header_constants()
    assert {n: v for n, v in consts.items() if n.removeprefix("TW_") in Code.__members__} == {
        f"TW_{c.name}": c.value for c in Code
    }
    assert {n: v for n, v in consts.items() if n.startswith("TW_ARG_")} == {f"TW_ARG_{t.name}": t.value for t in Tag}
    assert consts["TW_FORMAT_CUDA"] == FORMAT_CUDA and consts["TW_FORMAT_PTX"] == FORMAT_PTX
    assert consts["TW_MAX_ARG_BYTES"] == MAX_ARG_BYTES and consts["TW_MAX_ARG_RECORDS"] == MAX_ARG_RECORDS


# ---- the reference ---------------------------------------------------------------------------


def test_reference_documents_every_function_with_its_wasm_signature() -> None:
    documented = {}
    for name, params, result in re.findall(r"^#### `(\w+)\(([^)]*)\) -> (\w+)`$", _reference(), re.M):
        types = tuple(p.split(":")[1].strip() for p in params.split(",") if p.strip())
        assert name not in documented, f"{name} is documented twice"
        documented[name] = (types, (result,))
    assert documented == SIGNATURES


def test_reference_quotes_the_header_declaration_of_every_function() -> None:
    text, header = _reference(), HEADER.read_text()
    for name in SIGNATURES:
        m = re.search(rf"^\w+ tw_{name}\([^)]*\);$", text, re.M)
        assert m, f"the reference quotes no C declaration of {name}"
        quoted = re.sub(r"\s+", " ", m.group(0))
        assert quoted.rstrip(";") in re.sub(r"\s+", " ", header).replace("( ", "("), f"{quoted} is not the header's"


def test_reference_documents_every_code_with_its_value() -> None:
    rows = re.findall(r"^\| (-?\d+) \| `([A-Z_]+)` \|", _section(_reference(), "Return codes"), re.M)
    assert {name: int(value) for value, name in rows} == {c.name: c.value for c in Code}


def test_reference_documents_every_record_tag_with_its_payload() -> None:
    section = _section(_reference(), "Kernel argument records")
    rows = re.findall(r"^\| `(0x[0-9a-f]{2})` \| `TW_ARG_(\w+)` \| [^|]*\((\d+)\) \|", section, re.M)
    assert {int(tag, 16): (name, int(size)) for tag, name, size in rows} == {
        t.value: (t.name, _PAYLOAD_BYTES[t]) for t in Tag
    }
    assert f"**{MAX_ARG_BYTES} bytes**" in section and f"**{MAX_ARG_RECORDS} records**" in section
    assert f"{LAST_ERROR_MAX_BYTES} bytes" in _section(_reference(), "Conventions: pointers, handles, return values")


def _std_param_types(cell: str) -> tuple[str, ...]:
    out: list[str] = []
    for group in cell.split(";"):
        names, _, kind = group.rpartition(":")
        kind = kind.strip()
        ptype = {"buffer": "buf", "buffers": "buf", "i32": "i32", "f32": "f32"}[kind]
        out += [ptype] * len(re.findall(r"`\w+`", names))
    return tuple(out)


def test_reference_documents_every_std_kernel_with_its_parameters() -> None:
    section = _section(_reference(), "The `std` kernel library")
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", section, re.M)
    assert {name: _std_param_types(cell) for name, cell in rows} == {name: k.params for name, k in STD.items()}


def test_every_std_kernel_has_a_cuda_source_or_a_library_path() -> None:
    sources = [p for p in ROOT.rglob("std.cu") if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]
    assert sources, "no std.cu in the repository"
    cuda = set(re.findall(r'extern "C" __global__ void (\w+)\(', sources[0].read_text()))
    assert cuda <= set(STD)
    assert set(STD) - cuda == {"gemm_f32"}, "only gemm_f32 runs through a library (cuBLAS)"
    assert "cuBLAS" in _section(_reference(), "The `std` kernel library")


def test_reference_limits_cite_real_settings_with_their_defaults() -> None:
    section = _section(_reference(), "Limits")
    fields = Settings.model_fields
    cited = re.findall(r"`TENSORWASM_([A-Z_]+)`", section)
    assert cited
    for env in cited:
        assert env.lower() in fields, f"the reference cites TENSORWASM_{env}, which is no setting"
    defaults = {n: f.default for n, f in fields.items()}
    assert defaults["max_buffers_per_instance"] == 1024 and "| 1024 (`QUOTA_EXCEEDED`)" in section
    assert defaults["max_modules_per_instance"] == 64 and "| 64 (`QUOTA_EXCEEDED`)" in section
    assert defaults["stdout_limit_bytes"] == 16 << 20 and "| 16 MiB" in section
    assert defaults["stderr_tail_bytes"] == 64 << 10 and "last 64 KiB" in section
    assert defaults["max_request_bytes"] == 32 << 20 and "| 32 MiB" in section
    for field in ("gpu_memory_bytes", "wasm_memory_bytes", "timeout_ms", "max_module_bytes"):
        assert f"`{field}`" in section and f"default_{field}" in fields


def test_nothing_cites_a_file_the_repository_does_not_have() -> None:
    for path in [ROOT / "README.md", HEADER, *EXAMPLES.glob("*.c"), *(ROOT / "docs").glob("*.md")]:
        assert "ABI" + ".md" not in path.read_text(), f"{path.relative_to(ROOT)} cites a file the repository does not have"
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.relative_to(ROOT)} links to {target}, which does not exist"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_anchors_in_links_exist() -> None:
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target, anchor in re.findall(r"\]\(([^)#:]*)#([^)]+)\)", path.read_text()):
            dest = (path.parent / target) if target else path
            assert anchor in _anchors(dest), f"{path.relative_to(ROOT)} links to {target}#{anchor}, no such heading"


# ---- the reference's examples, run ------------------------------------------------------------


def _example(name: str) -> str:
    m = re.search(rf"<!-- guest: {re.escape(name)} -->\n```\w+\n(.*?)```", _reference(), re.S)
    assert m, f"the reference has no example {name}"
    return m.group(1)


async def test_the_c_example_builds_and_sums(client: httpx.AsyncClient, tmp_path: Path) -> None:
    source = tmp_path / "sum.c"
    source.write_text(_example("sum.c"))
    wasm = build_c(source, tmp_path)
    _, key = await new_tenant(client)
    assert (await deploy(client, key, "sum", wasm)).status_code == 201
    r = await client.post("/v1/functions/sum/invoke", content=np.arange(1, 101, dtype="f4").tobytes(), headers=key)
    assert r.status_code == 200, r.text
    assert r.text == "5050\n"
    # the error path the reference shows: a failing call, its message on stderr, a non-zero exit
    _, nogpu = await new_tenant(client, gpu_memory_bytes=0)
    assert (await deploy(client, nogpu, "sum", wasm)).status_code == 201
    r = await client.post("/v1/functions/sum/invoke", content=b"\0" * 8, headers=nogpu)
    err = r.json()["error"]
    assert r.status_code == 500 and err["code"] == "guest_error" and err["exit_code"] == 2
    assert "buffer_alloc failed (-1)" in err["stderr_tail"] and "no GPU access" in err["stderr_tail"]


async def test_the_wat_example_is_deployed_as_text_and_doubles(client: httpx.AsyncClient) -> None:
    text = _example("double.wat").encode()
    _, key = await new_tenant(client)
    r = await deploy(client, key, "double", text)
    assert r.status_code == 201, r.text
    # the reference: the text is stored as sent
    assert r.json()["sha256"] == hashlib.sha256(text).hexdigest() and r.json()["size"] == len(text)
    assert (await deploy(client, key, "double", text)).json()["version"] == 1  # same text: same version
    x = np.arange(1000, dtype="f4") - 500
    r = await client.post("/v1/functions/double/invoke", content=x.tobytes(), headers=key)
    assert r.status_code == 200, r.text
    assert np.array_equal(np.frombuffer(r.content, "f4"), 2 * x)
    # a failing call ends the guest with exit status -code: over the cap is QUOTA_EXCEEDED (6)
    _, small = await new_tenant(client, gpu_memory_bytes=64)
    assert (await deploy(client, small, "double", text)).status_code == 201
    r = await client.post("/v1/functions/double/invoke", content=x.tobytes(), headers=small)
    assert r.status_code == 500 and r.json()["error"]["exit_code"] == -Code.QUOTA_EXCEEDED


async def test_a_wat_body_that_does_not_parse_is_refused_with_the_parsers_message(client: httpx.AsyncClient) -> None:
    _, key = await new_tenant(client)
    r = await deploy(client, key, "broken", b"(module (func")
    assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_module"
    assert "expected" in r.json()["error"]["message"]


def test_the_examples_in_the_repository_build_against_the_header(tmp_path: Path) -> None:
    for source in sorted(EXAMPLES.glob("*.c")):
        build_c(source, tmp_path)  # asserts that zig succeeded


def test_the_reference_build_command_works_as_written(tmp_path: Path) -> None:
    name = "sum.c"
    section = _section(_reference(), "Building guests and examples")
    assert "python3 -m ziglang cc -target wasm32-wasi -O2 -s -Iexamples" in section
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "tensorwasm.h").write_text(HEADER.read_text())
    (tmp_path / name).write_text(_example(name))
    res = subprocess.run(
        [sys.executable, "-m", "ziglang", "cc", "-target", "wasm32-wasi", "-O2", "-s", "-Iexamples", name, "-o", "out.wasm"],
        cwd=tmp_path, capture_output=True, text=True,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out.wasm").read_bytes()[:4] == b"\0asm"
