"""State-machine tests of the serving core: the real Engine, AdapterCache and Scheduler.

Hypothesis drives random interleavings of what a host lives through: requests on many adapters
(more than the device slots, so loads evict) from three tenants sharing a queue of four (so a
tenant's queued job is refused as busy when another's takes its place), cancellation before
start and mid-stream, clients that vanish mid-stream, a row whose logits are poisoned, a decode
step that fails for no row, revocations. After every rule the invariants that attribution rests
on must hold:

- pins on each slot equal the live sequences on that slot, and cache references equal the live
  adapter sequences (every lease is released exactly once: no leak, no double release);
- no slot holds anything but the load its live sequences were admitted on (never reloaded under a
  live sequence);
- every job is finished exactly once, and none is lost;
- every ``ok`` row's tokens equal PEFT's greedy output for that adapter alone, its
  ``adapter_digest`` (read from the slot) is the adapter it asked for;
- no invariant violation is ever counted.

The scheduler runs without its thread (``start=False``; the machine calls ``run_once``), so each
interleaving is reproducible and shrinks. ``LORAPLANE_STATE_EXAMPLES`` sets the number of examples
(default 2,000).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from peft import PeftModel
from transformers import LlamaForCausalLM

import backend.serving.row_runs as row_runs
from backend.serving.cache import AdapterCache, CacheBudgets, CacheQuota, CacheRefused
from backend.serving.engine import DecodeBatch, GenerationRequest, GenerationResult
from backend.serving.engine import Sequence as EngineSequence
from backend.serving.kv_admission import kv_need
from backend.serving.lease import Lease
from backend.serving.prefix_cache import PrefixCache, PrefixKey
from backend.serving.scheduler import QueueFull, Scheduler, SchedulerLimits
from control.contracts.ledger import Outcome
from control.tools.kit import KitManifest
from tests.artifacts import perturbed_copy
from tests.faults import FAIL_STEP, POISON_ROW, FaultyEngine

EXAMPLES = int(os.environ.get("LORAPLANE_STATE_EXAMPLES", "2000"))
MAX_TOKENS = 5
PROMPTS = ("Once upon a time", "The cat", "1 + 1")
MIN_TOKENS = 2  # every reference differs from every other in its first two tokens
SLOTS = 2
FAULTS = ("none", "none", "none", "cancel_before_start", "poison", "fail_step", "gone")
WORLD_DIGESTS = ["sha256:" + f"{0xa0 + i:02x}" * 32 for i in range(6)]


@dataclass
class World:
    """Built once per module: the engine, six adapters on disk, PEFT's references."""

    engine: FaultyEngine
    paths: dict[str, Path]  # digest -> adapter directory
    tenants: dict[str, str]  # digest -> owning tenant
    # (digest or None, prompt) -> PEFT greedy token ids, MAX_TOKENS of them or up to eos
    reference: dict[tuple[str | None, str], list[int]] = field(default_factory=dict)


WORLD: World | None = None


def _peft_ids(model: torch.nn.Module, ids: list[int], eos: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=MAX_TOKENS, eos_token_id=eos, pad_token_id=eos)
    new = out[0, len(ids):].tolist()
    return new[: new.index(eos) + 1] if eos in new else new


@pytest.fixture(scope="module")
def world(kit_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> World:
    kit = KitManifest.load(kit_dir)
    root = tmp_path_factory.mktemp("state-machine-adapters")
    paths: dict[str, Path] = {}
    tenants: dict[str, str] = {}
    for i, (name, factor) in enumerate((n, f) for f in (1.0, -2.0)
                                       for n in ("alpha", "beta", "gamma")):
        digest = WORLD_DIGESTS[i]
        paths[digest] = perturbed_copy(kit_dir / kit.adapters[name].path, root / f"a{i}", factor)
        tenants[digest] = ("acme", "globex")[i % 2]
    engine = FaultyEngine(kit_dir / "base", kit_dir / "tokenizer", device="cpu", max_rank=8,
                          max_adapters=SLOTS)
    eos = min(engine.eos_ids)
    w = World(engine, paths, tenants)
    base = LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32).eval()
    for prompt in PROMPTS:
        w.reference[(None, prompt)] = _peft_ids(base, engine.encode(prompt), eos)
    for digest, path in paths.items():
        model = PeftModel.from_pretrained(
            LlamaForCausalLM.from_pretrained(kit_dir / "base", dtype=torch.float32),
            path).eval()
        for prompt in PROMPTS:
            w.reference[(digest, prompt)] = _peft_ids(model, engine.encode(prompt), eos)
    for prompt in PROMPTS:  # a swap between two adapters must show in the tokens
        outputs = [tuple(w.reference[(d, prompt)][:MIN_TOKENS]) for d in [None, *paths]]
        assert len(set(outputs)) == len(outputs), f"indistinguishable references on {prompt!r}"
    global WORLD
    WORLD = w
    return w


class Sink:
    """Records how its job ended; can cancel, or break like a vanished client."""

    def __init__(self, *, cancel: bool = False, gone_after: int | None = None) -> None:
        self.cancel = cancel
        self.gone_after = gone_after
        self.pieces: list[str] = []
        self.ends: list[tuple[GenerationResult, Outcome, str | None]] = []

    def cancelled(self) -> bool:
        return self.cancel

    def token(self, piece: str) -> None:
        if self.gone_after is not None and len(self.pieces) >= self.gone_after:
            raise BrokenPipeError("client gone")
        self.pieces.append(piece)

    def finish(self, result: GenerationResult, outcome: Outcome, reason: str | None) -> None:
        self.ends.append((result, outcome, reason))


@dataclass
class Job:
    digest: str | None
    prompt: str
    fault: str
    max_tokens: int
    seq: EngineSequence
    sink: Sink


class ServingMachine(RuleBasedStateMachine):
    """One host: engine (two device slots), cache (six adapters), scheduler (three rows)."""

    def __init__(self) -> None:
        super().__init__()
        assert WORLD is not None
        self.w = WORLD
        self.eng = WORLD.engine
        self.eng.fail_steps = 0
        self.violations_before = self.eng.violations.total
        self.prefix: PrefixCache[DecodeBatch] = PrefixCache(8 * 2**20)
        self.cache = AdapterCache(
            self.eng, WORLD.paths.__getitem__,
            budgets=CacheBudgets(device_bytes=2**30, host_bytes=2**30, store_bytes=2**30),
            quota=CacheQuota(resident_share=1.0, loads_per_minute=1e9, load_burst=10**9,
                             room_wait_s=0.0),  # nothing frees room while we wait here
            on_purge=self.prefix.purge_adapter)
        # A KV budget two of the longest rows fill: it binds before the count does for long
        # rows, while three short ones still fit.
        longest = 0
        for text in (p + f for p in PROMPTS for f in ("", POISON_ROW, FAIL_STEP)):
            probe = self.eng.open_sequence(GenerationRequest(text, None, max_tokens=MAX_TOKENS))
            longest = max(longest, kv_need(probe))
            self.eng.close_sequence(probe)
        self.kv_budget = 2 * longest
        # Prompts over 6 tokens ("Once upon a time" 17 with bos, "The cat" 8, and every prompt
        # with a fault's suffix) are prefilled in chunks between decode steps
        # (backend.serving.chunked_prefill); "1 + 1" (6) takes the one-pass prefill. At 8,
        # positions restarting at 0 in every chunk went unnoticed here.
        self.sched = Scheduler(self.eng, SchedulerLimits(max_running=3, max_queued=4,
                                                         max_kv_tokens=self.kv_budget,
                                                         prefill_chunk=6),
                               self.prefix, start=False)
        self.jobs: list[Job] = []
        self.revoked: set[str] = set()

    @initialize()
    def empty_engine(self) -> None:
        assert self.eng.resident_adapters() == {} and self.eng.pins() == {}

    # -- rules ------------------------------------------------------------------------------

    @rule(adapter=st.sampled_from([None, *WORLD_DIGESTS]),
          prompt=st.sampled_from(PROMPTS), max_tokens=st.integers(MIN_TOKENS, MAX_TOKENS),
          fault=st.sampled_from(FAULTS), stream=st.booleans(),
          tenant=st.sampled_from(("acme", "globex", "initech")))
    def submit(self, adapter: str | None, prompt: str, max_tokens: int, fault: str,
               stream: bool, tenant: str) -> None:
        text = prompt + {"poison": POISON_ROW, "fail_step": FAIL_STEP}.get(fault, "")
        refs_before = self.cache.references()
        if adapter is None:
            lease = Lease(None, self.eng.violations)
        else:
            try:
                lease = self.cache.acquire(adapter, self.w.tenants[adapter])
            except CacheRefused as e:
                assert adapter not in self.revoked or e.reason == "revoked"
                assert self.cache.references() == refs_before  # a refusal holds nothing
                return
            assert adapter not in self.revoked, "a revoked adapter was leased"
        seq = self.eng.open_sequence(GenerationRequest(text, adapter, max_tokens=max_tokens),
                                     lease)
        sink = Sink(cancel=fault == "cancel_before_start",
                    gone_after=1 if fault == "gone" else None)
        key = PrefixKey("base", adapter, "tok", tuple(seq.prompt_ids), salt=b"tenant")
        try:
            # the tenant that sent it: the queue is shared fairly, so at the bound a job of a
            # tenant holding more of it may be refused (busy) in this one's place
            self.sched.submit(seq, sink, stream=stream or fault == "gone", key=key, tenant=tenant)
        except QueueFull:
            lease.release()  # the caller still owns the lease on QueueFull
            return
        self.jobs.append(Job(adapter, prompt, fault, max_tokens, seq, sink))

    @rule(adapter=st.sampled_from([None, *WORLD_DIGESTS]), prompt=st.sampled_from(PROMPTS),
          tenant=st.sampled_from(("acme", "globex", "initech")), n=st.integers(2, 5))
    def flood(self, adapter: str | None, prompt: str, tenant: str, n: int) -> None:
        """One tenant sends ``n`` at once: the queue fills, and another tenant's next request
        takes the place of this tenant's newest."""
        for _ in range(n):
            self.submit(adapter, prompt, MAX_TOKENS, "none", False, tenant)

    @rule(turns=st.integers(1, 4))
    def step(self, turns: int) -> None:
        for _ in range(turns):
            self.sched.run_once()

    @precondition(lambda self: any(not j.sink.ends for j in self.jobs))
    @rule(pick=st.integers(0, 10**6))
    def cancel(self, pick: int) -> None:
        live = [j for j in self.jobs if not j.sink.ends]
        live[pick % len(live)].sink.cancel = True

    @rule()
    def fail_next_step(self) -> None:
        self.eng.fail_steps = 1

    @rule(adapter=st.sampled_from(WORLD_DIGESTS))
    def revoke(self, adapter: str) -> None:
        self.cache.revoke(adapter)
        self.revoked.add(adapter)

    @rule()
    def drain(self) -> None:
        self._drain()

    def _drain(self) -> None:
        for _ in range(500):
            if not self.sched.run_once():
                return
        raise AssertionError("the scheduler did not drain in 500 turns")

    # -- invariants -------------------------------------------------------------------------

    def _live(self) -> list[Job]:
        return [j for j in self.jobs if not j.sink.ends]

    @invariant()
    def the_running_batch_stays_within_its_kv_budget(self) -> None:
        assert self.sched.kv_reserved() <= self.kv_budget
        batch = self.sched.running_batch()
        # the engine's own tensors, not the accounting: the running batch's first layer, and
        # that layer of every prompt still being prefilled in chunks, beside it
        layers = self.sched.prefill_tensors()[::2 * self.eng.base_config.num_hidden_layers]
        if batch is not None:  # each KV segment's first layer
            assert sum(seg.rows * seg.width for seg in batch.segments) <= self.kv_budget
            layers += [seg.keys[0] for seg in batch.segments]
        # and the buffers under them, with the room reserved for the tokens to come
        held = sum(k.untyped_storage().nbytes() // (k.shape[1] * k.shape[3] * k.element_size())
                   for k in layers)
        assert held <= self.kv_budget

    @invariant()
    def no_violation_counted(self) -> None:
        assert self.eng.violations.total == self.violations_before, \
            self.eng.violations.snapshot()

    @invariant()
    def pins_and_references_equal_live_sequences(self) -> None:
        live = self._live()
        want = Counter(j.seq.holder.slot for j in live if j.seq.holder is not None)
        assert self.eng.pins() == dict(want)
        assert self.cache.references() == sum(1 for j in live if j.digest is not None)

    @invariant()
    def no_slot_reloaded_under_a_live_sequence(self) -> None:
        assert self.eng.stale_rows([j.seq for j in self._live()]) == []

    @invariant()
    def every_job_ends_once_and_ok_rows_are_their_adapters_alone(self) -> None:
        for j in self.jobs:
            assert len(j.sink.ends) <= 1, f"job ended {len(j.sink.ends)} times"
            if not j.sink.ends:
                continue
            result, outcome, reason = j.sink.ends[0]
            assert j.seq.lease.released
            if outcome == Outcome.OK:
                assert j.fault not in ("poison", "fail_step", "cancel_before_start"), reason
                want = self.w.reference[(j.digest, j.prompt)][: j.max_tokens]
                assert result.token_ids == want, (j.digest, j.prompt, result.token_ids, want)
                assert result.adapter_digest == j.digest  # read from the slot
            if j.fault == "poison" and outcome == Outcome.FAILED:
                assert reason in ("numerical", "engine")

    def teardown(self) -> None:
        try:
            self._drain()
            self.sched.stop()
            assert all(len(j.sink.ends) == 1 for j in self.jobs), "a job was lost"
            assert self.eng.pins() == {} and self.cache.references() == 0
            assert self.eng.violations.total == self.violations_before
        finally:
            for digest in list(self.eng.resident_adapters()):
                self.eng.unload_adapter(digest)


TestServingStateMachine = ServingMachine.TestCase
TestServingStateMachine.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=20, deadline=None, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@pytest.fixture(autouse=True)
def _cheap_row_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps split the batch into runs of rows whenever that leaves out any padding
    (backend.serving.row_runs): the machine's prompts differ by a few tokens, which the
    default cost of a run would not split for, and each run's tokens are checked here."""
    monkeypatch.setattr(row_runs, "RUN_COST", 0)


@pytest.fixture(autouse=True)
def _world(world: World) -> None:
    """Build the world before hypothesis runs the machine."""
