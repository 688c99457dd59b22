"""How hard the fuzzers push: ``LORAPLANE_FUZZ_EXAMPLES`` cases per fuzzer (default 10,000).

10,000 cases for each of the three fuzzers (ticket decoder, request parameter parser, adapter
validator) run in the default test command; set a smaller number for a quick local loop.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pyseto
from cryptography.hazmat.primitives import serialization
from hypothesis import HealthCheck, settings

from control.contracts.tickets import TicketSigner

FUZZ_EXAMPLES = int(os.environ.get("LORAPLANE_FUZZ_EXAMPLES", "10000"))
# Cases actually run per fuzzer in this process (the tests assert the count, and print it).
CASES: Counter[str] = Counter()

fuzz = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    database=None,  # every run explores afresh; no example database left in the tree
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large],
)


def pyseto_key(signer: TicketSigner) -> Any:
    """``signer``'s private key as a pyseto key: tests forge payloads with pyseto itself, an
    implementation independent of the signer's own encoder."""
    pem = signer._private.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
    return pyseto.Key.new(version=4, purpose="public", key=pem)
