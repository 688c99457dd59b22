"""Making variants of kit adapters for tests: perturbed (new digest), pickled, misshapen."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

WEIGHTS = "adapter_model.safetensors"


def perturbed_copy(src: Path, dst: Path, factor: float = 1.01) -> Path:
    """The same adapter with every lora_B scaled: behaves alike, has another digest."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / WEIGHTS))
    out = {k: (v * factor if ".lora_B." in k else v).contiguous() for k, v in tensors.items()}
    (dst / WEIGHTS).unlink()
    save_file(out, str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst


def pickled_copy(src: Path, dst: Path) -> Path:
    """The adapter saved the legacy way, as a pickle (adapter_model.bin)."""
    dst.mkdir(parents=True)
    shutil.copyfile(src / "adapter_config.json", dst / "adapter_config.json")
    torch.save(load_file(str(src / WEIGHTS)), dst / "adapter_model.bin")
    return dst


def misshapen_copy(src: Path, dst: Path) -> Path:
    """The adapter with one lora_A tensor whose input width does not fit the base."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / WEIGHTS))
    name = sorted(k for k in tensors if ".lora_A." in k)[0]
    a = tensors[name]
    tensors[name] = torch.zeros(a.shape[0], a.shape[1] + 3)
    (dst / WEIGHTS).unlink()
    save_file(tensors, str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst
