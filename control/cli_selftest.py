"""CLI verbs for this area; registered on the typer apps of control.cli."""

from __future__ import annotations

from typing import Annotated

import typer

from control.cli import console, emit, errors, selftest_app, settings, state


@selftest_app.command("hostile")
def selftest_hostile(
    gateway: Annotated[str, typer.Option(help="Gateway URL, e.g. http://127.0.0.1:8080.")] = (
        "http://127.0.0.1:8080"),
    http: Annotated[str, typer.Option(help="Triton HTTP host:port.")] = "127.0.0.1:8000",
    grpc: Annotated[str, typer.Option(help="Triton gRPC host:port.")] = "127.0.0.1:8001",
    metrics: Annotated[str | None, typer.Option(
        help="Triton metrics URL, searched for leaks (e.g. http://127.0.0.1:8002/metrics).")
    ] = None,
    base: Annotated[str | None, typer.Option(help="Served base digest (default: the only one).")
                    ] = None,
    category: Annotated[list[str] | None, typer.Option(
        help="Run only these categories (repeatable).")] = None,
    requests: Annotated[int, typer.Option(help="Attribution requests.")] = 1000,
    clients: Annotated[int, typer.Option(help="Concurrent attribution clients.")] = 32,
) -> None:
    """Try every hostile case against a running deployment; count refusals and failures.

    Needs operator access to the deployment's home and database (it creates two tenants and a
    few adapters of its own, revoked afterwards). Exit code 1 if any case failed.
    """
    from control.selftest import CATEGORIES, Target, run_hostile

    cats = tuple(category) if category else CATEGORIES
    with errors():
        unknown = [c for c in cats if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown category {unknown[0]!r}; one of {', '.join(CATEGORIES)}")
        report = run_hostile(Target(settings(), gateway, http, grpc, metrics, base),
                             categories=cats, attribution_requests=requests, clients=clients)
    data = report.to_json()

    def human() -> None:
        from rich.table import Table

        t = Table(title="hostile suite")
        for col in ("category", "tried", "refused as expected", "failed"):
            t.add_column(col)
        for c, r in data.items():
            t.add_row(c, str(r["tried"]), str(r["refused_as_expected"]), str(r["failed"]))
        console.print(t)
        for c, r in data.items():
            for f in r["failures"]:
                console.print(f"[red]{c}[/red] {f}")

    emit(data, human)
    _ = state
    raise typer.Exit(1 if report.failed else 0)
