"""Adapters made on purpose to be refused, and valid ones made from a base's shapes alone.

Used by ``loraplane selftest hostile`` against a running deployment (which has no model kit at
hand) and by the test suite. Everything is written with numpy and safetensors' numpy API, so
nothing here needs torch. Each :class:`HostileArtifact` turns a valid adapter directory into a
variant that validation must refuse with the named check.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import shutil
import tarfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from control.app.validation import CONFIG_FILE, WEIGHTS_FILE

LORA_KEY = "base_model.model.{module}.lora_{ab}.weight"


def synth_adapter(
    dst: Path,
    linear_shapes: dict[str, list[int]],
    base_ref: str,
    *,
    rank: int = 4,
    targets: Iterable[str] = ("q_proj", "v_proj"),
    seed: int = 0,
    scale: float = 0.5,
) -> Path:
    """A valid LoRA adapter for a base with these Linear shapes (random weights, numpy only).

    ``scale`` is large enough that the adapter visibly changes the base's greedy output.
    """
    targets = sorted(set(targets))
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for module, (out_f, in_f) in sorted(linear_shapes.items()):
        if not any(module == t or module.endswith("." + t) for t in targets):
            continue
        tensors[LORA_KEY.format(module=module, ab="A")] = (
            rng.standard_normal((rank, in_f)) * scale).astype(np.float32)
        tensors[LORA_KEY.format(module=module, ab="B")] = (
            rng.standard_normal((out_f, rank)) * scale).astype(np.float32)
    if not tensors:
        raise ValueError("no Linear layer of the base matches the targets")
    dst.mkdir(parents=True)
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
              "base_model_name_or_path": base_ref, "bias": "none", "lora_dropout": 0.0,
              "task_type": "CAUSAL_LM"}
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True))
    return dst


@dataclass(frozen=True)
class HostileArtifact:
    """``build(valid_src, dst)`` writes a variant that validation refuses with ``check``."""

    name: str
    check: str
    build: Callable[[Path, Path], None]


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        os.chmod(p, 0o644)  # copies of read-only store files must stay editable


def _tensors(dst: Path) -> dict[str, np.ndarray]:
    return dict(load_file(str(dst / WEIGHTS_FILE)))


def _save(dst: Path, tensors: dict[str, np.ndarray]) -> None:
    (dst / WEIGHTS_FILE).unlink()
    save_file(tensors, str(dst / WEIGHTS_FILE), metadata={"format": "pt"})


def _config(dst: Path) -> dict[str, object]:
    return dict(json.loads((dst / CONFIG_FILE).read_text()))


def _write_config(dst: Path, config: dict[str, object] | str) -> None:
    text = config if isinstance(config, str) else json.dumps(config)
    (dst / CONFIG_FILE).write_text(text)


def _first(tensors: dict[str, np.ndarray], half: str) -> str:
    return sorted(k for k in tensors if f".lora_{half}." in k)[0]


def _weights_op(op: Callable[[dict[str, np.ndarray]], None]) -> Callable[[Path, Path], None]:
    def build(src: Path, dst: Path) -> None:
        _copy(src, dst)
        t = _tensors(dst)
        op(t)
        _save(dst, t)
    return build


def _bytes_op(op: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def build(src: Path, dst: Path) -> None:
        _copy(src, dst)
        path = dst / WEIGHTS_FILE
        path.write_bytes(op(path.read_bytes()))
    return build


def _config_op(op: Callable[[dict[str, object]], dict[str, object] | str]
               ) -> Callable[[Path, Path], None]:
    def build(src: Path, dst: Path) -> None:
        _copy(src, dst)
        _write_config(dst, op(_config(dst)))
    return build


def _header_op(op: Callable[[dict[str, object]], None]) -> Callable[[Path, Path], None]:
    """Rewrite the safetensors header JSON, keeping the data section as it is."""
    def rewrite(raw: bytes) -> bytes:
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8:8 + n])
        op(header)
        new = json.dumps(header).encode()
        return len(new).to_bytes(8, "little") + new + raw[8 + n:]
    return _bytes_op(rewrite)


def _poison(value: float) -> Callable[[dict[str, np.ndarray]], None]:
    def op(t: dict[str, np.ndarray]) -> None:
        k = _first(t, "B")
        a = t[k].copy()
        a.flat[0] = value
        t[k] = a
    return op


def _drop(half: str) -> Callable[[dict[str, np.ndarray]], None]:
    def op(t: dict[str, np.ndarray]) -> None:
        del t[_first(t, half)]
    return op


def _drop_module(t: dict[str, np.ndarray]) -> None:
    key = _first(t, "A")
    del t[key], t[key.replace(".lora_A.", ".lora_B.")]


def _extra(t: dict[str, np.ndarray]) -> None:
    t["base_model.model.evil_payload"] = np.zeros(16, dtype=np.float32)


def _wrong_dtype(t: dict[str, np.ndarray]) -> None:
    k = _first(t, "A")
    t[k] = t[k].astype(np.int32)


def _f16(t: dict[str, np.ndarray]) -> None:  # valid: dtype is free among floats
    for k in t:
        t[k] = t[k].astype(np.float16)


def _shape_bomb(h: dict[str, object]) -> None:
    k = sorted(x for x in h if x != "__metadata__")[0]
    entry = h[k]
    assert isinstance(entry, dict)
    entry["shape"] = [2**40, 2**40]


def _overlap(h: dict[str, object]) -> None:
    keys = sorted((x for x in h if x != "__metadata__"),
                  key=lambda x: h[x]["data_offsets"][0])  # type: ignore[index]
    e0, e1 = h[keys[0]], h[keys[1]]
    assert isinstance(e0, dict) and isinstance(e1, dict)
    size = e1["data_offsets"][1] - e1["data_offsets"][0]
    e1["data_offsets"] = [e0["data_offsets"][0], e0["data_offsets"][0] + size]


def _dup_header_key(raw: bytes) -> bytes:
    n = int.from_bytes(raw[:8], "little")
    text = raw[8:8 + n].decode().rstrip()
    first_key = json.loads(text)
    k = sorted(x for x in first_key if x != "__metadata__")[0]
    dup = text[:-1] + ", " + json.dumps(k) + ": " + json.dumps(first_key[k]) + "}"
    new = dup.encode()
    return len(new).to_bytes(8, "little") + new + raw[8 + n:]


def _zip(raw: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        # A classic bomb: a small archive that inflates to far more than it holds.
        z.writestr(WEIGHTS_FILE, raw + b"\0" * (8 << 20))
    return buf.getvalue()


def _tar(raw: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        info = tarfile.TarInfo("../../" + WEIGHTS_FILE)  # path traversal inside the archive
        info.size = len(raw)
        t.addfile(info, io.BytesIO(raw))
    return buf.getvalue()


def _pickle_bin(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    shutil.copyfile(src / CONFIG_FILE, dst / CONFIG_FILE)
    (dst / "adapter_model.bin").write_bytes(pickle.dumps(dict(load_file(str(src / WEIGHTS_FILE)))))


def _symlink(src: Path, dst: Path) -> None:
    _copy(src, dst)
    (dst / WEIGHTS_FILE).unlink()
    (dst / WEIGHTS_FILE).symlink_to((src / WEIGHTS_FILE).resolve())


def _traversal_base(c: dict[str, object]) -> dict[str, object]:
    return {**c, "base_model_name_or_path": "../../../../etc/passwd"}


def _lying_rank(c: dict[str, object]) -> dict[str, object]:
    r = c["r"]
    assert isinstance(r, int)
    return {**c, "r": max(1, r // 2)}


def _lying_targets(c: dict[str, object]) -> dict[str, object]:
    targets = c["target_modules"]
    assert isinstance(targets, list)
    extra = next(t for t in ("o_proj", "k_proj", "up_proj", "down_proj", "gate_proj", "lm_head")
                 if t not in targets)
    return {**c, "target_modules": [*targets, extra]}


def _phantom_target(c: dict[str, object]) -> dict[str, object]:
    targets = c["target_modules"]
    assert isinstance(targets, list)
    return {**c, "target_modules": [*targets, "no_such_layer"]}


def _nan_alpha(c: dict[str, object]) -> str:
    return json.dumps(c).replace(f'"lora_alpha": {json.dumps(c["lora_alpha"])}',
                                 '"lora_alpha": NaN')


def _dup_r(c: dict[str, object]) -> str:
    return json.dumps(c)[:-1] + ', "r": 1}'


HOSTILE_ARTIFACTS: tuple[HostileArtifact, ...] = (
    HostileArtifact("pickle-bin", "format", _pickle_bin),
    HostileArtifact("pickle-named-safetensors", "format", _bytes_op(
        lambda raw: pickle.dumps({"w": list(raw[:64])}, protocol=4))),
    HostileArtifact("symlinked-weights", "files", _symlink),
    HostileArtifact("nan-weights", "values", _weights_op(_poison(float("nan")))),
    HostileArtifact("inf-weights", "values", _weights_op(_poison(float("inf")))),
    HostileArtifact("neg-inf-weights", "values", _weights_op(_poison(float("-inf")))),
    HostileArtifact("truncated", "format", _bytes_op(lambda raw: raw[:-100])),
    HostileArtifact("truncated-header", "format", _bytes_op(lambda raw: raw[:20])),
    HostileArtifact("trailing-bytes", "format", _bytes_op(lambda raw: raw + b"\0" * 4096)),
    HostileArtifact("header-length-bomb", "format", _bytes_op(
        lambda raw: (2**62).to_bytes(8, "little") + raw[8:])),
    HostileArtifact("shape-bomb", "format", _header_op(_shape_bomb)),
    HostileArtifact("overlapping-offsets", "format", _header_op(_overlap)),
    HostileArtifact("duplicate-tensor-key", "format", _bytes_op(_dup_header_key)),
    HostileArtifact("zip-bomb", "format", _bytes_op(_zip)),
    HostileArtifact("tar-with-traversal", "format", _bytes_op(_tar)),
    HostileArtifact("gzip", "format", _bytes_op(gzip.compress)),
    HostileArtifact("extra-tensor", "shapes", _weights_op(_extra)),
    HostileArtifact("missing-lora-b", "shapes", _weights_op(_drop("B"))),
    HostileArtifact("missing-module", "shapes", _weights_op(_drop_module)),
    HostileArtifact("integer-dtype", "shapes", _weights_op(_wrong_dtype)),
    HostileArtifact("config-lies-rank", "shapes", _config_op(_lying_rank)),
    HostileArtifact("config-lies-targets", "shapes", _config_op(_lying_targets)),
    HostileArtifact("config-phantom-target", "shapes", _config_op(_phantom_target)),
    HostileArtifact("config-nan-alpha", "config", _config_op(_nan_alpha)),
    HostileArtifact("config-duplicate-key", "config", _config_op(_dup_r)),
    HostileArtifact("config-nesting-bomb", "config", _config_op(
        lambda _c: "[" * 200_000 + "]" * 200_000)),
    HostileArtifact("config-dora", "config", _config_op(lambda c: {**c, "use_dora": True})),
    HostileArtifact("config-modules-to-save", "config", _config_op(
        lambda c: {**c, "modules_to_save": ["lm_head"]})),
    HostileArtifact("config-path-traversal-base", "base", _config_op(_traversal_base)),
)

# Variants that must still be accepted (the validator must not refuse what is fine).
VALID_VARIANTS: tuple[tuple[str, Callable[[Path, Path], None]], ...] = (
    ("float16", _weights_op(_f16)),
)
