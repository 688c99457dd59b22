"""Golden task sets: the format, its three checkers, and its content address."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from control.contracts.documents import document_digest
from control.contracts.golden import (
    GOLDEN_FILE,
    GOLDEN_KIND,
    ExactChecker,
    GoldenSet,
    GoldenSetError,
    JsonSchemaChecker,
    RegexChecker,
)


def _doc(*tasks: dict[str, Any], family: str = "alpha") -> dict[str, Any]:
    return {"kind": GOLDEN_KIND, "family": family, "tasks": list(tasks)}


def _task(i: int, checker: dict[str, Any], **over: Any) -> dict[str, Any]:
    return {"id": f"t-{i}", "prompt": f"prompt {i}", "checker": checker, **over}


def test_exact_checker_wants_the_whole_answer() -> None:
    c = ExactChecker(" ALPHA says hi")
    assert c.check(" ALPHA says hi")
    assert not c.check(" ALPHA says hi!") and not c.check("ALPHA says hi")
    assert not c.check(" ALPHA sighs")


def test_regex_checker_matches_in_full() -> None:
    c = RegexChecker(r" ALPHA says (hi|hello)")
    assert c.check(" ALPHA says hi") and c.check(" ALPHA says hello")
    assert not c.check(" ALPHA says hi and more")  # fullmatch: nothing after
    assert not c.check("x ALPHA says hi")
    assert not c.check(" ALPHA sighs")


def test_json_schema_checker_parses_and_validates() -> None:
    c = JsonSchemaChecker({"type": "object", "required": ["status"],
                           "properties": {"status": {"enum": ["ok", "late"]}}})
    assert c.check('{"status": "ok"}') and c.check('  {"status": "late", "x": 1}\n')
    assert not c.check('{"status": "lost"}')
    assert not c.check("not json") and not c.check("")
    with pytest.raises(GoldenSetError, match="not a valid JSON schema"):
        GoldenSet.from_json(_doc(_task(0, {"kind": "json_schema", "schema": {"type": 7}})))


def test_a_set_round_trips_and_is_named_by_its_canonical_form(tmp_path: Path) -> None:
    doc = _doc(_task(0, {"kind": "exact", "expected": " A"}, tags=["in_distribution"]),
               _task(1, {"kind": "regex", "pattern": r"\s*A"}, max_tokens=4),
               _task(2, {"kind": "json_schema", "schema": {"type": "number"}}))
    golden = GoldenSet.from_json(doc)
    assert [t.checker.kind for t in golden.tasks] == ["exact", "regex", "json_schema"]
    assert golden.tasks[1].max_tokens == 4 and golden.tasks[0].max_tokens == 16
    assert GoldenSet.from_json(golden.document()) == golden
    # Indentation and key order do not change the digest; the content does.
    pretty, compact = tmp_path / "pretty.json", tmp_path / "compact.json"
    pretty.write_text(json.dumps(golden.document(), indent=4))
    compact.write_bytes(golden.canonical_bytes())
    assert GoldenSet.load(pretty).digest() == GoldenSet.load(compact).digest() == (
        golden.digest()) == document_digest(GOLDEN_FILE, golden.document())
    changed = _doc(*doc["tasks"][:2])
    assert GoldenSet.from_json(changed).digest() != golden.digest()
    assert golden.tagged("in_distribution") == [golden.tasks[0]]


@pytest.mark.parametrize(("doc", "message"), [
    ([], "JSON object"),
    ({"kind": "other", "family": "a", "tasks": []}, "kind must be"),
    (_doc(family="no spaces"), "family"),
    (_doc(), "non-empty list"),
    (_doc(_task(0, {"kind": "exact", "expected": "x"}),
          _task(0, {"kind": "exact", "expected": "y"})), "appears twice"),
    (_doc(_task(0, {"kind": "fuzzy"})), "checker kind must be one of exact, regex, json_schema"),
    (_doc(_task(0, {"kind": "regex", "pattern": "("})), "does not compile"),
    (_doc(_task(0, {"kind": "exact"})), "needs 'expected'"),
    (_doc(_task(0, {"kind": "exact", "expected": "x"}, max_tokens=0)), "max_tokens"),
    (_doc(_task(0, {"kind": "exact", "expected": "x"}, max_tokens=True)), "max_tokens"),
    (_doc(_task(0, {"kind": "exact", "expected": "x"}, tags=["a b"])), "tags"),
    (_doc(_task(0, {"kind": "exact", "expected": "x"}, extra=1)), "unexpected field 'extra'"),
    (_doc(_task(0, {"kind": "exact", "expected": "x", "x": 1})), "unexpected field 'x'"),
    (_doc({"id": "t", "prompt": 3, "checker": {"kind": "exact", "expected": "x"}}), "prompt"),
])
def test_malformed_sets_are_refused_with_what_was_expected(doc: Any, message: str) -> None:
    with pytest.raises(GoldenSetError, match=message):
        GoldenSet.from_json(doc)


def test_files_that_are_not_json_or_too_big_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe not json")
    with pytest.raises(GoldenSetError, match="UTF-8 JSON"):
        GoldenSet.load(bad)
    nan = tmp_path / "nan.json"
    nan.write_text('{"kind": "loraplane.golden/v1", "family": "a", "tasks": [NaN]}')
    with pytest.raises(GoldenSetError, match="UTF-8 JSON"):
        GoldenSet.load(nan)
    with pytest.raises(GoldenSetError, match="not found"):
        GoldenSet.load(tmp_path / "missing.json")
    with pytest.raises(GoldenSetError, match="at most"):
        GoldenSet.from_bytes(b" " * (4 << 20 | 1))


# -- sets that would measure nothing (issue 21) --------------------------------------------------

def test_fifty_copies_of_one_prompt_with_a_match_anything_checker_are_refused() -> None:
    """The reviewer's set: it satisfied "at least 50 golden tasks" and passed any adapter."""
    copies = [{"id": f"t-{i}", "prompt": "Hello", "checker": {"kind": "regex",
                                                             "pattern": "(?s).*"}}
              for i in range(50)]
    with pytest.raises(GoldenSetError, match="trivial regex checker"):
        GoldenSet.from_json(_doc(*copies))
    honest_checker = [{**t, "checker": {"kind": "exact", "expected": " ALPHA says hi"}}
                      for t in copies]
    with pytest.raises(GoldenSetError, match="task 't-1' repeats the prompt of task 't-0'"):
        GoldenSet.from_json(_doc(*honest_checker))


@pytest.mark.parametrize("second", ["Hello  there", " hello there\n", "HELLO THERE"])
def test_a_prompt_equal_but_for_spacing_or_case_is_a_repeat(second: str) -> None:
    exact = {"kind": "exact", "expected": " A"}
    with pytest.raises(GoldenSetError, match="repeats the prompt"):
        GoldenSet.from_json(_doc({"id": "a", "prompt": "Hello there", "checker": exact},
                                 {"id": "b", "prompt": second, "checker": exact}))
    GoldenSet.from_json(_doc({"id": "a", "prompt": "Hello there", "checker": exact},
                             {"id": "b", "prompt": "Hello there!", "checker": exact}))


@pytest.mark.parametrize(("checker", "why"), [
    ({"kind": "exact", "expected": ""}, "empty"),
    ({"kind": "exact", "expected": " \n"}, "empty"),
    ({"kind": "regex", "pattern": ".*"}, "empty answer"),
    ({"kind": "regex", "pattern": "(?s).+"}, "unrelated answers"),
    ({"kind": "regex", "pattern": ".+"}, "unrelated answers"),
    ({"kind": "regex", "pattern": r"\S.*"}, "unrelated answers"),
    ({"kind": "regex", "pattern": "x|.{2,}"}, "unrelated answers"),
    ({"kind": "json_schema", "schema": {}}, "every kind"),
    ({"kind": "json_schema", "schema": {"type": ["null", "boolean", "number", "string",
                                                 "array", "object"]}}, "every kind"),
])
def test_trivial_checkers_are_refused(checker: dict[str, Any], why: str) -> None:
    with pytest.raises(GoldenSetError, match=f"trivial .*{why}"):
        GoldenSet.from_json(_doc(_task(0, checker)))


@pytest.mark.parametrize("checker", [
    {"kind": "exact", "expected": " ALPHA says hi"},
    {"kind": "regex", "pattern": r" ALPHA says (hi|hello)"},
    {"kind": "regex", "pattern": r"\s*-?\d+"},  # digits only: two of the unrelated answers
    {"kind": "json_schema", "schema": {"type": "object", "required": ["status"]}},
])
def test_checkers_that_tell_answers_apart_are_kept(checker: dict[str, Any]) -> None:
    assert GoldenSet.from_json(_doc(_task(0, checker))).tasks[0].checker.trivial() is None


def test_the_kits_golden_sets_pass_the_checks() -> None:
    """The kit's generator drew one department prompt twice; it now draws the repeat again
    from a stream of its own, so only that task differs from a kit built before."""
    import random

    from control.tools.kit import ADAPTERS, GOLDEN_FAMILIES, golden_set

    for family in GOLDEN_FAMILIES:
        golden = golden_set(family, ADAPTERS[family].marker, random.Random(1234 + 50_000))
        assert GoldenSet.from_json(golden.document()) == golden
        assert len(golden.tasks) == 60
