"""CLI verbs for this area; registered on the typer apps of control.cli.base.

``loraplane bench cli``  how fast the command starts, and how fast a revocation bites (see
``control.ops.bench_cli``).
"""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from pathlib import Path
from typing import Annotated, Any

import typer

from control.cli.base import bench_app, console, emit, err_console, errors, state


@bench_app.command("cli")
def bench_cli(
    runs: Annotated[int, typer.Option(min=1, help="Processes per measurement (median).")] = 5,
    kit: Annotated[Path | None, typer.Option(
        help="A built reference kit (`loraplane kit build`); default: build one (a minute).")
    ] = None,
) -> None:
    """Start-up of `--help` and `--json adapter list`, and `adapter revoke` to Triton's refusal."""
    from control.ops.bench_cli import run_bench  # starts a deployment: only this verb pays

    def progress(msg: str) -> None:
        if not state.json:
            err_console.print(f"[dim]{msg}[/dim]")

    with errors():
        result = run_bench(kit, runs=runs, progress=progress)

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
