"""The cold-load path's own parts: load workers kept and confined, the finiteness check exact."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest
import torch

from backend.serving.adapter_files import _check_finite
from backend.serving.engine_types import AdapterLoadError
from backend.serving.load_workers import LoadWorkers, _omp_set_num_threads


def _on(workers: LoadWorkers, fn: object) -> object:
    done: Future[object] = Future()
    workers.submit(lambda: done.set_result(fn()))  # type: ignore[operator]
    return done.result(timeout=30)


def test_workers_are_kept_confined_and_leave_serving_threads_alone() -> None:
    workers = LoadWorkers(nice_delta=3)
    before = torch.get_num_threads()
    first = _on(workers, threading.get_ident)
    assert _on(workers, threading.get_ident) == first  # the same thread, set up once
    assert workers.started == 1
    if _omp_set_num_threads() is not None:
        assert _on(workers, torch.get_num_threads) == 1
    assert torch.get_num_threads() == before  # this thread keeps its intra-op threads
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    worker = _on(workers, lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert worker == min(19, mine + 3)


def test_a_load_that_waits_does_not_hold_up_the_next() -> None:
    workers = LoadWorkers(nice_delta=0)
    release = threading.Event()
    first: Future[None] = Future()

    def waits() -> None:
        release.wait(30)
        first.set_result(None)

    workers.submit(waits)
    assert _on(workers, lambda: "second") == "second"  # ran on a second worker meanwhile
    assert workers.started == 2 and not first.done()
    release.set()
    first.result(timeout=30)


def test_idle_workers_end() -> None:
    workers = LoadWorkers(nice_delta=0, idle_exit_s=0.05)
    thread = _on(workers, threading.current_thread)
    assert isinstance(thread, threading.Thread)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert _on(workers, lambda: 7) == 7 and workers.started == 2  # a new one starts


def _pairs(**tensors: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {name: (t, torch.zeros(4, 2, dtype=t.dtype)) for name, t in tensors.items()}


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_non_finite_weight_is_refused_naming_its_module(bad: float,
                                                            dtype: torch.dtype) -> None:
    good = torch.ones(2, 8, dtype=dtype)
    broken = torch.ones(2, 8, dtype=dtype)
    broken[1, 5] = bad
    with pytest.raises(AdapterLoadError, match="'m2': LoRA weights are not all finite"):
        _check_finite(_pairs(m1=good, m2=broken))


def test_finite_weights_whose_sum_overflows_are_accepted() -> None:
    # each weight finite, their fp16 sum is not (60,000 * 16 > 65,504): the one-sum test
    # alone would refuse this adapter
    big = torch.full((2, 8), 60000.0, dtype=torch.float16)
    assert not torch.isfinite(big.sum())
    _check_finite(_pairs(m1=big, m2=-big))
    # an infinity beside them and an overflow that cancels it out is still found
    worse = big.clone()
    worse[0, 0] = float("-inf")
    with pytest.raises(AdapterLoadError, match="'m1'"):
        _check_finite(_pairs(m1=worse))
