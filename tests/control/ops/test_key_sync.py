"""A Triton host's ``keys/public`` holds the recorded, unretired signing keys and nothing else.

The verifier (``load_public_keys``) trusts every ``*.pub`` in that folder, naming each key by
its content; one key sync must leave nothing there that the control plane did not record.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts.config import Settings
from control.contracts.tickets import (
    TicketRejected,
    TicketSigner,
    TicketVerifier,
    load_public_keys,
)
from control.ops.key_sync import sync_public_keys

DIGEST = "sha256:" + "0" * 64


class Recorded:
    """The two reads of the routing projection that key sync makes (every key here vouched for
    by the root: which keys the root vouches for is tests/control/app/test_forged_signing_keys's
    question; this file is about the folder)."""

    def __init__(self, keys: dict[str, str], retired: frozenset[str] = frozenset()) -> None:
        self.keys, self.retired = keys, retired

    def vouched_signing_keys(self, keys_dir: Path) -> dict[str, str]:
        return dict(self.keys)

    def retired_key_ids(self) -> frozenset[str]:
        return self.retired


def _signer() -> TicketSigner:
    return TicketSigner(Ed25519PrivateKey.generate())


def _sync(settings: Settings, recorded: Recorded) -> int:
    return sync_public_keys(settings, recorded)  # type: ignore[arg-type]


def _ticket(signer: TicketSigner) -> str:
    return signer.issue(tenant="acme", model="lora_llm", base=DIGEST, adapter=None,
                        tokenizer=DIGEST, release=None, disclose=False, ttl_s=60)[0]


def _verifier(public: Path, *signers: TicketSigner) -> TicketVerifier:
    """A host's verifier over the key files in ``public``, holding the seals of ``signers``
    (what this test checks is which public keys the sync leaves trusted)."""
    return TicketVerifier(load_public_keys(public), model="lora_llm", base=DIGEST,
                          tokenizer=DIGEST, seal_keys={s.kid: s.seal_key for s in signers})


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(home=tmp_path / "host", db_url="sqlite://")


def test_a_strangers_key_file_is_gone_after_one_sync(settings: Settings) -> None:
    ours, stranger = _signer(), _signer()
    recorded = Recorded({ours.kid: ours.public_b64})
    public = settings.keys_dir / "public"
    _sync(settings, recorded)
    (public / f"{stranger.kid}.pub").write_text(stranger.public_b64 + "\n")
    trusted = _verifier(public, ours, stranger).verify(_ticket(stranger))
    assert trusted.kid == stranger.kid  # trusted: the bug
    assert _sync(settings, recorded) == 1
    assert sorted(os.listdir(public)) == [f"{ours.kid}.pub"]
    with pytest.raises(TicketRejected) as refused:
        _verifier(public, ours, stranger).verify(_ticket(stranger))
    assert refused.value.reason == "unknown_key"
    assert _verifier(public, ours, stranger).verify(_ticket(ours)).kid == ours.kid
    assert _sync(settings, recorded) == 0


def test_a_recorded_kids_file_holding_another_key_is_rewritten(settings: Settings) -> None:
    ours, stranger = _signer(), _signer()
    recorded = Recorded({ours.kid: ours.public_b64})
    public = settings.keys_dir / "public"
    _sync(settings, recorded)
    path = public / f"{ours.kid}.pub"
    path.write_text(stranger.public_b64 + "\n")  # the name says our kid; the key is not ours
    assert set(load_public_keys(public)) == {stranger.kid}
    assert _sync(settings, recorded) == 1
    assert path.read_text().strip() == ours.public_b64
    assert not path.is_symlink()
    assert set(load_public_keys(public)) == {ours.kid}


def test_only_regular_files_named_for_a_recorded_key_survive(settings: Settings,
                                                             tmp_path: Path) -> None:
    ours, retired, stranger = _signer(), _signer(), _signer()
    recorded = Recorded({ours.kid: ours.public_b64, retired.kid: retired.public_b64},
                        retired=frozenset({retired.kid}))
    public = settings.keys_dir / "public"
    public.mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "key"
    target.write_text(ours.public_b64 + "\n")
    (public / f"{ours.kid}.pub").symlink_to(target)  # right content today, any content later
    (public / f"{stranger.kid}.pub").symlink_to(elsewhere / "missing")
    (public / f"{retired.kid}.pub").write_text(retired.public_b64 + "\n")
    (public / f".{stranger.kid}.pub").write_text(stranger.public_b64 + "\n")  # globbed too
    (public / f"{stranger.kid}.pem").write_text(stranger.public_b64 + "\n")
    (public / "notes.txt").write_text("hello\n")
    (public / "sub.pub").mkdir()  # a folder the verifier would fail to read
    (public / "sub.pub" / f"{stranger.kid}.pub").write_text(stranger.public_b64 + "\n")
    _sync(settings, recorded)
    assert sorted(os.listdir(public)) == [f"{ours.kid}.pub"]
    assert (public / f"{ours.kid}.pub").is_file() and not (public / f"{ours.kid}.pub").is_symlink()
    assert target.read_text().strip() == ours.public_b64  # a link's target is left alone
    assert set(load_public_keys(public)) == {ours.kid}


def test_a_public_folder_that_is_a_symlink_is_replaced(settings: Settings,
                                                       tmp_path: Path) -> None:
    ours, stranger = _signer(), _signer()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / f"{stranger.kid}.pub").write_text(stranger.public_b64 + "\n")
    settings.keys_dir.mkdir(parents=True)
    (settings.keys_dir / "public").symlink_to(theirs)
    _sync(settings, Recorded({ours.kid: ours.public_b64}))
    public = settings.keys_dir / "public"
    assert public.is_dir() and not public.is_symlink()
    assert set(load_public_keys(public)) == {ours.kid}
    assert os.listdir(theirs) == [f"{stranger.kid}.pub"]  # not ours to clean


def test_a_recorded_key_whose_id_is_not_its_hash_is_not_written(settings: Settings) -> None:
    ours, other = _signer(), _signer()
    recorded = Recorded({ours.kid: ours.public_b64, "0123456789abcdef": other.public_b64,
                         "fedcba9876543210": "not base64!"})
    _sync(settings, recorded)
    assert sorted(os.listdir(settings.keys_dir / "public")) == [f"{ours.kid}.pub"]
