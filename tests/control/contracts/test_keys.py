"""Key files created by several processes at once: one key wins, and its public half is the one
published (the audit key's ``public.pem`` once held the loser's public half, so verification
failed for good; a reader could also catch ``public.pem`` half written)."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from control.contracts.keys import load_ed25519, load_or_create_ed25519, write_atomically

CREATORS = 8


def _pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM,
                                         serialization.PublicFormat.SubjectPublicKeyInfo)


def _race(d: Path) -> tuple[list[Ed25519PrivateKey], Path, Path]:
    """``CREATORS`` threads create the key in ``d`` at once; returns what each got."""
    path, public = d / "private.pem", d / "public.pem"
    start = threading.Barrier(CREATORS)
    got: list[Ed25519PrivateKey] = []

    def publish(k: Ed25519PrivateKey) -> None:
        public.write_bytes(_pem(k))
        time.sleep(random.uniform(0, 0.02))  # widen the window between publish and link

    def create() -> None:
        start.wait()
        got.append(load_or_create_ed25519(path, "test key", before_publish=publish)[0])

    threads = [threading.Thread(target=create) for _ in range(CREATORS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got, path, public


def test_concurrent_creators_agree_on_one_key_and_publish_its_public_half(tmp_path: Path
                                                                          ) -> None:
    for round_ in range(3):
        d = tmp_path / f"round-{round_}"
        d.mkdir()
        got, path, public = _race(d)
        winner = load_ed25519(path, "test key")
        assert {_pem(k) for k in got} == {_pem(winner)}, "creators ended with different keys"
        assert public.read_bytes() == _pem(winner), "the published public half is not the key's"
        assert sorted(p.name for p in d.iterdir() if not p.name.endswith(".lock")) == [
            "private.pem", "public.pem"]  # no temporary file left behind


def test_an_atomic_write_is_never_seen_half_done(tmp_path: Path) -> None:
    path = tmp_path / "public.pem"
    big, small = b"A" * 400_000, b"B" * 10
    write_atomically(path, big)
    stop = threading.Event()
    seen: set[bytes] = set()

    def read() -> None:
        while not stop.is_set():
            data = path.read_bytes()
            seen.add(data if data in (big, small) else b"torn:" + data[:8])

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(200):
            write_atomically(path, big if i % 2 else small)
    finally:
        stop.set()
        reader.join()
    assert seen <= {big, small}, "a reader saw a file half written"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
