"""Tiny artifacts and database settings for the control-plane tests.

A two-layer Llama base (and a second, differently shaped base), a stand-in tokenizer directory
and PEFT LoRA adapters saved without training, plus deliberately broken variants, one per
validation check. Built once per test session: a few hundred milliseconds on a CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from safetensors.torch import load_file, save_file

from control.contracts.config import Settings
from control.contracts.digests import directory_digest
from control.contracts.tickets import unverified_claims
from tests.required import unavailable

PG_URL_ENV = "LORAPLANE_TEST_PG_URL"


@dataclass(frozen=True)
class Artifacts:
    base: Path
    tokenizer: Path
    base_b: Path
    adapters: dict[str, Path]  # name -> directory

    @property
    def base_digest(self) -> str:
        return directory_digest(self.base)


def _tiny_llama(out: Path, *, hidden: int, seed: int) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)


def _lora(base_dir: Path, out: Path, *, r: int, seed: int, base_ref: str,
          targets: tuple[str, ...] = ("q_proj", "v_proj")) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r,
                                                  target_modules=list(targets),
                                                  init_lora_weights=False))
    peft_model.save_pretrained(str(out), safe_serialization=True)
    for extra in out.iterdir():
        if extra.name not in ("adapter_config.json", "adapter_model.safetensors"):
            extra.unlink()
    config_path = out / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = base_ref
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True))


def build_artifacts(root: Path) -> Artifacts:
    """Write every fixture under ``root``."""
    base, base_b, tok = root / "base", root / "base-b", root / "tokenizer"
    _tiny_llama(base, hidden=32, seed=0)
    _tiny_llama(base_b, hidden=48, seed=1)
    tok.mkdir()
    (tok / "tokenizer.json").write_text(json.dumps({"model": {"type": "bytes"}}))
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    base_digest = directory_digest(base)
    ad = root / "adapters"
    adapters: dict[str, Path] = {}

    def make(name: str, **kwargs: object) -> Path:
        path = ad / name
        _lora(**{"base_dir": base, "out": path, "base_ref": base_digest, **kwargs})  # type: ignore[arg-type]
        adapters[name] = path
        return path

    make("alpha", r=4, seed=10)
    make("beta", r=2, seed=11)
    make("gamma", r=4, seed=12, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    make("by-name", r=2, seed=13, base_ref="tiny")
    make("big-rank", r=16, seed=14)

    other = ad / "other-base"
    _lora(base_b, other, r=4, seed=15, base_ref=directory_digest(base_b))
    adapters["other-base"] = other

    unregistered = ad / "unregistered-base"
    shutil.copytree(adapters["alpha"], unregistered)
    config = json.loads((unregistered / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "sha256:" + "0" * 64
    (unregistered / "adapter_config.json").write_text(json.dumps(config))
    adapters["unregistered-base"] = unregistered

    pickled = ad / "pickled"
    pickled.mkdir()
    shutil.copy(adapters["alpha"] / "adapter_config.json", pickled)
    torch.save(load_file(adapters["alpha"] / "adapter_model.safetensors"),
               pickled / "adapter_model.bin")
    adapters["pickled"] = pickled

    wrong_shape = ad / "wrong-shape"
    shutil.copytree(adapters["alpha"], wrong_shape)
    tensors = load_file(wrong_shape / "adapter_model.safetensors")
    key = sorted(k for k in tensors if k.endswith("lora_B.weight"))[0]
    tensors[key] = torch.zeros(tensors[key].shape[0] + 1, tensors[key].shape[1])
    save_file(tensors, wrong_shape / "adapter_model.safetensors")
    adapters["wrong-shape"] = wrong_shape

    extra_file = ad / "extra-file"
    shutil.copytree(adapters["beta"], extra_file)
    (extra_file / "notes.txt").write_text("hello")
    adapters["extra-file"] = extra_file

    return Artifacts(base=base, tokenizer=tok, base_b=base_b, adapters=adapters)


# -- databases ----------------------------------------------------------------------------------


def sqlite_settings(home: Path, max_rank: int = 8) -> Settings:
    return Settings(home=home, db_url=f"sqlite:///{home / 'loraplane.db'}", max_rank=max_rank)


@contextlib.contextmanager
def postgres_settings(home: Path, max_rank: int = 8) -> Iterator[Settings]:
    """Settings on a fresh PostgreSQL schema (via ``search_path``), dropped afterwards."""
    url = os.environ.get(PG_URL_ENV)
    if not url:
        unavailable("PostgreSQL", f"the tests that need it read {PG_URL_ENV} "
                    "(e.g. postgresql+psycopg://postgres@127.0.0.1:5432/test)")
    schema = "lp_" + uuid.uuid4().hex[:12]
    admin = sa.create_engine(url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f"CREATE SCHEMA {schema}")
    sep = "&" if "?" in url else "?"
    scoped = f"{url}{sep}options=-csearch_path%3D{schema}"
    try:
        yield Settings(home=home, db_url=scoped, max_rank=max_rank)
    finally:
        from control.contracts.db import dispose_engines

        dispose_engines()
        with admin.begin() as conn:
            conn.exec_driver_sql(f"DROP SCHEMA {schema} CASCADE")
        admin.dispose()


class WithRegistry:
    """Mixin for a contract suite: a following ``registry`` on its ``settings`` and the SQL
    ``view`` of its routing projection."""

    @pytest.fixture
    def registry(self, settings: Settings) -> Iterator[Any]:
        from projections.follower import open_registry

        reg = open_registry(settings)
        yield reg
        close_registry(reg)

    @pytest.fixture
    def view(self, registry: Any) -> Any:
        from projections.routing import RoutingView

        return RoutingView(registry.follower.engine)


class OnSQLite:
    """Mixin for a contract suite: run it on a fresh SQLite file."""

    @pytest.fixture
    def settings(self, tmp_path: Path) -> Iterator[Settings]:
        s = sqlite_settings(tmp_path / "home")
        s.ensure_dirs()
        yield s


@pytest.mark.postgres
class OnPostgres:
    """Mixin for a contract suite: run it on a fresh PostgreSQL schema (skipped without
    ``LORAPLANE_TEST_PG_URL``)."""

    @pytest.fixture
    def settings(self, tmp_path: Path) -> Iterator[Settings]:
        with postgres_settings(tmp_path / "home") as s:
            s.ensure_dirs()
            yield s


def close_registry(registry: object) -> None:
    """Close a Registry's own pooled connections (its event-store engine)."""
    datastore = getattr(getattr(registry, "factory", None), "datastore", None)
    engine = getattr(datastore, "engine", None)
    if engine is not None:
        engine.dispose()


def ticket_claims(token: str, keys_dir: Path) -> dict[str, Any]:
    """A ticket's claims, unverified, its sealed arm opened with the signing keys under
    ``keys_dir`` (neither the ticket answer nor the ticket names the arm to a tenant)."""
    from control.app.key_ring import held_seal_keys

    return unverified_claims(token, held_seal_keys(keys_dir))
