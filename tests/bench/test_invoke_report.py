"""bench invoke's report: with several flood runs, the other tenant is judged on its worst one;
what the node's metrics say of each run (slow calls, stalls, the fronts' phases)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from app.bench.cpu import HostCpu, Role, RoleCpu
from app.bench.invoke import Loaded, Spread, _phase_summary, _report
from app.bench.observed import FrontPhases, Slow, Split, Stalls, front_phases, front_turns, replaced, scrape, slow_calls, split, stalls
from app.bench.wrk import WrkResult
from app.observability.phases import Phase


def _result(p99_ms: float, ok: int = 1000, other: int = 0) -> WrkResult:
    return WrkResult(
        requests=ok + other, seconds=1.0, ok=ok, limited=0, other=other,
        p50_ms=p99_ms / 2, p90_ms=p99_ms, p99_ms=p99_ms, max_ms=p99_ms, socket_errors=0,
    )


def _results(beside_p99s: list[float]) -> dict[str, WrkResult]:
    runs = ("bare1_c32", "bareN_c1", "bareN_c32", "bareN_c256", "relay_c1", "relay_c32", "floor_c1", "floor_c32", "node_c1", "node_c32", "node_c256")
    r = {k: _result(1.0) for k in runs}
    r["quiet_alone"], r["flood_at_quota"] = _result(2.0), _result(1.0)
    for i, p99 in enumerate(beside_p99s):
        tag = f"_{i}" if i else ""
        r[f"flood_at_4x{tag}"], r[f"quiet_beside_flood{tag}"] = _result(1.0, other=5), _result(p99)
    return r


def _line(out: str, start: str) -> str:
    return next(line for line in out.splitlines() if line.startswith(start))


def test_one_flood_run_is_reported_as_before(capsys: pytest.CaptureFixture[str]) -> None:
    _report(_results([3.0]), 2, 8)
    out = capsys.readouterr().out
    assert _line(out, "other tenant p99 beside the flood / alone").endswith("yes")
    assert "runs (ms)" not in out
    # the flood's own replies other than 200/429 are not counted as errors
    assert _line(out, "socket errors").split()[-3:] == ["0", "0", "yes"]


def test_several_flood_runs_are_listed_and_the_worst_decides(capsys: pytest.CaptureFixture[str]) -> None:
    _report(_results([3.0, 9.0, 2.5]), 2, 8)
    out = capsys.readouterr().out
    assert _line(out, "other tenant c=1 p99 beside the flood, 3 runs").split()[-3:] == ["3.0", "9.0", "2.5"]
    assert _line(out, "other tenant c=1 p99 alone / worst beside").split()[-3:] == ["2.00", "/", "9.00"]
    assert _line(out, "other tenant p99 worst beside the flood / alone").split()[-4:] == ["4.50x", "<=", "2.0x", "NO"]


def test_the_turns_the_flood_waited_for_are_read_from_the_metric_and_shown_per_run(capsys: pytest.CaptureFixture[str]) -> None:
    text = "# HELP tensorwasm_front_turns_total x\n# TYPE tensorwasm_front_turns_total counter\ntensorwasm_front_turns_total 1500.0\n"
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        assert front_turns(scrape(client)) == 1500
    _report(_results([3.0, 2.0]), 2, 8, turns=[1500, 0])
    out = capsys.readouterr().out
    assert _line(out, "per run: turns the flood's calls waited for").split()[-4:] == ["1500", "(1.5/call)", "0", "(0.0/call)"]


def test_workers_replaced_during_the_floods_are_counted_from_the_nodes_metrics(capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "# HELP tensorwasm_worker_restarts_total Workers replaced, by reason\n"
        "# TYPE tensorwasm_worker_restarts_total counter\n"
        'tensorwasm_worker_restarts_total{reason="evicted"} 2.0\n'
        'tensorwasm_worker_restarts_total{reason="cancelled"} 3.0\n'
        "# HELP tensorwasm_workers Worker processes by state\n"
        "# TYPE tensorwasm_workers gauge\n"
        'tensorwasm_workers{state="idle"} 7.0\n'
    )
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        so_far = replaced(scrape(client))
    assert so_far == Counter(evicted=2, cancelled=3)
    _report(_results([3.0]), 2, 8, replaced=so_far - Counter(evicted=2))
    assert _line(capsys.readouterr().out, "workers replaced during the flood runs").split()[-3:] == ["3", "(cancelled", "3)"]
    _report(_results([3.0]), 2, 8, replaced=Counter())
    assert _line(capsys.readouterr().out, "workers replaced during the flood runs").split()[-1] == "0"


def test_the_other_tenants_slow_calls_are_split_by_where_they_waited(capsys: pytest.CaptureFixture[str]) -> None:
    def histogram(name: str, tenant: str, under: int, count: int) -> str:
        return (
            f"# TYPE tensorwasm_invocation_{name}_seconds histogram\n"
            f'tensorwasm_invocation_{name}_seconds_bucket{{le="0.05",tenant="{tenant}"}} {under}.0\n'
            f'tensorwasm_invocation_{name}_seconds_bucket{{le="+Inf",tenant="{tenant}"}} {count}.0\n'
            f'tensorwasm_invocation_{name}_seconds_count{{tenant="{tenant}"}} {count}.0\n'
            f'tensorwasm_invocation_{name}_seconds_sum{{tenant="{tenant}"}} 1.0\n'
        )

    text = histogram("duration", "quiet", 90, 100) + histogram("wait", "quiet", 96, 100) + histogram("run", "quiet", 100, 100)
    text += histogram("duration", "flood", 0, 500)  # another tenant's are not counted
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        slow = slow_calls(scrape(client), "quiet")
    assert slow == Slow(total=10, waiting=4, running=0, calls=100)
    assert slow - Slow(3, 1, 0, 40) == Slow(7, 3, 0, 60)
    _report(_results([3.0, 4.0]), 2, 8, slow=[Slow(7, 3, 0, 60), Slow(0, 0, 0, 998)])
    out = capsys.readouterr().out
    assert _line(out, "other tenant's calls over 50 ms per run").split()[-2:] == ["7/3/0", "0/0/0"]
    # beside wrk's replies in each run (1000 each here): whether its requests reached the node
    assert _line(out, "other tenant per run").split()[-2:] == ["1000/60/3", "1000/998/4"]


def test_stalls_per_run_come_from_the_nodes_histograms_and_the_hosts_cpu_times(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    def histogram(family: str, under: int, count: int, labels: str = "") -> str:
        sep = "," if labels else ""
        return (
            f"# TYPE {family} histogram\n"
            f'{family}_bucket{{{labels}{sep}le="0.01"}} {under}.0\n'
            f'{family}_bucket{{{labels}{sep}le="+Inf"}} {count}.0\n'
            f"{family}_count{{{labels}}} {count}.0\n"
        )

    text = histogram("tensorwasm_event_loop_lag_seconds", 990, 1000) + histogram("tensorwasm_supervisor_event_loop_lag_seconds", 100, 101)
    text += "# TYPE tensorwasm_gc_pause_seconds histogram\n"
    text += "".join(histogram("tensorwasm_gc_pause_seconds", n - 1, n, f'generation="{g}"').split("\n", 1)[1] for g, n in ((0, 50), (2, 3)))
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        samples = scrape(client)
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice, in clock ticks
    stat.write_text(f"cpu  {300 * tick} 0 {100 * tick} {590 * tick} 0 0 0 {10 * tick} 0 0\ncpu0 1 2 3\n")
    host = HostCpu.read(str(stat))
    assert (host.total_s, host.busy_s, host.steal_s) == (1000, 400, 10)
    assert HostCpu.read(str(tmp_path / "absent")) == HostCpu()
    run = stalls(samples, host) - stalls([], HostCpu(500, 300, 5))
    assert (run.front_lags, run.supervisor_lags, run.gc_pauses) == (10, 1, 2)
    assert run.describe() == "10/1/2/20%/1.0%"  # busy 100 s and steal 5 s of 500 s of the host's CPU time
    _report(_results([3.0]), 2, 8, stalls=[run, Stalls()])
    assert _line(capsys.readouterr().out, "per run: loop lags").split()[-2:] == ["10/1/2/20%/1.0%", "0/0/0/0%/0.0%"]


def test_the_other_tenant_is_judged_on_the_calls_it_made_with_wrks_corrected_p99_beside(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([150.0, 4.0])  # wrk's p99s: one slow call at c=1 reads as a tail of 150 ms
    r["quiet_alone"] = replace(r["quiet_alone"], timed_p99_ms=2.0)
    r["quiet_beside_flood"] = replace(r["quiet_beside_flood"], timed_p99_ms=3.0)
    r["quiet_beside_flood_1"] = replace(r["quiet_beside_flood_1"], timed_p99_ms=3.6)
    _report(r, 2, 8, after_idle_ms=222.4)
    out = capsys.readouterr().out
    assert _line(out, "other tenant's first call after idling").split()[-1] == "222.4"
    assert _line(out, "other tenant c=1 p99 beside the flood, 2 runs, per call").split()[-2:] == ["3.0", "3.6"]
    assert _line(out, "other tenant c=1 p99 beside the flood, 2 runs, wrk's").split()[-2:] == ["150.0", "4.0"]
    assert _line(out, "other tenant c=1 p99 alone / worst beside").split()[-3:] == ["2.00", "/", "3.60"]
    assert _line(out, "other tenant p99 worst beside the flood / alone").split()[-4:] == ["1.80x", "<=", "2.0x", "yes"]
    assert _line(out, "the same by wrk's p99").split()[-1] == "75.00x"


def test_each_flood_run_is_judged_against_the_alone_run_just_before_it(capsys: pytest.CaptureFixture[str]) -> None:
    """A host drifts within minutes: each flood run's p99 is compared with the other tenant's
    p99 alone measured right before it, and the worst of those ratios decides."""
    r = _results([3.0, 5.0, 2.5])  # the first alone run: 2.0 ms
    for tag, p99 in (("", 1.6), ("_1", 3.0), ("_2", 1.0)):
        r[f"quiet_alone_before{tag}"] = _result(p99)
    _report(r, 2, 8)
    out = capsys.readouterr().out
    assert _line(out, "other tenant c=1 p99 alone just before each flood run, 3 runs").split()[-3:] == ["1.60", "3.00", "1.00"]
    line = _line(out, "other tenant p99 beside each flood run / alone just before it")
    assert line.split()[-6:] == ["1.88x", "1.67x", "2.50x", "<=", "2.0x", "NO"]  # the third run: 2.5 against 1.0
    assert _line(out, "other tenant p99 worst beside the flood / first alone run").split()[-1] == "2.50x"  # 5.0 / 2.0, not judged
    r["quiet_alone_before_2"] = _result(1.5)
    _report(r, 2, 8)
    assert _line(capsys.readouterr().out, "other tenant p99 beside each flood run / alone just before it").split()[-4:] == ["1.67x", "<=", "2.0x", "yes"]


def test_the_nodes_cpu_per_call_is_printed_per_role_with_its_busiest_process(capsys: pytest.CaptureFixture[str]) -> None:
    roles = {
        Role.FRONT: RoleCpu(Role.FRONT, 8, 883.4, 0.83), Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 129.0, 0.72),
        Role.WORKER: RoleCpu(Role.WORKER, 8, 539.0, 0.43), Role.OTHER: RoleCpu(Role.OTHER, 1, 3.0, 0.01),
    }
    _report(_results([3.0]), 8, 8, cpu_use={32: roles})
    line = _line(capsys.readouterr().out, "c=32: node CPU per call")
    assert line.split("core)")[1].split() == ["fronts", "883", "(83%)", "supervisor", "129", "(72%)", "workers", "539", "(43%)"]
    _report(_results([3.0]), 1, 8, cpu_use={32: {Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 700.0, 0.95)}})
    assert "node 700 (95%)" in _line(capsys.readouterr().out, "c=32: node CPU per call")  # one process: the whole node


def test_a_c1_calls_time_is_split_into_its_lease_wait_its_guests_run_and_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    def sums(tenant: str, count: int, duration: float, wait: float, run: float) -> str:
        out = ""
        for name, total in (("duration", duration), ("wait", wait), ("run", run)):
            out += (
                f"# TYPE tensorwasm_invocation_{name}_seconds histogram\n"
                f'tensorwasm_invocation_{name}_seconds_count{{tenant="{tenant}"}} {count}.0\n'
                f'tensorwasm_invocation_{name}_seconds_sum{{tenant="{tenant}"}} {total}\n'
            )
        return out

    text = sums("hot", 3000, 1.2, 0.3, 0.45) + sums("other", 10, 5.0, 5.0, 5.0)
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=text))) as client:
        after = split(scrape(client), "hot")
    during = after - Split(1000, 0.4, 0.1, 0.15)  # the scrape before the c=1 run
    assert during.calls == 2000
    assert [round(x) for x in during.mean_us()] == [400, 100, 150]
    r = _results([3.0])
    r["node_c1"] = replace(r["node_c1"], requests=2000, seconds=1.0)  # one connection: a 500 us cycle
    _report(r, 2, 8, c1_split=during)
    assert _line(capsys.readouterr().out, "c=1 mean us").split("rest)")[1].split() == ["500", "|", "400", "(100,", "150,", "150)"]


def test_the_c32_split_says_what_a_call_spends_beside_its_guest(capsys: pytest.CaptureFixture[str]) -> None:
    _report(_results([3.0]), 2, 8, c32_split=Split(calls=1000, call_s=3.0, wait_s=2.2, run_s=0.25))
    assert _line(capsys.readouterr().out, "c=32 mean us: call in the node").split()[-4:] == ["3000", "(2200,", "250,", "550)"]
    _report(_results([3.0]), 2, 8)
    assert "c=32 mean us" not in capsys.readouterr().out


def _phases_text(calls: int, seconds: dict[str, float]) -> str:
    text = "# HELP tensorwasm_front_phase_seconds_total A front's own time\n# TYPE tensorwasm_front_phase_seconds_total counter\n"
    text += "".join(f'tensorwasm_front_phase_seconds_total{{phase="{p}"}} {v}\n' for p, v in seconds.items())
    text += "# HELP tensorwasm_front_phase_calls_total Calls\n# TYPE tensorwasm_front_phase_calls_total counter\n"
    return text + f"tensorwasm_front_phase_calls_total {calls}.0\n"


def test_the_fronts_cpu_per_call_is_split_by_phase_from_the_nodes_counters(capsys: pytest.CaptureFixture[str]) -> None:
    before = {p.label: 1.0 for p in Phase}
    after = {p.label: 1.0 for p in Phase} | {"auth": 1.02, "send": 1.05, "record_write": 1.1, "from_a_newer_node": 9.0}
    scrapes = iter([_phases_text(500, before), _phases_text(10_500, after)])
    with httpx.Client(base_url="http://node", transport=httpx.MockTransport(lambda _: httpx.Response(200, text=next(scrapes)))) as client:
        run = front_phases(scrape(client))
        run = front_phases(scrape(client)) - run
    assert run.calls == 10_000
    us = run.per_call_us()
    assert [round(us[p], 3) for p in (Phase.AUTH, Phase.SEND, Phase.RECORD_WRITE, Phase.ADMIT)] == [2.0, 5.0, 10.0, 0.0]
    assert front_phases([]) == FrontPhases()  # a node that publishes none
    fronts = {Role.FRONT: RoleCpu(Role.FRONT, 2, 100.0, 0.9), Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 1.0, 0.01)}
    # the phases and their shares come from the second node (the CPU phase clock), its runs set
    # beside the first node's
    profiled = Loaded(runs={32: _result(1.0, ok=900)}, cpu_use={32: fronts}, phases={32: run})
    _report(_results([3.0]), 2, 8, cpu_use={32: {Role.FRONT: RoleCpu(Role.FRONT, 2, 90.0, 0.9)}}, profiled=profiled)
    out = capsys.readouterr().out
    assert _line(out, "c=32: node with the CPU phase clock req/s").split()[-3:] == ["900", "|", "0.90x"]
    assert _line(out, "c=32: fronts' CPU per call by phase").split()[-1] == "100"
    assert "10000 calls" in _line(out, "c=32: fronts' CPU per call by phase")
    assert _line(out, "  auth").split()[-2:] == ["2.0", "(2.0%)"]
    assert _line(out, "  record_write").split()[-2:] == ["10.0", "(10.0%)"]
    assert _line(out, "  all phases").split()[-2:] == ["17.0", "(17.0%)"]
    assert _line(out, "  other: HTTP server, ASGI, event loop, middleware").split()[-2:] == ["83.0", "(83.0%)"]
    summary = _phase_summary(run, 100.0)  # --json
    assert summary["calls"] == 10_000 and summary["fronts_cpu_us"] == 100.0
    assert summary["us_per_call"]["send"] == pytest.approx(5.0) and summary["other_us"] == pytest.approx(83.0)
    # a one-process node: its first process is its front
    one = Loaded(runs={256: _result(1.0)}, cpu_use={256: {Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 50.0, 0.9)}}, phases={256: run})
    _report(_results([3.0]), 1, 8, profiled=one)
    assert _line(capsys.readouterr().out, "  other").split()[-2:] == ["33.0", "(66.0%)"]


def test_the_call_paths_targets_are_judged_and_a_two_core_host_has_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0])
    r["bareN_c1"], r["relay_c1"], r["floor_c1"] = _result(0.4), _result(0.6), _result(0.7)  # p50s 0.2, 0.3, 0.35 ms
    r["node_c1"], r["bare1_c32"] = _result(0.9), replace(_result(1.0), requests=2500)  # p50 0.45 ms; 2,500 req/s
    roles = {
        Role.FRONT: RoleCpu(Role.FRONT, 8, 280.0, 0.8), Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 2.0, 0.01),
        Role.WORKER: RoleCpu(Role.WORKER, 8, 300.0, 0.4),
    }
    split32 = Split(calls=1000, call_s=1.0, wait_s=0.1, run_s=0.2)  # the guest's run: 200 us a call
    _report(r, 8, 8, cpu_use={32: roles}, c32_split=split32)
    out = capsys.readouterr().out
    assert _line(out, "c=1 p50: node / bare").split()[-4:] == ["2.25x", "<=", "2.0x", "NO"]
    assert _line(out, "c=1 p50: node / one hop + guest").split()[-4:] == ["1.29x", "<=", "1.3x", "yes"]
    assert _line(out, "c=1 p50: one hop + guest, less one hop").split()[-4:] == ["50", "<=", "60", "yes"]
    assert _line(out, "c=32: CPU per call, us").split()[-7:] == ["280", "|", "2", "|", "100", "300|5|150", "yes"]
    assert _line(out, "c=32: node / bare with 1 process").split()[-4:] == ["0.40x", ">=", "1.0x", "NO"]
    # a front over its bound fails the CPU line
    _report(r, 8, 8, cpu_use={32: {**roles, Role.FRONT: RoleCpu(Role.FRONT, 8, 301.0, 0.8)}}, c32_split=split32)
    assert _line(capsys.readouterr().out, "c=32: CPU per call, us").split()[-2:] == ["300|5|150", "NO"]
    # two processes, a 2-core host: its own bounds for c=1 against bare and c=32 against one process
    _report(r, 2, 8, cpu_use={32: roles}, c32_split=split32)
    out = capsys.readouterr().out
    assert _line(out, "c=1 p50: node / bare").split()[-4:] == ["2.25x", "<=", "3.0x", "yes"]
    assert _line(out, "c=32: node / bare with 1 process").split()[-4:] == ["0.40x", ">=", "0.35x", "yes"]


def test_with_a_node_run_without_polling_the_cpu_bounds_judge_its_work_and_the_polling_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0])
    split32 = Split(calls=1000, call_s=1.0, wait_s=0.1, run_s=0.05)  # the guest's run: 50 us a call
    polled = {
        Role.FRONT: RoleCpu(Role.FRONT, 8, 330.0, 1.0), Role.SUPERVISOR: RoleCpu(Role.SUPERVISOR, 1, 1.0, 0.01),
        Role.WORKER: RoleCpu(Role.WORKER, 8, 290.0, 0.97),
    }
    work = {**polled, Role.FRONT: RoleCpu(Role.FRONT, 8, 290.0, 0.9), Role.WORKER: RoleCpu(Role.WORKER, 8, 190.0, 0.6)}
    resting = Loaded(runs={32: _result(1.0, ok=900)}, cpu_use={32: work}, c32_split=split32)
    _report(r, 8, 8, cpu_use={32: polled}, c32_split=split32, resting=resting)
    out = capsys.readouterr().out
    # the default node's figures are shown, not judged: 330 | 1 | 240
    assert _line(out, "c=32: CPU per call, us").split()[-5:] == ["330", "|", "1", "|", "240"]
    assert _line(out, "c=32 without polling: req/s").split()[-3:] == ["900", "|", "0.90x"]
    assert _line(out, "c=32 without polling: CPU per call").split()[-7:] == ["290", "|", "1", "|", "140", "300|5|150", "yes"]
    assert _line(out, "c=32: CPU per call spent polling").split()[-3:] == ["40", "|", "100"]
    # its work over a bound fails the line
    resting.cpu_use[32] = {**work, Role.WORKER: RoleCpu(Role.WORKER, 8, 201.0, 0.6)}
    _report(r, 8, 8, cpu_use={32: polled}, c32_split=split32, resting=resting)
    assert _line(capsys.readouterr().out, "c=32 without polling: CPU per call").split()[-2:] == ["300|5|150", "NO"]


def test_the_spread_tenants_runs_are_judged_against_bare_echo(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0])
    r["spread_c32"], r["spread_c256"] = _result(1.0, ok=400), _result(1.0, ok=300)  # bare: 1,000 req/s each
    _report(r, 8, 8)
    out = capsys.readouterr().out
    assert _line(out, "c=32 over 16 tenants of max_concurrency 4: node req/s").split()[-3:] == ["400", "|", "0"]
    assert _line(out, "c=32 over 16 tenants of max_concurrency 4: node / bare").split()[-4:] == ["0.40x", ">=", "0.35x", "yes"]
    assert _line(out, "c=256 over 16 tenants of max_concurrency 4: node / bare").split()[-4:] == ["0.30x", ">=", "0.35x", "NO"]
    # the workers replaced during those runs, by reason, and the warm-up before them
    _report(r, 8, 8, spread=Spread(replaced=Counter({"evicted": 3, "rotated": 1, "crashed": 0}), warm_s=4.31))
    assert _line(capsys.readouterr().out, "16 tenants: warm-up (s)").split()[-7:] == ["4.3", "|", "4", "(evicted", "3,", "rotated", "1)"]
    # a report without those runs has no such lines
    _report(_results([3.0]), 8, 8)
    assert "over 16 tenants" not in capsys.readouterr().out


def test_the_hosts_floor_for_the_other_tenants_figure_is_shown_beside_it(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0, 6.0])
    for tag, (quiet_alone, private_alone, private_beside) in (("", (1.0, 0.5, 1.0)), ("_1", (2.0, 0.5, 1.5))):
        r[f"quiet_alone_before{tag}"] = _result(quiet_alone)
        r[f"private_alone_before{tag}"], r[f"private_beside_flood{tag}"] = _result(private_alone), _result(private_beside)
    _report(r, 2, 8)
    out = capsys.readouterr().out
    assert _line(out, "other tenant p99 beside each flood run / alone just before it").split()[-4:] == ["3.00x", "<=", "2.0x", "NO"]
    assert _line(out, "own front and worker").split()[-2:] == ["0.50/1.00", "0.50/1.50"]
    assert _line(out, "the same, beside each flood run / alone").split()[-2:] == ["2.00x", "3.00x"]
    assert _line(out, "other tenant's ratio / that floor's").split()[-2:] == ["1.50x", "1.00x"]


def test_without_the_hosts_floor_runs_no_floor_is_shown(capsys: pytest.CaptureFixture[str]) -> None:
    _report(_results([3.0]), 2, 8)
    assert "own front and worker" not in capsys.readouterr().out


def test_the_guest_floor_less_its_hop_is_judged_on_the_calls_alternated_on_one_connection(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0])
    r["relay_c1"], r["floor_c1"] = _result(0.2), _result(0.4)  # two runs: 100 µs apart at the p50
    r["floor_mixed_c1"] = replace(_result(0.5), timed_p50_ms=0.245, alternate_p50_ms=0.2)
    _report(r, 2, 8)
    out = capsys.readouterr().out
    assert _line(out, "c=1 p50: one hop + guest, less one hop, two runs (us)").split()[-1] == "100"
    assert _line(out, "  the same, the two alternated on one connection").split()[-4:] == ["45", "<=", "60", "yes"]
    assert _line(out, "  their p50s there").split()[-3:] == ["0.245", "|", "0.200"]
    del r["floor_mixed_c1"]  # results without the alternated run: judged on the two runs
    _report(r, 2, 8)
    assert _line(capsys.readouterr().out, "c=1 p50: one hop + guest, less one hop (us)").split()[-4:] == ["100", "<=", "60", "NO"]


def test_the_c1_ratio_to_the_guest_floor_is_judged_on_the_median_of_rounds_taken_in_turn(capsys: pytest.CaptureFixture[str]) -> None:
    r = _results([3.0])
    r["floor_c1"], r["node_c1"] = _result(0.4), _result(0.8)  # runs minutes apart: 2.00x
    # six rounds, node then floor each: 1.25, 1.5, 1.2, 1.27, 2.0, 1.1
    for i, (node, floor) in enumerate([(0.25, 0.2), (0.3, 0.2), (0.24, 0.2), (0.254, 0.2), (0.4, 0.2), (0.22, 0.2)]):
        r[f"node_c1_round{i}"], r[f"floor_c1_round{i}"] = _result(2 * node), _result(2 * floor)
    _report(r, 8, 8)
    out = capsys.readouterr().out
    assert _line(out, "c=1 p50: node / one hop + guest, runs minutes apart").split()[-1] == "2.00x"
    assert _line(out, "c=1 p50: node / one hop + guest, 6 rounds in turn (median)").split()[-4:] == ["1.26x", "<=", "1.3x", "yes"]
    assert _line(out, "  each round's").split()[-6:] == ["1.25", "1.50", "1.20", "1.27", "2.00", "1.10"]
    assert _line(out, "  the rounds' median p50s").split()[-3:] == ["0.252", "|", "0.200"]
    r["node_c1_round4"] = _result(0.2)  # a round's node below its floor counts as it is
    r["node_c1_round0"] = _result(0.6)
    r["node_c1_round1"] = r["node_c1_round3"] = _result(0.8)  # now 1.5, 2.0, 1.2, 2.0, 0.5, 1.1
    _report(r, 8, 8)
    assert _line(capsys.readouterr().out, "c=1 p50: node / one hop + guest, 6 rounds").split()[-4:] == ["1.35x", "<=", "1.3x", "NO"]
    del r["floor_c1_round2"]  # the rounds end at the first without both runs: 1.5, 2.0
    _report(r, 8, 8)
    assert _line(capsys.readouterr().out, "c=1 p50: node / one hop + guest, 2 rounds").split()[-4:] == ["1.75x", "<=", "1.3x", "NO"]
