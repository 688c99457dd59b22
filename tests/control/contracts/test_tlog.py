"""RFC 6962 hashing and proofs, C2SP signed notes, checkpoints and tlog-proofs
(``control.contracts.tlog``), against the RFC's recursive definitions and published vectors."""

from __future__ import annotations

import hashlib

import pytest

from control.contracts.tlog import (
    EMPTY_ROOT,
    Checkpoint,
    Frontier,
    NoteSigner,
    ProofError,
    TlogProof,
    Verifier,
    consistency_proof,
    inclusion_proof,
    leaf_hash,
    node_hash,
    open_note,
    root,
    verify_consistency,
    verify_inclusion,
)

# The leaves and roots of certificate-transparency's Merkle tree tests (RFC 6962 hashing).
CT_LEAVES = [bytes.fromhex(h) for h in (
    "", "00", "10", "2021", "3031", "40414243", "5051525354555657",
    "606162636465666768696a6b6c6d6e6f")]
CT_ROOTS = [
    "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d",
    "fac54203e7cc696cf0dfcb42c92a1d9dbaf70ad9e621f4bd8d98662f00e3c125",
    "aeb6bcfe274b70a14fb067a5e5578264db0fa9b51af5e0ba159158f329e06e77",
    "d37ee418976dd95753c1c73862b9398fa2a2cf9b4ff0fdfe8b30cd95209614b7",
    "4e3bbb1f7b478dcfe71fb631631519a3bca12c9aefca1612bfce4c13a86264d4",
    "76e67dadbcdf1e10e1b74ddc608abd2f98dfb16fbce75277b5232a127f2087ef",
    "ddb89be403809e325750d3d263cd78929c2942b7942a34b77e122c9594a74c8c",
    "5dc9da79a70659a9ad559cb701ded9a2ab9d823aad2f4960cfe370eff4604328",
]


def mth(leaves: list[bytes]) -> bytes:
    """RFC 6962 2.1's recursive definition, as written."""
    if not leaves:
        return hashlib.sha256(b"").digest()
    if len(leaves) == 1:
        return leaf_hash(leaves[0])
    k = 1
    while k * 2 < len(leaves):
        k *= 2
    return node_hash(mth(leaves[:k]), mth(leaves[k:]))


def test_roots_match_the_published_vectors_and_the_definition() -> None:
    hashes = [leaf_hash(x) for x in CT_LEAVES]
    assert [root(hashes[:n]).hex() for n in range(1, 9)] == CT_ROOTS
    assert root([]) == EMPTY_ROOT
    data = [bytes([i]) * i for i in range(40)]
    for n in range(41):
        assert root([leaf_hash(x) for x in data[:n]]) == mth(data[:n]), n


def test_every_inclusion_proof_verifies_and_a_wrong_one_does_not() -> None:
    hashes = [leaf_hash(bytes([i])) for i in range(21)]
    for n in range(1, 22):
        r = root(hashes[:n])
        for i in range(n):
            proof = inclusion_proof(i, hashes[:n])
            verify_inclusion(i, n, hashes[i], proof, r)
            with pytest.raises(ProofError) as e:
                verify_inclusion(i, n, leaf_hash(b"other"), proof, r)
            assert e.value.check == "inclusion"
            if n > 1:
                with pytest.raises(ProofError):
                    verify_inclusion((i + 1) % n, n, hashes[i], proof, r)


def test_every_consistency_proof_verifies_and_a_forked_tree_does_not() -> None:
    hashes = [leaf_hash(bytes([i])) for i in range(19)]
    forked = [*hashes[:5], leaf_hash(b"forged"), *hashes[6:]]
    for n in range(1, 20):
        for m in range(1, n + 1):
            proof = consistency_proof(m, hashes[:n])
            verify_consistency(m, n, root(hashes[:m]), root(hashes[:n]), proof)
            if m > 5:  # the old tree held the changed leaf: no proof links it to the fork
                with pytest.raises(ProofError) as e:
                    verify_consistency(m, n, root(hashes[:m]), root(forked[:n]), proof)
                assert e.value.check == "consistency"


def test_frontier_extends_to_the_same_root_and_round_trips() -> None:
    hashes = [leaf_hash(bytes([i])) for i in range(37)]
    f = Frontier()
    for i, h in enumerate(hashes):
        f.append(h)
        assert f.root() == root(hashes[:i + 1])
        again = Frontier.from_json(f.to_json())
        assert (again.size, again.root()) == (f.size, f.root())
    assert len(f.nodes) == bin(37).count("1")


def test_signed_checkpoint_opens_with_its_key_only() -> None:
    signer = NoteSigner.generate("loraplane.ledger/host-a")
    other = NoteSigner.generate("loraplane.ledger/host-a")  # same name, another key
    cp = Checkpoint("loraplane.ledger/host-a", 3, root([leaf_hash(b"x")] * 3))
    note = signer.sign(cp.text())
    assert note.startswith(cp.text() + "\n\u2014 loraplane.ledger/host-a ")
    text, key = open_note(note, [other.verifier, signer.verifier])
    assert Checkpoint.parse(text) == cp and key == signer.verifier
    assert Verifier.parse(signer.verifier.vkey()) == signer.verifier
    with pytest.raises(ProofError) as e:
        open_note(note, [other.verifier])
    assert e.value.check == "unknown key"
    forged = note.replace("\n3\n", "\n4\n")
    with pytest.raises(ProofError) as e:
        open_note(forged, [signer.verifier])
    assert e.value.check == "signature"


def test_tlog_proof_round_trips_in_the_c2sp_text_form() -> None:
    signer = NoteSigner.generate("example.com/log")
    note = signer.sign(Checkpoint("example.com/log", 2, b"\x01" * 32).text())
    p = TlogProof(1, (b"\x02" * 32,), note, b'{"a":1}')
    text = p.text()
    assert text.splitlines()[:3] == ["c2sp.org/tlog-proof@v1", "extra eyJhIjoxfQ==",
                                     "index 1"]
    assert TlogProof.parse(text) == p
    with pytest.raises(ProofError):
        TlogProof.parse(text.replace("index 1", "index x"))
