"""Registration through the CLI: bad adapters exit non-zero, say why, are audited, store nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from control.cli.main import app
from control.contracts.store import ArtifactStore
from control.tools.kit import KitManifest
from tests.artifacts import misshapen_copy, pickled_copy


def _cli(home: Path, *args: str) -> tuple[int, str]:
    res = CliRunner().invoke(app, ["--json", "--home", str(home), "--actor", "ops", *args],
                             env={"LORAPLANE_DB_URL": ""})
    return res.exit_code, res.stdout


@pytest.fixture()
def home(tmp_path: Path, kit_dir: Path) -> Path:
    kit = KitManifest.load(kit_dir)
    h = tmp_path / "home"
    code, out = _cli(h, "base", "register", str(kit_dir / kit.base_path), "--name", "tiny",
                     "--alias", "base")
    assert code == 0, out
    assert json.loads(out)["digest"] == kit.base_digest
    code, out = _cli(h, "tenant", "create", "acme")
    assert code == 0 and json.loads(out)["api_key"].startswith("lp_")
    return h


def _bad_adapters(kit_dir: Path, tmp: Path) -> dict[str, Path]:
    kit = KitManifest.load(kit_dir)
    alpha = kit_dir / kit.adapters["alpha"].path
    return {
        "base": kit_dir / kit.adapters["other-base"].path,
        "format": pickled_copy(alpha, tmp / "pickled"),
        "shapes": misshapen_copy(alpha, tmp / "misshapen"),
    }


def test_bad_adapters_are_refused_audited_and_not_stored(home: Path, kit_dir: Path,
                                                         tmp_path: Path) -> None:
    store = ArtifactStore(home / "store")
    before = set(store.digests())
    for check, path in _bad_adapters(kit_dir, tmp_path).items():
        code, out = _cli(home, "adapter", "register", str(path), "--tenant", "acme",
                         "--alias", "acme-x")
        assert code != 0, f"{check}: accepted"
        err = json.loads(out)
        assert err["check"] == check and err["error"], err
        assert str(home) not in err["error"]  # no store paths in messages
    assert set(store.digests()) == before
    code, out = _cli(home, "audit", "log")
    events = json.loads(out)
    rejected = [e for e in events if e["event_type"] == "RegistrationRejected"]
    assert sorted(e["summary"]["check"] for e in rejected) == ["base", "format", "shapes"]
    assert all(e["actor"] == "ops" for e in rejected)
    assert not any(e["event_type"] == "AdapterRegistered" for e in events)


def test_full_operator_flow(home: Path, kit_dir: Path) -> None:
    kit = KitManifest.load(kit_dir)
    code, out = _cli(home, "adapter", "register", str(kit_dir / kit.adapters["alpha"].path),
                     "--tenant", "acme", "--alias", "acme-alpha")
    assert code == 0, out
    digest = json.loads(out)["digest"]
    assert digest == kit.adapters["alpha"].digest
    assert _cli(home, "grant", "acme", "acme-alpha")[0] == 0
    # Draft releases cannot be resolved: no ticket yet.
    code, out = _cli(home, "ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha")
    assert code != 0
    # Guarded lifecycle: no skipping from draft to stable.
    code, out = _cli(home, "adapter", "promote", digest, "--to", "stable")
    assert code != 0 and "draft" in json.loads(out)["error"]
    report = home.parent / "eval.json"
    report.write_text(json.dumps({"suite": "smoke", "passed": True}))
    code, out = _cli(home, "adapter", "release", digest, "--evaluation", str(report),
                     "--external")
    assert code == 0 and json.loads(out)["state"] == "stable", out
    code, out = _cli(home, "ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha")
    assert code == 0, out
    ticket = json.loads(out)
    assert ticket["adapter"] == digest and ticket["tenant"] == "acme"
    assert ticket["ticket"].startswith("v4.public.")
    # Signing key rotation: retire the key that signed it, and the next ticket has the new one.
    code, out = _cli(home, "key", "rotate")
    assert code == 0 and json.loads(out)["previous"] == ticket["kid"], out
    new_kid = json.loads(out)["kid"]
    assert _cli(home, "key", "retire", ticket["kid"], "--reason", "rotated")[0] == 0
    code, out = _cli(home, "ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha")
    assert code == 0 and json.loads(out)["kid"] == new_kid
    assert _cli(home, "adapter", "revoke", digest, "--reason", "leak")[0] == 0
    code, _ = _cli(home, "ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha")
    assert code != 0
    code, out = _cli(home, "audit", "log")
    kinds = [e["event_type"] for e in json.loads(out)]
    for kind in ("BaseRegistered", "TenantCreated", "AdapterRegistered", "AliasGranted",
                 "EvaluationRecorded", "AdapterPromoted", "ReleaseCreated", "AliasPointed",
                 "SigningKeyRecorded", "AdapterRevoked"):
        assert kind in kinds
    assert (home / "keys" / "private" / "active.pem").stat().st_mode & 0o777 == 0o600
    code, out = _cli(home, "adapter", "promote", digest, "--to", "stable")
    assert code != 0 and "revoked" in json.loads(out)["error"]


def test_operators_learn_why_there_is_no_ticket(home: Path, kit_dir: Path) -> None:
    kit = KitManifest.load(kit_dir)
    code, out = _cli(home, "adapter", "register", str(kit_dir / kit.adapters["alpha"].path),
                     "--tenant", "acme", "--alias", "acme-alpha")
    assert code == 0, out

    def why(tenant: str, alias: str) -> str:
        code, out = _cli(home, "ticket", "issue", "--tenant", tenant, "--alias", alias)
        assert code == 2, out
        return str(json.loads(out)["error"])

    assert "unknown alias 'acme-beta'" in why("acme", "acme-beta")
    assert "not granted: run `loraplane grant acme acme-alpha`" in why("acme", "acme-alpha")
    assert _cli(home, "grant", "acme", "acme-alpha")[0] == 0
    assert "no servable release" in why("acme", "acme-alpha")  # still a draft
    assert "unknown tenant 'globex'" in why("globex", "acme-alpha")


def test_incidents_about_an_unknown_digest_are_an_error_not_an_empty_answer(
        home: Path, kit_dir: Path) -> None:
    kit = KitManifest.load(kit_dir)
    code, out = _cli(home, "adapter", "register", str(kit_dir / kit.adapters["alpha"].path),
                     "--tenant", "acme", "--alias", "acme-alpha")
    digest = json.loads(out)["digest"]
    one_off = digest[:-1] + ("0" if digest[-1] != "0" else "1")
    code, out = _cli(home, "incident", "requests", "--adapter", one_off)
    assert code == 2 and f"unknown adapter digest {one_off}" in json.loads(out)["error"]
    code, out = _cli(home, "incident", "requests", "--training-data-version", "v9")
    assert code == 2 and "unknown training data version 'v9'" in json.loads(out)["error"]
    code, out = _cli(home, "incident", "requests", "--adapter", digest)  # known, served nothing
    assert code == 0 and json.loads(out) == []
    res = CliRunner().invoke(app, ["--home", str(home), "incident", "requests", "--adapter",
                                   digest], env={"LORAPLANE_DB_URL": "", "COLUMNS": "200"})
    assert res.exit_code == 0 and digest in res.stdout  # the title shows the whole digest


@pytest.mark.parametrize("verb", [
    ["ticket", "issue", "--tenant", "acme", "--alias", "acme-alpha"],
    ["incident", "requests", "--adapter", "sha256:" + "ab" * 32],
    ["audit", "log"], ["audit", "verify"], ["stats"], ["adapter", "list"], ["tenant", "list"],
    ["key", "list"], ["alias", "show", "acme-alpha"],
], ids=lambda v: " ".join(v[:2]))
def test_read_only_verbs_name_a_missing_state_instead_of_creating_one(
        tmp_path: Path, verb: list[str]) -> None:
    nowhere = tmp_path / "not-a-home"
    code, out = _cli(nowhere, *verb)
    assert code == 2, out
    assert "no loraplane state in" in json.loads(out)["error"]
    assert "LORAPLANE_HOME" in json.loads(out)["error"]
    assert not nowhere.exists()  # nothing was created
