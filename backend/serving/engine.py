"""The multi-LoRA serving engine: many adapters on one shared base, in one mixed batch.

Resident adapters live in stacked slots (``backend.serving.slots``): every ``nn.Linear`` an
adapter may target is wrapped, when the engine is built, by a ``SlottedLinear`` holding A/B for
all slots; each row of a batch names its slot, slot 0 being the all-zero base slot. How many
slots, and what they cost, is the memory plan's (``backend.serving.memory``): a configuration
that cannot hold one adapter of the maximum rank is refused before the base weights are read.
The per-row delta runs the segment or the gather path (``backend.serving.lora_ops``), chosen per
batch; one forward pass per decoding step serves every row.

Rows join and leave between decode steps (``prefill``, ``merge``, ``retain``, ``advance``; the
KV bookkeeping is ``backend.serving.batch_ops``): the continuous-batching scheduler
(``backend.serving.scheduler``) drives them; ``generate`` drives the same steps for one batch.

The engine is the face of three collaborators that share its lock: adapter residency (slots,
loads, pins: ``backend.serving.residency``), the provenance record of what each slot's banks
hold (``backend.serving.provenance``), and the batch steps (``backend.serving.batch_steps``).

Prompt format (the reference kit's, ``control.tools.kit``): the raw prompt tokenized without
special tokens (text spelling one stays plain text), the tokenizer's bos prepended; the
continuation follows and stops at eos or ``max_tokens``. Adapter files are parsed and checked
against the base by ``backend.serving.adapter_files``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence as Sequence_
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM, PreTrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from backend.serving.adapter_files import AdapterSource, HostAdapter, PreparedAdapter
from backend.serving.batch_steps import BatchSteps, first_logits, generate_all, row_generator
from backend.serving.chunked_prefill import PartialPrefill, prefill_chunk
from backend.serving.engine_types import (
    AdapterBusyError,
    AdapterLoadError,
    DecodeBatch,
    EngineError,
    GenerationRequest,
    GenerationResult,
    InvalidRequestError,
    Sequence,
    UnknownAdapterError,
)
from backend.serving.fingerprint import CHECK_EVERY as FINGERPRINT_EVERY
from backend.serving.lease import Lease, Violations
from backend.serving.lora_ops import SlotBatch
from backend.serving.memory import (
    AdapterBudget,
    BaseShapes,
    MemoryPlan,
    device_memory,
    plan_memory,
    serving_dtype,
)
from backend.serving.placement_gate import PlacementGate
from backend.serving.prefix_cache import uncached_tokenizer
from backend.serving.residency import SlotResidency
from backend.serving.row_runs import use_row_runs
from backend.serving.sampling import InvalidParameter, check_sampling
from backend.serving.slots import SlotIdentity

log = logging.getLogger("loraplane.engine")
# The engine's types and the adapter-file types, importable from here as before.
__all__ = ["AdapterBusyError", "AdapterLoadError", "AdapterSource", "DecodeBatch", "Engine",
           "EngineError", "GenerationRequest", "GenerationResult", "HostAdapter",
           "InvalidRequestError", "PreparedAdapter", "Sequence", "UnknownAdapterError"]


class Engine:
    """One base model serving mixed batches of LoRA adapters held in stacked slots: the
    request side and the one forward pass (:meth:`_forward`) here; slots in ``residency``,
    what they hold in ``provenance``, the batch steps in ``steps`` (one lock for all)."""

    def __init__(
        self,
        base_dir: Path,
        tokenizer_dir: Path,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_rank: int = 64,
        max_adapters: int | None = None,
        budget: AdapterBudget | None = None,
        violations: Violations | None = None,
    ) -> None:
        """``max_adapters``: a fixed slot count (tests, benchmarks); otherwise as many slots as
        ``budget`` (the configured adapter memory, see ``backend.serving.memory``) holds. Raises
        ``AdapterMemoryError`` before reading any weights when not even one adapter of
        ``max_rank`` fits."""
        # Broken lease/pin invariants, counted (and raised) here, exported as a metric.
        self.violations = violations or Violations()
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = getattr(torch, serving_dtype(self._device.type))
        self._dtype = dtype
        self._max_rank = max_rank
        self.plan: MemoryPlan = plan_memory(
            BaseShapes.from_dir(Path(base_dir)), max_rank=max_rank,
            element_size=torch.empty((), dtype=dtype).element_size(),
            budget=budget or AdapterBudget(), device_bytes=device_memory(str(self._device)),
            slots=max_adapters)
        self._lock = threading.RLock()
        self.placement_lock = PlacementGate(self._lock)  # for slot changes (AdapterCache._place)
        # Without the tokenizer's word cache: shared by all tenants, it cannot be salted.
        self._tokenizer: PreTrainedTokenizerBase = uncached_tokenizer(
            AutoTokenizer.from_pretrained(Path(tokenizer_dir), local_files_only=True))
        model = LlamaForCausalLM.from_pretrained(
            Path(base_dir), dtype=dtype, use_safetensors=True, local_files_only=True
        )
        use_row_runs(model)  # decode attention over each row's own width
        # transformers wraps .to() with a signature mypy misreads
        self._model: LlamaForCausalLM = model.to(self._device).eval()  # type: ignore[arg-type]
        self.residency = SlotResidency(self._model, self.plan, self._lock, self.violations,
                                       device=self._device, dtype=dtype, max_rank=max_rank)
        self._slotted = self.residency.slotted  # module name -> its slot banks
        self._active = self.residency.active  # slot -> pins held by live sequences
        # What each slot holds, read by every pass; fingerprint_every: passes between weight
        # checks (0: none), a test or benchmark may set it.
        self.provenance = self.residency.provenance
        self.fingerprints = self.provenance.fingerprints
        self.fingerprint_every = FINGERPRINT_EVERY
        log.info("%s", self.plan.describe())

        eos = self._model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if not eos_ids and self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(int(i) for i in eos_ids)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else min(self._eos_ids, default=0))
        # Through a lambda, so a subclass's (or a test's) _forward is the one every step runs.
        self.steps = BatchSteps(self._model, self.residency.context, self._lock, self._device,
                                self._pad_id, lambda *a: self._forward(*a))

    # -- properties -------------------------------------------------------------------------

    @property
    def base_config(self) -> PreTrainedConfig:
        return self._model.config

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def max_adapters(self) -> int:
        return self.residency.table.capacity

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    # -- adapters (backend.serving.residency) -----------------------------------------------

    def read_adapter(self, source: AdapterSource) -> HostAdapter:
        """Parse and validate an adapter on the host; nothing becomes resident.

        ``source`` is a directory, or its files already in memory (relative path -> bytes), as
        the store hands them over after checking those bytes against the digest.
        """
        return self.residency.read_adapter(source)

    def prepare(self, adapter: HostAdapter) -> PreparedAdapter:
        """The adapter in the slots' dtype and layout (see :class:`PreparedAdapter`); takes no
        lock, so a cold load's conversion never holds up a decode step."""
        return self.residency.prepare(adapter)

    def place(self, digest: str, adapter: HostAdapter | PreparedAdapter) -> int:
        """Put a validated adapter in a free slot; return its resident device bytes.

        The engine's lock is held only to choose the slot and issue the copies (asynchronous
        from pinned memory on CUDA); a :class:`HostAdapter` is prepared first, outside it.
        """
        prepared = adapter if isinstance(adapter, PreparedAdapter) else self.prepare(adapter)
        return self.residency.place(digest, prepared)

    def load_adapter(self, digest: str, adapter_dir: Path) -> int:
        """Make an adapter resident under ``digest``; return its resident bytes.

        Loading a digest that is already resident is a no-op. On any error nothing of the
        adapter stays resident and ``AdapterLoadError`` says what was expected and found.
        """
        with self._lock:
            if self.residency.table.slot_of(digest) is not None:
                return self.plan.slot_bytes
            return self.place(digest, self.read_adapter(adapter_dir))

    def unload_adapter(self, digest: str) -> None:
        """Drop a resident adapter and zero its slot. ``UnknownAdapterError`` if it is not
        resident; ``AdapterBusyError`` while a running sequence uses it (its slot must not be
        handed to another adapter mid-way)."""
        self.residency.unload(digest)

    def resident_adapters(self) -> dict[str, int]:
        """Resident adapter digests and their bytes on the device."""
        return self.residency.resident_adapters()

    def slot_of(self, digest: str) -> int | None:
        """The slot an adapter occupies, or None."""
        return self.residency.slot_of(digest)

    def slot_identity(self, digest: str) -> SlotIdentity | None:
        """The slot, digest and load generation of a resident adapter, or None."""
        return self.residency.identity_of(digest)

    def slot_tensors(self, digest: str) -> list[torch.Tensor]:
        """The views of an adapter's whole slot, in every target module (byte accounting)."""
        return self.residency.slot_tensors(digest)

    def base_tensors(self) -> list[torch.Tensor]:
        """The base model's parameters and buffers (memory accounting)."""
        return self.residency.base_tensors()

    def bank_tensors(self) -> list[torch.Tensor]:
        """Every slot bank, A and B of every target module (memory accounting)."""
        return self.residency.bank_tensors()

    def base_slot_is_zero(self) -> bool:
        """Slot 0 (base rows) is all zero in every module: no sentinel reaches an adapter."""
        return self.residency.base_slot_is_zero()

    def slot_bytes_for(self, adapter: HostAdapter | PreparedAdapter) -> int:
        """Device bytes ``adapter`` will occupy once placed: one whole slot (the banks are
        allocated in full, so a slot costs the same whatever the adapter targets)."""
        return self.plan.slot_bytes

    def pins(self) -> dict[int, int]:
        """Slot -> pins held by live sequences (state-machine tests, metrics)."""
        return self.residency.pins()

    def stale_rows(self, seqs: Sequence_[Sequence]) -> list[int]:
        """Indices of ``seqs`` whose slot no longer holds the load they were admitted on."""
        return self.residency.stale_rows(seqs)

    # -- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Prompt token ids: bos, then the prompt's tokens (the kit's prompt format)."""
        # Prompt text spelling "</s>" stays plain bytes: only the bos added here is special.
        ids: list[int] = self._tokenizer(
            prompt, add_special_tokens=False, split_special_tokens=True
        )["input_ids"]
        bos = self._tokenizer.bos_token_id
        return [int(bos), *ids] if bos is not None else list(ids)

    def text(self, ids: Sequence_[int]) -> str:
        """Decode generated ids (eos dropped) to text."""
        out = self._tokenizer.decode([t for t in ids if t not in self._eos_ids],
                                     skip_special_tokens=True)
        assert isinstance(out, str)
        return out

    def validate(self, request: GenerationRequest) -> int:
        """Check one request as ``generate`` would; return its prompt length in tokens.

        Lets a caller refuse one bad request instead of failing the batch it would join.
        Raises ``UnknownAdapterError`` or ``InvalidRequestError``.
        """
        with self._lock:
            ids, _ = self._prepare_one(request)
            return len(ids)

    def open_sequence(self, request: GenerationRequest, lease: Lease | None = None) -> Sequence:
        """Validate a request and pin its adapter's slot until its lease is released.

        ``lease``: the request's lease (the service's, already holding the cache reference);
        the pin joins it, so one release gives both back. Without one, the sequence gets a
        lease of its own. On error nothing is pinned.
        """
        with self._lock:
            ids, holder = self._prepare_one(request)
            if lease is None:
                lease = Lease(request.adapter, self.violations)
            if holder is not None:
                self.residency.pin(holder)
                lease.attach(lambda: self.residency.unpin(holder))
            return Sequence(request, ids, lease, holder,
                            row_generator(request, self._device))

    def close_sequence(self, seq: Sequence) -> None:
        """Release the sequence's lease (its slot pin, and what else the lease holds)."""
        seq.lease.release()

    def _prepare_one(self, r: GenerationRequest) -> tuple[list[int], SlotIdentity | None]:
        holder = None
        if r.adapter is not None:
            holder = self.residency.table.identity_of(r.adapter)
            if holder is None:
                raise UnknownAdapterError(f"adapter not resident: {r.adapter}")
        try:  # the service checks these at admission already; the engine trusts no caller
            check_sampling(r.max_tokens, r.temperature, r.top_p, r.seed)
        except InvalidParameter as e:
            raise InvalidRequestError(str(e)) from None
        ids = self.encode(r.prompt)
        limit = int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        if limit and len(ids) + r.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({r.max_tokens}) exceeds the "
                f"model's {limit} positions"
            )
        return ids, holder

    # -- whole batches (the oracle's entry points) ------------------------------------------

    def next_token_logits(self, requests: Sequence_[GenerationRequest]) -> torch.Tensor:
        """Logits for the first generated token of each request, in one mixed batch.

        Shape ``[batch, vocab]``, float32. The correctness oracle compares these with PEFT.
        """
        return first_logits(self, requests)

    def generate(self, requests: Sequence_[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request in one mixed batch, one forward pass per step."""
        return generate_all(self, requests)

    # -- continuous batching steps (backend.serving.batch_steps) ----------------------------

    def prefill(self, seqs: list[Sequence],
                cached: dict[int, DecodeBatch] | None = None) -> DecodeBatch:
        """Run the prompts of new sequences (left-padded, one mixed batch) into a DecodeBatch;
        ``cached``: index of ``seqs`` -> a one-row prefix-cache entry (no forward pass)."""
        return self.steps.prefill(seqs, cached)

    def prefill_chunk(self, part: PartialPrefill, tokens: int) -> DecodeBatch | None:
        """The next ``tokens`` of a long prompt; its batch once done (``chunked_prefill``)."""
        return prefill_chunk(self.steps, part, tokens)

    def merge(self, a: DecodeBatch, b: DecodeBatch) -> DecodeBatch:
        """One batch holding the rows of both (``backend.serving.batch_ops.merged``)."""
        return self.steps.merge(a, b)

    def retain(self, batch: DecodeBatch, keep: list[int], *,
               reuse: bool = False) -> DecodeBatch | None:
        """The batch with only rows ``keep``; None when no row is left (``reuse``: the caller
        gives ``batch`` up, so its KV buffers may hold the rows kept)."""
        return self.steps.retain(batch, keep, reuse=reuse)

    def choose(self, batch: DecodeBatch) -> list[int | None]:
        """Pick each row's next token; mark rows that reached eos or their limit as done.

        A row whose logits are not finite, or whose sampling distribution is not one, fails
        alone (``failure = "numerical"``, done, no token): the other rows go on.
        """
        return self.steps.choose(batch, self._eos_ids)

    def advance(self, batch: DecodeBatch) -> None:
        """One decode step: feed each row's last token, extend the KV cache, new logits."""
        self.steps.advance(batch)

    def _forward(self, seqs: list[Sequence], slots: SlotBatch, ids: torch.Tensor,
                 mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        # Provenance backstop: no row's delta is applied from a slot that no longer holds the
        # load the row was admitted on. The scheduler drops such rows before each step; reaching
        # this means a caller skipped that check, so the whole pass is refused.
        if self.stale_rows(seqs):
            self.violations.raise_("stale_slot", "a forward pass over a reloaded slot")
        # What each row's slot holds now, as the banks record it: the pass computes with these
        # weights (the engine's lock keeps them in place until it returns).
        self.provenance.observe(seqs, self.fingerprint_every)
        return self.steps.run_model(slots, ids, mask, positions, cache)
