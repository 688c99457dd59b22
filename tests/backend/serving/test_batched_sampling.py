"""Token choice for a whole decode batch with one device read (issue 26, "fewer syncs").

Every test drives ``BatchSteps.choose``, the step the scheduler runs, on real ``Sequence`` rows
whose generators ``row_generator`` seeds from the request, as the engine does. What must hold:

- greedy rows (temperature 0) take exactly the argmax of their logits;
- sampled rows draw from the temperature distribution cut to the nucleus: the smallest prefix of
  tokens by probability whose mass reaches top_p, never a token of the tail;
- a row's tokens depend only on its own request and seed: the same seeded request alone, or among
  other tenants' rows (any number, any position, even one with the same seed), gives the same
  tokens at every step: the batch must not let one tenant's output depend on another's;
- a row whose logits are not finite, or whose probabilities are not a distribution, fails alone;
- the whole choice reads the device once per step (each read stalls a GPU).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from backend.serving.batch_steps import BatchSteps, row_generator
from backend.serving.engine_types import DecodeBatch, GenerationRequest, Sequence
from backend.serving.lease import Lease, Violations
from backend.serving.lora_ops import SlotBatch

CPU = torch.device("cpu")
ENDLESS = 10**9  # max_tokens no test reaches: rows end only by failing


def _seq(temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None) -> Sequence:
    request = GenerationRequest("p", None, max_tokens=ENDLESS, temperature=temperature,
                                top_p=top_p, seed=seed)
    return Sequence(request, [1], Lease(None, Violations()), None, row_generator(request, CPU))


def _batch(seqs: list[Sequence], logits: torch.Tensor) -> DecodeBatch:
    n = len(seqs)
    return DecodeBatch.one(seqs, [], [], torch.ones((n, 1), dtype=torch.long),
                       torch.zeros((n, 1), dtype=torch.long), logits,
                       SlotBatch.from_slots([0] * n, CPU))


def _choose(seqs: list[Sequence], logits: torch.Tensor) -> list[int | None]:
    return BatchSteps.choose(_batch(seqs, logits), frozenset())


def _first_max(row: list[float]) -> int:
    return max(range(len(row)), key=lambda j: (row[j], -j))


# -- greedy ----------------------------------------------------------------------------------------

def test_greedy_rows_take_the_argmax_among_sampled_neighbours() -> None:
    g = torch.Generator().manual_seed(5)
    seqs = [_seq(), _seq(1.0, 0.9, seed=1), _seq(), _seq(2.0, 1.0, seed=2), _seq()]
    greedy = [0, 2, 4]
    for _ in range(20):
        logits = torch.randn((5, 300), generator=g) * 4
        logits[2, 7] = logits[2, 9] = logits[2].max() + 1  # a tie: the first index wins
        logits[4] = logits[4].sign() * 3e38  # finite, but overflows any softmax
        chosen = _choose(seqs, logits)
        for i in greedy:
            assert chosen[i] == _first_max(logits[i].tolist())
    assert all(s.failure is None for s in seqs)


# -- the sampled distribution ----------------------------------------------------------------------

LOGITS = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]


def _nucleus(logits: list[float], temperature: float, top_p: float) -> dict[int, float]:
    """The intended distribution, in float64 from the definition: softmax at the temperature,
    then the smallest most-probable prefix whose mass reaches top_p, renormalised."""
    weights = [math.exp(v / temperature) for v in logits]
    probs = [w / sum(weights) for w in weights]
    kept: list[int] = []
    for i in sorted(range(len(probs)), key=lambda j: -probs[j]):
        kept.append(i)
        if sum(probs[j] for j in kept) >= top_p:
            break
    mass = sum(probs[j] for j in kept)
    return {i: probs[i] / mass for i in kept}


# (temperature, top_p, token order): each configuration permutes the logits its own way, so a
# row that used another row's logits or parameters would show in its counts
CONFIGS = [(0.7, 0.9, [0, 1, 2, 3, 4, 5]), (2.0, 1.0, [5, 4, 3, 2, 1, 0]),
           (1.0, 0.7, [2, 0, 1, 4, 5, 3])]
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}  # chi-square 0.999 quantiles


def test_sampled_frequencies_follow_the_top_p_cut_temperature_distribution() -> None:
    rows_per_config, steps = 500, 40  # 20,000 draws per configuration
    seqs: list[Sequence] = []
    rows: list[torch.Tensor] = []
    for c, (temperature, top_p, order) in enumerate(CONFIGS):
        for r in range(rows_per_config):
            seqs.append(_seq(temperature, top_p, seed=c * rows_per_config + r))
            rows.append(torch.tensor([LOGITS[order.index(t)] for t in range(len(LOGITS))]))
    seqs.append(_seq())  # a greedy row in the same batch
    rows.append(torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0]))
    logits = torch.stack(rows)
    for _ in range(steps):
        _choose(seqs, logits)
    assert seqs[-1].produced == [4] * steps
    for c, (temperature, top_p, order) in enumerate(CONFIGS):
        counts = Counter(t for s in seqs[c * rows_per_config:(c + 1) * rows_per_config]
                         for t in s.produced)
        want = {order[i]: p for i, p in _nucleus(LOGITS, temperature, top_p).items()}
        n = rows_per_config * steps
        assert set(counts) <= set(want), f"tokens of the tail were drawn: {counts}"
        if top_p < 1.0:
            assert len(want) < len(LOGITS)  # the case really cuts a tail
        chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in want.items())
        assert chi2 < CHI2_999[len(want) - 1], (temperature, top_p, counts, want)


def test_top_p_tiny_keeps_only_the_most_probable_token() -> None:
    seqs = [_seq(5.0, 0.001, seed=s) for s in range(50)]
    logits = torch.tensor([[0.0, 0.1, 0.05, -1.0]] * 50)
    for _ in range(5):
        _choose(seqs, logits)
    assert {t for s in seqs for t in s.produced} == {1}


# -- batch composition -----------------------------------------------------------------------------

VOCAB, STEPS = 256, 64
TARGET = (0.8, 0.9, 1234)  # temperature, top_p, seed


def _target_logits(step: int) -> torch.Tensor:
    return torch.randn(VOCAB, generator=torch.Generator().manual_seed(step)) * 3


def _run(layout: list[str], neighbour_seed: int) -> list[list[int]]:
    """STEPS decode steps of a batch laid out as ``layout``: "target" (the seeded request under
    test), "twin" (another tenant's request with the same seed and the same logits), "greedy",
    "hot" (temperature 2, full vocab), "other" (another seed and top_p), "poison" (nan logits).
    Neighbours get fresh logits each step; the tokens of each target and twin row."""
    kinds: dict[str, Callable[[], Sequence]] = {
        "target": lambda: _seq(*TARGET), "twin": lambda: _seq(*TARGET), "greedy": _seq,
        "hot": lambda: _seq(2.0, 1.0, seed=neighbour_seed),
        "other": lambda: _seq(1.0, 0.5, seed=neighbour_seed + 1),
        "poison": lambda: _seq(1.0, 0.9, seed=neighbour_seed + 2)}
    seqs = [kinds[k]() for k in layout]
    noise = torch.Generator().manual_seed(neighbour_seed)
    for step in range(STEPS):
        logits = torch.randn((len(layout), VOCAB), generator=noise) * 3
        for i, kind in enumerate(layout):
            if kind in ("target", "twin"):
                logits[i] = _target_logits(step)
            elif kind == "poison":
                logits[i] = math.nan
        _choose(seqs, logits)
    assert all((s.failure is not None) == (k == "poison") for s, k in zip(seqs, layout,
                                                                           strict=True))
    return [s.produced for s, k in zip(seqs, layout, strict=True) if k in ("target", "twin")]


def test_a_rows_tokens_do_not_depend_on_the_other_rows_in_its_batch() -> None:
    alone, = _run(["target"], 0)
    assert len(set(alone)) > 5  # really sampled, not a constant
    layouts = [["target", "greedy"], ["greedy", "hot", "target"],
               ["other", "poison", "greedy", "target", "hot", "twin", "other"],
               ["hot"] * 9 + ["target"], ["twin", "target", "poison"]]
    for n, layout in enumerate(layouts):
        for tokens in _run(layout, 100 + n):
            assert tokens == alone, layout


def test_the_same_seed_gives_the_same_tokens_and_another_seed_others() -> None:
    def tokens(seed: int) -> list[int]:
        seq = _seq(1.0, 0.95, seed=seed)
        for step in range(STEPS):
            _choose([seq], _target_logits(step)[None])
        return seq.produced

    assert tokens(7) == tokens(7)
    assert tokens(7) != tokens(8)


# -- rows that fail alone --------------------------------------------------------------------------

def test_a_row_that_is_not_a_distribution_fails_alone() -> None:
    healthy = torch.randn((3, 50), generator=torch.Generator().manual_seed(3))
    bad = {
        "nan": torch.full((50,), math.nan),
        "inf": torch.zeros(50).index_fill(0, torch.tensor([4]), math.inf),
        "no mass": torch.full((50,), -math.inf),
        "overflows at its temperature": torch.full((50,), 3e38),  # finite logits, inf / 0.5
    }
    kinds = [_seq(), _seq(1.0, 0.9, seed=1), _seq(0.5, 1.0, seed=2)]
    alone = [_choose([kinds[i]], healthy[i][None])[0] for i in range(3)]
    for name, row in bad.items():
        for sampled in (True, False):
            if name == "overflows at its temperature" and not sampled:
                continue  # a greedy row takes the argmax of finite logits
            seqs = [_seq(), _seq(1.0, 0.9, seed=1), _seq(0.5, 1.0, seed=2)]
            poisoned = _seq(0.5, 0.9, seed=9) if sampled else _seq()
            chosen = _choose([seqs[0], poisoned, seqs[1], seqs[2]],
                             torch.stack([healthy[0], row, healthy[1], healthy[2]]))
            assert chosen[1] is None, name
            assert (poisoned.failure, poisoned.done, poisoned.produced) == ("numerical", True, [])
            assert [chosen[0], *chosen[2:]] == alone, name
            assert all(s.failure is None and not s.done for s in seqs)


# -- one device read per step ----------------------------------------------------------------------

READS = ("tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
         "__array__")


@contextmanager
def _counting_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every way Python code can turn a tensor into host values, counted while it runs."""
    seen: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _name: str = name,
                    _original: Any = original, **kwargs: Any) -> Any:
            seen.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    try:
        yield seen
    finally:
        monkeypatch.undo()


@pytest.mark.parametrize("layout", [["greedy"] * 4, ["sampled"] * 4,
                                    ["greedy", "sampled", "poison", "sampled", "greedy"]])
def test_choose_reads_the_device_once_per_step(layout: list[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seqs = [_seq() if k == "greedy" else _seq(0.9, 0.8, seed=i) for i, k in enumerate(layout)]
    logits = torch.randn((len(layout), 64), generator=torch.Generator().manual_seed(1))
    for i, kind in enumerate(layout):
        if kind == "poison":
            logits[i] = math.nan
    for _ in range(3):
        batch = _batch(seqs, logits)
        with _counting_reads(monkeypatch) as seen:
            chosen = BatchSteps.choose(batch, frozenset())
        assert seen == ["tolist"], seen
        assert (None in chosen) == ("poison" in layout)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_choosing_on_cuda_never_synchronises_before_the_read() -> None:
    from backend.serving.sampling import RowSampling, choose_tokens

    cuda = torch.device("cuda")
    rows = [RowSampling(0.0, 1.0, None)] + [
        RowSampling(0.9, p, torch.Generator(device=cuda).manual_seed(i))
        for i, p in enumerate((1.0, 0.9, 0.5))]
    logits = torch.randn((4, 32000), device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ids = choose_tokens(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert ids.tolist()[0] == int(logits[0].argmax())
