"""A prompt (prefix) cache: the KV cache and first-token logits of a prompt already run.

Every entry is keyed by a tenant salt, the base, adapter and tokenizer digests and the prompt's
token ids. The adapter part is the digest from the verified ticket, never an alias: when an alias
moves, its tickets name the new digest, so the old adapter's entries cannot answer them. Two
adapters with the same prompt have different keys. Revoking a digest purges its entries.

Tenant-private: a hit answers faster than a miss, so a cache shared by two tenants tells one of
them, by timing its own requests, whether the other recently sent a prompt (vLLM's
CVE-2025-46570; PromptPeek recovers prompts token by token this way). So the key's ``salt`` is
derived on the host from the verified ticket's tenant (:class:`TenantSalts`): two tenants on the
base model, or on one adapter granted to both, never share an entry, while one tenant's repeated
prompts still hit. The caller never supplies the salt: no request parameter is read for it (a
``cache_salt`` or any other parameter is ignored, as every parameter but the ticket is), unlike
vLLM's caller-chosen ``cache_salt``, which a caller could copy from a victim.

The other prompt-derived cache on the serving path is the tokenizer's own word cache (the
``tokenizers`` library memoizes word -> tokens; the kit's byte-level tokenizer treats a whole
prompt as one word): :func:`uncached_tokenizer` turns it off, since it cannot be salted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

V = TypeVar("V")
T = TypeVar("T")

log = logging.getLogger("loraplane.prefix_cache")

# Domain separation: a salt is only ever a prefix-cache salt, whatever else a secret keys.
SALT_DOMAIN = b"loraplane/prefix-cache/tenant/v1\x00"


@dataclass(frozen=True)
class PrefixKey:
    """What a cached prompt result depends on; equal keys must give equal results, and only
    requests of one tenant may give equal keys (``salt``, keyword-only so no caller can leave
    it out)."""

    base: str
    adapter: str | None  # None: the bare base model
    tokenizer: str
    token_ids: tuple[int, ...]
    salt: bytes = field(kw_only=True, repr=False)


class TenantSalts:
    """The host's tenant salts: HMAC-SHA256 of the tenant id under a secret of this process.

    The secret is random per process and never leaves it: the cache lives in this process's
    memory, so nothing needs the salts elsewhere, and no salt can be computed, or copied, from
    outside (the tenant id alone, a public name, would do for the key; the secret also keeps a
    salt seen in a dump from naming its tenant by a dictionary of tenant ids)."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret if secret is not None else secrets.token_bytes(32)

    def of(self, tenant: str) -> bytes:
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("a prefix-cache salt needs the verified ticket's tenant")
        return hmac.new(self._secret, SALT_DOMAIN + tenant.encode("utf-8"),
                        hashlib.sha256).digest()


def uncached_tokenizer(tokenizer: T) -> T:
    """``tokenizer`` with the ``tokenizers`` model's word cache off and emptied (BPE and
    Unigram keep one: a word's tokens, shared by every caller; see the module notes). A
    tokenizer without one (a slow tokenizer, WordPiece) is returned as it is."""
    backend: Any = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    resize, clear = getattr(model, "_resize_cache", None), getattr(model, "_clear_cache", None)
    if callable(resize) and callable(clear):
        resize(0)  # capacity 0: nothing is stored from now on
        clear()
    elif model is not None:
        log.info("the tokenizer model %s keeps no word cache", type(model).__name__)
    return tokenizer


@dataclass
class PrefixStats:
    hits: int = 0
    misses: int = 0
    entries: int = 0
    bytes: int = 0


class PrefixCache(Generic[V]):
    """LRU over a byte budget; thread-safe."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[PrefixKey, tuple[V, int]] = OrderedDict()
        self.stats = PrefixStats()

    def get(self, key: PrefixKey) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: PrefixKey, value: V, nbytes: int) -> None:
        """Insert (or replace) an entry; evict least recently used ones to fit the budget."""
        if nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.stats.bytes -= old[1]
            while self._items and self.stats.bytes + nbytes > self.max_bytes:
                _, (_, n) = self._items.popitem(last=False)
                self.stats.bytes -= n
            self._items[key] = (value, nbytes)
            self.stats.bytes += nbytes
            self.stats.entries = len(self._items)

    def purge_adapter(self, adapter: str) -> int:
        """Drop every entry of one adapter digest; return how many."""
        with self._lock:
            doomed = [k for k in self._items if k.adapter == adapter]
            for k in doomed:
                self.stats.bytes -= self._items.pop(k)[1]
            self.stats.entries = len(self._items)
            return len(doomed)

    def values(self) -> list[V]:
        """Every cached value, least recently used first (memory accounting)."""
        with self._lock:
            return [v for v, _n in self._items.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
