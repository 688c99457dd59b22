"""Transparency-log primitives: RFC 6962 Merkle hashing and proofs, C2SP signed notes,
checkpoints and tlog-proofs. Pure: no database, no I/O; used by hosts, the control plane and
offline verifiers alike.

- Hashing (RFC 6962 2.1): a leaf hashes as SHA-256(0x00 || leaf), an inner node as
  SHA-256(0x01 || left || right); the tree over n leaves splits at the largest power of two
  below n. Proofs follow RFC 9162 2.1.3 (inclusion) and 2.1.4 (consistency).
- :class:`Frontier`: the perfect subtrees covering a log prefix (at most log2(n) hashes). Whoever
  holds the frontier of a verified size can check a later tree head by hashing only the leaves
  appended since: that recomputation is the consistency check between two checkpoints.
- Signed notes (c2sp.org/signed-note): the text, a blank line, then one line per signature
  ``— <key name> <base64(key id || signature)>``; an Ed25519 key id is the first four bytes of
  SHA-256(name || "\\n" || 0x01 || public key), and a verifier key reads
  ``<name>+<hex key id>+<base64(0x01 || public key)>``.
- Checkpoints (c2sp.org/tlog-checkpoint): the note text ``<origin>\\n<size>\\n<base64 root>\\n``.
- Proofs (c2sp.org/tlog-proof): ``c2sp.org/tlog-proof@v1``, an optional ``extra`` line, ``index
  N``, the inclusion proof's hashes one per line, a blank line, then the signed checkpoint.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

EMPTY_ROOT = hashlib.sha256(b"").digest()
PROOF_HEADER = "c2sp.org/tlog-proof@v1"
_ED25519 = b"\x01"
_DASH = "\u2014"


class ProofError(ValueError):
    """A proof, note or checkpoint that does not check; ``check`` names the failed check."""

    def __init__(self, check: str, detail: str) -> None:
        super().__init__(f"{check}: {detail}")
        self.check = check


# -- hashing ---------------------------------------------------------------------------------

def leaf_hash(leaf: bytes) -> bytes:
    return hashlib.sha256(b"\x00" + leaf).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two below ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def root(hashes: Sequence[bytes]) -> bytes:
    """The Merkle tree hash of the leaves whose leaf hashes are ``hashes``."""
    f = Frontier()
    f.extend(hashes)
    return f.root()


def inclusion_proof(index: int, hashes: Sequence[bytes]) -> list[bytes]:
    """The audit path of leaf ``index`` in the tree over ``hashes`` (RFC 6962 2.1.1)."""
    if not 0 <= index < len(hashes):
        raise ValueError(f"index {index} outside a tree of {len(hashes)} leaves")
    if len(hashes) == 1:
        return []
    k = _split(len(hashes))
    if index < k:
        return [*inclusion_proof(index, hashes[:k]), root(hashes[k:])]
    return [*inclusion_proof(index - k, hashes[k:]), root(hashes[:k])]


def verify_inclusion(index: int, size: int, leaf: bytes, proof: Sequence[bytes],
                     expected_root: bytes) -> None:
    """Raise ProofError("inclusion", ...) unless ``proof`` puts leaf hash ``leaf`` at
    ``index`` of the tree of ``size`` leaves whose root is ``expected_root`` (RFC 9162
    2.1.3.2)."""
    if not 0 <= index < size:
        raise ProofError("inclusion", f"index {index} is outside a tree of {size} leaves")
    fn, sn, r = index, size - 1, leaf
    for p in proof:
        if sn == 0:
            raise ProofError("inclusion", "the proof is longer than the tree is deep")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0 or r != expected_root:
        raise ProofError("inclusion", "the entry is not at this index of the checkpointed tree")


def consistency_proof(old_size: int, hashes: Sequence[bytes]) -> list[bytes]:
    """The proof that the tree of ``old_size`` leaves is a prefix of the tree over ``hashes``
    (RFC 6962 2.1.2)."""
    if not 0 < old_size <= len(hashes):
        raise ValueError(f"old size {old_size} outside 1..{len(hashes)}")

    def sub(m: int, leaves: Sequence[bytes], complete: bool) -> list[bytes]:
        n = len(leaves)
        if m == n:
            return [] if complete else [root(leaves)]
        k = _split(n)
        if m <= k:
            return [*sub(m, leaves[:k], complete), root(leaves[k:])]
        return [*sub(m - k, leaves[k:], False), root(leaves[:k])]

    return sub(old_size, hashes, True)


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes,
                       proof: Sequence[bytes]) -> None:
    """Raise ProofError("consistency", ...) unless ``proof`` shows the tree (old_size,
    old_root) is a prefix of (new_size, new_root) (RFC 9162 2.1.4.2)."""
    bad = ProofError("consistency", f"the tree of {new_size} leaves does not extend the "
                     f"tree of {old_size}")
    if not 0 < old_size <= new_size:
        raise ProofError("consistency", f"sizes {old_size} -> {new_size}")
    if old_size == new_size:
        if proof or old_root != new_root:
            raise bad
        return
    path = list(proof)
    if old_size & (old_size - 1) == 0:  # a power of two: the old root starts the path
        path.insert(0, old_root)
    if not path:
        raise bad
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise bad
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0 or fr != old_root or sr != new_root:
        raise bad


@dataclass
class Frontier:
    """The perfect subtrees covering leaves [0, size), largest first: (height, hash) each."""

    size: int = 0
    nodes: list[tuple[int, bytes]] = field(default_factory=list)

    def append(self, h: bytes) -> None:
        height = 0
        while self.nodes and self.nodes[-1][0] == height:
            h = node_hash(self.nodes.pop()[1], h)
            height += 1
        self.nodes.append((height, h))
        self.size += 1

    def extend(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self.append(h)

    def root(self) -> bytes:
        if not self.nodes:
            return EMPTY_ROOT
        r = self.nodes[-1][1]
        for _height, h in reversed(self.nodes[:-1]):
            r = node_hash(h, r)
        return r

    def copy(self) -> Frontier:
        return Frontier(self.size, list(self.nodes))

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "nodes": [[ht, b64(h)] for ht, h in self.nodes]}

    @classmethod
    def from_json(cls, doc: Mapping[str, object]) -> Frontier:
        nodes = doc.get("nodes") or []
        assert isinstance(nodes, list)
        size = doc.get("size", 0)
        assert isinstance(size, int)
        return cls(size, [(int(ht), unb64(h)) for ht, h in nodes])


# -- leaves ------------------------------------------------------------------------------------

def canonical(doc: Mapping[str, object]) -> bytes:
    """The one byte form of a leaf document: sorted keys, no spaces, UTF-8."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise ProofError("format", "expected base64 text")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ProofError("format", f"not base64: {text[:20]!r}") from None


# -- signed notes and checkpoints ------------------------------------------------------------

def _key_hash(name: str, public: bytes) -> bytes:
    return hashlib.sha256(name.encode() + b"\n" + _ED25519 + public).digest()[:4]


def _check_name(name: str) -> str:
    if not name or any(c.isspace() or c == "+" for c in name):
        raise ValueError(f"a note key name has no spaces or '+': {name!r}")
    return name


@dataclass(frozen=True)
class Verifier:
    """A trusted Ed25519 note key: its name, key id and public key."""

    name: str
    key_id: bytes
    public: bytes

    @classmethod
    def of(cls, name: str, public: bytes) -> Verifier:
        return cls(_check_name(name), _key_hash(name, public), public)

    @classmethod
    def parse(cls, vkey: str) -> Verifier:
        """Read ``<name>+<hex key id>+<base64(0x01 || key)>``."""
        parts = vkey.strip().split("+", 2)  # the base64 key may hold "+" itself
        if len(parts) != 3:
            raise ProofError("key", "a verifier key reads <name>+<hex id>+<base64 key>")
        name, hex_id, key = parts
        raw = unb64(key)
        if len(raw) != 33 or raw[:1] != _ED25519:
            raise ProofError("key", f"{name}: not an Ed25519 verifier key")
        v = cls.of(name, raw[1:])
        if v.key_id.hex() != hex_id.lower():
            raise ProofError("key", f"{name}: the key id does not match the key")
        return v

    def vkey(self) -> str:
        return f"{self.name}+{self.key_id.hex()}+{b64(_ED25519 + self.public)}"


class NoteSigner:
    """An Ed25519 note key (the private half never leaves the host that made it)."""

    def __init__(self, name: str, private: Ed25519PrivateKey) -> None:
        self.private = private
        public = private.public_key().public_bytes(serialization.Encoding.Raw,
                                                   serialization.PublicFormat.Raw)
        self.verifier = Verifier.of(name, public)

    @classmethod
    def generate(cls, name: str) -> NoteSigner:
        return cls(name, Ed25519PrivateKey.generate())

    def sign(self, text: str) -> str:
        """The signed note of ``text`` (which ends with a newline)."""
        if not text.endswith("\n"):
            raise ValueError("note text must end with a newline")
        sig = self.private.sign(text.encode())
        return f"{text}\n{_DASH} {self.verifier.name} {b64(self.verifier.key_id + sig)}\n"


def open_note(note: str, trusted: Sequence[Verifier]) -> tuple[str, Verifier]:
    """The text of ``note`` and the trusted key that signed it; ProofError("signature", ...)
    when no trusted key signed it ("unknown key" when none of its keys is trusted)."""
    text, sep, sigs = note.partition("\n\n")
    if not sep or not sigs.endswith("\n"):
        raise ProofError("format", "a signed note is text, a blank line, then signatures")
    text += "\n"
    known = False
    for line in sigs.splitlines():
        dash, _, rest = line.partition(" ")
        name, _, sig64 = rest.partition(" ")
        if dash != _DASH or not name or not sig64:
            raise ProofError("format", f"not a signature line: {line[:60]!r}")
        raw = unb64(sig64)
        for v in trusted:
            if v.name != name or raw[:4] != v.key_id:
                continue
            known = True
            try:
                Ed25519PublicKey.from_public_bytes(v.public).verify(raw[4:], text.encode())
            except InvalidSignature:
                continue
            return text, v
    if not known:
        raise ProofError("unknown key", "no trusted key signed this checkpoint")
    raise ProofError("signature", "the checkpoint's signature does not verify")


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    size: int
    root: bytes

    def text(self) -> str:
        return f"{self.origin}\n{self.size}\n{b64(self.root)}\n"

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        lines = text.split("\n")
        if len(lines) < 4 or not lines[0] or not lines[1].isdigit() or (
                lines[1] != "0" and lines[1].startswith("0")):
            raise ProofError("format", "a checkpoint reads origin, size, root hash")
        r = unb64(lines[2])
        if len(r) != 32:
            raise ProofError("format", "a checkpoint's root hash has 32 bytes")
        return cls(lines[0], int(lines[1]), r)


# -- proofs (receipts) -------------------------------------------------------------------------

@dataclass(frozen=True)
class TlogProof:
    """A c2sp.org/tlog-proof: entry ``index``, its inclusion ``hashes`` and the signed
    ``checkpoint`` note; ``extra`` carries the entry itself (the leaf's bytes)."""

    index: int
    hashes: tuple[bytes, ...]
    checkpoint: str
    extra: bytes | None = None

    def text(self) -> str:
        lines = [PROOF_HEADER]
        if self.extra is not None:
            lines.append(f"extra {b64(self.extra)}")
        lines.append(f"index {self.index}")
        lines += [b64(h) for h in self.hashes]
        return "\n".join(lines) + "\n\n" + self.checkpoint

    @classmethod
    def parse(cls, text: str) -> TlogProof:
        head, sep, note = text.partition("\n\n")
        lines = head.split("\n")
        if not sep or lines[0] != PROOF_HEADER:
            raise ProofError("format", f"not a {PROOF_HEADER} proof")
        extra = None
        rest = lines[1:]
        if rest and rest[0].startswith("extra "):
            extra = unb64(rest[0][len("extra "):])
            rest = rest[1:]
        if not rest or not rest[0].startswith("index ") or not rest[0][6:].isdigit():
            raise ProofError("format", "the proof names no entry index")
        hashes = tuple(unb64(h) for h in rest[1:])
        if any(len(h) != 32 for h in hashes):
            raise ProofError("format", "an inclusion hash has 32 bytes")
        return cls(int(rest[0][6:]), hashes, note, extra)
