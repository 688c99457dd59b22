"""The ``BaseModel`` aggregate (a registered base model) and its ``BaseName`` index.

A base is known by its digest: its tokenizer's digest and the shapes of its Linear layers (what
an adapter must fit) are recorded with it. ``BaseName`` maps a base's name to its digest; a name
is taken once.
"""

from __future__ import annotations

from uuid import UUID

from eventsourcing.domain import Aggregate, event

from control.domain.errors import DomainError
from control.domain.ids import base_id, base_name_id
from control.domain.names import check_actor, check_name


class BaseModel(Aggregate):
    class BaseRegistered(Aggregate.Created):
        name: str
        digest: str
        tokenizer_digest: str
        linear_shapes: dict[str, list[int]]
        actor: str

    @staticmethod
    def create_id(digest: str) -> UUID:
        return base_id(digest)

    @event(BaseRegistered)
    def __init__(
        self,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> None:
        self.name = name
        self.digest = digest
        self.tokenizer_digest = tokenizer_digest
        self.linear_shapes = linear_shapes

    @classmethod
    def register(
        cls,
        name: str,
        digest: str,
        tokenizer_digest: str,
        linear_shapes: dict[str, list[int]],
        actor: str,
    ) -> BaseModel:
        if not linear_shapes:
            raise DomainError("base model has no Linear weights")
        return cls(name=check_name("base", name), digest=digest,
                   tokenizer_digest=tokenizer_digest, linear_shapes=linear_shapes,
                   actor=check_actor(actor))


class BaseName(Aggregate):
    """Name -> digest index for base models (a name is taken once)."""

    class BaseNamed(Aggregate.Created):
        name: str
        digest: str
        actor: str

    @staticmethod
    def create_id(name: str) -> UUID:
        return base_name_id(name)

    @event(BaseNamed)
    def __init__(self, name: str, digest: str, actor: str) -> None:
        self.name = name
        self.digest = digest
