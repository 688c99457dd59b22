"""Domain rules and adapter validation, without a database."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from control.domain import (
    DRAFT,
    REVOKED,
    STABLE,
    Adapter,
    Alias,
    AlreadyExists,
    BaseModel,
    DomainError,
    IllegalTransition,
    Tenant,
    ValidationFailed,
    adapter_id,
    check_transition,
    hash_api_key,
    is_servable,
    tenant_id,
)
from control.validation import BaseInfo, base_linear_shapes, validate_adapter
from tests.fixtures_control import Artifacts, artifacts  # noqa: F401  (pytest fixture)

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
BASE = "sha256:" + "b" * 64
TOK = "sha256:" + "c" * 64


def _adapter(tenant: str = "acme", digest: str = D1) -> Adapter:
    return Adapter(tenant=tenant, digest=digest, base_digest=BASE, tokenizer_digest=TOK, rank=4,
                   target_modules=["q_proj"], alias="chat", actor="alice")


def test_ids_are_deterministic() -> None:
    assert Tenant.create("acme", "lp_x", "alice").id == tenant_id("acme")
    assert _adapter().id == adapter_id(D1)
    assert adapter_id(D1) != adapter_id(D2)


def test_tenant_event_carries_only_the_key_hash() -> None:
    tenant = Tenant.create("acme", "lp_secret", "alice")
    (created,) = tenant.collect_events()
    assert created.api_key_hash == hash_api_key("lp_secret")  # type: ignore[attr-defined]
    assert "lp_secret" not in repr(created)
    assert created.actor == "alice"  # type: ignore[attr-defined]


def test_names_and_actor_are_checked() -> None:
    with pytest.raises(DomainError):
        Tenant.create("../etc", "lp_x", "alice")
    with pytest.raises(DomainError):
        Tenant.create("acme", "lp_x", " ")


def test_lifecycle() -> None:
    adapter = _adapter()
    assert adapter.state == DRAFT
    with pytest.raises(IllegalTransition):
        adapter.promote("canary-that-does-not-exist", "bob")
    adapter.promote(STABLE, "bob")
    assert adapter.state == STABLE
    with pytest.raises(IllegalTransition):
        adapter.promote(STABLE, "bob")
    adapter.revoke("leaked", "carol")
    assert adapter.state == REVOKED and adapter.revoked
    with pytest.raises(IllegalTransition):
        adapter.revoke("again", "carol")
    with pytest.raises(IllegalTransition):
        adapter.promote(STABLE, "bob")
    events = adapter.collect_events()
    assert [type(e).__name__ for e in events] == [
        "AdapterRegistered", "AdapterPromoted", "AdapterRevoked"]
    assert all(e.actor for e in events)  # type: ignore[attr-defined]


def test_illegal_transition_records_nothing() -> None:
    adapter = _adapter()
    adapter.collect_events()
    with pytest.raises(IllegalTransition):
        check_transition(DRAFT, REVOKED)  # revocation is its own command, not a promotion
    with pytest.raises(IllegalTransition):
        adapter.promote(REVOKED, "bob")
    assert adapter.collect_events() == []


def test_servability() -> None:
    assert is_servable(None)  # the base alone
    assert is_servable(STABLE)
    assert not is_servable(DRAFT)
    assert not is_servable(REVOKED)


def test_alias_rules() -> None:
    alias = Alias.create("chat", owner="acme", base_digest=BASE, adapter_digest=D1,
                         tokenizer_digest=TOK, actor="alice")
    assert not alias.may_resolve("acme")  # the owner is not granted implicitly
    alias.grant("acme", "alice")
    assert alias.may_resolve("acme")
    with pytest.raises(AlreadyExists):
        alias.grant("acme", "alice")
    with pytest.raises(DomainError):
        alias.point_to_adapter(_adapter(tenant="other", digest=D2), "alice")
    revoked = _adapter(digest=D2)
    revoked.revoke("bad", "alice")
    with pytest.raises(IllegalTransition):
        alias.point_to_adapter(revoked, "alice")
    base = BaseModel.register(name="tiny", digest=BASE, tokenizer_digest=TOK,
                              linear_shapes={"m.q": [4, 4]}, actor="op")
    alias.point_to_base(base, "alice")
    assert alias.adapter_digest is None


# -- validation (files only) ------------------------------------------------------------------


def _info(art: Artifacts) -> BaseInfo:
    return BaseInfo(name="tiny", digest=art.base_digest, tokenizer_digest=TOK,
                    linear_shapes=base_linear_shapes(art.base))


def _validate(art: Artifacts, path: Path, max_rank: int = 8) -> object:
    info = _info(art)
    return validate_adapter(path, max_rank=max_rank,
                            lookup_base=lambda ref: info if ref in ("tiny", info.digest) else None)


def test_valid_adapter(artifacts: Artifacts) -> None:  # noqa: F811
    facts = _validate(artifacts, artifacts.adapters["gamma"])
    assert facts.rank == 4  # type: ignore[attr-defined]
    assert facts.target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("name", "check"), [
    ("pickled", "format"),
    ("extra-file", "files"),
    ("wrong-shape", "shapes"),
    ("big-rank", "rank"),
    ("unregistered-base", "base"),
    ("other-base", "base"),
])
def test_each_check_names_itself(artifacts: Artifacts, name: str, check: str) -> None:  # noqa: F811
    with pytest.raises(ValidationFailed) as info:
        _validate(artifacts, artifacts.adapters[name])
    assert info.value.check == check
    assert str(artifacts.adapters[name].parent) not in info.value.message


def test_config_and_structure_checks(artifacts: Artifacts, tmp_path: Path) -> None:  # noqa: F811
    src = artifacts.adapters["alpha"]

    def variant(name: str) -> Path:
        d = tmp_path / name
        shutil.copytree(src, d)
        return d

    bad_json = variant("bad-json")
    (bad_json / "adapter_config.json").write_text("{nope")
    not_lora = variant("not-lora")
    cfg = json.loads((src / "adapter_config.json").read_text())
    (not_lora / "adapter_config.json").write_text(json.dumps({**cfg, "peft_type": "IA3"}))
    zero_rank = variant("zero-rank")
    (zero_rank / "adapter_config.json").write_text(json.dumps({**cfg, "r": 0}))
    subdir = variant("subdir")
    (subdir / "nested").mkdir()
    link = variant("link")
    (link / "adapter_model.safetensors").unlink()
    (link / "adapter_model.safetensors").symlink_to(src / "adapter_model.safetensors")
    garbage = variant("garbage")
    (garbage / "adapter_model.safetensors").write_bytes(b"\x80\x04not safetensors")
    for path, check in [(bad_json, "config"), (not_lora, "config"), (zero_rank, "config"),
                        (subdir, "files"), (link, "files"), (garbage, "format")]:
        with pytest.raises(ValidationFailed) as info:
            _validate(artifacts, path)
        assert info.value.check == check, path.name
        assert str(tmp_path) not in info.value.message
