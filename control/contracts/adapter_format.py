"""The adapter format loraplane serves: which PEFT LoRA adapters it accepts, and how their
tensors are named.

Two places refuse an adapter: registration (``control.app.validation``, before anything is
stored) and the engine (``backend.serving.engine``, when it loads one, even one that never went
through registration). They must agree, and once did not: the engine's own copy of the
unsupported features lacked ``layers_to_transform`` and ``layers_pattern``, so it would have
served such an adapter on every layer. So the rules live here, once. Here and not in
``backend.serving``: the layers put ``control.app`` below ``backend.serving``, so registration
may not import the engine's package, and ``backend.serving`` may import only
``control.contracts`` from ``control``. ``control.contracts`` is the one part both may import.

The rules:

- ``adapter_config.json`` is strict JSON (no duplicate keys, no NaN or Infinity: two parsers
  could disagree on what it says) holding an object of at most ``MAX_CONFIG_BYTES``, with
  ``peft_type`` ``"LORA"``, an integer rank ``r > 0``, a finite positive ``lora_alpha``,
  non-empty ``target_modules`` and a boolean ``use_rslora`` if any (it changes the scaling).
- Every feature in ``UNSUPPORTED_FEATURES`` is absent or set to a value meaning "off": the
  engine implements plain LoRA only, and an adapter that needs more is refused rather than
  served wrong. Values are compared by type too (``0`` is not ``false``).
- Every tensor is ``base_model.model.<module>.lora_A.weight`` or ``.lora_B.weight`` (PEFT's
  names), and every module has both.

:class:`LoraConfig` is the parsed config: a frozen dataclass that validates on construction.
Failures raise :class:`AdapterFormatError`, whose message says what was expected and what was
found; a found value is shown only when it is a number, a boolean or a short plain word, so a
message never carries a path or another tenant's text.

No torch, transformers or peft here: CLI verbs import registration validation and must start
fast.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal, TypeVar, cast

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
TENSOR_PREFIX = "base_model.model."

# adapter_config.json features the engine does not implement -> the values that mean "off".
UNSUPPORTED_FEATURES: Mapping[str, tuple[object, ...]] = MappingProxyType({
    "use_dora": (False, None),  # DoRA: a magnitude vector beside A and B
    "fan_in_fan_out": (False, None),  # weights stored transposed (Conv1D bases)
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, []),  # whole modules replaced, not a low-rank delta
    "rank_pattern": ({}, None),  # per-module ranks and alphas: one rank and one scaling here
    "alpha_pattern": ({}, None),
    "layer_replication": (None, []),
    # Only some layers adapted: the engine would apply the delta on every layer it has a
    # tensor for, so both are refused rather than trusted.
    "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""),
    "trainable_token_indices": (None, {}, []),
    "alora_invocation_tokens": (None, []),
    "use_qalora": (False, None),
    "use_bdlora": (False, None),
    "target_parameters": (None, []),
})

Matrix = Literal["A", "B"]
T = TypeVar("T")

_TENSOR_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<matrix>[AB])\.weight")
_LAYER = re.compile(r"(?:^|\.)layers\.(?P<index>\d+)\.")
_PLAIN_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,31}")


class AdapterFormatError(ValueError):
    """An adapter is not in the format loraplane serves; the message says what was expected and
    what was found."""


def strict_json(raw: bytes | str) -> object:
    """JSON as RFC 8259 has it: no duplicate keys, no NaN/Infinity; ValueError otherwise."""
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constants)
    except RecursionError:  # deeply nested input
        raise ValueError("JSON nested too deeply") from None


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key")  # two parsers could disagree on which value wins
    return out


def _no_constants(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


def shown(value: object) -> str:
    """``value`` as an error message may show it: JSON for numbers, booleans, null and short
    plain words; only its kind for anything else (a path, free text, a list, an object)."""
    if value is None or isinstance(value, (bool, int, float)):
        text = json.dumps(value)
        return text if len(text) <= 32 else "a number too long to show"
    if isinstance(value, str):
        return json.dumps(value) if _PLAIN_WORD.fullmatch(value) else "another string"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {len(value)}"
    if isinstance(value, dict):
        return "an empty object" if not value else f"an object of {len(value)} keys"
    return type(value).__name__


def _finite_positive(x: object) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        as_float = float(x)  # an integer too large for a float has no usable scaling
    except OverflowError:
        return False
    return math.isfinite(as_float) and as_float > 0


def _same(a: object, b: object) -> bool:
    # False == 0 in Python; a config value must match in type too.
    return type(a) is type(b) and a == b


@dataclass(frozen=True)
class LoraConfig:
    """A PEFT LoRA ``adapter_config.json`` that loraplane can serve, validated on construction.

    ``target_modules`` is sorted and without duplicates; a single name in the file counts as a
    list of one.
    """

    rank: int  # r
    alpha: float  # lora_alpha
    target_modules: tuple[str, ...]
    use_rslora: bool = False

    def __post_init__(self) -> None:
        """Refuse what the engine cannot serve, naming the field, the expectation and the
        value found."""
        rank, alpha, targets = self.rank, self.alpha, self.target_modules
        if not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0:
            raise AdapterFormatError(f"r must be an integer greater than 0, found {shown(rank)}")
        if not _finite_positive(alpha):
            raise AdapterFormatError(
                f"lora_alpha must be a finite positive number, found {shown(alpha)}")
        if (not isinstance(targets, tuple) or not targets
                or not all(isinstance(t, str) and t for t in targets)):
            raise AdapterFormatError("target_modules must be a non-empty list of module names, "
                                     f"found {shown(_as_json(targets))}")
        if not isinstance(self.use_rslora, bool):
            raise AdapterFormatError(
                f"use_rslora must be true or false, found {shown(self.use_rslora)}")

    @property
    def scaling(self) -> float:
        """The factor on ``B @ A``: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA (PEFT's)."""
        return float(self.alpha / math.sqrt(self.rank) if self.use_rslora
                     else self.alpha / self.rank)

    @classmethod
    def from_dict(cls, config: Mapping[str, object]) -> LoraConfig:
        """Parse a decoded ``adapter_config.json``; AdapterFormatError if it cannot be served.

        Checked in this order: ``peft_type``, the fields (``r``, ``lora_alpha``,
        ``target_modules``, ``use_rslora``), then every unsupported feature.
        """
        if config.get("peft_type") != "LORA":
            raise AdapterFormatError(
                f"peft_type must be LORA, found {shown(config.get('peft_type'))}")
        targets = config.get("target_modules")
        if isinstance(targets, str):
            targets = [targets]
        if isinstance(targets, list) and all(isinstance(t, str) for t in targets):
            targets = tuple(sorted(set(targets)))
        rslora = config.get("use_rslora")
        # The types are checked by __post_init__, which names the field and the value found.
        parsed = cls(rank=cast(int, config.get("r")), alpha=cast(float, config.get("lora_alpha")),
                     target_modules=cast(tuple[str, ...], targets),
                     use_rslora=False if rslora is None else cast(bool, rslora))
        for key, off in UNSUPPORTED_FEATURES.items():
            if key in config and not any(_same(config[key], v) for v in off):
                raise AdapterFormatError(
                    f"{key} is not supported: expected {' or '.join(json.dumps(v) for v in off)}"
                    f", found {shown(config[key])}")
        return parsed

    @classmethod
    def from_json(cls, raw: bytes) -> LoraConfig:
        """Parse the bytes of ``adapter_config.json`` (strict JSON, a bounded object)."""
        return cls.from_dict(parse_config(raw))


def parse_config(raw: bytes) -> dict[str, object]:
    """The JSON object in ``adapter_config.json``'s bytes, parsed strictly (see strict_json)."""
    if len(raw) > MAX_CONFIG_BYTES:
        raise AdapterFormatError(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = strict_json(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise AdapterFormatError(f"{CONFIG_FILE} is not valid JSON (duplicate keys, NaN and "
                                 "Infinity are refused)") from None
    if not isinstance(config, dict):
        raise AdapterFormatError(f"{CONFIG_FILE} must hold a JSON object, found {shown(config)}")
    return config


def _as_json(value: object) -> object:
    # A tuple reached __post_init__ only through from_dict, from a JSON list: show it as one.
    return list(value) if isinstance(value, tuple) else value


@dataclass(frozen=True)
class LoraTensor:
    """Where one tensor of ``adapter_model.safetensors`` belongs: a module of the base model
    (its path, e.g. ``model.layers.0.self_attn.q_proj``) and the matrix (``A [r, in]`` or
    ``B [out, r]``)."""

    module: str
    matrix: Matrix

    @classmethod
    def parse(cls, key: str) -> LoraTensor:
        """The module and matrix a tensor name stands for; AdapterFormatError if the name is
        not ``base_model.model.<module>.lora_A.weight`` or ``.lora_B.weight``."""
        m = _TENSOR_KEY.fullmatch(key)
        if m is None:
            raise AdapterFormatError(f"unexpected tensor {key[:120]!r}: only "
                                     f"{TENSOR_PREFIX}<module>.lora_A.weight and "
                                     ".lora_B.weight are allowed")
        return cls(m.group("module"), cast(Matrix, m.group("matrix")))

    @property
    def key(self) -> str:
        """The tensor's name in the weights file."""
        return f"{TENSOR_PREFIX}{self.module}.lora_{self.matrix}.weight"

    @property
    def layer(self) -> int | None:
        """The index of the decoder layer the module sits in (``...layers.<i>...``), if any."""
        m = _LAYER.search(self.module)
        return int(m.group("index")) if m else None


def lora_pairs(tensors: Mapping[str, T]) -> dict[str, tuple[T, T]]:
    """``{module: (lora_A, lora_B)}``, sorted by module, from ``{tensor name: tensor}``.

    The tensors are whatever the caller holds (a header's dtype and shape, or the weights);
    only their names are read. AdapterFormatError for a name outside the naming rule, no
    tensors at all, or a module with only one of its two matrices.
    """
    halves: dict[str, dict[Matrix, T]] = {}
    for key, value in sorted(tensors.items()):
        tensor = LoraTensor.parse(key)
        halves.setdefault(tensor.module, {})[tensor.matrix] = value
    if not halves:
        raise AdapterFormatError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    pairs: dict[str, tuple[T, T]] = {}
    for module, found in sorted(halves.items()):
        if set(found) != {"A", "B"}:
            have = "lora_A" if "A" in found else "lora_B"
            raise AdapterFormatError(
                f"{module[:120]!r} needs both lora_A and lora_B, found only {have}")
        pairs[module] = (found["A"], found["B"])
    return pairs
