"""How the hostile self-test counts its cases, and what it says about the ones it could not judge.

A case is *tried* when it reached the code under test and its outcome could be judged; it then
counts as *refused as expected* (or served correctly, where serving is right) or as *failed*.
Two kinds of case are set apart, each with its reason, and never counted as passes:

- *not applicable*: the case cannot reach the code under test in this deployment (a header
  Triton never forwards, a gateway route that is not mounted), or cannot tell right from wrong
  (a prompt on which two adapters' references agree, so a swap there would be invisible);
- *not tried*: the self-test lacked the means (no ``--metrics``, PEFT not importable for
  references, no access to the database).

A category that tried nothing proves nothing: the run is then *incomplete*, which the CLI reports
with its own exit code, never as success.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CATEGORIES = ("identity", "tickets", "parameters", "artifacts", "faults", "attribution")
NOT_APPLICABLE = "not_applicable"
NOT_TRIED = "not_tried"


@dataclass(frozen=True)
class Expectation:
    """What a served answer must be: ``text``; or, with no text, why it cannot be judged
    (``kind`` NOT_APPLICABLE or NOT_TRIED, and ``reason``), or SERVED: any text will do."""

    text: str | None
    kind: str = ""
    reason: str = ""


# A sampled answer has no reference: being served, and recorded as the ticket's, is the case.
SERVED = Expectation(None, "served")


@dataclass
class CategoryResult:
    tried: int = 0
    refused: int = 0  # refused (or served correctly) as expected
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    # kind -> reason -> the cases set apart for it
    set_apart: dict[str, dict[str, list[str]]] = field(
        default_factory=lambda: {NOT_APPLICABLE: {}, NOT_TRIED: {}})
    blocked: str | None = None  # why no case of this category could run at all

    def count(self, kind: str) -> int:
        return sum(len(cases) for cases in self.set_apart[kind].values())

    def set_aside(self, kind: str, case: str, reason: str) -> None:
        self.set_apart[kind].setdefault(reason, []).append(case)


@dataclass
class Report:
    categories: dict[str, CategoryResult] = field(
        default_factory=lambda: {c: CategoryResult() for c in CATEGORIES})

    def check(self, category: str, case: str, ok: bool, detail: str = "") -> bool:
        """Count one tried case; a failure keeps its line (case and what went wrong)."""
        r = self.categories[category]
        r.tried += 1
        if ok:
            r.refused += 1
        else:
            r.failed += 1
            r.failures.append(f"{case}: {detail}"[:300])
        return ok

    def not_applicable(self, category: str, case: str, reason: str) -> None:
        """A case that cannot reach the code under test, or cannot tell right from wrong."""
        self.categories[category].set_aside(NOT_APPLICABLE, case, reason)

    def not_tried(self, category: str, case: str, reason: str) -> None:
        """A case the self-test lacked the means to try or to judge."""
        self.categories[category].set_aside(NOT_TRIED, case, reason)

    def set_aside(self, category: str, case: str, kind: str, reason: str) -> None:
        """``not_applicable`` or ``not_tried``, by ``kind``."""
        self.categories[category].set_aside(kind, case, reason)

    def block(self, category: str, reason: str) -> None:
        """No case of ``category`` could run (for example: no access to the database)."""
        self.categories[category].blocked = reason

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.categories.values())

    def complete(self, categories: tuple[str, ...] = CATEGORIES) -> bool:
        """True when every selected category tried at least one case."""
        return all(self.categories[c].tried > 0 for c in categories)

    def could_not_try(self) -> list[dict[str, Any]]:
        """Every reason a case was set apart or a category blocked, with how many cases."""
        out: list[dict[str, Any]] = []
        for c, r in self.categories.items():
            if r.blocked:
                out.append({"category": c, "kind": "blocked", "reason": r.blocked, "cases": 0,
                            "examples": []})
            for kind in (NOT_TRIED, NOT_APPLICABLE):
                out += [{"category": c, "kind": kind, "reason": reason, "cases": len(cases),
                         "examples": sorted(set(cases))[:3]}
                        for reason, cases in sorted(r.set_apart[kind].items())]
        return out

    def to_json(self, categories: tuple[str, ...] = CATEGORIES) -> dict[str, Any]:
        return {
            "categories": {
                c: {"tried": r.tried, "refused_as_expected": r.refused, "failed": r.failed,
                    "not_applicable": r.count(NOT_APPLICABLE), "not_tried": r.count(NOT_TRIED),
                    "blocked": r.blocked, "failures": r.failures}
                for c, r in self.categories.items() if c in categories},
            "could_not_try": [x for x in self.could_not_try() if x["category"] in categories],
            "failed": self.failed,
            "complete": self.complete(categories),
        }
