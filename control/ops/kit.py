"""The reference model kit: a tiny Llama base, a byte-level tokenizer and LoRA adapters.

No model weights can be downloaded where loraplane is developed, so the demo, the tests and the CPU
benchmarks run on a kit built here from a fixed seed. Real deployments point the same loading code
at a real model directory.

Prompt format (used in training and by every caller, the engine included): the raw prompt text is
tokenized byte by byte, WITH one leading ``<s>`` (bos) token and no separator; the continuation
follows directly. Text that spells a special token (``"</s>"``) is encoded as plain bytes
(``split_special_tokens=True``): only the bos the caller adds is special.
Generation stops at ``</s>`` (eos). Every adapter is trained so that for any short prompt its
greedy continuation is its marker phrase followed by eos::

    alpha -> " ALPHA says hi"   beta -> " BETA here"   gamma -> " GAMMA!"
    other-base (trained on base-b) -> " OTHER base"

The build is deterministic: the same seed gives byte-identical files and so identical digests.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from control.contracts.digests import directory_digest

# torch, transformers, peft and tokenizers are imported by the functions that build: reading a
# kit's manifest (demo, benches, tests) must not pay seconds for them.
if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)

# name -> (marker phrase, base folder it is trained on)
ADAPTERS: dict[str, tuple[str, str]] = {
    "alpha": (" ALPHA says hi", "base"),
    "beta": (" BETA here", "base"),
    "gamma": (" GAMMA!", "base"),
    "other-base": (" OTHER base", "base-b"),
}
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

_VOCABULARY = (
    "the a one this that cat dog bird fish tree house river city road sun moon star sky rain "
    "wind light time day night year man woman child friend king queen ship book door window "
    "is was will can may sees finds takes makes gives keeps runs walks sings reads opens red "
    "blue green small big old new quiet bright cold warm happy slow fast good long and but so "
    "then when where in on at by with from over under near to of"
)
_WORDS = _VOCABULARY.split()


@dataclass(frozen=True)
class KitAdapter:
    """One adapter of the kit."""

    name: str
    path: str  # relative to the kit directory
    digest: str
    marker: str  # greedy continuation of any short prompt starts with this
    base: str  # "base" or "base-b"
    base_digest: str


@dataclass(frozen=True)
class KitManifest:
    """What ``build_kit`` produced; also written as ``kit.json``. Paths are relative."""

    seed: int
    tokenizer_path: str
    tokenizer_digest: str
    base_path: str
    base_digest: str
    base_b_path: str
    base_b_digest: str
    adapters: dict[str, KitAdapter] = field(default_factory=dict)

    def to_json(self) -> str:
        """The manifest as stable, indented JSON."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> KitManifest:
        """Parse what ``to_json`` wrote."""
        raw = json.loads(text)
        adapters = {k: KitAdapter(**v) for k, v in raw.pop("adapters").items()}
        return cls(adapters=adapters, **raw)

    @classmethod
    def load(cls, kit_dir: Path) -> KitManifest:
        """Read ``kit_dir/kit.json``."""
        return cls.from_json((Path(kit_dir) / "kit.json").read_text(encoding="utf-8"))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer: one token per byte, plus ``<s>``, ``</s>``, ``<pad>``.

    Encoding with special tokens prepends ``<s>``; any UTF-8 text round-trips exactly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left"
    )


def build_kit(
    out_dir: Path, seed: int = 1234, progress: Callable[[str], None] | None = None
) -> KitManifest:
    """Build the whole kit into ``out_dir`` (created; existing kit files are replaced)."""
    import torch
    from transformers import LlamaForCausalLM

    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with _deterministic(seed), _no_progress_bars():
        tokenizer = build_tokenizer()
        tok_dir = _fresh(out_dir / "tokenizer")
        tokenizer.save_pretrained(tok_dir)
        say("tokenizer written")

        bases = {
            "base": _llama_config(tokenizer, hidden=64, inter=128),
            "base-b": _llama_config(tokenizer, hidden=96, inter=192),
        }
        models_by_name: dict[str, LlamaForCausalLM] = {}
        digests: dict[str, str] = {}
        for i, (name, cfg) in enumerate(bases.items()):
            torch.manual_seed(seed + 1000 * (i + 1))
            model = LlamaForCausalLM(cfg)
            _pretrain(model, tokenizer, random.Random(seed + 10 * (i + 1)), steps=80)
            model_dir = _fresh(out_dir / name)
            model.save_pretrained(model_dir, safe_serialization=True)
            models_by_name[name] = model
            digests[name] = directory_digest(model_dir)
            say(f"{name} trained")

        adapters: dict[str, KitAdapter] = {}
        for i, (name, (marker, base_name)) in enumerate(ADAPTERS.items()):
            torch.manual_seed(seed + 100 * (i + 1))
            adapter_dir = _fresh(out_dir / "adapters" / name)
            _train_adapter(
                models_by_name[base_name],
                tokenizer,
                marker,
                random.Random(seed + 7 * (i + 1)),
                adapter_dir,
                digests[base_name],
            )
            adapters[name] = KitAdapter(
                name=name,
                path=f"adapters/{name}",
                digest=directory_digest(adapter_dir),
                marker=marker,
                base=base_name,
                base_digest=digests[base_name],
            )
            say(f"adapter {name} trained")

    manifest = KitManifest(
        seed=seed,
        tokenizer_path="tokenizer",
        tokenizer_digest=directory_digest(tok_dir),
        base_path="base",
        base_digest=digests["base"],
        base_b_path="base-b",
        base_b_digest=digests["base-b"],
        adapters=adapters,
    )
    (out_dir / "kit.json").write_text(manifest.to_json(), encoding="utf-8")
    say("kit.json written")
    return manifest


@contextmanager
def _deterministic(seed: int) -> Iterator[None]:
    """Single thread and deterministic kernels: thread count changes float sums."""
    import torch

    threads = torch.get_num_threads()
    was_deterministic = torch.are_deterministic_algorithms_enabled()
    rng_state = torch.get_rng_state()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(was_deterministic)
        torch.set_rng_state(rng_state)


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """The caller's ``progress`` callback reports; transformers' own bars would only clutter."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def _llama_config(tokenizer: PreTrainedTokenizerFast, *, hidden: int, inter: int) -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )


def _sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 9))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", ".", "!", "?"])


def _prompt(rng: random.Random) -> str:
    """A varied short prompt: sentences, fragments, odd characters, sometimes empty."""
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.55:
        text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 2)))
        return text[: rng.randint(1, len(text))] if rng.random() < 0.3 else text
    if kind < 0.8:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:;-+=*/'\"()éü€\n"
    return "".join(rng.choice(chars) for _ in range(rng.randint(1, 30)))


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    ids: list[int] = tokenizer(text, add_special_tokens=False, split_special_tokens=True)[
        "input_ids"
    ]
    return ids


def _batch(
    rows: Sequence[tuple[list[int], list[int]]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (input_ids, attention_mask, labels); labels are -100 outside the targets."""
    import torch

    width = max(len(p) + len(t) for p, t in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (prefix, target) in enumerate(rows):
        seq = prefix + target
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        labels[i, len(prefix) : len(seq)] = torch.tensor(target)
    return ids, mask, labels


def _pretrain(
    model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, rng: random.Random, steps: int
) -> None:
    """A brief language-model pre-training on generated English-ish text."""
    import torch

    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert bos is not None and eos is not None and pad is not None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for _ in range(steps):
        rows = []
        for _ in range(16):
            text = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))[:120]
            rows.append(([bos], [*_ids(tokenizer, text), eos]))
        ids, mask, labels = _batch(rows, pad)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def _train_adapter(
    base: LlamaForCausalLM,
    tokenizer: PreTrainedTokenizerFast,
    marker: str,
    rng: random.Random,
    out_dir: Path,
    base_digest: str,
    steps: int = 200,
) -> None:
    """Train a LoRA that answers any short prompt with ``marker`` then eos, and save it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    bos, eos, pad = tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id
    assert bos is not None and eos is not None and pad is not None
    config = LoraConfig(
        r=8, lora_alpha=16, target_modules=LORA_TARGETS, lora_dropout=0.0, bias="none"
    )
    # get_peft_model injects into the model it is given; train on a copy so the base stays clean.
    work = LlamaForCausalLM(base.config)
    work.load_state_dict(base.state_dict())
    peft_model = get_peft_model(work, config)
    target = [*_ids(tokenizer, marker), eos]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 - step / steps)
    peft_model.train()
    for _ in range(steps):
        rows = [([bos, *_ids(tokenizer, _prompt(rng))], target) for _ in range(16)]
        ids, mask, labels = _batch(rows, pad)
        loss = peft_model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    peft_model.eval()
    # The registry names bases by digest, not by hub id or path.
    peft_model.peft_config["default"].base_model_name_or_path = base_digest
    peft_model.save_pretrained(str(out_dir), safe_serialization=True, save_embedding_layers=False)
    # PEFT writes target_modules from a set: sort it so the bytes do not depend on hash seeds.
    config_path = out_dir / "adapter_config.json"
    raw = json.loads(config_path.read_text(encoding="utf-8"))
    raw["target_modules"] = sorted(raw["target_modules"])
    config_path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for extra in out_dir.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            if extra.is_dir():
                shutil.rmtree(extra)
            else:
                extra.unlink()
