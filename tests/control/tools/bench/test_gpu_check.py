"""``make gpu-check`` in its CPU dry run, as CI can run it, and the check catching what it is for.

The dry run runs from a ``make gpu-bundle`` folder (``control.tools.bench.gpu_bundle``, its
wheels packed from this venv) on a bare host with the network off (``bare_device``): an
interpreter that sees only torch and what a GPU image brings beside it, so every other package
the check imports must come from the bundle. It builds a toy bench kit and runs every check of
``control.tools.bench.gpu_check``; its report must name every check, pass, and carry numbers that
show each check reached the code: rows compared on both LoRA paths (each path read from the
batches that ran), every request's tokens counted, the production-shape path run at scaled-down
sizes. No speed is asserted: on a CPU the throughput ratios are measured, never judged.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.serving.engine import Engine
from backend.serving.memory_report import MEMORY_CATEGORIES
from control.tools.bench import gpu_bundle, gpu_check
from control.tools.bench.gpu_check import PROFILES, Status
from control.tools.bench.gpu_shapes import SHAPE_PROFILES
from control.tools.bench.kit import NEW_TOKENS, BenchKit, build_bench_kit
from tests.control.tools.bench.bare_device import device_python, fake_image, run_bundle

CHECKS = {"libraries", "libraries_in_stub_env", "peft_equality_segment", "peft_equality_gather",
          "mixed_vs_base", "continuous_batching", "memory_accounting", "production_shapes"}


@dataclass
class BundledRun:
    bundle: Path
    report: dict[str, Any]
    stderr: str
    network_namespace: bool


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory) -> BundledRun:
    """``make gpu-bundle`` (wheels from this venv) and ``gpu-check --device cpu`` run from the
    bundle folder on a bare host with no network, its report both printed and written to
    ``--out``."""
    root = tmp_path_factory.mktemp("gpu-bundle")
    bundle = root / "bundle"
    assert gpu_bundle.main(["--from-env", "--out", str(bundle)]) == 0
    python = device_python(root, fake_image(root / "image"))
    out = root / "report.json"
    run, isolated = run_bundle(bundle, python, ["--device", "cpu", "--out", str(out)])
    assert run.returncode == 0, run.stderr[-4000:]
    printed = json.loads(run.stdout)
    assert printed == json.loads(out.read_text())
    return BundledRun(bundle, dict(printed), run.stderr, isolated)


@pytest.fixture(scope="module")
def report(bundled: BundledRun) -> dict[str, Any]:
    return bundled.report


def test_bundle_runs_offline_with_its_own_packages_over_the_image(bundled: BundledRun) -> None:
    env = bundled.report["environment"]
    site = str(bundled.bundle / "site")
    # the packages the image lacks or has too old come from the bundle's wheels ...
    for name in ("transformers", "peft", "tokenizers", "safetensors"):
        assert env[f"{name}_path"].startswith(site + os.sep), (name, env)
    # ... and torch, the one under test, from the image
    assert not env["torch_path"].startswith(str(bundled.bundle))
    # the environment is printed before any check runs
    assert bundled.stderr.index("gpu-check: environment: {") < bundled.stderr.index("building")
    manifest = json.loads((bundled.bundle / "bundle.json").read_text())
    assert {"transformers", "peft", "SQLAlchemy"} <= set(manifest["bundled"])
    assert not [n for n in manifest["bundled"] if gpu_bundle.from_the_image(n)]
    assert (bundled.bundle / "src" / "backend" / "serving" / "engine.py").is_file()


def test_dry_run_reports_every_check_and_passes(report: dict[str, Any]) -> None:
    assert report["mode"] == "cpu dry run"
    assert set(report["checks"]) == CHECKS
    assert report["passed"] is True
    assert not [n for n, c in report["checks"].items() if c["status"] == Status.FAIL]
    setup = report["setup"]
    assert setup["device"] == "cpu" and setup["dtype"] == "bfloat16"
    assert setup["shape"] == PROFILES["cpu"].shape.as_dict()
    assert setup["adapters"] == PROFILES["cpu"].adapters
    # no GPU: the library checks say so instead of passing
    for name in ("libraries", "libraries_in_stub_env"):
        assert report["checks"][name]["status"] == Status.NOT_AVAILABLE


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
    # bf16 at two layers: the first token's logits agree with PEFT's within the bound
    assert check["tolerance"] == gpu_check.logit_rtol(torch.bfloat16, 2) == 2.0**-6
    assert 0 < check["max_first_token_relative_diff"] <= check["tolerance"]


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
    # the goal scales with what batching gains on this machine
    batch = streams["batch_tokens_per_s"]
    assert streams["batch_speedup"] == pytest.approx(batch["all"] / batch["one"])
    assert streams["share_of_batch_speedup"] == pytest.approx(streams["ratio"]
                                                              / streams["batch_speedup"])


def test_dry_run_runs_the_production_shape_path_at_scaled_down_sizes(
        report: dict[str, Any]) -> None:
    check = report["checks"]["production_shapes"]
    assert check["status"] == Status.PASS, check["problems"]
    profile = SHAPE_PROFILES["cpu"]
    assert check["shape"] == {**profile.shape.as_dict(), "vocab": profile.vocab}
    # every projection adapted, ranks below the banks' (padding), sampling on
    assert check["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                "down_proj"]
    assert min(check["ranks"]) < max(check["ranks"])
    assert check["sampling"]["temperature"] > 0
    first = check["first_token"]
    assert set(first["relative_diff"]) == {"base"} | {f"r{r}-{i}" for i, r in
                                                      enumerate(profile.ranks)}
    assert max(first["relative_diff"].values()) <= first["tolerance"]
    assert first["smallest_adapter_effect"] > 10 * first["tolerance"]
    assert [c["context"] for c in check["contexts"]] == list(profile.contexts)
    for c in check["contexts"]:
        assert c["rows_complete"] == c["rows"] == profile.rows and c["failures"] == []
        # with these seeds no row draws eos: every row made every token
        assert c["tokens"] == c["tokens_expected"] == profile.rows * (profile.steps + 1)
        assert c["decode_steps"] == profile.steps and c["ms_per_step"] > 0
        assert "peak_bytes" not in c  # memory is judged on CUDA only


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
