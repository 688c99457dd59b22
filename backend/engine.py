"""The multi-LoRA serving engine: many adapters on one shared base, in one mixed batch.

Every LoRA-targeted ``nn.Linear`` of the base is wrapped by a ``LoraLinear`` that computes
``base(x) + delta``, where each row of the batch picks its adapter through
``AdapterBatch.adapter_indices``; rows without an adapter get no delta. One forward pass per
decoding step serves every row of every adapter together.

Prompt format (the one the reference kit is trained with, see ``backend.kit``): the raw prompt text
tokenized without special tokens (text spelling one stays plain text), with the tokenizer's bos
token prepended; the continuation
follows directly and stops at eos or ``max_tokens``.

The engine trusts its caller: adapter directories arrive already verified against their digest.
It still validates every tensor against the base, because a verified file can still be wrong.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn
from transformers import AutoTokenizer, DynamicCache, LlamaForCausalLM, PreTrainedConfig
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY_PREFIX = "base_model.model."

# adapter_config.json fields that change what the weights mean; a non-default value is refused
# rather than silently served wrong. field -> values that are fine.
_UNSUPPORTED_FLAGS: dict[str, tuple[Any, ...]] = {
    "use_dora": (False, None),
    "fan_in_fan_out": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layer_replication": (None, []),
    "trainable_token_indices": (None, {}, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "target_parameters": (None, []),
}


class EngineError(Exception):
    """Base class of the engine's errors."""


class AdapterLoadError(EngineError):
    """An adapter cannot be served on this base; nothing of it stays resident."""


class UnknownAdapterError(EngineError, LookupError):
    """A request or an unload names an adapter that is not resident."""


class InvalidRequestError(EngineError, ValueError):
    """A generation request is malformed (limits, sampling parameters)."""


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue, with its adapter (by digest) or ``None`` for the bare base."""

    prompt: str
    adapter: str | None
    max_tokens: int = 16
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0
    seed: int | None = None  # per request, for reproducible sampling


@dataclass(frozen=True)
class GenerationResult:
    """The continuation of one request.

    ``text`` excludes the prompt and the eos token; ``token_ids`` are all generated tokens,
    including the eos that stopped generation, if any; ``tokens_out == len(token_ids)``.
    """

    text: str
    token_ids: list[int]
    tokens_in: int
    tokens_out: int


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's LoRA pair for one linear module."""

    a: torch.Tensor  # [rank, in_features]
    b: torch.Tensor  # [out_features, rank]
    scaling: float


@dataclass(frozen=True)
class AdapterSegment:
    """The rows of a batch that use one adapter slot."""

    slot: int
    rows: torch.Tensor  # [n] long, row indices into the batch


@dataclass(frozen=True)
class AdapterBatch:
    """Which adapter each row of the current forward pass uses."""

    adapter_indices: torch.Tensor  # [batch] long, adapter slot per row, -1 for the bare base
    segments: tuple[AdapterSegment, ...]  # one per distinct adapter slot in the batch

    @classmethod
    def from_slots(cls, slots: Sequence[int], device: torch.device) -> AdapterBatch:
        """Group the rows by slot; base rows (-1) get no segment."""
        segments = tuple(
            AdapterSegment(
                slot=slot,
                rows=torch.tensor(
                    [i for i, s in enumerate(slots) if s == slot], dtype=torch.long, device=device
                ),
            )
            for slot in sorted(set(slots))
            if slot >= 0
        )
        indices = torch.tensor(list(slots), dtype=torch.long, device=device)
        return cls(adapter_indices=indices, segments=segments)


@dataclass
class LoraContext:
    """Shared by every ``LoraLinear``: the batch of the forward pass in progress."""

    batch: AdapterBatch | None = None


def apply_lora_grouped(
    out: torch.Tensor,  # [batch, seq, out_features], updated in place
    x: torch.Tensor,  # [batch, seq, in_features]
    batch: AdapterBatch,
    weights: dict[int, LoraWeights],
) -> None:
    """Add each row's LoRA delta, one gathered matmul pair per adapter in the batch.

    The same arithmetic as PEFT (``B(A(x)) * scaling`` added to the base output), so results match
    it to fp32 rounding. A later backend swaps this for stacked slots and a bgmv kernel.
    """
    for segment in batch.segments:
        w = weights.get(segment.slot)
        if w is None:  # this adapter does not target this module
            continue
        xs = x.index_select(0, segment.rows)  # [n, seq, in_features]
        delta = F.linear(F.linear(xs.to(w.a.dtype), w.a), w.b) * w.scaling  # [n, seq, out]
        out.index_add_(0, segment.rows, delta.to(out.dtype))


class LoraLinear(nn.Module):
    """A base ``nn.Linear`` plus the per-row delta of whichever adapters target it."""

    def __init__(self, base: nn.Linear, context: LoraContext) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.weights: dict[int, LoraWeights] = {}  # adapter slot -> weights

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        batch = self.context.batch
        if batch is not None and self.weights:
            apply_lora_grouped(out, x, batch, self.weights)
        return out


@dataclass
class _Resident:
    slot: int
    nbytes: int
    modules: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _LoraSpec:
    """What adapter_config.json says, validated."""

    rank: int
    scaling: float

    @classmethod
    def from_config(cls, raw: dict[str, Any], max_rank: int) -> _LoraSpec:
        peft_type = raw.get("peft_type")
        if peft_type != "LORA":
            raise AdapterLoadError(f"unsupported adapter type: expected LORA, found {peft_type!r}")
        for name, fine in _UNSUPPORTED_FLAGS.items():
            if name in raw and raw[name] not in fine:
                raise AdapterLoadError(
                    f"unsupported adapter_config.json: {name}={raw[name]!r} "
                    f"(supported: {', '.join(repr(v) for v in fine)})"
                )
        rank, alpha = raw.get("r"), raw.get("lora_alpha")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise AdapterLoadError(
                f"adapter_config.json: r must be a positive integer, found {rank!r}"
            )
        if rank > max_rank:
            raise AdapterLoadError(f"adapter rank {rank} exceeds this engine's max_rank {max_rank}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
            raise AdapterLoadError(
                f"adapter_config.json: lora_alpha must be a number, found {alpha!r}"
            )
        rslora = bool(raw.get("use_rslora", False))
        scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        return cls(rank=rank, scaling=float(scaling))


class Engine:
    """One base model serving mixed batches of LoRA adapters."""

    def __init__(
        self,
        base_dir: Path,
        tokenizer_dir: Path,
        *,
        device: str | None = None,
        dtype: torch.dtype | None = None,
        max_rank: int = 64,
    ) -> None:
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self._device.type == "cuda" else torch.float32
        self._dtype = dtype
        self._max_rank = max_rank
        self._lock = threading.RLock()
        self._tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
            Path(tokenizer_dir), local_files_only=True
        )
        model = LlamaForCausalLM.from_pretrained(
            Path(base_dir), dtype=dtype, use_safetensors=True, local_files_only=True
        )
        # transformers wraps .to() with a signature mypy misreads
        self._model: LlamaForCausalLM = model.to(self._device).eval()  # type: ignore[arg-type]
        self._context = LoraContext()
        self._adapters: dict[str, _Resident] = {}
        self._next_slot = 0

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

    # -- adapters ---------------------------------------------------------------------------

    def load_adapter(self, digest: str, adapter_dir: Path) -> int:
        """Make an adapter resident under ``digest``; return its resident bytes.

        Loading a digest that is already resident is a no-op. On any error nothing of the
        adapter stays resident and ``AdapterLoadError`` says what was expected and found.
        """
        with self._lock:
            if digest in self._adapters:
                return self._adapters[digest].nbytes
            spec = _LoraSpec.from_config(_read_config(Path(adapter_dir)), self._max_rank)
            pairs = self._validated_pairs(_read_tensors(Path(adapter_dir)), spec)

            # Everything is validated: from here on nothing can fail half-way.
            staged = {
                name: LoraWeights(
                    a=a.to(device=self._device, dtype=self._dtype).contiguous(),
                    b=b.to(device=self._device, dtype=self._dtype).contiguous(),
                    scaling=spec.scaling,
                )
                for name, (a, b) in pairs.items()
            }
            slot = self._next_slot
            self._next_slot += 1
            nbytes = 0
            for name, w in staged.items():
                self._wrapped(name).weights[slot] = w
                nbytes += w.a.numel() * w.a.element_size() + w.b.numel() * w.b.element_size()
            self._adapters[digest] = _Resident(slot=slot, nbytes=nbytes, modules=sorted(staged))
            return nbytes

    def unload_adapter(self, digest: str) -> None:
        """Drop a resident adapter; raise ``UnknownAdapterError`` if it is not resident."""
        with self._lock:
            resident = self._adapters.pop(digest, None)
            if resident is None:
                raise UnknownAdapterError(f"adapter not resident: {digest}")
            for name in resident.modules:
                self._wrapped(name).weights.pop(resident.slot, None)

    def resident_adapters(self) -> dict[str, int]:
        """Resident adapter digests and their bytes on the device."""
        with self._lock:
            return {digest: r.nbytes for digest, r in self._adapters.items()}

    def _validated_pairs(
        self, tensors: dict[str, torch.Tensor], spec: _LoraSpec
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Module name -> (A, B), each checked against the base's module and the config."""
        halves: dict[str, dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            if not key.startswith(_KEY_PREFIX) or not key.endswith(
                (".lora_A.weight", ".lora_B.weight")
            ):
                raise AdapterLoadError(
                    f"unsupported tensor {key!r}: expected "
                    f"'{_KEY_PREFIX}<module>.lora_A.weight' or '.lora_B.weight'"
                )
            module, half = key[len(_KEY_PREFIX) :].rsplit(".", 2)[:2]
            halves.setdefault(module, {})[half] = tensor
        if not halves:
            raise AdapterLoadError("adapter has no LoRA tensors")

        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, found in sorted(halves.items()):
            if set(found) != {"lora_A", "lora_B"}:
                raise AdapterLoadError(f"module {module!r}: needs both lora_A and lora_B")
            try:
                target = self._model.get_submodule(module)
            except AttributeError:
                raise AdapterLoadError(f"module {module!r} does not exist in the base") from None
            if not isinstance(target, (nn.Linear, LoraLinear)):
                raise AdapterLoadError(
                    f"module {module!r} is a {type(target).__name__}, expected a Linear layer"
                )
            a, b = found["lora_A"], found["lora_B"]
            want_a = (spec.rank, target.in_features)
            want_b = (target.out_features, spec.rank)
            if tuple(a.shape) != want_a or tuple(b.shape) != want_b:
                raise AdapterLoadError(
                    f"module {module!r}: expected lora_A {list(want_a)} and lora_B "
                    f"{list(want_b)}, found {list(a.shape)} and {list(b.shape)}"
                )
            if not a.is_floating_point() or not b.is_floating_point():
                raise AdapterLoadError(f"module {module!r}: LoRA weights must be floating point")
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                raise AdapterLoadError(f"module {module!r}: LoRA weights are not all finite")
            pairs[module] = (a, b)
        return pairs

    def _wrapped(self, name: str) -> LoraLinear:
        """The ``LoraLinear`` at ``name``, wrapping the plain Linear there on first use."""
        module = self._model.get_submodule(name)
        if isinstance(module, LoraLinear):
            return module
        assert isinstance(module, nn.Linear)
        wrapper = LoraLinear(module, self._context)
        parent_name, _, child = name.rpartition(".")
        setattr(self._model.get_submodule(parent_name), child, wrapper)
        return wrapper

    # -- generation -------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """Prompt token ids: bos, then the prompt's tokens (the kit's prompt format)."""
        # Prompt text spelling "</s>" stays plain bytes: only the bos added here is special.
        ids: list[int] = self._tokenizer(
            prompt, add_special_tokens=False, split_special_tokens=True
        )["input_ids"]
        bos = self._tokenizer.bos_token_id
        return [int(bos), *ids] if bos is not None else list(ids)

    def next_token_logits(self, requests: Sequence[GenerationRequest]) -> torch.Tensor:
        """Logits for the first generated token of each request, in one mixed batch.

        Shape ``[batch, vocab]``, float32. The correctness oracle compares these with PEFT.
        """
        with self._lock, torch.inference_mode():
            prompts, slots = self._prepare(requests)
            if not prompts:
                return torch.empty((0, self._model.config.vocab_size))
            try:
                logits, _, _, _ = self._prefill(prompts, slots)
            finally:
                self._context.batch = None
            return logits.float().cpu()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Continue every request in one mixed batch, one forward pass per step."""
        with self._lock, torch.inference_mode():
            prompts, slots = self._prepare(requests)
            if not prompts:
                return []
            try:
                return self._decode(requests, prompts, slots)
            finally:
                self._context.batch = None

    def validate(self, request: GenerationRequest) -> int:
        """Check one request as ``generate`` would; return its prompt length in tokens.

        Lets a caller refuse one bad request instead of failing the batch it would join.
        Raises ``UnknownAdapterError`` or ``InvalidRequestError``.
        """
        with self._lock:
            ids, _ = self._prepare_one(request)
            return len(ids)

    def _prepare(self, requests: Sequence[GenerationRequest]) -> tuple[list[list[int]], list[int]]:
        """Validate requests; return prompt ids and adapter slots (-1 for base) per row."""
        prepared = [self._prepare_one(r) for r in requests]
        return [ids for ids, _ in prepared], [slot for _, slot in prepared]

    def _prepare_one(self, r: GenerationRequest) -> tuple[list[int], int]:
        if r.adapter is None:
            slot = -1
        elif r.adapter in self._adapters:
            slot = self._adapters[r.adapter].slot
        else:
            raise UnknownAdapterError(f"adapter not resident: {r.adapter}")
        if not isinstance(r.max_tokens, int) or r.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, found {r.max_tokens!r}")
        if not (r.temperature >= 0.0 and math.isfinite(r.temperature)):
            raise InvalidRequestError(f"temperature must be >= 0, found {r.temperature!r}")
        if not 0.0 < r.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], found {r.top_p!r}")
        ids = self.encode(r.prompt)
        limit = int(getattr(self._model.config, "max_position_embeddings", 0) or 0)
        if limit and len(ids) + r.max_tokens > limit:
            raise InvalidRequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({r.max_tokens}) exceeds the "
                f"model's {limit} positions"
            )
        return ids, slot

    def _prefill(
        self, prompts: list[list[int]], slots: list[int]
    ) -> tuple[torch.Tensor, DynamicCache, torch.Tensor, torch.Tensor]:
        """Run the left-padded prompts; return (logits [batch, vocab], cache, mask, positions)."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(self._device), mask.to(self._device)  # [batch, width]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)  # [batch, width]
        self._context.batch = AdapterBatch.from_slots(slots, self._device)
        cache = DynamicCache(config=self._model.config)
        out = self._model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :], cache, mask, positions[:, -1:]

    def _decode(
        self,
        requests: Sequence[GenerationRequest],
        prompts: list[list[int]],
        slots: list[int],
    ) -> list[GenerationResult]:
        logits, cache, mask, last_pos = self._prefill(prompts, slots)
        generators = [self._generator(r) for r in requests]
        produced: list[list[int]] = [[] for _ in requests]
        done = [False] * len(requests)
        for _ in range(max(r.max_tokens for r in requests)):
            next_ids = self._choose(logits.float(), requests, generators, done)  # [batch]
            for i, token in enumerate(next_ids.tolist()):
                if done[i]:
                    continue
                produced[i].append(token)
                if token in self._eos_ids or len(produced[i]) >= requests[i].max_tokens:
                    done[i] = True
            if all(done):
                break
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # [batch, width+t]
            last_pos = last_pos + 1  # [batch, 1]
            out = self._model(
                input_ids=next_ids.unsqueeze(1),
                attention_mask=mask,
                position_ids=last_pos,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            cache = out.cache
            logits = out.logits[:, -1, :]
        return [
            GenerationResult(
                text=self._text([t for t in ids if t not in self._eos_ids]),
                token_ids=ids,
                tokens_in=len(prompt),
                tokens_out=len(ids),
            )
            for ids, prompt in zip(produced, prompts, strict=True)
        ]

    def _text(self, ids: list[int]) -> str:
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        assert isinstance(text, str)
        return text

    def _generator(self, request: GenerationRequest) -> torch.Generator | None:
        if request.temperature == 0.0:
            return None
        gen = torch.Generator(device=self._device)
        if request.seed is None:
            gen.seed()
        else:
            gen.manual_seed(request.seed)
        return gen

    def _choose(
        self,
        logits: torch.Tensor,  # [batch, vocab] float32
        requests: Sequence[GenerationRequest],
        generators: list[torch.Generator | None],
        done: list[bool],
    ) -> torch.Tensor:
        """Next token per row ([batch] long): greedy, or temperature/top-p sampling."""
        chosen = logits.argmax(dim=-1)  # [batch]
        for i, (r, gen) in enumerate(zip(requests, generators, strict=True)):
            if gen is None:
                continue
            if done[i]:
                chosen[i] = self._pad_id
                continue
            chosen[i] = _sample(logits[i], r.temperature, r.top_p, gen)
        return chosen


def _sample(
    logits: torch.Tensor,  # [vocab] float32
    temperature: float,
    top_p: float,
    generator: torch.Generator,
) -> torch.Tensor:
    """One token id (0-dim long) by temperature and nucleus (top-p) sampling."""
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator)[0]


def _read_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise AdapterLoadError(f"adapter has no {ADAPTER_CONFIG}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterLoadError(f"{ADAPTER_CONFIG} is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise AdapterLoadError(f"{ADAPTER_CONFIG} must hold a JSON object")
    return raw


def _read_tensors(adapter_dir: Path) -> dict[str, torch.Tensor]:
    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise AdapterLoadError(f"adapter has no {ADAPTER_WEIGHTS} (only safetensors is served)")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise AdapterLoadError(
            f"{ADAPTER_WEIGHTS} is not a readable safetensors file: {exc}"
        ) from None
