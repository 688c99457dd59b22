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
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from backend.serving.fair_share import over_fair_part

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


# What an entry occupies: (storage identity, bytes) per storage it holds (see ``footprint``).
Footprint = Callable[[Any], Iterable[tuple[Hashable, int]]]


class PrefixCache(Generic[V]):
    """LRU over a byte budget, shared fairly between tenants; thread-safe.

    Fair sharing: when an entry needs room, the victim is the least recently used entry of the
    tenant (the key's ``salt``; the cache never learns a tenant's name) holding the most bytes
    over its fair part, the budget split evenly between the tenants with entries and the one
    inserting, the new entry counted. When only the inserting tenant is over and it holds
    nothing to give back, the new entry is not kept. So a tenant alone may fill the whole
    budget, and one that floods new prompts evicts its own entries, never another's while
    that one holds no more than its part (before, one tenant's flood emptied everyone's
    prefixes).

    ``footprint`` (optional) names the storages an entry holds; the cache then keeps, entry by
    entry as they come and go, the bytes of every storage its entries hold, each counted once
    (:meth:`held_bytes`). The memory report reads that instead of walking every entry's tensors:
    a walk over a full cache, thousands of entries, ran after every finished batch and took a
    third of a busy host's engine process (issue 24's Zipf bench, where every prompt is new).
    """

    def __init__(self, max_bytes: int, footprint: Footprint | None = None) -> None:
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        # key -> (entry, its bytes, its footprint when it came)
        self._items: OrderedDict[PrefixKey, tuple[V, int, tuple[tuple[Hashable, int], ...]]] = \
            OrderedDict()
        self.stats = PrefixStats()
        self._footprint = footprint
        self._storages: dict[Hashable, list[int]] = {}  # storage -> [entries holding it, bytes]
        self._held = 0  # bytes of every storage in _storages
        # salt -> its keys, least recently used first, and the bytes they hold
        self._tenants: dict[bytes, OrderedDict[PrefixKey, None]] = {}
        self._tenant_bytes: dict[bytes, int] = {}

    @property
    def tracks_storages(self) -> bool:
        return self._footprint is not None

    def held_bytes(self, excluding: Iterable[Hashable] = ()) -> int:
        """Bytes of the storages the entries hold, each once, less those in ``excluding``
        (storages another category has counted already). Needs ``footprint``."""
        if self._footprint is None:
            raise RuntimeError("this prefix cache was made without a footprint")
        with self._lock:
            counted = sum(self._storages[k][1] for k in set(excluding) if k in self._storages)
            return self._held - counted

    def _hold(self, footprint: tuple[tuple[Hashable, int], ...], sign: int) -> None:
        for key, nbytes in footprint:
            held = self._storages.get(key)
            if sign > 0:
                if held is None:
                    self._storages[key] = [1, nbytes]
                    self._held += nbytes
                else:
                    held[0] += 1
            elif held is not None:
                held[0] -= 1
                if held[0] == 0:
                    del self._storages[key]
                    self._held -= held[1]

    def _drop(self, key: PrefixKey) -> None:
        item = self._items.pop(key)
        # the footprint taken when the entry came: what it held then is what it gives back
        self.stats.bytes -= item[1]
        self._hold(item[2], -1)
        keys = self._tenants[key.salt]
        del keys[key]
        self._tenant_bytes[key.salt] -= item[1]
        if not keys:
            del self._tenants[key.salt], self._tenant_bytes[key.salt]

    def _victim(self, salt: bytes, nbytes: int) -> PrefixKey | None:
        """The entry to evict for ``nbytes`` more of ``salt``'s (see the class notes); None:
        nobody over its part has an entry to give back."""
        held = dict(self._tenant_bytes)
        held[salt] = held.get(salt, 0) + nbytes
        over = {s: by for s, by in over_fair_part(held, self.max_bytes).items()
                if self._tenants.get(s)}
        if not over:
            return None
        worst = max(over, key=lambda s: over[s])
        return next(iter(self._tenants[worst]))

    def get(self, key: PrefixKey) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                self.stats.misses += 1
                return None
            self._items.move_to_end(key)
            self._tenants[key.salt].move_to_end(key)
            self.stats.hits += 1
            return item[0]

    def put(self, key: PrefixKey, value: V, nbytes: int) -> bool:
        """Insert (or replace) an entry, evicting to fit the budget as the class notes say;
        False when it is not kept."""
        if nbytes > self.max_bytes:
            return False
        # a storage once per entry, however many of its tensors view it
        footprint = (tuple(dict(self._footprint(value)).items())
                     if self._footprint is not None else ())
        with self._lock:
            if key in self._items:
                self._drop(key)
            while self.stats.bytes + nbytes > self.max_bytes:
                victim = self._victim(key.salt, nbytes)
                if victim is None:
                    self.stats.entries = len(self._items)
                    return False
                self._drop(victim)
            self._items[key] = (value, nbytes, footprint)
            self._tenants.setdefault(key.salt, OrderedDict())[key] = None
            self._tenant_bytes[key.salt] = self._tenant_bytes.get(key.salt, 0) + nbytes
            self.stats.bytes += nbytes
            self._hold(footprint, +1)
            self.stats.entries = len(self._items)
            return True

    def purge_adapter(self, adapter: str) -> int:
        """Drop every entry of one adapter digest; return how many."""
        with self._lock:
            doomed = [k for k in self._items if k.adapter == adapter]
            for k in doomed:
                self._drop(k)
            self.stats.entries = len(self._items)
            return len(doomed)

    def values(self) -> list[V]:
        """Every cached value, least recently used first (memory accounting)."""
        with self._lock:
            return [item[0] for item in self._items.values()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
