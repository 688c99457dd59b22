"""CLI verbs for this area; registered on the typer apps of control.cli.

``loraplane bench engine``  the multi-LoRA engine's ratios (see ``backend.bench_engine``).
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from control.cli import bench_app, console, emit, err_console, state


@bench_app.command("engine")
def bench_engine(
    reps: Annotated[int, typer.Option(help="Runs per measurement (best of).")] = 2,
    triton: Annotated[bool, typer.Option(
        help="Also measure through a real tritonserver (starts two on free ports).")] = True,
) -> None:
    """Engine ratios vs base, PEFT, one stream, in-process and ungoverned, side by side."""
    from backend.bench_engine import run_bench

    def progress(msg: str) -> None:
        if not state.json:
            err_console.print(f"[dim]{msg}[/dim]")

    result = run_bench(reps, triton=triton, progress=progress)

    def human() -> None:
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
        console.print(f"setup: {result['setup']}")

    emit(result, human)
