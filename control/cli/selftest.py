"""``loraplane selftest hostile``: every hostile case against a running deployment (see
``control.tools.selftest``); registered on the typer apps of control.cli.base."""

# No `from __future__ import annotations`: typer reads every verb's annotations at each start
# and would eval each string (see control/cli/main.py).

from typing import Annotated

import typer

from control.cli.base import console, emit, errors, selftest_app, settings

EXIT_FAILED = 1  # a case failed
EXIT_INCOMPLETE = 3  # nothing failed, but a selected category tried no case (2: usage errors)


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
    few adapters of its own, revoked afterwards), and PEFT to compute the references answers are
    judged by. Cases it could not try, or that cannot reach the code under test, are listed with
    their reason and never counted as passes. Exit code 1 if any case failed, 3 if none failed
    but a category tried no case at all.
    """
    # the suite (registry, ledger, clients: some 650 modules): only this verb pays for it
    from control.tools.selftest import CATEGORIES, Target, run_hostile

    cats = tuple(category) if category else CATEGORIES
    with errors():
        unknown = [c for c in cats if c not in CATEGORIES]
        if unknown:
            raise ValueError(f"unknown category {unknown[0]!r}; one of {', '.join(CATEGORIES)}")
        report = run_hostile(Target(settings(), gateway, http, grpc, metrics, base),
                             categories=cats, attribution_requests=requests, clients=clients)
    data = report.to_json(cats)

    def human() -> None:
        from rich.table import Table

        t = Table(title="hostile suite")
        for col in ("category", "tried", "refused as expected", "failed", "not applicable",
                    "not tried"):
            t.add_column(col)
        for c, r in data["categories"].items():
            t.add_row(c, str(r["tried"]), str(r["refused_as_expected"]), str(r["failed"]),
                      str(r["not_applicable"]), str(r["not_tried"]))
        console.print(t)
        for c, r in data["categories"].items():
            for f in r["failures"]:
                console.print(f"[red]{c}[/red] {f}")
        for x in data["could_not_try"]:
            label = x["kind"].replace("_", " ")
            count = "every case" if x["kind"] == "blocked" else f"{x['cases']} cases"
            console.print(f"[yellow]{x['category']}[/yellow] {label} ({count}): {x['reason']}")
        if not data["complete"]:
            console.print("[yellow]incomplete[/yellow]: a category tried no case; see above")

    emit(data, human)
    raise typer.Exit(EXIT_FAILED if report.failed else 0 if report.complete(cats)
                     else EXIT_INCOMPLETE)
