"""The registry side of a host's revocation steps (``backend.serving.service.RevocationSteps``).

The Triton model's entry point (``model_repository/lora_llm_stream/1/model.py``) hands this class
to the serving glue, which opens it on the first revocation; serving itself never imports the
registry.
"""

from __future__ import annotations

from control.app.registry import Registry
from control.contracts.config import Settings


class RegistrySteps:
    """Reads and records one host's revocation steps as events on the adapter."""

    def __init__(self, settings: Settings) -> None:
        # follow=False: a host records facts; the control plane's follower projects them.
        self.registry = Registry(settings, follow=False)

    def done(self, digest: str, host: str) -> list[str]:
        return list(self.registry.adapter(digest).serving_steps.get(host, []))

    def record(self, digest: str, host: str, step: str) -> None:
        self.registry.record_serving_step(digest, host, step, actor=f"host:{host}")
