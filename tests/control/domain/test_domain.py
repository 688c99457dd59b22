"""Domain rules and adapter validation, without a database."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from control.app.validation import BaseInfo, base_linear_shapes, validate_adapter
from control.domain import (
    CANARY,
    CANDIDATE,
    DEPRECATED,
    DRAFT,
    REVOKED,
    STABLE,
    Adapter,
    AdapterState,
    Alias,
    AlreadyExists,
    BaseModel,
    DomainError,
    IllegalTransition,
    NotFound,
    Release,
    SigningKey,
    Tenant,
    TenantPolicy,
    ValidationFailed,
    adapter_id,
    canary_bucket,
    check_transition,
    choose_release,
    hash_api_key,
    is_servable,
    tenant_id,
)
from tests.fixtures_control import Artifacts

D1 = "sha256:" + "1" * 64
D2 = "sha256:" + "2" * 64
BASE = "sha256:" + "b" * 64
TOK = "sha256:" + "c" * 64


def _adapter(tenant: str = "acme", digest: str = D1,
             signature: dict[str, str] | None = None) -> Adapter:
    return Adapter(tenant=tenant, digest=digest, base_digest=BASE, tokenizer_digest=TOK, rank=4,
                   target_modules=["q_proj"], alias="chat", metadata={}, signature=signature,
                   actor="alice")


def _release(digest: str, adapter: str | None = D1, tenant: str | None = "acme") -> Release:
    return Release(digest=digest, tenant=tenant, adapter_digest=adapter, base_digest=BASE,
                   tokenizer_digest=TOK, chat_template_digest=None, inference_defaults={},
                   evaluation_report_digest=None, actor="op")


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


def test_api_key_rotation_and_revocation() -> None:
    tenant = Tenant.create("acme", "lp_first", "alice")
    tenant.rotate_api_key("lp_second", "alice")
    assert tenant.api_key_hash == hash_api_key("lp_second")
    tenant.revoke_api_keys("leaked", "sec")
    assert tenant.api_key_hash is None
    with pytest.raises(IllegalTransition, match="no API key"):
        tenant.revoke_api_keys("again", "sec")  # nothing to withdraw: nothing recorded
    tenant.rotate_api_key("lp_third", "alice")  # a tenant gets a key back by rotation
    events = tenant.collect_events()
    assert [type(e).__name__ for e in events] == [
        "TenantCreated", "ApiKeyRotated", "ApiKeysRevoked", "ApiKeyRotated"]
    assert not any(k in repr(events) for k in ("lp_first", "lp_second", "lp_third"))
    assert events[2].reason == "leaked"  # type: ignore[attr-defined]
    with pytest.raises(DomainError):
        tenant.rotate_api_key("lp_x", " ")


def test_grant_removal() -> None:
    alias = Alias.create("chat", owner="acme", release=None, actor="alice")
    with pytest.raises(NotFound, match="no grant"):
        alias.remove_grant("acme", "op")
    alias.grant("acme", "op")
    alias.grant("globex", "op")
    alias.remove_grant("acme", "op")
    assert not alias.may_resolve("acme") and alias.may_resolve("globex")
    alias.grant("acme", "op")  # granted again after a removal
    assert [type(e).__name__ for e in alias.collect_events()][-2:] == [
        "AliasGrantRemoved", "AliasGranted"]


def test_signing_key_retires_once() -> None:
    key = SigningKey(kid="k1", public_key_b64="AAAA", actor="op")
    assert not key.retired
    key.retire("rotated", "op")
    assert key.retired
    with pytest.raises(IllegalTransition, match="already retired"):
        key.retire("again", "op")
    assert [type(e).__name__ for e in key.collect_events()] == [
        "SigningKeyRecorded", "SigningKeyRetired"]


def test_names_and_actor_are_checked() -> None:
    with pytest.raises(DomainError):
        Tenant.create("../etc", "lp_x", "alice")
    with pytest.raises(DomainError):
        Tenant.create("acme", "lp_x", " ")


def test_lifecycle_walks_each_guarded_step() -> None:
    adapter = _adapter()
    assert adapter.state == DRAFT
    with pytest.raises(IllegalTransition, match="lifecycle is"):
        adapter.promote("canary-that-does-not-exist", "bob")
    with pytest.raises(IllegalTransition, match="from 'draft' to 'stable'"):
        adapter.promote(STABLE, "bob")  # no skipping: stable needs candidate and canary first
    adapter.promote(CANDIDATE, "bob")
    with pytest.raises(IllegalTransition, match="evaluation report"):
        adapter.promote(CANARY, "bob", release="sha256:" + "e" * 64)
    adapter.record_evaluation("sha256:" + "f" * 64, {"accuracy": 0.9}, "eve", external=True)
    adapter.promote(CANARY, "bob", release="sha256:" + "e" * 64)
    assert adapter.had_canary and adapter.release == "sha256:" + "e" * 64
    adapter.promote(STABLE, "bob")
    adapter.promote(DEPRECATED, "bob")
    with pytest.raises(IllegalTransition):
        adapter.promote(STABLE, "bob")
    adapter.revoke("leaked", "carol")
    assert adapter.state == REVOKED and adapter.revoked
    with pytest.raises(IllegalTransition):
        adapter.revoke("again", "carol")
    events = adapter.collect_events()
    assert [type(e).__name__ for e in events] == [
        "AdapterRegistered", "AdapterPromoted", "EvaluationRecorded", "AdapterPromoted",
        "AdapterPromoted", "AdapterPromoted", "AdapterRevoked"]
    assert all(e.actor for e in events)  # type: ignore[attr-defined]


def test_signature_policy_guards_candidate() -> None:
    key = "-----BEGIN PUBLIC KEY-----\nx\n-----END PUBLIC KEY-----\n"
    policy = TenantPolicy(require_signature=True, trusted_keys=[key])
    unsigned = _adapter()
    unsigned.collect_events()
    with pytest.raises(IllegalTransition, match="signature"):
        unsigned.promote(CANDIDATE, "bob", policy)
    assert unsigned.collect_events() == []
    signed = _adapter(digest=D2, signature={"method": "model-signing/key"})
    signed.promote(CANDIDATE, "bob", policy)
    assert signed.state == CANDIDATE
    with pytest.raises(DomainError, match="trusted key"):
        TenantPolicy(require_signature=True)
    with pytest.raises(DomainError):
        TenantPolicy(max_rank=0)


@pytest.mark.parametrize("state", [DRAFT, CANDIDATE, CANARY, STABLE, DEPRECATED])
def test_revocation_from_any_state(state: str) -> None:
    adapter = _adapter()
    adapter.record_evaluation("sha256:" + "f" * 64, {}, "eve", external=True)
    path = [CANDIDATE, CANARY, STABLE, DEPRECATED]
    for step in path[: path.index(state) + 1] if state != DRAFT else []:
        adapter.promote(step, "bob", release="sha256:" + "e" * 64)
    assert adapter.state == state
    adapter.revoke("bad", "carol")
    assert adapter.state == REVOKED


def test_illegal_transition_records_nothing() -> None:
    adapter = _adapter()
    adapter.collect_events()
    with pytest.raises(IllegalTransition):
        check_transition(DRAFT, REVOKED)  # revocation is its own command, not a promotion
    with pytest.raises(IllegalTransition):
        adapter.promote(REVOKED, "bob")
    with pytest.raises(IllegalTransition):
        adapter.promote(CANARY, "bob", release="sha256:" + "e" * 64)
    assert adapter.collect_events() == []
    assert adapter.state == DRAFT


def test_serving_steps_after_revocation() -> None:
    adapter = _adapter()
    with pytest.raises(IllegalTransition, match="revoked"):
        adapter.record_serving_step("host-a", "drained", "backend")
    adapter.revoke("leak", "sec")
    with pytest.raises(IllegalTransition, match="'drained' before 'purged'"):
        adapter.record_serving_step("host-a", "purged", "backend")
    for step in ("drained", "purged", "unloaded"):
        adapter.record_serving_step("host-a", step, "backend")
    adapter.record_serving_step("host-b", "drained", "backend")
    with pytest.raises(AlreadyExists):
        adapter.record_serving_step("host-b", "drained", "backend")
    assert adapter.serving_steps == {"host-a": ["drained", "purged", "unloaded"],
                                     "host-b": ["drained"]}
    kinds = [type(e).__name__ for e in adapter.collect_events()][-4:]
    assert kinds == ["AdapterDrained", "AdapterPurged", "AdapterUnloaded", "AdapterDrained"]


def test_servability() -> None:
    assert is_servable(None)  # the base alone
    assert is_servable(STABLE) and is_servable(CANARY)
    for state in (DRAFT, CANDIDATE, DEPRECATED, REVOKED):
        assert not is_servable(state)


def test_canary_split_is_sticky_and_proportional() -> None:
    buckets = [canary_bucket("acme", f"session-{i}") for i in range(4000)]
    assert buckets == [canary_bucket("acme", f"session-{i}") for i in range(4000)]
    share = sum(b < 25 for b in buckets) / len(buckets)
    assert 0.2 < share < 0.3
    assert choose_release("S", "C", 25, 10) == ["C", "S"]
    assert choose_release("S", "C", 25, 60) == ["S", "C"]
    assert choose_release(None, "C", 25, 60) == ["C"]  # no stable yet: the canary takes all
    assert choose_release("S", None, 0, 0) == ["S"]
    assert choose_release(None, None, 0, 0) == []


def test_alias_rules() -> None:
    alias = Alias.create("chat", owner="acme", release=None, actor="alice")
    assert not alias.may_resolve("acme")  # the owner is not granted implicitly
    alias.grant("acme", "alice")
    assert alias.may_resolve("acme")
    with pytest.raises(AlreadyExists):
        alias.grant("acme", "alice")
    with pytest.raises(DomainError, match="owner"):
        alias.point(_release("sha256:" + "1" * 64, tenant="other"), True, "alice")
    with pytest.raises(IllegalTransition, match="not servable"):
        alias.point(_release("sha256:" + "2" * 64), False, "alice")
    r1, r2 = _release("sha256:" + "3" * 64), _release("sha256:" + "4" * 64, adapter=D2)
    alias.point(r1, True, "alice")
    with pytest.raises(IllegalTransition, match="already"):
        alias.point(r1, True, "alice")
    alias.set_canary(r2, 20, True, "alice")
    assert (alias.canary, alias.canary_percent) == (r2.digest, 20)
    with pytest.raises(DomainError, match="percent"):
        alias.set_canary(r2, 0, True, "alice")
    alias.point(r2, True, "alice")  # the canary graduates: the split ends
    assert alias.stable == r2.digest and alias.canary is None and alias.history == [r1.digest]
    with pytest.raises(IllegalTransition, match="no longer servable"):
        alias.rollback(False, "alice")
    alias.rollback(True, "alice")
    assert alias.stable == r1.digest and alias.history == []
    with pytest.raises(IllegalTransition, match="no previous"):
        alias.rollback(True, "alice")
    base = BaseModel.register(name="tiny", digest=BASE, tokenizer_digest=TOK,
                              linear_shapes={"m.q": [4, 4]}, actor="op")
    assert base.digest == BASE
    base_release = _release("sha256:" + "5" * 64, adapter=None, tenant=None)
    alias.point(base_release, True, "alice")  # a base-only release fits any alias
    assert alias.stable == base_release.digest


# -- validation (files only) ------------------------------------------------------------------


def _info(art: Artifacts) -> BaseInfo:
    return BaseInfo(name="tiny", digest=art.base_digest, tokenizer_digest=TOK,
                    linear_shapes=base_linear_shapes(art.base))


def _validate(art: Artifacts, path: Path, max_rank: int = 8) -> object:
    info = _info(art)
    return validate_adapter(path, max_rank=max_rank,
                            lookup_base=lambda ref: info if ref in ("tiny", info.digest) else None)


def test_valid_adapter(artifacts: Artifacts) -> None:
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
def test_each_check_names_itself(artifacts: Artifacts, name: str, check: str) -> None:
    with pytest.raises(ValidationFailed) as info:
        _validate(artifacts, artifacts.adapters[name])
    assert info.value.check == check
    assert str(artifacts.adapters[name].parent) not in info.value.message


def test_config_and_structure_checks(artifacts: Artifacts, tmp_path: Path) -> None:
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


def test_lifecycle_states_are_an_enum_of_plain_strings() -> None:
    assert [s.value for s in AdapterState] == [
        "draft", "candidate", "canary", "stable", "deprecated", "revoked"]
    assert tuple(AdapterState) == (DRAFT, CANDIDATE, CANARY, STABLE, DEPRECATED, REVOKED)
    assert CANARY == "canary" and f"{CANARY}" == "canary" and str(CANARY) == "canary"
    check_transition("canary", "stable")  # states read back as strings follow the same table
    with pytest.raises(IllegalTransition, match="from 'stable' to 'canary'"):
        check_transition(STABLE, CANARY)
    adapter = _adapter()
    adapter.promote("candidate", "bob")  # a plain string names the same state
    assert adapter.state is CANDIDATE
    (_, promoted) = adapter.collect_events()
    assert type(promoted.from_state) is str and type(promoted.to) is str  # type: ignore[attr-defined]
