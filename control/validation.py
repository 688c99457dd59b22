"""Adapter and base-model validation: reads files, touches no database.

An adapter directory is checked before anything is stored, one named check at a time:

- ``files``: only ``adapter_config.json`` and ``adapter_model.safetensors``; no symlinks, no
  subdirectories.
- ``format``: weights in safetensors only (pickle-based ``.bin``/``.pt``/``.pth``/``.pkl``/...
  are refused without being opened); the safetensors header must parse.
- ``config``: ``adapter_config.json`` is a LoRA config with an integer rank ``r > 0``,
  ``lora_alpha`` and ``target_modules``.
- ``rank``: ``r`` is at most the configured maximum.
- ``base``: the adapter names (or the caller names) a registered base, by digest or name.
- ``shapes``: every tensor is a ``lora_A``/``lora_B`` weight of a Linear layer of that base and
  fits its shape (``lora_A [r, in]``, ``lora_B [out, r]``); nothing else is in the file.

Messages name the check and what was expected; they never contain a path outside the adapter
directory (only the adapter's own file names) or anything about other tenants.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from control.digests import DIGEST_RE
from control.domain import ValidationFailed

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ALLOWED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
# Serialisations that can run code when loaded (pickle and friends), refused by name.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib",
                             ".npy", ".npz", ".h5", ".msgpack"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
MAX_CONFIG_BYTES = 1 << 20
_LORA_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
_SAFE_ECHO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


@dataclass(frozen=True)
class BaseInfo:
    """What validation needs to know about a registered base model."""

    name: str
    digest: str
    tokenizer_digest: str
    linear_shapes: dict[str, list[int]]


@dataclass(frozen=True)
class AdapterFacts:
    """What a valid adapter declares, as recorded in ``AdapterRegistered``."""

    base_digest: str
    tokenizer_digest: str
    rank: int
    target_modules: list[str]


BaseLookup = Callable[[str], "BaseInfo | None"]


def _fail(check: str, message: str) -> ValidationFailed:
    return ValidationFailed(check, message)


def check_files(adapter_dir: Path) -> None:
    """The ``files`` and ``format`` checks on the directory listing (no file is opened)."""
    if not adapter_dir.is_dir() or adapter_dir.is_symlink():
        raise _fail("files", "the adapter must be a directory")
    entries = sorted(adapter_dir.iterdir(), key=lambda p: p.name)
    for p in entries:
        if p.is_symlink():
            raise _fail("files", f"symlinks are not allowed ({p.name})")
        if p.is_dir():
            raise _fail("files", f"subdirectories are not allowed ({p.name}/)")
        if not p.is_file():
            raise _fail("files", f"only regular files are allowed ({p.name})")
    names = [p.name for p in entries]
    for name in names:
        if Path(name).suffix.lower() in PICKLE_SUFFIXES:
            raise _fail(
                "format",
                f"{name} is a pickle-based weight file; only safetensors is accepted "
                f"(save with safe_serialization=True as {WEIGHTS_FILE})",
            )
    unexpected = [n for n in names if n not in ALLOWED_FILES]
    if unexpected:
        raise _fail(
            "files",
            f"unexpected file {unexpected[0]}; only {CONFIG_FILE} and {WEIGHTS_FILE} are allowed",
        )
    if CONFIG_FILE not in names:
        raise _fail("files", f"{CONFIG_FILE} is missing")
    if WEIGHTS_FILE not in names:
        raise _fail("format", f"{WEIGHTS_FILE} is missing (safetensors weights are required)")


def read_header_shapes(path: Path, check: str = "format") -> dict[str, tuple[str, list[int]]]:
    """``{tensor name: (dtype, shape)}`` from a safetensors header, without reading tensors."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            out: dict[str, tuple[str, list[int]]] = {}
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                sl = f.get_slice(key)
                out[key] = (str(sl.get_dtype()), [int(d) for d in sl.get_shape()])
            return out
    except ValidationFailed:
        raise
    except Exception:
        raise _fail(check, f"{path.name} is not a valid safetensors file") from None


def _load_config(adapter_dir: Path) -> dict[str, object]:
    path = adapter_dir / CONFIG_FILE
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise _fail("config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _fail("config", f"{CONFIG_FILE} is not valid JSON") from None
    if not isinstance(config, dict):
        raise _fail("config", f"{CONFIG_FILE} must hold a JSON object")
    return config


def check_config(config: dict[str, object]) -> tuple[int, list[str]]:
    """The ``config`` check; returns (rank, target_modules)."""
    if config.get("peft_type") != "LORA":
        found = str(config.get("peft_type"))[:32]
        raise _fail("config", f"peft_type must be LORA, found {found!r}")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise _fail("config", "r must be an integer greater than 0")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise _fail("config", "lora_alpha must be a positive number")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    if (not isinstance(targets, list) or not targets
            or not all(isinstance(t, str) and t for t in targets)):
        raise _fail("config", "target_modules must be a non-empty list of module names")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise _fail("config", f"{key} is not supported (one rank for every module)")
    for key in ("use_dora", "fan_in_fan_out"):
        if config.get(key):
            raise _fail("config", f"{key}=true is not supported")
    return r, sorted(set(targets))


def check_rank(rank: int, max_rank: int) -> None:
    """The ``rank`` check."""
    if rank > max_rank:
        raise _fail("rank", f"rank r={rank} exceeds the maximum of {max_rank}")


def _echo(value: str) -> str:
    # Echo the caller's own base reference only when it is harmless (a digest or a plain name):
    # it could be a local path of the uploader's machine.
    return f" {value!r}" if DIGEST_RE.match(value) or _SAFE_ECHO.match(value) else ""


def check_base(config: dict[str, object], base: str | None, lookup: BaseLookup) -> BaseInfo:
    """The ``base`` check: the explicit ``base`` or ``base_model_name_or_path`` is registered."""
    ref = base if base is not None else config.get("base_model_name_or_path")
    if not isinstance(ref, str) or not ref:
        raise _fail("base", "no base model given: set base_model_name_or_path to a registered "
                            "base digest or name")
    info = lookup(ref)
    if info is None:
        raise _fail("base", f"base model{_echo(ref)} is not registered")
    return info


def _matches_target(module: str, targets: list[str]) -> bool:
    # PEFT's rule for a list of names: exact path, or the last components match.
    return any(module == t or module.endswith("." + t) for t in targets)


def check_shapes(
    tensors: dict[str, tuple[str, list[int]]], base: BaseInfo, rank: int, targets: list[str]
) -> None:
    """The ``shapes`` check: LoRA pairs on the base's Linear layers, of rank ``rank``, only."""
    if not tensors:
        raise _fail("shapes", f"{WEIGHTS_FILE} holds no tensors")
    seen: dict[str, set[str]] = {}
    for key, (dtype, shape) in sorted(tensors.items()):
        m = _LORA_KEY.match(key)
        if m is None:
            raise _fail("shapes", f"unexpected tensor {key[:120]!r}: only "
                                  "base_model.model.<module>.lora_A/lora_B.weight are allowed")
        module, ab = m.group("module"), m.group("ab")
        linear = base.linear_shapes.get(module)
        if linear is None:
            raise _fail("shapes", f"{module[:120]!r} is not a Linear layer of the base model")
        if not _matches_target(module, targets):
            raise _fail("shapes", f"{module[:120]!r} is not in target_modules")
        if dtype not in FLOAT_DTYPES:
            raise _fail("shapes", f"{key[:120]!r} has dtype {dtype}; floating point expected")
        out_f, in_f = linear
        expected = [rank, in_f] if ab == "A" else [out_f, rank]
        if shape != expected:
            raise _fail("shapes", f"{key[:120]!r} has shape {shape}, expected {expected} "
                                  f"(rank {rank}, Linear [{out_f}, {in_f}])")
        seen.setdefault(module, set()).add(ab)
    for module, halves in sorted(seen.items()):
        if halves != {"A", "B"}:
            raise _fail("shapes", f"{module[:120]!r} needs both lora_A and lora_B")


def validate_adapter(
    adapter_dir: Path, *, lookup_base: BaseLookup, max_rank: int, base: str | None = None
) -> AdapterFacts:
    """Run every check on ``adapter_dir``; raise ValidationFailed at the first failure."""
    check_files(adapter_dir)
    config = _load_config(adapter_dir)
    rank, targets = check_config(config)
    check_rank(rank, max_rank)
    info = check_base(config, base, lookup_base)
    tensors = read_header_shapes(adapter_dir / WEIGHTS_FILE, check="format")
    check_shapes(tensors, info, rank, targets)
    return AdapterFacts(base_digest=info.digest, tokenizer_digest=info.tokenizer_digest,
                        rank=rank, target_modules=targets)


def base_linear_shapes(base_dir: Path) -> dict[str, list[int]]:
    """``{module path: [out, in]}`` for every Linear weight of a base model, from headers only.

    A Linear weight is a 2-D tensor named ``<module>.weight``. Embeddings are 2-D too and are
    left out (``embed_tokens`` or any ``*embed*`` module): LoRA on them has other shapes.
    ``lm_head`` is included when the checkpoint stores it (it is a Linear); with tied
    embeddings it is absent. Sharded checkpoints (several ``*.safetensors``) are merged.
    """
    files = sorted(p for p in base_dir.iterdir() if p.suffix == ".safetensors")
    pickles = [p.name for p in base_dir.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES]
    if pickles:
        raise _fail("format", f"base model holds pickle-based weights ({pickles[0]}); "
                              "safetensors only")
    if not files:
        raise _fail("format", "base model has no .safetensors weights")
    shapes: dict[str, list[int]] = {}
    for path in files:
        for key, (_dtype, shape) in read_header_shapes(path).items():
            if not key.endswith(".weight") or len(shape) != 2:
                continue
            module = key.removesuffix(".weight")
            if "embed" in module.rsplit(".", 1)[-1]:
                continue
            shapes[module] = shape
    return dict(sorted(shapes.items()))
