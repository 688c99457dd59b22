"""``make gpu-check`` in its CPU dry run, as CI can run it, and the check catching what it is for.

The dry run builds a toy bench kit and runs every check of ``control.tools.bench.gpu_check``; its
report must name every check, pass, and carry numbers that show each check reached the code: rows
compared on both LoRA paths (each path read from the batches that ran), every request's tokens
counted. No speed is asserted: on a CPU the throughput ratios are measured, never judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.serving.engine import Engine
from backend.serving.memory_report import MEMORY_CATEGORIES
from control.ops.triton_server import REPO_ROOT
from control.tools.bench import gpu_check
from control.tools.bench.gpu_check import PROFILES, Status
from control.tools.bench.kit import NEW_TOKENS, BenchKit, build_bench_kit

CHECKS = {"peft_equality_segment", "peft_equality_gather", "mixed_vs_base",
          "continuous_batching", "memory_accounting"}


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The dry run, as a developer starts it (``make gpu-check GPU_CHECK_ARGS='--device
    cpu'``), its report both printed and written to ``--out``."""
    out = tmp_path_factory.mktemp("gpu-check") / "report.json"
    run = subprocess.run([sys.executable, "-m", "control.tools.bench.gpu_check", "--device", "cpu",
                          "--out", str(out)], cwd=REPO_ROOT, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    printed = json.loads(run.stdout)
    assert printed == json.loads(out.read_text())
    return dict(printed)


def test_dry_run_reports_every_check_and_passes(report: dict[str, Any]) -> None:
    assert report["mode"] == "cpu dry run"
    assert set(report["checks"]) == CHECKS
    assert report["passed"] is True
    assert not [n for n, c in report["checks"].items() if c["status"] == Status.FAIL]
    setup = report["setup"]
    assert setup["device"] == "cpu" and setup["dtype"] == "bfloat16"
    assert setup["shape"] == PROFILES["cpu"].shape.as_dict()
    assert setup["adapters"] == PROFILES["cpu"].adapters


@pytest.mark.parametrize("path", ["segment", "gather"])
def test_dry_run_compares_every_row_with_peft_on_the_path_it_forced(report: dict[str, Any],
                                                                    path: str) -> None:
    check = report["checks"][f"peft_equality_{path}"]
    assert check["status"] == Status.PASS, check["problems"]
    adapters = PROFILES["cpu"].adapters
    assert check["adapter_rows"] == adapters and check["rows"] > adapters  # base rows too
    assert check["rows_equal"] + check["rows_parting_at_near_ties"] == check["rows"]
    assert all(p["tie"] for p in check["partings"])
    assert check["rows_equal"] >= check["rows"] // 2
    # the adapters matter, so equality tells them apart
    assert 2 * check["adapter_rows_differing_from_base"] >= adapters
    # the path is what the batches ran: gather leaves its per-row copies on every step
    assert check["paths_run"] == [path]
    assert check["decode_steps"] == check["tokens_per_row"] - 1
    gathering = check["decode_steps"] if path == "gather" else 0
    assert check["decode_steps_gathering"] == gathering


def test_dry_run_measures_throughput_without_judging_it(report: dict[str, Any]) -> None:
    adapters = PROFILES["cpu"].adapters
    mixed = report["checks"]["mixed_vs_base"]
    assert mixed["status"] == Status.MEASURED and mixed["goal_judged"] is False
    assert mixed["tokens_per_run"] == {"mixed": adapters * NEW_TOKENS,
                                       "base": adapters * NEW_TOKENS}
    assert mixed["ratio"] == pytest.approx(mixed["mixed_tokens_per_s"]
                                           / mixed["base_tokens_per_s"])
    streams = report["checks"]["continuous_batching"]
    assert streams["status"] == Status.MEASURED and streams["streams"] == adapters
    assert streams["tokens_per_run"] == {"many": adapters * NEW_TOKENS, "one": NEW_TOKENS}
    assert streams["ratio"] == pytest.approx(streams["many_streams_tokens_per_s"]
                                             / streams["one_stream_tokens_per_s"])


def test_dry_run_counts_memory_by_category_and_says_why_it_compares_nothing(
        report: dict[str, Any]) -> None:
    memory = report["checks"]["memory_accounting"]
    assert memory["status"] == Status.SKIPPED
    assert "torch.cuda.memory_allocated" in memory["reason"]
    categories = memory["categories"]
    assert set(categories) == set(MEMORY_CATEGORIES)
    # a batch was running on the gather path, its prompts cached: every category is counted
    assert all(categories[kind] > 0 for kind in MEMORY_CATEGORIES), categories
    assert memory["counted_bytes"] == sum(categories.values())


@dataclass
class Toy:
    kit: BenchKit
    engine: Engine
    rows: list[gpu_check.Row]
    references: list[gpu_check.Greedy]
    base_outputs: list[gpu_check.Greedy]


@pytest.fixture(scope="module")
def toy(tmp_path_factory: pytest.TempPathFactory) -> Toy:
    """The dry run's kit and engine, in this process, with PEFT's references."""
    profile = PROFILES["cpu"]
    kit = build_bench_kit(tmp_path_factory.mktemp("toy") / "kit", n_adapters=profile.adapters,
                          shape=profile.shape, delta_share=gpu_check.ADAPTER_SHARE)
    engine = Engine(kit.base, kit.tokenizer, device="cpu", dtype=torch.bfloat16, max_rank=16,
                    max_adapters=profile.adapters)
    for digest, path in kit.adapters.items():
        engine.load_adapter(digest, path)
    rows = gpu_check.equality_rows(engine, kit)
    references, base_outputs = gpu_check.peft_references(kit, rows, engine.device, engine.dtype)
    return Toy(kit, engine, rows, references, base_outputs)


@pytest.mark.parametrize("path", ["segment", "gather"])
def test_equality_fails_on_the_row_whose_adapter_the_engine_does_not_apply(
        toy: Toy, path: str) -> None:
    """One adapter's B zeroed in its slot: that row is served as the base would serve it. The
    check names the row, at the first token, and no near-tie excuses it."""
    victim = next(i for i, r in enumerate(toy.rows) if r.adapter is not None)
    digest = toy.rows[victim].adapter
    assert digest is not None
    banks = toy.engine.slot_tensors(digest)
    saved = [t.clone() for t in banks]
    try:
        for b in banks[1::2]:  # [a, b] per target module
            b.zero_()
        check = gpu_check.check_equality(toy.engine, toy.rows, toy.references,
                                         toy.base_outputs, path)
    finally:
        for t, s in zip(banks, saved, strict=True):
            t.copy_(s)
    assert check["status"] == Status.FAIL
    assert "rows part from PEFT where the logits are not a near-tie" in check["problems"]
    failing = [p for p in check["partings"] if not p["tie"]]
    assert [p["row"] for p in failing] == [victim]
    assert failing[0]["position"] == 0
    assert failing[0]["engine_token"] == toy.base_outputs[victim].tokens[0]
    # restored: the same check passes again
    again = gpu_check.check_equality(toy.engine, toy.rows, toy.references, toy.base_outputs,
                                     path)
    assert again["status"] == Status.PASS, again["problems"]


def test_equality_fails_when_the_adapters_do_not_change_the_answer(toy: Toy) -> None:
    """References whose adapter rows answer as the base does prove nothing: refused."""
    check = gpu_check.check_equality(toy.engine, toy.rows, toy.base_outputs, toy.base_outputs,
                                     "gather")
    assert check["status"] == Status.FAIL
    assert check["adapter_rows_differing_from_base"] == 0
    assert any("change PEFT's answer" in p for p in check["problems"])


@pytest.mark.parametrize(("ratio", "complete", "judged", "status"), [
    (0.90, True, True, Status.PASS),
    (0.80, True, True, Status.FAIL),
    (0.80, True, False, Status.MEASURED),
    (0.90, False, False, Status.FAIL),  # lost tokens fail even where the goal is not judged
])
def test_throughput_is_judged_against_the_goal_only_where_asked(
        ratio: float, complete: bool, judged: bool, status: Status) -> None:
    assert gpu_check.judge("mixed_vs_base", ratio, complete, judged) == status


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_mode_without_a_gpu_says_how_to_get_one_or_run_the_dry_run(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert gpu_check.main(["--device", "cuda", "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "CUDA build of torch" in err and "GPU_CHECK_ARGS='--device cpu'" in err
    assert not any(tmp_path.iterdir())  # refused before building anything
