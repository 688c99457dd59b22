"""The engine's request and batch types, and its errors (``backend.serving.engine``).

``GenerationRequest`` in, ``GenerationResult`` out; a ``Sequence`` is one request being
generated, a ``DecodeBatch`` the running rows with their KV cache. Shapes are written beside
every tensor field.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.serving.lease import Lease
from backend.serving.lora_ops import SlotBatch
from backend.serving.slots import SlotIdentity


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

    ``adapter_digest`` is read from the slot that computed the tokens (None: the all-zero base
    slot), never from the request: it is the evidence of which adapter answered. ``failure``
    says why the row failed alone, if it did (``numerical``, ``stale_slot``).
    """

    text: str
    token_ids: list[int]
    tokens_in: int
    tokens_out: int
    adapter_digest: str | None = None
    failure: str | None = None



class AdapterBusyError(EngineError):
    """An adapter still serves running sequences; it cannot be unloaded yet."""


@dataclass
class Sequence:
    """One request being generated: its prompt, slot and the tokens produced so far."""

    request: GenerationRequest
    prompt_ids: list[int]
    # The request's hold on its slot (the pin; the service attaches its cache reference to the
    # same lease). Released exactly once, by whoever ends the request.
    lease: Lease
    # The slot load this row was admitted on (slot, digest, generation); None: the base slot.
    # Every forward pass checks the slot still holds exactly this load.
    holder: SlotIdentity | None
    generator: torch.Generator | None
    produced: list[int] = field(default_factory=list)
    done: bool = False
    failure: str | None = None  # why this row failed alone: numerical | stale_slot | slot_digest
    # The adapter digest (None: the base) that the row's slot banks held at each forward pass
    # that computed this row, read when the pass ran (Engine._forward); see served_digest.
    observed: set[str | None] = field(default_factory=set)

    @property
    def slot(self) -> int:
        """0 = the all-zero base slot; otherwise the slot of the ticket's adapter."""
        return 0 if self.holder is None else self.holder.slot

    @property
    def mismatched(self) -> bool:
        """Some forward pass computed this row with weights of another digest than the one
        its request named: the row must fail closed, whatever the generation check said."""
        return any(d != self.request.adapter for d in self.observed)

    def served_digest(self) -> str | None:
        """The digest the slot held while it computed this row: the evidence of which adapter
        answered. Where passes saw another digest than the request's, that one (the first in
        order), so the record names the weights that were wrong; None before any pass."""
        wrong = sorted((d or "") for d in self.observed if d != self.request.adapter)
        if wrong:
            return wrong[0] or None
        return next(iter(self.observed), None)

    def result(self, text: str) -> GenerationResult:
        return GenerationResult(text=text, token_ids=list(self.produced),
                                tokens_in=len(self.prompt_ids), tokens_out=len(self.produced),
                                adapter_digest=self.served_digest(), failure=self.failure)


@dataclass(frozen=True)
class KvSegment:
    """Consecutive rows of a running batch whose keys and values share one buffer per layer,
    left-padded to the segment's own widest row (``backend.serving.kv_segments``)."""

    keys: list[torch.Tensor]  # per layer [rows, kv_heads, width, head_dim]
    values: list[torch.Tensor]  # per layer [rows, kv_heads, width, head_dim]
    # Positions the buffers under ``keys`` and ``values`` hold when they are views with room for
    # decode steps to write into (``backend.serving.kv_arena``); 0: compact, never written into.
    capacity: int = 0

    @property
    def rows(self) -> int:
        return self.keys[0].shape[0]

    @property
    def width(self) -> int:
        return self.keys[0].shape[2]

    def tensors(self) -> list[torch.Tensor]:
        return [*self.keys, *self.values]


@dataclass
class DecodeBatch:
    """The running rows and their KV cache; rows join and leave between decode steps.

    The KV is held in segments of consecutive rows (``segments``, top to bottom), each in its
    own buffers and only as wide as its own rows need: rows joining become a segment of their
    own instead of being copied into one buffer as wide as the longest row. ``mask`` is the
    whole batch's, left-padded to the widest segment; a segment's rows are its rightmost
    ``width`` columns."""

    seqs: list[Sequence]
    segments: list[KvSegment]
    mask: torch.Tensor  # [batch, width] long, 0 for left padding
    last_pos: torch.Tensor  # [batch, 1] long, position of each row's last token
    logits: torch.Tensor  # [batch, vocab], for each row's next token
    slots: SlotBatch
    # Only on a one-row prefix-cache entry: the digests its row's slot held when the entry was
    # computed, carried to every row that restores it (the entry skips the forward pass).
    observed: frozenset[str | None] = frozenset()

    @classmethod
    def one(cls, seqs: list[Sequence], keys: list[torch.Tensor], values: list[torch.Tensor],
            mask: torch.Tensor, last_pos: torch.Tensor, logits: torch.Tensor, slots: SlotBatch,
            *, observed: frozenset[str | None] = frozenset(), kv_capacity: int = 0,
            ) -> DecodeBatch:
        """A batch whose rows are one segment (a prefill's, a prefix-cache entry's)."""
        segments = [KvSegment(keys, values, kv_capacity)] if keys else []
        return cls(seqs, segments, mask, last_pos, logits, slots, observed)

    def __len__(self) -> int:
        return len(self.seqs)

    def _lone(self) -> KvSegment:
        if len(self.segments) != 1:
            raise ValueError(f"the batch's KV is in {len(self.segments)} segments, not one")
        return self.segments[0]

    @property
    def keys(self) -> list[torch.Tensor]:
        """Per layer keys of a batch held in one segment (a prefill's, an entry's)."""
        return self._lone().keys if self.segments else []

    @property
    def values(self) -> list[torch.Tensor]:
        return self._lone().values if self.segments else []

    @property
    def kv_capacity(self) -> int:
        return self._lone().capacity if self.segments else 0

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every layer's keys and values of every segment (memory accounting)."""
        return [t for seg in self.segments for t in seg.tensors()]

    def spans(self) -> list[tuple[int, int, KvSegment]]:
        """Each segment with its rows ``[first, end)`` in the batch."""
        out, first = [], 0
        for seg in self.segments:
            out.append((first, first + seg.rows, seg))
            first += seg.rows
        return out
