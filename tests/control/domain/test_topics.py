"""Event topics: those stored before the domain was split keep resolving, new ones name modules.

The list below is every topic the single-module domain could store (aggregate classes, which
created events carry as ``originator_topic``, and their event classes), spelled out: it is what
users' databases hold, so it must never be derived from the current code.
"""

from __future__ import annotations

import importlib
from typing import Any

import eventsourcing.utils
import pytest
from eventsourcing.utils import get_topic, resolve_topic

import control.domain
from control.domain import topics

FORMER_TOPICS = {
    "control.domain:Adapter": "adapter",
    "control.domain:Adapter.AdapterRegistered": "adapter",
    "control.domain:Adapter.EvaluationRecorded": "adapter",
    "control.domain:Adapter.AdapterPromoted": "adapter",
    "control.domain:Adapter.AdapterRevoked": "adapter",
    "control.domain:Adapter.AdapterDrained": "adapter",
    "control.domain:Adapter.AdapterPurged": "adapter",
    "control.domain:Adapter.AdapterUnloaded": "adapter",
    "control.domain:Alias": "alias",
    "control.domain:Alias.AliasCreated": "alias",
    "control.domain:Alias.AliasPointed": "alias",
    "control.domain:Alias.AliasCanarySet": "alias",
    "control.domain:Alias.AliasCanaryCleared": "alias",
    "control.domain:Alias.AliasRolledBack": "alias",
    "control.domain:Alias.AliasGranted": "alias",
    "control.domain:Alias.AliasGrantRemoved": "alias",
    "control.domain:BaseModel": "base_model",
    "control.domain:BaseModel.BaseRegistered": "base_model",
    "control.domain:BaseName": "base_model",
    "control.domain:BaseName.BaseNamed": "base_model",
    "control.domain:RegistrationRejection": "rejection",
    "control.domain:RegistrationRejection.RegistrationRejected": "rejection",
    "control.domain:Release": "release",
    "control.domain:Release.ReleaseCreated": "release",
    "control.domain:SigningKey": "signing_key",
    "control.domain:SigningKey.SigningKeyRecorded": "signing_key",
    "control.domain:SigningKey.SigningKeyRetired": "signing_key",
    "control.domain:Tenant": "tenant",
    "control.domain:Tenant.TenantCreated": "tenant",
    "control.domain:Tenant.TenantPolicySet": "tenant",
    "control.domain:Tenant.ApiKeyRotated": "tenant",
    "control.domain:Tenant.ApiKeysRevoked": "tenant",
}


def _class_in(module_name: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(f"control.domain.{module_name}")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def test_former_topics_resolve_to_the_classes_of_the_new_modules() -> None:
    for topic, module_name in FORMER_TOPICS.items():
        cls = _class_in(module_name, topic.partition(":")[2])
        assert resolve_topic(topic) is cls, topic
        # New events are written under the module that defines the class.
        assert get_topic(cls) == f"control.domain.{module_name}:{topic.partition(':')[2]}"
        assert resolve_topic(get_topic(cls)) is cls


def test_former_topics_resolve_by_registration_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Even with nothing left to import under the old names (no re-export, an empty topic
    cache), the registered aggregate topics resolve every former event topic."""
    expected = {t: _class_in(m, t.partition(":")[2]) for t, m in FORMER_TOPICS.items()}
    monkeypatch.setattr(eventsourcing.utils, "_topic_cache", {})
    for name in {t.partition(":")[2].partition(".")[0] for t in FORMER_TOPICS}:
        monkeypatch.delattr(control.domain, name)
    topics.register_former_topics()
    topics.register_former_topics()  # again: registering the same class twice is harmless
    for topic, cls in expected.items():
        assert resolve_topic(topic) is cls, topic

