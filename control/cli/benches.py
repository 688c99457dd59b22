"""CLI verbs of the benchmarks: each reports ratios measured side by side in one run.

``loraplane bench cli``      how fast the command starts, and how fast a revocation bites (see
                             ``control.tools.bench_cli``).
``loraplane bench engine``   the multi-LoRA engine's ratios (see ``control.tools.bench.engine``).
``loraplane bench control``  the control plane's ratios (see ``control.tools.bench_control``).
``loraplane bench scale``    incident queries over a million ledger rows (see
                             ``control.tools.bench_incidents``), cold loads of 7B-shaped
                             adapters (``control.tools.bench_coldload``), Zipf traffic over
                             1,000 adapters (``control.tools.bench_zipf``), the churn attack
                             (``control.tools.bench_fairness``), the warm-up list
                             (``control.tools.bench_warmup``) and 100,000 adapters in the
                             registry (``control.tools.bench_registry``).
``loraplane bench kv``       a decode step's KV write in place against the whole KV concatenated
                             anew (see ``control.tools.bench_kv``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from control.cli.base import bench_app, console, emit, err_console, errors, settings, state

if TYPE_CHECKING:
    from rich.table import Table


def _progress(msg: str) -> None:
    if not state.json:
        err_console.print(f"[dim]{msg}[/dim]")


# --- cli --------------------------------------------------------------------------------------

@bench_app.command("cli")
def bench_cli(
    runs: Annotated[int, typer.Option(min=1, help="Processes per measurement (median).")] = 5,
    kit: Annotated[Path | None, typer.Option(
        help="A built reference kit (`loraplane kit build`); default: build one (a minute).")
    ] = None,
) -> None:
    """Start-up of `--help` and `--json adapter list`, and `adapter revoke` to Triton's refusal."""
    from control.tools.bench_cli import run_bench  # starts a deployment: only this verb pays

    with errors():
        result = run_bench(kit, runs=runs, progress=_progress)

    def human() -> None:
        from rich.table import Table

        t = Table(title=f"loraplane bench cli: medians of {result['setup']['runs']} processes")
        for col in ("what", "median s", "goal s", "met", "each run s"):
            t.add_column(col)
        for key, values in result["runs"].items():
            goal: Any = result["goals"].get(key)
            met = result["met"].get(key)
            t.add_row(key, f"{result['medians'][key]:.3f}",
                      "" if goal is None else f"{goal:g}",
                      "" if met is None else ("yes" if met else "NO"),
                      " ".join(f"{v:.3f}" for v in values))
        console.print(t)
        console.print(f"setup: {result['setup']}")

    emit(result, human)


# --- engine -----------------------------------------------------------------------------------

@bench_app.command("engine")
def bench_engine(
    reps: Annotated[int, typer.Option(
        help="Runs per in-process measurement (best of).")] = 2,
    triton: Annotated[bool, typer.Option(
        help="Also measure through real tritonservers (governed and open, side by side).")
    ] = True,
    triton_runs: Annotated[int | None, typer.Option(
        help="Alternating runs of each side for governed_vs_open, reported as median and "
             "spread; at least 5 (default: control.tools.bench.engine.TRITON_RUNS, 15).")] = None,
) -> None:
    """Engine ratios vs base, PEFT, one stream, in-process and an open (ungoverned) engine."""
    # torch, transformers, peft and the open engine: only this verb may load them
    from control.tools.bench.engine import TRITON_RUNS, run_bench

    with errors():
        result = run_bench(reps, triton=triton, progress=_progress,
                           triton_runs=TRITON_RUNS if triton_runs is None else triton_runs)

    def human() -> None:
        from rich.table import Table

        t = Table(title="loraplane bench engine (ratios measured side by side in one run)")
        for col in ("key", "ratio", "goal", "met"):
            t.add_column(col)
        for key, goal in result["goals"].items():
            ratio: Any = result["ratios"][key]
            met = result["met"][key]
            t.add_row(key, "n/a" if ratio is None else f"{ratio:.2f}", goal,
                      "n/a" if met is None else ("yes" if met else "NO"))
        console.print(t)
        m = Table(title="measurements")
        m.add_column("what")
        m.add_column("value")
        for k, v in result["measurements"].items():
            m.add_row(k, f"{v:.4g}")
        console.print(m)
        side = result["governed_vs_open"]
        if side is not None:
            console.print(_side_by_side_table(side))
        console.print(f"setup: {result['setup']}")

    emit(result, human)


def _side_by_side_table(side: dict[str, Any]) -> "Table":
    """governed_vs_open: each side's tokens/s spread, the per-round ratios, the cross-checks."""
    from rich.table import Table

    t = Table(title=f"governed_vs_open: {side['runs_each']} runs each, {side['order']}; "
                    f"ratio of medians {side['ratio_of_medians']:.3f}")
    for col in ("what", "median", "min", "q1", "q3", "max"):
        t.add_column(col)
    for key in ("governed_tokens_per_s", "open_tokens_per_s", "round_ratios"):
        s = side[key]
        fmt = "{:.3f}" if key == "round_ratios" else "{:.1f}"
        t.add_row(key, *(fmt.format(s[k]) for k in ("median", "min", "q1", "q3", "max")))
    ci = side["round_ratio_median_interval"]
    t.add_row(f"median round ratio, {ci['coverage']:.0%} interval", "",
              f"{ci['low']:.3f}", "", "", f"{ci['high']:.3f}")
    t.add_row("distinguishable from 1", "yes" if side["distinguishable_from_1"] else "no")
    tokens = side["tokens"]
    t.caption = (f"tokens returned: governed {tokens['governed_returned']} (ledger "
                 f"{tokens['governed_ledger']}), open {tokens['open_returned']}; open ledger "
                 f"rows {side['open_ledger_rows']}; answers differing between the sides "
                 f"{side['answers_differing_between_sides']}")
    return t


# --- control ----------------------------------------------------------------------------------

@bench_app.command("control")
def bench_control(
    pg_url: Annotated[str | None, typer.Option(
        help="Also measure on this PostgreSQL URL (default $LORAPLANE_TEST_PG_URL).")] = None,
    commands: Annotated[int, typer.Option(help="Commands per measurement.")] = 300,
    tickets: Annotated[int, typer.Option(help="Ticket requests per measurement.")] = 2000,
) -> None:
    """Control plane ratios: command vs raw save, projection events/s, ticket p50 at c=16."""
    # the registry, the gateway and their baselines: only this verb pays for them
    from control.tools.bench_control import run_all

    url = pg_url or os.environ.get("LORAPLANE_TEST_PG_URL")
    with errors():
        results = run_all(settings().home / "bench-control", pg_url=url, commands=commands,
                          tickets=tickets)
    emit(results, lambda: console.print_json(json.dumps(results)))


# --- release ----------------------------------------------------------------------------------

@bench_app.command("release")
def bench_release(
    rollouts: Annotated[int | None, typer.Option(
        help="Simulated rollouts per scenario (default: 300, or 2000 with --full).")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="The full run: 2000 rollouts per scenario (about a minute).")] = False,
    seed: Annotated[int, typer.Option(help="Seed of the simulated traffic.")] = 21,
) -> None:
    """The rollout judge's error rates, simulated with the functions the controller calls:
    false rollbacks, detections, requests per arm and completions, beside the old rule's."""
    # the domain's rollout and numpy: only this verb loads them
    from control.tools.bench_release import FULL_ROLLOUTS, QUICK_ROLLOUTS, run_bench

    n = rollouts if rollouts is not None else FULL_ROLLOUTS if full else QUICK_ROLLOUTS
    with errors():
        result = run_bench(rollouts=n, seed=seed, progress=_progress)

    def human() -> None:
        from rich.table import Table

        def rate(r: dict[str, float]) -> str:
            return f"{100 * r['rate']:.1f}% ({100 * r['low']:.1f}-{100 * r['high']:.1f})"

        setup = result["setup"]
        t = Table(title=f"loraplane bench release: {setup['rollouts_per_scenario']} rollouts "
                        f"per scenario, steps {setup['steps']}, {setup['requests_per_window']} "
                        f"requests per {setup['window_s']:g} s window; rates with Wilson 95 % "
                        "intervals")
        for col in ("scenario", "rolled back", "completed", "inconclusive",
                    "1st step requests/arm, median (p95)", "before: rolled back",
                    "before: completed"):
            t.add_column(col)
        for name, s in result["scenarios"].items():
            req = s["requests_per_arm_first_step"]
            t.add_row(name, rate(s["rolled_back"]), rate(s["completed"]),
                      rate(s["inconclusive"]),
                      f"canary {req['target']['median']:g} ({req['target']['p95']:g}), stable "
                      f"{req['baseline']['median']:g} ({req['baseline']['p95']:g})",
                      rate(s["before"]["rolled_back"]), rate(s["before"]["completed"]))
        console.print(t)
        for key, g in result["goals"].items():
            console.print(f"{key}: {rate(g['rate'])}, goal {g['goal']}: "
                          + ("met" if g["met"] else "NOT met"))
        console.print(f"policy: {setup['policy']}; each test at alpha {setup['test_alpha']:.3g}")

    emit(result, human)


# --- ledger -----------------------------------------------------------------------------------

@bench_app.command("ledger")
def bench_ledger(
    quick: Annotated[bool, typer.Option(
        "--quick", help="Fewer rows and rounds (seconds, for CI); the default is the full run.")
    ] = False,
    pg_url: Annotated[str | None, typer.Option(
        help="Also measure on this PostgreSQL database (default: LORAPLANE_TEST_PG_URL).")
    ] = None,
) -> None:
    """ledger_log_vs_plain: rows/s of the ledger writer with each host's Merkle log over
    without, alternating rounds in one run (burst and paced loads), with the spread."""
    from control.tools.bench_ledger import run_bench  # the writer and a scratch database

    with errors():
        result = run_bench(quick=quick, pg_url=pg_url or os.environ.get("LORAPLANE_TEST_PG_URL"),
                           progress=_progress)

    def human() -> None:
        from rich.table import Table

        t = Table(title="loraplane bench ledger: ledger_log_vs_plain (logged rows/s / plain)")
        for col in ("database", "load", "median ratio", "spread", "runs", "rows/run",
                    "plain rows/s", "logged rows/s", "goal met"):
            t.add_column(col)
        for db in ("sqlite", "postgresql"):
            for load in ("burst", "paced"):
                r = result.get(db, {}).get(load)
                if r:
                    t.add_row(db, load, f"{r['ledger_log_vs_plain']:.3f}",
                              f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f}", str(r["runs"]),
                              str(r["rows_per_run"]), f"{r['plain_rows_s']:.0f}",
                              f"{r['logged_rows_s']:.0f}", "yes" if r["met"] else "NO")
        console.print(t)

    emit(result, human)


# --- kv -------------------------------------------------------------------------------------

@bench_app.command("kv")
def bench_kv(
    quick: Annotated[bool, typer.Option(
        "--quick", help="Two widths, fewer steps and rounds (seconds, for CI).")] = False,
) -> None:
    """concat_vs_arena: a decode step's KV cache work, concatenated anew (before) over written in
    place (now), per context width, alternating rounds in one run."""
    from control.tools.bench_kv import run_bench  # torch and transformers: only this verb

    with errors():
        result = run_bench(quick=quick, progress=_progress)

    def human() -> None:
        from rich.table import Table

        s = result["setup"]
        t = Table(title=f"loraplane bench kv: one decode step's cache work, {s['layers']} layers x "
                        f"{s['rows']} rows x {s['kv_heads']} kv heads x {s['head_dim']} "
                        f"({s['dtype']}, {s['device']}, {s['rounds']} rounds)")
        for col in ("width", "concat / arena", "round ratios", "concat ms", "arena ms",
                    "MiB allocated per step (concat / arena)", "same values"):
            t.add_column(col)
        for w in result["widths"]:
            r, alloc = w["round_ratios"], w["bytes_allocated_per_step"]
            t.add_row(str(w["width"]), f"{w['concat_vs_arena']:.1f}", f"{r[0]:.1f}-{r[-1]:.1f}",
                      f"{w['concat_step_s']['median'] * 1e3:.2f}",
                      f"{w['arena_step_s']['median'] * 1e3:.3f}",
                      f"{alloc['concat'] / 2**20:.1f} / {alloc['arena'] / 2**20:.1f}",
                      "yes" if w["same_values"] else "NO")
        console.print(t)

    emit(result, human)


# --- scale ------------------------------------------------------------------------------------

@bench_app.command("scale")
def bench_scale(
    quick: Annotated[bool, typer.Option(
        "--quick", help="100,000 ledger rows instead of 1,000,000 (seconds, for CI).")] = False,
    pg_url: Annotated[str | None, typer.Option(
        help="Also measure on this PostgreSQL database (default: LORAPLANE_TEST_PG_URL).")
    ] = None,
    kit: Annotated[Path | None, typer.Option(
        help="A built reference kit for the Zipf bench (`loraplane kit build`); default: "
             "build one (a minute).")] = None,
) -> None:
    """Incident queries over a million ledger rows, by adapter, release, training data version
    and base (one hour), on SQLite and PostgreSQL: median and p95 ms, rows, indexes used; cold
    loads of 7B-shaped adapters against a plain read and SHA-256 of the same files; and
    zipf_1000_vs_32, tokens/s through a real Triton with Zipf traffic over 1,000 adapters (200
    with --quick) on 32 device slots over the same traffic on 32 adapters; the churn attack on
    the adapter cache (bench_fairness) and the first request after a restart with and without
    the warm-up list (bench_warmup); and 100,000 adapters in the registry (1,000 with --quick):
    registration and projection rebuild rates, ticket_p99_100k_vs_100 through the gateway, and
    the gateway's and the host view's resident memory (bench_registry)."""
    import tempfile

    from control.tools import (
        bench_coldload,  # torch and transformers load for this bench only
        bench_fairness,  # the serving path in-process: likewise
        bench_registry,  # scratch registries and gateway processes: likewise
        bench_warmup,  # likewise
        bench_zipf,  # a deployment with a real tritonserver: likewise
    )
    from control.tools.bench_incidents import run_bench  # a scratch ledger of its own
    from control.tools.kit import build_kit  # transformers: only when no kit is given

    with errors(), tempfile.TemporaryDirectory(prefix="loraplane-scale-") as tmp:
        if kit is None:  # one kit for every bench below
            _progress("building the reference kit (a minute)")
            kit = Path(tmp) / "kit"
            build_kit(kit)
        result = {"incidents": run_bench(
            quick=quick, pg_url=pg_url or os.environ.get("LORAPLANE_TEST_PG_URL"),
            progress=_progress),
            "cold_loads": bench_coldload.run_bench(quick=quick, progress=_progress),
            "zipf": bench_zipf.run_bench(kit, quick=quick, progress=_progress),
            "fairness": bench_fairness.run_bench(kit, quick=quick, progress=_progress),
            "warmup": bench_warmup.run_bench(kit, quick=quick, progress=_progress),
            "registry": bench_registry.run_bench(
                quick=quick, pg_url=pg_url or os.environ.get("LORAPLANE_TEST_PG_URL"),
                progress=_progress)}

    def human() -> None:
        from rich.table import Table

        inc = result["incidents"]
        t = Table(title=f"loraplane bench scale: incident queries (goal p95 < {inc['goal_ms']:g} "
                        f"ms, {inc['queries_per_kind']} subjects each)")
        for col in ("database", "ledger rows", "query", "median ms", "p95 ms", "rows",
                    "indexes", "goal met"):
            t.add_column(col)
        for db in ("sqlite", "postgresql"):
            r = inc.get(db)
            if not r:
                continue
            for kind in ("adapter", "release", "training_data_version", "base_hour"):
                k = r[kind]
                t.add_row(db, f"{r['rows']:,}", kind, f"{k['median_ms']:.1f}",
                          f"{k['p95_ms']:.1f}", str(k["rows_median"]),
                          ", ".join(k["indexes"]) or "none (table scan)",
                          "yes" if k["met"] else "NO")
        console.print(t)
        c = result["cold_loads"]
        t = Table(title=f"cold loads, {c['adapter_bytes'] / 2**20:.0f} MiB 7B-shaped adapters, "
                        f"{c['loads']} loads: {c['covers']}")
        for col in ("key", "measured", "goal", "met"):
            t.add_column(col)
        t.add_row("cold_load_vs_read_7b", f"{c['cold_load_vs_read_7b']:.2f}", c["goal_ratio"],
                  "yes" if c["met_ratio"] else "NO")
        t.add_row("cold load p95 (s)", f"{c['cold_load_p95_s']:.3f}", c["goal_cold_load_p95_s"],
                  "yes" if c["met_seconds"] else "NO")
        t.add_row("read + SHA-256 p95 (s)", f"{c['read_hash_p95_s']:.3f}", "", "")
        console.print(t)
        z = result["zipf"]

        def num(v: Any, fmt: str = "{:.3f}") -> str:
            return "n/a" if v is None else fmt.format(v)

        setup = z["setup"]
        t = Table(title=f"zipf_1000_vs_32 = {z['zipf_1000_vs_32']:.3f} (round pairs "
                        f"{z['spread']['min']:.3f}-{z['spread']['max']:.3f}), "
                        f"{z['goals']['zipf_1000_vs_32']}: "
                        f"{'met' if z['met']['goal'] else 'NOT met'}"
                        f"{'' if z['met']['floor'] else ', BELOW the floor'}; {z['adapters']} "
                        f"vs {z['small_adapters']} adapters, {setup['slots']} slots, "
                        f"{setup['clients']} clients, {setup['requests_per_round']} requests x "
                        f"{setup['rounds_each']} rounds each")
        for col in ("side", "tokens/s median", "rounds", "ok/sent", "device hit",
                    "host-tier hit", "loads/s", "evictions", "load wait p95 s (waiting / all)",
                    "latency p95 s"):
            t.add_column(col)
        for side in ("large", "small"):
            s = z["sides"][side]
            hr, w = s["hit_rate"], s["load_wait_s"]
            t.add_row(side, num(s["tokens_per_s"]["median"], "{:.1f}"),
                      " ".join(f"{v:.1f}" for v in s["tokens_per_s"]["rounds"]),
                      f"{s['ok']}/{s['requests']}", num(hr["device"]), num(hr["host"]),
                      num(s["loads_per_s"], "{:.2f}"),
                      ", ".join(f"{k} {v}" for k, v in s["evictions"].items()) or "-",
                      f"{num(w['p95_waiting'])} / {num(w['p95_all'])}",
                      num(s["latency_s"]["p95"]))
        p = z["provenance"]
        t.caption = (f"provenance {'ok' if p['provenance_ok'] else 'FAILED'}: "
                     f"{p['ok_answers']} ok answers, {p['digest_mismatches']} digest and "
                     f"{p['ledger_mismatches']} ledger mismatches, {p['sample_mismatches']} of "
                     f"{p['sampled']} sampled outputs differ from PEFT; registration "
                     f"{setup['registration_s']:.0f} s, run {setup['seconds']:.0f} s")
        console.print(t)
        f, w = result["fairness"], result["warmup"]
        t = Table(title=f"fair sharing under a churn attack ({f['goal']}: "
                        f"{'met' if f['met'] else 'NOT met'}) and the warm-up list")
        for col in ("figure", "measured"):
            t.add_column(col)
        t.add_row("victims' p95, churn / none", f"{f['churn_vs_none_p95']:.3f}")
        t.add_row("victims' hit rate, churn / none", f"{f['churn_vs_none_hit_rate']:.3f}")
        t.add_row("victims' p95, churn / steady attacker", f"{f['churn_vs_steady_p95']:.3f}")
        t.add_row("first-request TTFT after a restart, with / without the list",
                  f"{w['with_vs_without']:.3f} ({w['ttft_first_with_s'] * 1e3:.1f} / "
                  f"{w['ttft_first_without_s'] * 1e3:.1f} ms)")
        console.print(t)
        reg = result["registry"]
        for db, g in (("SQLite", reg), ("PostgreSQL", reg.get("postgresql"))):
            if g is None:
                continue
            t = Table(title=f"{g['adapters']:,} adapters in the registry vs "
                            f"{g['small_adapters']}, {db} "
                            f"({g['goal']}: {'met' if g['met'] else 'NOT met'})")
            for col in ("figure", "measured"):
                t.add_column(col)
            for mode in ("steady", "churn"):
                k = g["tickets"][mode]
                p99 = k["ticket_p99_ms"]
                t.add_row(f"ticket p99 ms, {mode}: large / small (ratio)",
                          f"{p99['large']['median']:.2f} / {p99['small']['median']:.2f} "
                          f"({k['ratio']:.3f})")
            t.add_row("registration, adapters/s (events/s)",
                      f"{g['registration_adapters_per_s']:.0f} "
                      f"({g['registration_events_per_s']:.0f})")
            t.add_row("projection rebuild, events/s",
                      f"{g['projection_events_per_s']:.0f} ({g['projection_events']:,} events)")
            t.add_row("gateway RSS MiB, large / small",
                      f"{g['gateway_rss_mib']['large']} / {g['gateway_rss_mib']['small']}")
            hv = g["host_view"]
            t.add_row("host governance view MiB (process RSS), large / small",
                      f"{hv['large']['view_mib']} ({hv['large']['rss_mib']}) / "
                      f"{hv['small']['view_mib']} ({hv['small']['rss_mib']})")
            console.print(t)

    emit(result, human)
