"""Where events recorded before the domain became a package still find their classes.

eventsourcing stores each event's topic as ``module:qualname`` and resolves it back to a class
when the event is read. Until the domain was split into one module per aggregate, every class
lived in the module ``control.domain``, so existing databases hold topics such as
``control.domain:Tenant.TenantCreated`` (and each created event names its aggregate class,
``control.domain:Tenant``, in its stored state). New events are written under the new modules
(``control.domain.tenant:Tenant.TenantCreated``); both forms must resolve to the same class.

Registering an aggregate class under its former topic covers its nested event classes too:
``resolve_topic`` looks the longest registered ``module:prefix`` up first, then the rest of the
qualname as attributes. The topics stay registered for good: stored events never change.
"""

from __future__ import annotations

from eventsourcing.domain import Aggregate
from eventsourcing.utils import register_topic

from control.domain.adapter import Adapter
from control.domain.alias import Alias
from control.domain.base_model import BaseModel, BaseName
from control.domain.rejection import RegistrationRejection
from control.domain.release import Release
from control.domain.signing_key import SigningKey
from control.domain.tenant import Tenant

# The one module every aggregate and event class lived in before the split.
FORMER_MODULE = "control.domain"

# Every aggregate whose events may be stored under the former module.
MOVED_AGGREGATES: tuple[type[Aggregate], ...] = (
    Tenant, BaseModel, BaseName, Adapter, Release, Alias, SigningKey, RegistrationRejection,
)


def former_topic(cls: type[Aggregate]) -> str:
    """The topic ``cls`` was stored under before the split, e.g. ``control.domain:Tenant``."""
    return f"{FORMER_MODULE}:{cls.__qualname__}"


def register_former_topics() -> None:
    """Make every former aggregate topic (and so each nested event's) resolve to its class.

    Safe to call again: registering the same class under the same topic is a no-op.
    """
    for cls in MOVED_AGGREGATES:
        register_topic(former_topic(cls), cls)
