"""Drive HTTP load with wrk (Debian's `wrk` package) and read its figures back as numbers.

wrk is an external C load generator: it stays far from its own limit where an in-process Python
client would be the bottleneck (a few hundred requests/s). A small Lua script counts replies by
status and prints one JSON line at the end.

wrk corrects its latency figures for coordinated omission: a reply that took longer than a
connection's mean interval between requests adds made-up samples for the requests that would
have been sent meanwhile, as if the load were open-loop. At c=1 one call of 200 ms among 40,000
of 0.07 ms reads as a p99 of 167 ms. A `timed` run also times each request itself (LuaJIT's FFI
and the monotonic clock) and reports the percentiles of the calls actually made beside wrk's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = "wrk is needed: `apt-get install wrk` (Debian/Ubuntu) or `brew install wrk`; or set TENSORWASM_WRK to its path"

_SCRIPT = r"""
wrk.method = "%(method)s"
wrk.body = %(body)s
%(headers)s
local timed = %(timed)s
local alternate = %(alternate)s
local rotate = %(rotate)s
local threads = {}
function setup(thread) thread:set("first", #threads); table.insert(threads, thread) end
if rotate ~= nil then
  -- each request with the next set of headers; each thread starts at its own set
  local formatted, turn
  function request()
    if formatted == nil then
      formatted = {}
      for k, set in ipairs(rotate) do
        local h = {}
        for name, v in pairs(set) do h[name] = v end
        formatted[k] = wrk.format(nil, nil, h)
      end
      turn = first %% #formatted
    end
    turn = turn %% #formatted + 1
    return formatted[turn]
  end
end
function init(args) ok = 0; limited = 0; other = 0; took = {}; took_alt = {}; n = 0 end
local clock, now_us, sent, alt
if timed then
  local ffi = require("ffi")
  ffi.cdef[[ typedef struct { long sec; long nsec; } tw_timespec; int clock_gettime(int, tw_timespec *); ]]
  clock = ffi.new("tw_timespec")
  now_us = function() ffi.C.clock_gettime(1, clock); return tonumber(clock.sec) * 1e6 + tonumber(clock.nsec) / 1e3 end
  -- one connection per thread: the request written last is the one answered next
  function request()
    n = n + 1
    alt = alternate ~= nil and n %% 2 == 0
    sent = now_us()
    if alt then return wrk.format(nil, alternate) end
    return wrk.format()
  end
end
function response(status, headers, body)
  if timed then
    local list = alt and took_alt or took
    list[#list + 1] = now_us() - sent
  end
  if status == 200 then ok = ok + 1 elseif status == 429 then limited = limited + 1 else other = other + 1 end
end
local function rank(sorted, p)
  if #sorted == 0 then return 0 end
  return sorted[math.max(1, math.ceil(p / 100 * #sorted))]
end
local function gather(name)
  local all = {}
  for _, t in ipairs(threads) do
    for _, v in ipairs(t:get(name)) do all[#all + 1] = v end
  end
  table.sort(all)
  return all
end
function done(summary, latency, requests)
  local o, l, x = 0, 0, 0
  for _, t in ipairs(threads) do o = o + t:get("ok"); l = l + t:get("limited"); x = x + t:get("other") end
  local all, other_path = gather("took"), gather("took_alt")
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests":%%d,"duration_us":%%d,"ok":%%d,"limited":%%d,"other":%%d,' ..
    '"p50_us":%%d,"p90_us":%%d,"p99_us":%%d,"max_us":%%d,"socket_errors":%%d,"timed":%%d,"timed_p99_us":%%d,' ..
    '"timed_p50_us":%%d,"alt_timed":%%d,"alt_p50_us":%%d}\n',
    summary.requests, summary.duration, o, l, x, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max, e.connect + e.read + e.write + e.timeout, #all, rank(all, 99),
    rank(all, 50), #other_path, rank(other_path, 50)))
end
"""


def _lua_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lua string literal for ASCII text


def _lua_table(sets: list[dict[str, str]]) -> str:
    rows = ("{" + ", ".join(f"[{_lua_str(k)}] = {_lua_str(v)}" for k, v in h.items()) + "}" for h in sets)
    return "{" + ", ".join(rows) + "}"


@dataclass(frozen=True)
class WrkResult:
    requests: int
    seconds: float
    ok: int
    limited: int
    other: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    socket_errors: int
    timed_p99_ms: float | None = None  # a timed run's: the p99 of the calls made (no correction)
    timed_p50_ms: float | None = None  # ... and their p50 (with `alternate`: of the URL's own calls)
    alternate_p50_ms: float | None = None  # with `alternate`: the p50 of the calls to the other path

    @property
    def call_p99_ms(self) -> float:
        """The p99 of the calls made where the run was timed, else wrk's (corrected) p99."""
        return self.timed_p99_ms if self.timed_p99_ms is not None else self.p99_ms

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def goodput(self) -> float:
        """Replies with status 200 per second."""
        return self.ok / self.seconds


def wrk_path() -> str | None:
    return os.environ.get("TENSORWASM_WRK") or shutil.which("wrk")


def run_wrk(
    url: str,
    *,
    connections: int,
    seconds: float,  # whole seconds: wrk takes no fractions
    threads: int | None = None,
    method: str = "GET",
    body: str = "",
    headers: dict[str, str] | None = None,
    timed: bool = False,
    alternate: str | None = None,
    rotate: list[dict[str, str]] | None = None,
) -> WrkResult:
    """`timed`: also time each request here (one connection per thread; calls wrk's Lua for every
    request, so for latency runs, not for throughput). `alternate` (a timed run's): another path
    on the same server, every other call of each connection, timed apart. `rotate` (an untimed
    run's): header sets taken in turn, one a request (each request formatted once, up front)."""
    if alternate is not None and not timed:
        raise ValueError("alternate paths are timed runs")
    if rotate is not None and (timed or not rotate):
        raise ValueError("rotated headers are for untimed runs, with at least one set")
    exe = wrk_path()
    if exe is None:
        raise RuntimeError(INSTALL_HINT)
    threads = connections if timed else max(1, min(threads or default_threads(), connections))
    lines = "\n".join(f"wrk.headers[{_lua_str(k)}] = {_lua_str(v)}" for k, v in (headers or {}).items())
    script = _SCRIPT % {
        "method": method, "body": _lua_str(body), "headers": lines, "timed": "true" if timed else "false",
        "alternate": _lua_str(alternate) if alternate is not None else "nil",
        "rotate": _lua_table(rotate) if rotate is not None else "nil",
    }
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(script)
        path = Path(f.name)
    try:
        cmd = [exe, "-t", str(threads), "-c", str(connections), "-d", f"{max(1, round(seconds))}s", "--timeout", "30s", "-s", str(path), url]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=seconds + 60).stdout
    finally:
        path.unlink(missing_ok=True)
    line = next((ln for ln in out.splitlines() if ln.startswith("WRKJSON ")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    raw = json.loads(line[len("WRKJSON "):])
    return WrkResult(
        requests=raw["requests"],
        seconds=raw["duration_us"] / 1e6,
        ok=raw["ok"],
        limited=raw["limited"],
        other=raw["other"],
        p50_ms=raw["p50_us"] / 1e3,
        p90_ms=raw["p90_us"] / 1e3,
        p99_ms=raw["p99_us"] / 1e3,
        max_ms=raw["max_us"] / 1e3,
        socket_errors=raw["socket_errors"],
        timed_p99_ms=raw["timed_p99_us"] / 1e3 if timed else None,
        timed_p50_ms=raw["timed_p50_us"] / 1e3 if timed else None,
        alternate_p50_ms=raw["alt_p50_us"] / 1e3 if alternate is not None and raw["alt_timed"] else None,
    )


def default_threads() -> int:
    """A quarter of the cores for the load generator (at least one, at most eight)."""
    return max(1, min(8, (os.cpu_count() or 1) // 4))
