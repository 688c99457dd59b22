"""Independent references for attribution: what PEFT generates, greedily, for one adapter alone.

The answer's ``adapter_digest`` and the ledger row are the engine's own claims about which
adapter computed the tokens: a check that compares them with the ticket compares the system with
itself. The evidence is the output. The reference is greedy generation by PEFT (not the serving
engine) on the very base, tokenizer and adapter files the deployment stores (each re-hashed
against its digest first), computed in the caller's own process. A replay against the server is
no reference: it can hit the prefix cache that the burst under test just filled.

A reference tells adapters apart only on a prompt where their outputs differ, so
:meth:`AttributionReference.indistinguishable` names, for an adapter and a prompt, the other
adapter (or the bare base) whose reference is the same text: a swap between the two would be
invisible there, and the caller counts that case apart.

The prompt format is the serving contract (``backend.serving.engine``'s docstring): the tokenizer's
bos
token, then the prompt tokenized without special tokens; the continuation stops at eos or
``max_tokens``; eos is dropped and special tokens skipped when decoding. It is restated here on
purpose, not imported: the reference must share no code with the engine it checks. The model runs
in float32 on the CPU, the engine's CPU precision.

torch, transformers and peft are imported only by :func:`load_reference`, so the CLI verbs that do
not serve still never import torch; where they are missing, it raises ``ReferenceUnavailable``
with the reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from control.contracts.store import ArtifactStore

BASE = "base"  # how a reference names the bare base model among adapter digests


class ReferenceUnavailable(Exception):
    """No reference can be computed here; ``reason`` says why (for the report)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AttributionReference:
    """One base model with every adapter of interest loaded beside it, under PEFT."""

    def __init__(self, torch: Any, peft: Any, model: Any, tokenizer: Any) -> None:
        self._torch, self._peft = torch, peft
        self._base = model  # the bare base, until the first adapter wraps it
        self._model: Any = None  # the PeftModel, once an adapter is added
        self._tok = tokenizer
        self._names: dict[str, str] = {}  # adapter digest -> PEFT adapter name
        self._texts: dict[tuple[str, str, int], str] = {}
        eos = model.generation_config.eos_token_id
        ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if not ids and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        self._eos = sorted(int(i) for i in ids)
        pad = tokenizer.pad_token_id
        self._pad = int(pad if pad is not None else (self._eos or [0])[0])

    @property
    def adapters(self) -> list[str]:
        return list(self._names)

    def add_adapter(self, digest: str, adapter_dir: Path) -> None:
        """Load the adapter stored under ``digest`` (already verified) next to the others."""
        if digest in self._names:
            return
        name = f"a{len(self._names)}"  # PEFT names become module keys: no ':' or '.' in them
        if self._model is None:
            self._model = self._peft.PeftModel.from_pretrained(
                self._base, str(adapter_dir), adapter_name=name, is_trainable=False).eval()
        else:
            self._model.load_adapter(str(adapter_dir), adapter_name=name, is_trainable=False)
        self._names[digest] = name

    def generate(self, prompt: str, adapter: str, max_tokens: int) -> str:
        """Greedy text for ``prompt`` on ``adapter`` (a digest added before, or ``BASE``)."""
        key = (prompt, adapter, max_tokens)
        if key not in self._texts:
            self._texts[key] = self._generate(prompt, adapter, max_tokens)
        return self._texts[key]

    def indistinguishable(self, prompt: str, adapter: str, max_tokens: int) -> str | None:
        """The other adapter digest (or ``BASE``) whose reference equals ``adapter``'s on
        ``prompt``, or None when every other reference differs."""
        mine = self.generate(prompt, adapter, max_tokens)
        for other in [BASE, *self._names]:
            if other != adapter and self.generate(prompt, other, max_tokens) == mine:
                return other
        return None

    def _generate(self, prompt: str, adapter: str, max_tokens: int) -> str:
        torch, tok = self._torch, self._tok
        ids = tok(prompt, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        bos = tok.bos_token_id
        input_ids = torch.tensor([[*([bos] if bos is not None else []), *ids]])
        kw = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  do_sample=False, max_new_tokens=max_tokens, eos_token_id=self._eos,
                  pad_token_id=self._pad)
        with torch.inference_mode():
            if adapter == BASE:
                if self._model is None:
                    out = self._base.generate(**kw)
                else:
                    with self._model.disable_adapter():
                        out = self._model.generate(**kw)
            else:
                self._model.set_adapter(self._names[adapter])
                out = self._model.generate(**kw)
        new = [int(t) for t in out[0, input_ids.shape[1]:].tolist()]
        for e in self._eos:  # stop at the first eos, as the engine does
            if e in new:
                new = new[: new.index(e)]
        return str(tok.decode(new, skip_special_tokens=True))


def load_reference(store: ArtifactStore, base_digest: str, tokenizer_digest: str,
                   adapters: Iterable[str] = ()) -> AttributionReference:
    """A reference over the stored base and tokenizer, with ``adapters`` (digests) loaded.

    Raises ``ReferenceUnavailable`` when PEFT cannot be imported or a stored artifact cannot be
    read or no longer matches its digest.
    """
    try:
        import peft
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except Exception as e:  # ImportError, or a broken install failing at import time
        raise ReferenceUnavailable(f"PEFT not importable ({type(e).__name__}: {e})"[:200]) from None
    try:
        base_dir = store.verify(base_digest)
        tok_dir = store.verify(tokenizer_digest)
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            str(base_dir), dtype=torch.float32, use_safetensors=True, local_files_only=True)
    except Exception as e:
        raise ReferenceUnavailable(
            f"the stored base or tokenizer cannot be loaded ({type(e).__name__})") from None
    ref = AttributionReference(torch, peft, model.eval(), tokenizer)
    add_adapters(ref, store, adapters)
    return ref


def add_adapters(ref: AttributionReference, store: ArtifactStore,
                 adapters: Iterable[str]) -> None:
    """Load each stored adapter (re-hashed against its digest) into ``ref``."""
    for digest in adapters:
        try:
            ref.add_adapter(digest, store.verify(digest))
        except Exception as e:
            raise ReferenceUnavailable(
                f"a stored adapter cannot be loaded into PEFT ({type(e).__name__})") from None
