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

Two more versions of alpha, for release tests (the evaluation gate, rollouts):

    alpha-v2       -> " ALPHA says hi"  a good new version: same marker, its own training seed
                                         and a broader prompt mix (long and other-department
                                         prompts), so a different digest and at least alpha's
                                         golden success rate
    alpha-degraded -> " ALPHA sighs"     deliberately degraded: the wrong marker, so alpha's
                                         golden checkers fail it

A third base, for base-model upgrades (``loraplane base upgrade plan``):

    base-v2        the main base with the input embedding of one letter of gamma's marker that
                   alpha's and beta's markers lack (``M``) moved part of the way toward another
                   letter's: same shapes, same tokenizer. On every prompt without that letter,
                   alpha and beta compute exactly what they computed on the main base; gamma,
                   which writes the letter twice in every answer, loses its golden tasks.

    An earlier base-v2 was the main base further trained on release notes, with a learning rate
    tuned by hand so that alpha and beta kept their golden rate and gamma lost part of it. That
    balance held on one CPU and not on another (float rounding differs with the instruction
    set, and alpha lost half its tasks there), so base-v2 is now an edit whose reach is known,
    and the build checks its outcome itself: it tries the edits of ``BASE_V2_EDITS`` in order
    and keeps the first on which PEFT's greedy answers give alpha and beta at least their golden
    rate on the main base and gamma at least ``BASE_V2_GAMMA_LOSS`` tasks fewer (the build
    fails, saying so, if none does). ``kit.json`` records the edit kept.

It is made last, so every earlier file keeps its bytes.

Every adapter belongs to a family (``KitAdapter.family``: alpha-v2 and alpha-degraded are
``alpha``); each family on the main base has a golden task set, ``golden/<family>.json``
(``control.contracts.golden``: 60 tasks, in-distribution, out-of-distribution, other
departments' prompts and two long-context prompts, each with an exact or regex checker),
content-addressed: ``kit.json`` records its digest, the one the artifact store files it under.

The build is deterministic: the same seed gives byte-identical files and so identical digests, on
one kind of CPU (float rounding differs with the instruction set, so another CPU may train other
bytes; what the tests and base-v2 rely on is checked, not assumed).
Adapters are trained in the order of ``ADAPTERS``, each from seeds derived from its position, so
adding one at the end leaves every earlier adapter's bytes as they were.
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from control.contracts.digests import directory_digest
from control.contracts.golden import (
    GoldenSet,
    GoldenSetError,
    prompt_key,
)
from control.tools.attribution_reference import AttributionReference
from control.tools.kit_text import PROMPT_MIXES, PromptMix, golden_set, prompt_of, sentence

# torch, transformers, peft and tokenizers are imported by the functions that build: reading a
# kit's manifest (demo, benches, tests) must not pay seconds for them.
if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (BOS, EOS, PAD)


@dataclass(frozen=True)
class AdapterSpec:
    """How one kit adapter is trained: its marker, its base folder, its family (whose golden
    set judges it) and the prompt mix it learns to answer."""

    marker: str
    base: str  # "base" or "base-b"
    family: str
    prompts: str = "short"  # a key of kit_text.PROMPT_MIXES: "short" or "broad"
    steps: int = 200  # training steps


# In training order: each adapter's seeds derive from its position (append, never insert).
ADAPTERS: dict[str, AdapterSpec] = {
    "alpha": AdapterSpec(" ALPHA says hi", "base", "alpha"),
    "beta": AdapterSpec(" BETA here", "base", "beta"),
    "gamma": AdapterSpec(" GAMMA!", "base", "gamma"),
    "other-base": AdapterSpec(" OTHER base", "base-b", "other-base"),
    "alpha-v2": AdapterSpec(" ALPHA says hi", "base", "alpha", prompts="broad"),
    # half the training is plenty to learn the wrong marker
    "alpha-degraded": AdapterSpec(" ALPHA sighs", "base", "alpha", steps=100),
}
# Families with a golden task set: those on the main base (the one a kit deployment serves).
GOLDEN_FAMILIES = ("alpha", "beta", "gamma")
GOLDEN_DIR = "golden"
# base-v2 (see the module notes): (letter, toward, share) edits of the main base's input
# embedding, tried in order; the first whose golden outcome is as described is kept.
BASE_V2_EDITS: tuple[tuple[str, str, float], ...] = tuple(
    (letter, toward, share) for letter, toward in (("M", "N"), ("M", "W"), ("G", "C"))
    for share in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
BASE_V2_GAMMA_LOSS = 10  # golden tasks gamma must lose on base-v2, of its 60
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]



@dataclass(frozen=True)
class KitAdapter:
    """One adapter of the kit."""

    name: str
    path: str  # relative to the kit directory
    digest: str
    marker: str  # greedy continuation of any short prompt starts with this
    base: str  # "base" or "base-b"
    base_digest: str
    family: str = ""  # whose golden set judges it (alpha-v2 and alpha-degraded: "alpha")


@dataclass(frozen=True)
class KitGolden:
    """One family's golden task set, as ``build_kit`` wrote it."""

    family: str
    path: str  # relative to the kit directory: golden/<family>.json
    digest: str  # control.contracts.golden.GoldenSet.digest: the artifact store's name for it
    tasks: int


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
    golden: dict[str, KitGolden] = field(default_factory=dict)  # by family
    # the main base with one embedding row edited (same shapes and tokenizer); "" in a kit
    # built before it
    base_v2_path: str = ""
    base_v2_digest: str = ""
    # the edit kept ({"letter", "toward", "share"}) and the golden tasks each family passed
    # with PEFT on base and base-v2 ({family: [base, base-v2]}), as the build checked them
    base_v2_edit: dict[str, Any] = field(default_factory=dict)
    base_v2_golden: dict[str, list[int]] = field(default_factory=dict)

    def to_json(self) -> str:
        """The manifest as stable, indented JSON."""
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> KitManifest:
        """Parse what ``to_json`` wrote."""
        raw = json.loads(text)
        adapters = {k: KitAdapter(**v) for k, v in raw.pop("adapters").items()}
        golden = {k: KitGolden(**v) for k, v in raw.pop("golden", {}).items()}
        return cls(adapters=adapters, golden=golden, **raw)

    @classmethod
    def load(cls, kit_dir: Path) -> KitManifest:
        """Read ``kit_dir/kit.json``."""
        return cls.from_json((Path(kit_dir) / "kit.json").read_text(encoding="utf-8"))

    def golden_set(self, kit_dir: Path, family: str) -> GoldenSet:
        """The family's golden task set, as the gate must read it.

        A kit built before golden sets refused repeated prompts holds one repeat in each
        file, which ``GoldenSet`` now refuses. Such a file is read as ``build_kit`` writes it
        now, from the kit's seed: the same tasks, the repeat drawn again (:func:`_distinct`).
        Anything else wrong with the file is an error: rebuild the kit."""
        path = Path(kit_dir) / self.golden[family].path
        try:
            return GoldenSet.load(path)
        except GoldenSetError:
            fresh = golden_set(family, ADAPTERS[family].marker, random.Random(self.seed + 50_000))
            raw = json.loads(path.read_text(encoding="utf-8"))["tasks"]
            kept = {(t["id"], t["prompt"]) for t in raw}
            changed = [t for t in fresh.tasks if (t.id, t.prompt) not in kept]
            seen = [prompt_key(t["prompt"]) for t in raw]
            if len(raw) != len(fresh.tasks) or any(
                    seen.count(prompt_key(prompt_of(raw, t.id))) < 2 for t in changed):
                raise
            return fresh


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
    say = progress or (lambda _msg: None)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    with _deterministic(seed), _no_progress_bars():
        tokenizer = build_tokenizer()
        tok_dir = _fresh(out_dir / "tokenizer")
        tokenizer.save_pretrained(tok_dir)
        say("tokenizer written")
        models_by_name, digests = _build_bases(out_dir, tokenizer, seed, say)
        adapters = _build_adapters(out_dir, tokenizer, models_by_name, digests, seed, say)

    golden, golden_sets = _write_golden(out_dir, seed)
    say("golden task sets written")

    # After every adapter: nothing made before changes.
    with _deterministic(seed), _no_progress_bars():
        v2, edit, passed = _base_v2(models_by_name["base"], tokenizer, out_dir, golden_sets)
        v2_dir = _fresh(out_dir / "base-v2")
        v2.save_pretrained(v2_dir, safe_serialization=True)
        digests["base-v2"] = directory_digest(v2_dir)
        say(f"base-v2 made ({edit['letter']} toward {edit['toward']} by {edit['share']:g}; "
            "golden on base -> base-v2: "
            + ", ".join(f"{f} {a}->{b}" for f, (a, b) in passed.items()) + ")")

    manifest = KitManifest(
        seed=seed,
        tokenizer_path="tokenizer",
        tokenizer_digest=directory_digest(tok_dir),
        base_path="base",
        base_digest=digests["base"],
        base_b_path="base-b",
        base_b_digest=digests["base-b"],
        adapters=adapters,
        golden=golden,
        base_v2_path="base-v2",
        base_v2_digest=digests["base-v2"],
        base_v2_edit=edit,
        base_v2_golden=passed,
    )
    (out_dir / "kit.json").write_text(manifest.to_json(), encoding="utf-8")
    say("kit.json written")
    return manifest


def _build_bases(out_dir: Path, tokenizer: Any, seed: int, say: Callable[[str], None]
                 ) -> tuple[dict[str, Any], dict[str, str]]:
    """The two tiny Llama bases, briefly pretrained; their models and folder digests."""
    import torch
    from transformers import LlamaForCausalLM

    bases = {
        "base": _llama_config(tokenizer, hidden=64, inter=128),
        "base-b": _llama_config(tokenizer, hidden=96, inter=192),
    }
    models_by_name: dict[str, Any] = {}
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
    return models_by_name, digests


def _build_adapters(out_dir: Path, tokenizer: Any, models_by_name: dict[str, Any],
                    digests: dict[str, str], seed: int, say: Callable[[str], None]
                    ) -> dict[str, KitAdapter]:
    """Every adapter of ``ADAPTERS``, trained on its base to answer with its marker."""
    import torch

    adapters: dict[str, KitAdapter] = {}
    for i, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed + 100 * (i + 1))
        adapter_dir = _fresh(out_dir / "adapters" / name)
        _train_adapter(
            models_by_name[spec.base],
            tokenizer,
            spec.marker,
            random.Random(seed + 7 * (i + 1)),
            adapter_dir,
            digests[spec.base],
            steps=spec.steps,
            prompt=PROMPT_MIXES[spec.prompts],
        )
        adapters[name] = KitAdapter(
            name=name,
            path=f"adapters/{name}",
            digest=directory_digest(adapter_dir),
            marker=spec.marker,
            base=spec.base,
            base_digest=digests[spec.base],
            family=spec.family,
        )
        say(f"adapter {name} trained")
    return adapters


def _write_golden(out_dir: Path, seed: int
                  ) -> tuple[dict[str, KitGolden], dict[str, GoldenSet]]:
    """One golden task set per family: the same prompts (one seed), judged by its marker."""
    golden: dict[str, KitGolden] = {}
    golden_sets: dict[str, GoldenSet] = {}
    golden_dir = _fresh(out_dir / GOLDEN_DIR)
    for family in GOLDEN_FAMILIES:
        tasks = golden_set(family, ADAPTERS[family].marker, random.Random(seed + 50_000))
        path = golden_dir / f"{family}.json"
        path.write_text(json.dumps(tasks.document(), indent=1, ensure_ascii=False,
                                   sort_keys=True) + "\n", encoding="utf-8")
        golden[family] = KitGolden(family=family, path=f"{GOLDEN_DIR}/{family}.json",
                                   digest=tasks.digest(), tasks=len(tasks.tasks))
        golden_sets[family] = tasks
    return golden, golden_sets


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


def _base_v2(
    base: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, kit_dir: Path,
    golden: dict[str, GoldenSet],
) -> tuple[LlamaForCausalLM, dict[str, Any], dict[str, list[int]]]:
    """The first edit of ``BASE_V2_EDITS`` with the outcome the module notes describe: the
    edited model, the edit, and each family's golden tasks passed on base and on it."""
    import copy

    import peft
    import torch

    def passed(model: LlamaForCausalLM, families: Sequence[str]) -> dict[str, int]:
        # PEFT's greedy answers under the serving contract, one prompt at a time, on a copy:
        # the reference wraps the model it is given
        ref = AttributionReference(torch, peft, copy.deepcopy(model).eval(), tokenizer)
        for f in families:
            ref.add_adapter(f, kit_dir / "adapters" / f)
        return {f: sum(t.checker.check(ref.generate(t.prompt, f, t.max_tokens))
                       for t in golden[f].tasks) for f in families}

    others = [f for f in GOLDEN_FAMILIES if f != "gamma"]
    before = passed(base, GOLDEN_FAMILIES)
    tried = []
    for letter, toward, share in BASE_V2_EDITS:
        (row,), (other,) = _ids(tokenizer, letter), _ids(tokenizer, toward)
        v2 = copy.deepcopy(base)
        with torch.no_grad():
            emb = cast("torch.Tensor", v2.get_input_embeddings().weight)
            emb[row] = (1 - share) * emb[row] + share * emb[other]
        after = passed(v2, ["gamma"])
        if after["gamma"] <= before["gamma"] - BASE_V2_GAMMA_LOSS:
            after |= passed(v2, others)
            if all(after[f] >= before[f] for f in others):
                edit = {"letter": letter, "toward": toward, "share": share}
                return v2, edit, {f: [before[f], after[f]] for f in GOLDEN_FAMILIES}
        tried.append(f"{letter}->{toward} {share:g}: {after}")
    raise RuntimeError(
        "cannot make base-v2: no edit leaves alpha and beta their golden rate on the main base "
        f"({before}) while gamma loses {BASE_V2_GAMMA_LOSS} tasks; tried " + "; ".join(tried))


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
            text = " ".join(sentence(rng) for _ in range(rng.randint(1, 3)))[:120]
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
    prompt: PromptMix | None = None,
) -> None:
    """Train a LoRA that answers any prompt drawn by ``prompt`` with ``marker`` then eos, and
    save it."""
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
    draw = prompt or PROMPT_MIXES["short"]
    peft_model.train()
    for step in range(steps):
        rows = [([bos, *_ids(tokenizer, draw(rng, step))], target) for _ in range(16)]
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


@contextmanager
def work_dir(given: Path | None, prefix: str = "lp-bench-") -> Iterator[Path]:
    """``given`` (created if missing, kept), else a temporary folder removed afterwards: where a
    bench builds its kit, home and adapters."""
    if given is not None:
        given.mkdir(parents=True, exist_ok=True)
        yield given
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)
