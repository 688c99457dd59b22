"""Adapter and base-model validation: reads files, touches no database.

An adapter directory is checked before anything is stored, one named check at a time:

- ``files``: only ``adapter_config.json`` and ``adapter_model.safetensors``; no symlinks, no
  subdirectories.
- ``format``: weights in safetensors only (pickle-based ``.bin``/``.pt``/``.pth``/``.pkl``/...
  are refused without being opened; archives and compressed files are recognised by their magic
  bytes and refused unopened). The container is parsed strictly before any tensor byte is read:
  the declared header length is bounded, the header is JSON without duplicate keys, every entry
  has a known dtype and a shape whose byte size equals its data range, the ranges tile the data
  section exactly (a truncated file or trailing bytes are refused).
- ``config``: ``adapter_config.json`` is a LoRA config (JSON without duplicate keys or NaN) with an
  integer rank ``r > 0``, a finite positive ``lora_alpha`` and ``target_modules``, and no
  feature the engine cannot serve (DoRA, biases, modules_to_save, per-layer patterns, ...).
  The rules are ``control.contracts.adapter_format``'s, which the engine applies at load too.
- ``rank``: ``r`` is at most the configured maximum.
- ``base``: the adapter names (or the caller names) a registered base, by digest or name.
- ``shapes``: every tensor is a ``lora_A``/``lora_B`` weight (named by the format's rule, both
  halves of each pair present) of a Linear layer of that base and fits its shape
  (``lora_A [r, in]``, ``lora_B [out, r]``); nothing else is in the file. Every
  base Linear that ``target_modules`` names has its pair, and every name matches some Linear, so
  the config cannot lie about what the adapter changes.
- ``values``: every weight is finite (no NaN or infinity); read only after the checks above
  bounded the file's size by the base's shapes and the rank.

Messages name the check and what was expected; they never contain a path outside the adapter
directory (only the adapter's own file names) or anything about other tenants.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors import safe_open

from control.contracts.adapter_format import (
    CONFIG_FILE,
    MAX_CONFIG_BYTES,
    WEIGHTS_FILE,
    AdapterFormatError,
    LoraConfig,
    LoraTensor,
    lora_pairs,
    parse_config,
    strict_json,
)
from control.contracts.digests import DIGEST_RE
from control.domain import ValidationFailed

ALLOWED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE})
# Serialisations that can run code when loaded (pickle and friends), refused by name.
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt", ".joblib",
                             ".npy", ".npz", ".h5", ".msgpack"})
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
# A real adapter's header is a few KB (about 100 bytes per tensor); a header length field is
# checked against this before anything else is read, so a forged length cannot make us allocate.
MAX_HEADER_BYTES = 1 << 20
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
               "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# Archives and compressed containers, named in the refusal when the safetensors parse fails (the
# magic alone decides nothing: a header length can start with the same bytes). Nothing is ever
# inflated or extracted: the registry takes plain safetensors only.
_ARCHIVE_MAGIC = ((b"PK\x03\x04", "zip"), (b"PK\x05\x06", "zip"), (b"\x1f\x8b", "gzip"),
                  (b"BZh", "bzip2"), (b"\xfd7zXZ\x00", "xz"), (b"(\xb5/\xfd", "zstd"),
                  (b"7z\xbc\xaf'\x1c", "7z"), (b"Rar!", "rar"))
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


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors header: ``begin``/``end`` are offsets in the data section."""

    dtype: str
    shape: list[int]
    begin: int
    end: int


def _fail(check: str, message: str) -> ValidationFailed:
    return ValidationFailed(check, message)


def archive_kind(head: bytes) -> str | None:
    """The archive or compression format ``head`` (a file's first 512 bytes) starts, if any."""
    for magic, kind in _ARCHIVE_MAGIC:
        if head.startswith(magic):
            return kind
    if head[257:262] == b"ustar":
        return "tar"
    return None


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


def read_safetensors_header(
    path: Path, check: str = "format"
) -> tuple[int, dict[str, TensorEntry]]:
    """``(header length, {tensor name: entry})`` of a safetensors file, parsed strictly.

    Reads the 8-byte length and the header only; no tensor byte. Refuses a header longer than
    MAX_HEADER_BYTES, malformed or ambiguous JSON, unknown dtypes, shapes whose byte size differs
    from their data range, and ranges that overlap, leave gaps, or do not end exactly at the end
    of the file (truncated, or trailing bytes).
    """
    name = path.name
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(512)
        try:
            if size < 8:
                raise _fail(check, f"{name} is truncated (no header)")
            n = int.from_bytes(head[:8], "little")
            if n > MAX_HEADER_BYTES:
                raise _fail(check, f"{name} declares a {n}-byte header; at most "
                                   f"{MAX_HEADER_BYTES} bytes are accepted")
            if 8 + n > size:
                raise _fail(check, f"{name} is truncated (the header runs past the end)")
            f.seek(8)
            raw = f.read(n)
            try:
                header = strict_json(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                raise _fail(check, f"{name} has a malformed header (JSON without duplicate "
                                   "keys expected)") from None
            entries = _header_entries(header, name, check)
        except ValidationFailed as e:
            kind = archive_kind(head)
            if kind is None:
                raise
            raise _fail(check, f"{name} is a {kind} file, not safetensors: archives and "
                               "compressed files are refused unopened") from e
    data_len = size - 8 - n
    cursor = 0
    for key, entry in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if entry.begin != cursor:
            raise _fail(check, f"{name}: tensor {key[:120]!r} does not start where the previous "
                               "one ends (overlapping or gapped data)")
        cursor = entry.end
    if cursor < data_len:
        raise _fail(check, f"{name} has {data_len - cursor} trailing bytes after its tensors")
    if cursor > data_len:
        raise _fail(check, f"{name} is truncated ({cursor - data_len} bytes of tensor data "
                           "missing)")
    return n, entries


def _header_entries(header: object, name: str, check: str) -> dict[str, TensorEntry]:
    if not isinstance(header, dict):
        raise _fail(check, f"{name} has a malformed header (a JSON object expected)")
    entries: dict[str, TensorEntry] = {}
    for key, value in header.items():
        if key == "__metadata__":
            if not (isinstance(value, dict)
                    and all(isinstance(v, str) for v in value.values())):
                raise _fail(check, f"{name}: __metadata__ must map strings to strings")
            continue
        bad = _fail(check, f"{name}: tensor {key[:120]!r} needs exactly dtype, shape and "
                           "data_offsets [begin, end]")
        if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data_offsets"}:
            raise bad
        dtype, shape, offsets = value["dtype"], value["shape"], value["data_offsets"]
        if not (isinstance(dtype, str) and isinstance(shape, list) and isinstance(offsets, list)
                and len(offsets) == 2
                and all(type(d) is int and d >= 0 for d in [*shape, *offsets])):
            raise bad
        if dtype not in DTYPE_BYTES:
            raise _fail(check, f"{name}: tensor {key[:120]!r} has unknown dtype {dtype[:16]!r}")
        begin, end = offsets
        # math.prod of huge declared dims is exact in Python: a shape "bomb" is just a mismatch.
        if end < begin or end - begin != math.prod(shape) * DTYPE_BYTES[dtype]:
            raise _fail(check, f"{name}: tensor {key[:120]!r} declares shape {shape[:8]} "
                               f"of {dtype} but {end - begin} bytes of data")
        entries[key] = TensorEntry(dtype, [int(d) for d in shape], begin, end)
    return entries


_FINITE_VIEW = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}  # safetensors is little-endian


def check_values(path: Path, header_len: int, entries: dict[str, TensorEntry]) -> None:
    """The ``values`` check: every floating-point weight is finite."""
    with path.open("rb") as f:
        for key, e in sorted(entries.items()):
            f.seek(8 + header_len + e.begin)
            raw = f.read(e.end - e.begin)
            if e.dtype == "BF16":
                # bfloat16 is the top half of a float32: NaN/inf have all exponent bits set.
                bits = np.frombuffer(raw, dtype="<u2")
                finite = not bool(((bits & 0x7F80) == 0x7F80).any())
            elif e.dtype in _FINITE_VIEW:
                finite = bool(np.isfinite(np.frombuffer(raw, dtype=_FINITE_VIEW[e.dtype])).all())
            else:
                continue  # non-float dtypes were refused by the shapes check
            if not finite:
                raise _fail("values", f"{key[:120]!r} holds NaN or infinite weights")


def _load_config(adapter_dir: Path) -> dict[str, object]:
    path = adapter_dir / CONFIG_FILE
    if path.stat().st_size > MAX_CONFIG_BYTES:  # before reading it
        raise _fail("config", f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        return parse_config(path.read_bytes())
    except AdapterFormatError as e:
        raise _fail("config", str(e)) from None


def check_config(config: dict[str, object]) -> LoraConfig:
    """The ``config`` check: the adapter format's rules (``control.contracts.adapter_format``)."""
    try:
        return LoraConfig.from_dict(config)
    except AdapterFormatError as e:
        raise _fail("config", str(e)) from None


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
    try:
        seen = lora_pairs(tensors)  # the format's naming rule; both matrices of each module
    except AdapterFormatError as e:
        raise _fail("shapes", str(e)) from None
    for module, (a, b) in seen.items():
        linear = base.linear_shapes.get(module)
        if linear is None:
            raise _fail("shapes", f"{module[:120]!r} is not a Linear layer of the base model")
        if not _matches_target(module, targets):
            raise _fail("shapes", f"{module[:120]!r} is not in target_modules")
        out_f, in_f = linear
        for tensor, (dtype, shape), expected in ((LoraTensor(module, "A"), a, [rank, in_f]),
                                                 (LoraTensor(module, "B"), b, [out_f, rank])):
            key = tensor.key
            if dtype not in FLOAT_DTYPES:
                raise _fail("shapes", f"{key[:120]!r} has dtype {dtype}; floating point "
                                      "expected")
            if shape != expected:
                raise _fail("shapes", f"{key[:120]!r} has shape {shape}, expected {expected} "
                                      f"(rank {rank}, Linear [{out_f}, {in_f}])")
    # The config must not lie about what the adapter changes: each target names some Linear of
    # the base, and each Linear it names carries a LoRA pair.
    for target in targets:
        if not any(_matches_target(m, [target]) for m in base.linear_shapes):
            raise _fail("shapes", f"target_modules names {target[:120]!r}, which is not a "
                                  "Linear layer of the base model")
    for module in base.linear_shapes:
        if _matches_target(module, targets) and module not in seen:
            raise _fail("shapes", f"{module[:120]!r} is in target_modules but has no "
                                  "lora_A/lora_B tensors")


def validate_adapter(
    adapter_dir: Path, *, lookup_base: BaseLookup, max_rank: int, base: str | None = None
) -> AdapterFacts:
    """Run every check on ``adapter_dir``; raise ValidationFailed at the first failure."""
    check_files(adapter_dir)
    config = _load_config(adapter_dir)
    lora = check_config(config)
    rank, targets = lora.rank, list(lora.target_modules)
    check_rank(rank, max_rank)
    info = check_base(config, base, lookup_base)
    weights = adapter_dir / WEIGHTS_FILE
    header_len, entries = read_safetensors_header(weights, check="format")
    check_shapes({k: (e.dtype, e.shape) for k, e in entries.items()}, info, rank, targets)
    check_values(weights, header_len, entries)  # bounded now: shapes fit the base and the rank
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
