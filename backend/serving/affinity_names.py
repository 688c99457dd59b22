"""The names a host's placement metrics give each adapter (issue 25): the affinity values the
tickets of its recent requests carried.

The endpoint picker compares a request's ``model`` with the adapter names a host publishes
(``backend.triton.placement_metrics``). Through a host's OpenAI route ``model`` is the ticket's
affinity value (``control.gateway.host_openai``), never the adapter digest, which the ticket
seals; so the host publishes, for an adapter, the affinity values its requests came with. One
adapter may be reached through several aliases (each its own value), and one value may name two
adapters (both arms of a canary), so the map is digest -> the most recent values, at most
:data:`PER_DIGEST`, and the digest itself stands for requests whose ticket carried no value.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

PER_DIGEST = 2
# Adapters remembered, least recently used forgotten first: far more than a host keeps resident
# (its device slots and the host-memory series published), a few hundred kilobytes at most.
MAX_DIGESTS = 4096


class AffinityNames:
    def __init__(self, max_digests: int = MAX_DIGESTS) -> None:
        self.max_digests = max_digests
        self._names: OrderedDict[str, tuple[str, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def record(self, digest: str, affinity: str | None) -> None:
        """A request for adapter ``digest`` was admitted with a ticket of ``affinity`` (None:
        the ticket carried none)."""
        name = affinity if affinity is not None else digest
        with self._lock:
            before = self._names.pop(digest, ())
            self._names[digest] = (name, *(n for n in before if n != name))[:PER_DIGEST]
            while len(self._names) > self.max_digests:
                self._names.popitem(last=False)

    def names(self, digest: str) -> tuple[str, ...]:
        """What ``digest`` is published as, most recent first: its digest when nothing was
        recorded for it."""
        with self._lock:
            return self._names.get(digest) or (digest,)
