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
from typing import Any

import torch
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM, PreTrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from backend.serving.adapter_files import (
    AdapterSource,
    HostAdapter,
    PreparedAdapter,
    prepared,
    read_config,
    read_tensors,
    validated_pairs,
)
from backend.serving.batch_ops import cache_tensors, merged, selected
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
from backend.serving.fingerprint import WEIGHTS_CHANGED, BankFingerprints
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
from backend.serving.prefix_cache import uncached_tokenizer
from backend.serving.sampling import InvalidParameter, check_sampling, sample
from backend.serving.slots import (
    SlotContext,
    SlotIdentity,
    SlotsFull,
    SlotTable,
    SlottedLinear,
    wrap_targets,
)
from control.contracts.config import MAX_RANK_ENV

log = logging.getLogger("loraplane.engine")
# The engine's types and the adapter-file types, importable from here as before.
__all__ = ["AdapterBusyError", "AdapterLoadError", "AdapterSource", "DecodeBatch", "Engine",
           "EngineError", "GenerationRequest", "GenerationResult", "HostAdapter",
           "InvalidRequestError", "PreparedAdapter", "Sequence", "UnknownAdapterError"]


class Engine:
    """One base model serving mixed batches of LoRA adapters held in stacked slots."""

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
        # Without the tokenizer's word cache: shared by all tenants, it cannot be salted.
        self._tokenizer: PreTrainedTokenizerBase = uncached_tokenizer(
            AutoTokenizer.from_pretrained(Path(tokenizer_dir), local_files_only=True))
        model = LlamaForCausalLM.from_pretrained(
            Path(base_dir), dtype=dtype, use_safetensors=True, local_files_only=True
        )
        # transformers wraps .to() with a signature mypy misreads
        self._model: LlamaForCausalLM = model.to(self._device).eval()  # type: ignore[arg-type]
        self._context = SlotContext()
        self._table = SlotTable(self.plan.slots)
        self._slotted = self._wrap_targets()  # module name -> its slot banks
        # slot -> the digest whose weights its banks hold (None: zero). Written where the
        # weights are copied in and cleared where they are zeroed, apart from the slot table's
        # bookkeeping: every forward pass reads it for each row (Sequence.observed), so a broken
        # generation check still cannot pass another adapter's answer as this one's.
        self._bank_digest: list[str | None] = [None] * self._table.num_slots
        # The weights themselves, checked on a sample of passes (backend.serving.fingerprint);
        # fingerprint_every: passes between checks (0: none), a test or benchmark may set it.
        self.fingerprints = BankFingerprints(list(self._slotted.values()),
                                             self._table.num_slots, self._device)
        self.fingerprint_every = FINGERPRINT_EVERY
        self._passes = 0
        log.info("%s", self.plan.describe())
        self._modules: dict[str, list[str]] = {}  # digest -> modules it targets
        self._active: dict[int, int] = {}  # slot -> pins held by live sequences

        eos = self._model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if not eos_ids and self._tokenizer.eos_token_id is not None:
            eos_ids.add(self._tokenizer.eos_token_id)
        self._eos_ids = frozenset(int(i) for i in eos_ids)
        pad = self._tokenizer.pad_token_id
        self._pad_id = int(pad if pad is not None else min(self._eos_ids, default=0))

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
        return self._table.capacity

    @property
    def eos_ids(self) -> frozenset[int]:
        return self._eos_ids

    # -- adapters ---------------------------------------------------------------------------

    def read_adapter(self, source: AdapterSource) -> HostAdapter:
        """Parse and validate an adapter on the host; nothing becomes resident.

        ``source`` is a directory, or its files already in memory (relative path -> bytes), as
        the store hands them over after checking those bytes against the digest.
        """
        config = read_config(source)
        if config.rank > self._max_rank:
            raise AdapterLoadError(f"adapter rank {config.rank} exceeds this engine's max_rank "
                                   f"{self._max_rank} ({MAX_RANK_ENV})")
        pairs = validated_pairs(self._model, self._slotted, read_tensors(source), config)
        return HostAdapter(rank=config.rank, scaling=config.scaling, pairs=pairs)

    def prepare(self, adapter: HostAdapter) -> PreparedAdapter:
        """The adapter in the slots' dtype and layout (see :class:`PreparedAdapter`); takes no
        lock, so a cold load's conversion never holds up a decode step."""
        return prepared(adapter, self._dtype, pin=self._device.type == "cuda")

    def place(self, digest: str, adapter: HostAdapter | PreparedAdapter) -> int:
        """Put a validated adapter in a free slot; return its resident device bytes.

        The engine's lock is held only to choose the slot and issue the copies (asynchronous
        from pinned memory on CUDA); a :class:`HostAdapter` is prepared first, outside it.
        """
        prepared = adapter if isinstance(adapter, PreparedAdapter) else self.prepare(adapter)
        with self._lock:
            if self._table.slot_of(digest) is not None:
                return self.resident_adapters()[digest]
            modules = sorted(prepared.pairs)
            wrapped = [self._wrapped(name) for name in modules]
            try:
                slot = self._table.allocate(digest).slot
            except SlotsFull as e:
                raise AdapterLoadError(str(e)) from None
            if self._active.get(slot, 0):
                # A free slot with pins means a lease outlived its load: never reuse it.
                self._table.release(digest)
                self.violations.raise_("pinned_unload", f"slot {slot} is free but pinned")
            with torch.inference_mode():
                for module, name in zip(wrapped, modules, strict=True):
                    at, bt = prepared.pairs[name]
                    module.place(slot, at, bt)
            self._bank_digest[slot] = digest
            self.fingerprints.record(slot)
            self._modules[digest] = modules
            return self._slot_bytes(digest)

    def load_adapter(self, digest: str, adapter_dir: Path) -> int:
        """Make an adapter resident under ``digest``; return its resident bytes.

        Loading a digest that is already resident is a no-op. On any error nothing of the
        adapter stays resident and ``AdapterLoadError`` says what was expected and found.
        """
        with self._lock:
            if self._table.slot_of(digest) is not None:
                return self._slot_bytes(digest)
            return self.place(digest, self.read_adapter(adapter_dir))

    def unload_adapter(self, digest: str) -> None:
        """Drop a resident adapter and zero its slot.

        Raises ``UnknownAdapterError`` if it is not resident and ``AdapterBusyError`` while a
        running sequence still uses it: its slot must not be handed to another adapter mid-way.
        """
        with self._lock:
            slot = self._table.slot_of(digest)
            if slot is None:
                raise UnknownAdapterError(f"adapter not resident: {digest}")
            if self._active.get(slot, 0):
                # The cache unloads only unreferenced adapters, so this is a broken invariant
                # when it comes from the cache; counted either way.
                self.violations.count("pinned_unload", f"slot {slot}")
                raise AdapterBusyError("adapter is serving running sequences")
            for name in self._modules.pop(digest):
                self._wrapped(name).clear(slot)
            self._bank_digest[slot] = None
            self.fingerprints.clear(slot)
            self._table.release(digest)

    def resident_adapters(self) -> dict[str, int]:
        """Resident adapter digests and their bytes on the device."""
        with self._lock:
            return {d: self._slot_bytes(d) for d in self._table.digests()}

    def slot_of(self, digest: str) -> int | None:
        """The slot an adapter occupies, or None."""
        with self._lock:
            return self._table.slot_of(digest)

    def slot_tensors(self, digest: str) -> list[torch.Tensor]:
        """The tensor views an adapter occupies on the device (for byte accounting checks): its
        whole slot, in every target module, whichever modules it changes."""
        with self._lock:
            slot = self._table.slot_of(digest)
            if slot is None:
                return []
            out: list[torch.Tensor] = []
            for m in self._slotted.values():
                out += [m.a[slot], m.b[slot]]
            return out

    def base_tensors(self) -> list[torch.Tensor]:
        """The base model's parameters and buffers (memory accounting)."""
        return [*self._model.parameters(), *self._model.buffers()]

    def bank_tensors(self) -> list[torch.Tensor]:
        """Every slot bank, A and B of every target module (memory accounting)."""
        return [t for m in self._slotted.values() for t in m.banks()]

    def base_slot_is_zero(self) -> bool:
        """Slot 0 (base rows) is all zero in every module: no sentinel reaches an adapter."""
        with self._lock:
            return all(
                not m.a[0].any() and not m.b[0].any()
                for m in self._model.modules() if isinstance(m, SlottedLinear)
            )

    def slot_bytes_for(self, adapter: HostAdapter | PreparedAdapter) -> int:
        """Device bytes ``adapter`` will occupy once placed: one whole slot (the banks are
        allocated in full, so a slot costs the same whatever the adapter targets)."""
        return self.plan.slot_bytes

    def _slot_bytes(self, digest: str) -> int:
        return self.plan.slot_bytes

    def _wrapped(self, name: str) -> SlottedLinear:
        """The ``SlottedLinear`` at ``name`` (only target modules have one)."""
        return self._slotted[name]

    def _wrap_targets(self) -> dict[str, SlottedLinear]:
        """Wrap every target Linear in slot banks for all slots (``slots.wrap_targets``)."""
        try:
            return wrap_targets(self._model, self.plan.shapes, self._context,
                                self._table.num_slots, self._max_rank, self._dtype)
        except ValueError as e:
            raise EngineError(str(e)) from None

    # -- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Prompt token ids: bos, then the prompt's tokens (the kit's prompt format)."""
        # Prompt text spelling "</s>" stays plain bytes: only the bos added here is special.
        ids: list[int] = self._tokenizer(
            prompt, add_special_tokens=False, split_special_tokens=True
        )["input_ids"]
        bos = self._tokenizer.bos_token_id
        return [int(bos), *ids] if bos is not None else list(ids)

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
                self._active[holder.slot] = self._active.get(holder.slot, 0) + 1
                lease.attach(lambda: self._unpin(holder))
            return Sequence(request, ids, lease, holder, self._generator(request))

    def close_sequence(self, seq: Sequence) -> None:
        """Release the sequence's lease (its slot pin, and what else the lease holds)."""
        seq.lease.release()

    def _unpin(self, holder: SlotIdentity) -> None:
        with self._lock:
            left = self._active.get(holder.slot, 0) - 1
            if left < 0:
                self.violations.raise_("negative_pin", f"slot {holder.slot}")
            if left:
                self._active[holder.slot] = left
            else:
                self._active.pop(holder.slot, None)
            if self._table.holder(holder.slot) != holder:
                # The slot was emptied or refilled under a live pin: a row may have been served
                # by other weights. The scheduler checks before every step; this is the backstop.
                self.violations.count("stale_slot", f"slot {holder.slot} at unpin")

    def pins(self) -> dict[int, int]:
        """Slot -> pins held by live sequences (state-machine tests, metrics)."""
        with self._lock:
            return dict(self._active)

    def stale_rows(self, seqs: Sequence_[Sequence]) -> list[int]:
        """Indices of ``seqs`` whose slot no longer holds the load they were admitted on."""
        with self._lock:
            return [i for i, s in enumerate(seqs)
                    if s.holder is not None and self._table.holder(s.holder.slot) != s.holder]

    def slot_identity(self, digest: str) -> SlotIdentity | None:
        """The slot, digest and load generation of a resident adapter, or None."""
        with self._lock:
            return self._table.identity_of(digest)

    def text(self, ids: Sequence_[int]) -> str:
        """Decode generated ids (eos dropped) to text."""
        out = self._tokenizer.decode([t for t in ids if t not in self._eos_ids],
                                     skip_special_tokens=True)
        assert isinstance(out, str)
        return out

    def _prepare_one(self, r: GenerationRequest) -> tuple[list[int], SlotIdentity | None]:
        holder = None
        if r.adapter is not None:
            holder = self._table.identity_of(r.adapter)
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
        with self._lock:
            seqs = self._open_all(requests)
            try:
                if not seqs:
                    return torch.empty((0, self._model.config.vocab_size))
                return self.prefill(seqs).logits.float().cpu()
            finally:
                for s in seqs:
                    self.close_sequence(s)

    def generate(self, requests: Sequence_[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request in one mixed batch, one forward pass per step."""
        with self._lock:
            seqs = self._open_all(requests)
            try:
                batch = self.prefill(seqs) if seqs else None
                while batch is not None:
                    self.choose(batch)
                    batch = self.retain(batch, [i for i, s in enumerate(batch.seqs)
                                                if not s.done])
                    if batch is not None:
                        self.advance(batch)
                return [s.result(self.text(s.produced)) for s in seqs]
            finally:
                for s in seqs:
                    self.close_sequence(s)

    def _open_all(self, requests: Sequence_[GenerationRequest]) -> list[Sequence]:
        for r in requests:  # all or nothing: validate every request before pinning any slot
            self._prepare_one(r)
        return [self.open_sequence(r) for r in requests]

    # -- continuous batching steps ----------------------------------------------------------

    def prefill(self, seqs: list[Sequence],
                cached: dict[int, DecodeBatch] | None = None) -> DecodeBatch:
        """Run the prompts of new sequences (left-padded, one mixed batch) into a DecodeBatch.

        ``cached`` maps an index of ``seqs`` to a one-row batch restored from a prefix cache;
        those rows skip the forward pass.
        """
        cached = cached or {}
        todo = [i for i in range(len(seqs)) if i not in cached]
        with self._lock, torch.inference_mode():
            parts: list[DecodeBatch] = []
            if todo:
                parts.append(self._prefill_rows([seqs[i] for i in todo]))
            order = todo + [i for i in range(len(seqs)) if i in cached]
            for i in order[len(todo):]:
                one = cached[i]
                seqs[i].observed |= one.observed  # what the slot held when it was computed
                parts.append(DecodeBatch([seqs[i]], one.keys, one.values, one.mask,
                                         one.last_pos, one.logits, one.slots))
            merged = parts[0]
            for p in parts[1:]:
                merged = self.merge(merged, p)
            # restore request order
            pos = {i: k for k, i in enumerate(order)}
            out = self._select(merged, [pos[i] for i in range(len(seqs))])
            # slots come from the sequences now, never from what a cached entry was built with
            out.slots = SlotBatch.from_slots([s.slot for s in out.seqs], self._device)
            return out

    def _prefill_rows(self, seqs: list[Sequence]) -> DecodeBatch:
        prompts = [s.prompt_ids for s in seqs]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)  # [batch, width]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
        slots = SlotBatch.from_slots([s.slot for s in seqs], self._device)
        cache = DynamicCache(config=self._model.config)
        logits = self._forward(seqs, slots, ids, mask, positions, cache)
        keys, values = cache_tensors(cache)
        return DecodeBatch(list(seqs), keys, values, mask, positions[:, -1:], logits, slots)

    def _forward(self, seqs: list[Sequence], slots: SlotBatch, ids: torch.Tensor,
                 mask: torch.Tensor, positions: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
        # Provenance backstop: no row's delta is applied from a slot that no longer holds the
        # load the row was admitted on. The scheduler drops such rows before each step; reaching
        # this means a caller skipped that check, so the whole pass is refused.
        if self.stale_rows(seqs):
            self.violations.raise_("stale_slot", "a forward pass over a reloaded slot")
        # What each row's slot holds now, as the banks record it: the pass computes with these
        # weights (the engine's lock keeps them in place until it returns).
        for s in seqs:
            s.observed.add(self._bank_digest[s.slot])
        self._passes += 1
        if self.fingerprint_every and self._passes % self.fingerprint_every == 0:
            self._check_weights(seqs)
        self._context.batch = slots
        try:
            out = self._model(input_ids=ids, attention_mask=mask, position_ids=positions,
                              cache=cache, use_cache=True, logits_to_keep=1)
        finally:
            self._context.batch = None
        logits: torch.Tensor = out.logits[:, -1, :]
        return logits

    def _check_weights(self, seqs: list[Sequence]) -> None:
        """Rows whose slot's weights no longer sum what was placed fail closed (see
        ``backend.serving.fingerprint``)."""
        changed = set(self.fingerprints.changed(s.slot for s in seqs if s.slot))
        for s in seqs:
            if s.slot in changed:
                s.observed.add(WEIGHTS_CHANGED)
        if changed:
            self.violations.count("slot_weights", f"slots {sorted(changed)}")

    def merge(self, a: DecodeBatch, b: DecodeBatch) -> DecodeBatch:
        """One batch holding the rows of both (``backend.serving.batch_ops.merged``)."""
        with self._lock, torch.inference_mode():
            return merged(a, b, self._device)

    def retain(self, batch: DecodeBatch, keep: list[int]) -> DecodeBatch | None:
        """The batch with only rows ``keep``; None when no row is left."""
        if not keep:
            return None
        if keep == list(range(len(batch))):
            return batch
        with self._lock, torch.inference_mode():
            return self._select(batch, keep)

    def _select(self, batch: DecodeBatch, keep: list[int]) -> DecodeBatch:
        return selected(batch, keep, self._device)

    def choose(self, batch: DecodeBatch) -> list[int | None]:
        """Pick each row's next token; mark rows that reached eos or their limit as done.

        A row whose logits are not finite, or whose sampling distribution is not one, fails
        alone (``failure = "numerical"``, done, no token): the other rows go on.
        """
        with torch.inference_mode():
            logits = batch.logits.float()
            finite = torch.isfinite(logits).all(dim=-1).tolist()  # [batch]
            chosen: list[int | None] = [int(t) for t in logits.argmax(dim=-1).tolist()]
            for i, s in enumerate(batch.seqs):
                if not finite[i]:
                    chosen[i] = None
                elif s.generator is not None:
                    chosen[i] = sample(logits[i], s.request.temperature, s.request.top_p,
                                       s.generator)
        for s, token in zip(batch.seqs, chosen, strict=True):
            if token is None:
                s.failure, s.done = "numerical", True
                continue
            s.produced.append(token)
            if token in self._eos_ids or len(s.produced) >= s.request.max_tokens:
                s.done = True
        return chosen

    def advance(self, batch: DecodeBatch) -> None:
        """One decode step: feed each row's last token, extend the KV cache, new logits."""
        with self._lock, torch.inference_mode():
            ids = torch.tensor([[s.produced[-1]] for s in batch.seqs], dtype=torch.long,
                               device=self._device)  # [batch, 1]
            batch.mask = torch.cat([batch.mask, torch.ones_like(batch.mask[:, :1])], dim=1)
            batch.last_pos = batch.last_pos + 1
            cache = DynamicCache(config=self._model.config)
            layers: list[Any] = list(cache.layers)
            for layer, k, v in zip(layers, batch.keys, batch.values, strict=True):
                layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
            batch.logits = self._forward(batch.seqs, batch.slots, ids, batch.mask,
                                         batch.last_pos, cache)
            batch.keys, batch.values = cache_tensors(cache)

    def _generator(self, request: GenerationRequest) -> torch.Generator | None:
        if request.temperature == 0.0:
            return None
        gen = torch.Generator(device=self._device)
        if request.seed is None:
            gen.seed()
        else:
            gen.manual_seed(request.seed)
        return gen
