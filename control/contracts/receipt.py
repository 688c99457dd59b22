"""Offline verification of a per-answer receipt: a c2sp.org/tlog-proof of a ledger entry.

A receipt holds the ledger entry itself (the proof's ``extra``: the leaf of
``control.contracts.ledger_log``, binding request id, tenant, ticket id, served adapter, base
and tokenizer digests, sampling values and the SHA-256 of the output text), its position, the
inclusion proof and the host's signed checkpoint. :func:`verify_receipt` needs nothing but the
receipt, the output text the client got and the verifier keys it trusts (``loraplane receipt
keys`` writes the keys the control plane recorded); it raises :class:`~control.contracts.tlog.
ProofError` whose ``check`` names what failed:

- ``unknown key``: no trusted key signed the checkpoint; ``signature``: a trusted key's
  signature does not verify;
- ``origin``: the checkpoint is another log's than the entry's host;
- ``inclusion``: the entry is not at that position of the checkpointed tree (the entry was
  changed, a digest say, or the proof is against another checkpoint);
- ``output``: the text is not the output the entry was logged with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from control.contracts.ledger_log import origin_of, output_sha256, parse_leaf
from control.contracts.tlog import (
    Checkpoint,
    ProofError,
    TlogProof,
    Verifier,
    leaf_hash,
    open_note,
    verify_inclusion,
)


@dataclass(frozen=True)
class VerifiedReceipt:
    entry: dict[str, Any]  # the ledger leaf
    index: int
    tree_size: int
    key: str  # the verifier key that signed the checkpoint

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "request_id": self.entry.get("request_id"),
                "host": self.entry.get("host"), "index": self.index,
                "tree_size": self.tree_size, "key": self.key, "entry": self.entry}


def trusted_keys(text: str) -> list[Verifier]:
    """Verifier keys, one a line (blank lines and ``#`` comments skipped)."""
    return [Verifier.parse(line) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def verify_receipt(receipt: str, output: bytes, trusted: Sequence[Verifier]) -> VerifiedReceipt:
    """Check ``receipt`` for ``output`` with only ``trusted`` keys (module notes)."""
    proof = TlogProof.parse(receipt)
    if proof.extra is None:
        raise ProofError("format", "the receipt carries no ledger entry")
    text, key = open_note(proof.checkpoint, trusted)
    cp = Checkpoint.parse(text)
    try:
        entry = parse_leaf(proof.extra.decode())
    except (UnicodeDecodeError, ValueError):
        raise ProofError("format", "the receipt's entry is not a ledger entry") from None
    if cp.origin != origin_of(str(entry.get("host"))) or key.name != cp.origin:
        raise ProofError("origin", "the checkpoint is not the log of the entry's host")
    verify_inclusion(proof.index, cp.size, leaf_hash(proof.extra), proof.hashes, cp.root)
    if entry.get("output_sha256") != output_sha256(output):
        raise ProofError("output", "the text is not the output this request was answered with")
    return VerifiedReceipt(entry, proof.index, cp.size, key.vkey())
