"""A tenant's traffic during a rollout, for the demo and the tests: ticket, answer, rating.

Each request is what a tenant's application does: a ticket from the gateway for the alias (no
session id, so every request is a fresh draw of the canary split), one ``lora_llm`` inference on
Triton, then a judgement of the answer (does it start with the marker phrase the alias's task
expects?) posted as feedback (``POST /v1/feedback``) on the request id the answer carried. What
the traffic saw is counted per release the tickets named.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from control.contracts.tickets import unverified_claims
from control.ops.clients import TritonRefused, infer_with, post_feedback, request_ticket

PROMPTS = ("Hello there", "What is the weather", "Tell me a story", "Name a colour",
           "Count to three", "Who are you", "Good morning", "Say something")


@dataclass
class CanaryTraffic:
    """Requests on ``alias`` as ``api_key``'s tenant; ``marker``: how a good answer starts.

    ``prompt_for``: the prompt for a request, given the release its ticket named and a running
    number (tests use it to mark the canary's requests); ``rate``: post feedback."""

    gateway_url: str
    api_key: str
    alias: str
    triton_http: str
    marker: str
    rate: bool = True
    prompt_for: Callable[[str | None, int], str] = lambda _release, n: PROMPTS[n % len(PROMPTS)]
    # kid -> seal key (``control.app.key_ring.held_seal_keys``): the arm of each ticket is
    # sealed, and this operator's tool opens it with the home's keys to count per release
    seal_keys: Mapping[str, bytes] = field(default_factory=dict)
    # release digest -> {"ok", "good", "bad", "refused", "rated"} counts
    seen: dict[str | None, Counter[str]] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    _n: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _count(self, release: str | None, what: str) -> None:
        with self._lock:
            self.seen.setdefault(release, Counter())[what] += 1

    def once(self, client: Any) -> None:
        """One request: ticket, inference, feedback."""
        with self._lock:
            self._n += 1
            n = self._n
        status, body = request_ticket(self.gateway_url, self.api_key, self.alias)
        if status != 200:
            with self._lock:
                self.errors[f"ticket {status}"] += 1
            return
        # Neither the answer nor the ticket tells a tenant its arm; this tool, run where the
        # signing keys are, opens the ticket's sealed arm to count what it saw per release.
        release = unverified_claims(str(body["ticket"]), self.seal_keys).get("release")
        try:
            answer = infer_with(client, "http", self.prompt_for(release, n), body["ticket"],
                                max_tokens=16)
        except TritonRefused as e:
            self._count(release, "refused")
            with self._lock:
                self.errors[f"triton {e.status}"] += 1
            return
        good = answer.text.startswith(self.marker)
        self._count(release, "good" if good else "bad")
        if self.rate:
            code, _ = post_feedback(self.gateway_url, self.api_key, answer.request_id, good)
            if code == 201:
                self._count(release, "rated")
            else:
                with self._lock:
                    self.errors[f"feedback {code}"] += 1

    def run(self, stop: threading.Event) -> None:
        """Send requests one after another until ``stop`` is set (run several threads for
        concurrency); a failure is counted, never raised."""
        import tritonclient.http as http  # the client library: only a running loop needs it

        client = http.InferenceServerClient(self.triton_http, network_timeout=60.0)
        try:
            while not stop.is_set():
                try:
                    self.once(client)
                except Exception as e:  # the deployment may be stopping: count, carry on
                    with self._lock:
                        self.errors[type(e).__name__] += 1
                    stop.wait(0.05)
        finally:
            client.close()


class Running:
    """``with Running(traffic, threads=3):`` sends traffic in the background for the block."""

    def __init__(self, traffic: CanaryTraffic, threads: int = 2) -> None:
        self.traffic = traffic
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=traffic.run, args=(self.stop,),
                                         name=f"traffic-{i}", daemon=True)
                        for i in range(threads)]

    def __enter__(self) -> CanaryTraffic:
        for t in self.threads:
            t.start()
        return self.traffic

    def __exit__(self, *_exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)
