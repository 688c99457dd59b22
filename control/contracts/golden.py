"""Golden task sets: the prompts an adapter's release is judged on, each with its checker.

An adapter registers with its own golden task set (``loraplane adapter register --golden FILE``
or ``loraplane adapter golden DIGEST FILE``); the evaluation gate (``loraplane adapter gate``)
sends every task through the real serving path and judges each answer with the task's checker.
The set is a content-addressed document: stored in the artifact store as one canonical JSON file,
:data:`GOLDEN_FILE`, named by its digest (:func:`GoldenSet.digest`), which the adapter's events
carry. Formatting does not matter: the digest covers the canonical form of what was parsed.

Defined in contracts because both sides read it: the kit writes golden sets, the registry checks
and stores them, and the gate (operations) judges answers with them; none of that needs torch.

The document::

    {"kind": "loraplane.golden/v1", "family": "alpha",
     "tasks": [{"id": "in-001", "prompt": "Hello", "max_tokens": 16,
                "tags": ["in_distribution"],
                "checker": {"kind": "exact", "expected": " ALPHA says hi"}}, ...]}

Checkers, by ``kind`` (one class each, registered in :data:`CHECKERS`):

- ``exact``: the whole answer equals ``expected``;
- ``regex``: the whole answer matches ``pattern`` (``re.fullmatch``; anchor nothing yourself);
- ``json_schema``: the answer (surrounding whitespace stripped) parses as JSON and validates
  against ``schema`` (JSON Schema, the draft its ``$schema`` names, else 2020-12; ``jsonschema``).

Tags are free task names (``A-Z a-z 0-9 . _ -``); the gate reads :data:`LONG_CONTEXT` (its
long-context case) and reports success per tag. How many tasks a production release needs is the
gate policy's (``control.domain.gate``), not the format's.

A set that would measure nothing is refused (issue 21: fifty copies of one prompt with a
match-anything checker satisfied "at least 50 golden tasks"):

- **no prompt twice**: two prompts are one when they are equal once runs of whitespace are
  collapsed and letter case is folded (:func:`prompt_key`): a copy that differs only in spacing
  or case asks the model the same thing, and a task counted twice inflates the rate;
- **no trivial checker** (:meth:`Checker.trivial`): an exact answer that is empty or only
  whitespace; a regex that matches the empty answer or most of :data:`PROBE_ANSWERS` (answers
  no task means, such as a sentence, digits, JSON, another script); a JSON schema that accepts
  every kind of value in :data:`PROBE_VALUES`. A checker that passes unrelated answers cannot
  tell a good adapter from a bad one, or from none.
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from control.contracts.documents import canonical_json, document_digest
from control.contracts.sampling import MAX_NEW_TOKENS  # a golden task's max_tokens ceiling

GOLDEN_KIND = "loraplane.golden/v1"
GOLDEN_FILE = "golden.json"  # the one file of a golden set's directory in the artifact store
MAX_GOLDEN_BYTES = 4 << 20
MAX_TASKS = 5000
MAX_PROMPT_CHARS = 8192  # what a Triton host accepts (backend.serving.service)
DEFAULT_MAX_TOKENS = 16
MAX_PATTERN_CHARS = 2000
# Tags the gate reads; any other tag is reported, never interpreted.
IN_DISTRIBUTION = "in_distribution"
OUT_OF_DISTRIBUTION = "out_of_distribution"
OTHER_DEPARTMENT = "other_department"
LONG_CONTEXT = "long_context"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class GoldenSetError(ValueError):
    """A golden task set that cannot be used; the message says what was expected and found."""


# Answers no golden task means: a regex passing most of them passes anything a model says.
# One line each (a model's short answer seldom has a newline; ``.*`` matches every one).
PROBE_ANSWERS = ("x", " ", "hello world", " The quick brown fox jumps over the lazy dog.",
                 "42", "-3.5e7", '{"a": [1, 2]}', "Привет, как дела?", "你好，世界",
                 "I am sorry, I cannot help with that.", "<|endoftext|>", "!!!???",
                 "ALL CAPS ANSWER", "tab\there")
# The kinds of JSON value: a schema accepting every one of them accepts any JSON at all.
PROBE_VALUES: tuple[Any, ...] = (None, True, 0, -1.5, "", "text", [], [1, "a"], {},
                                 {"k": "v"})


class Checker(ABC):
    """Judges one answer. Subclasses register under their ``kind`` in :data:`CHECKERS`."""

    kind: ClassVar[str]

    @abstractmethod
    def check(self, answer: str) -> bool:
        """True if ``answer`` (the generated text, nothing stripped) passes."""

    @abstractmethod
    def trivial(self) -> str | None:
        """Why this checker would pass answers no task means (None: it would not)."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """The checker as the document holds it (with its ``kind``)."""

    @classmethod
    @abstractmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Checker:
        """Parse the checker object of task ``where``; GoldenSetError if malformed."""


@dataclass(frozen=True)
class ExactChecker(Checker):
    """The whole answer equals ``expected``."""

    expected: str
    kind: ClassVar[str] = "exact"

    def check(self, answer: str) -> bool:
        return answer == self.expected

    def trivial(self) -> str | None:
        # An empty answer is what a model that stops at once gives, adapter or not.
        if not self.expected.strip():
            return "its expected answer is empty or only whitespace"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "expected": self.expected}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Checker:
        _only_keys(raw, {"kind", "expected"}, where)
        expected = raw.get("expected")
        if not isinstance(expected, str):
            raise GoldenSetError(f"{where}: an exact checker needs 'expected' (a string)")
        return cls(expected)


@dataclass(frozen=True)
class RegexChecker(Checker):
    """The whole answer matches ``pattern`` (``re.fullmatch``)."""

    pattern: str
    _compiled: re.Pattern[str] = field(init=False, repr=False, compare=False)
    kind: ClassVar[str] = "regex"

    def __post_init__(self) -> None:
        object.__setattr__(self, "_compiled", re.compile(self.pattern))

    def check(self, answer: str) -> bool:
        return self._compiled.fullmatch(answer) is not None

    def trivial(self) -> str | None:
        if self.check(""):
            return "its pattern matches the empty answer"
        passed = sum(self.check(a) for a in PROBE_ANSWERS)
        if passed * 2 >= len(PROBE_ANSWERS):
            return (f"its pattern matches {passed} of {len(PROBE_ANSWERS)} unrelated answers "
                    "(a sentence, digits, JSON, another script...)")
        return None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "pattern": self.pattern}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Checker:
        _only_keys(raw, {"kind", "pattern"}, where)
        pattern = raw.get("pattern")
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            raise GoldenSetError(f"{where}: a regex checker needs 'pattern' (a non-empty string "
                                 f"of at most {MAX_PATTERN_CHARS} characters)")
        try:
            return cls(pattern)
        except re.error as e:
            raise GoldenSetError(f"{where}: pattern does not compile: {e}") from None


@dataclass(frozen=True)
class JsonSchemaChecker(Checker):
    """The answer, whitespace stripped, is JSON that validates against ``schema``."""

    schema: dict[str, Any]
    kind: ClassVar[str] = "json_schema"

    def __post_init__(self) -> None:
        self._validator()  # a schema that is itself invalid is refused at parse time

    def _validator(self) -> Any:
        import jsonschema  # only sets that hold a JSON-schema checker pay for the import

        cls = jsonschema.validators.validator_for(self.schema,
                                                  default=jsonschema.Draft202012Validator)
        cls.check_schema(self.schema)
        return cls(self.schema)

    def check(self, answer: str) -> bool:
        try:
            value = json.loads(answer.strip())
        except ValueError:
            return False
        return bool(self._validator().is_valid(value))

    def trivial(self) -> str | None:
        validator = self._validator()
        if all(validator.is_valid(v) for v in PROBE_VALUES):
            return "its schema accepts every kind of JSON value"
        return None

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "schema": self.schema}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], where: str) -> Checker:
        import jsonschema

        _only_keys(raw, {"kind", "schema"}, where)
        schema = raw.get("schema")
        if not isinstance(schema, dict):
            raise GoldenSetError(f"{where}: a json_schema checker needs 'schema' (an object)")
        try:
            return cls(schema)
        except jsonschema.SchemaError as e:
            raise GoldenSetError(f"{where}: not a valid JSON schema: {e.message}") from None


CHECKERS: dict[str, type[Checker]] = {
    c.kind: c for c in (ExactChecker, RegexChecker, JsonSchemaChecker)}


@dataclass(frozen=True)
class GoldenTask:
    """One prompt, how many tokens to generate, and how to judge the answer."""

    id: str
    prompt: str
    checker: Checker
    max_tokens: int = DEFAULT_MAX_TOKENS
    tags: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "prompt": self.prompt, "max_tokens": self.max_tokens,
                "tags": list(self.tags), "checker": self.checker.to_json()}


@dataclass(frozen=True)
class GoldenSet:
    """A family's golden tasks (``family``: a name, e.g. the adapter line ``alpha``)."""

    family: str
    tasks: tuple[GoldenTask, ...]

    def document(self) -> dict[str, Any]:
        """The JSON document the digest covers."""
        return {"kind": GOLDEN_KIND, "family": self.family,
                "tasks": [t.to_json() for t in self.tasks]}

    def canonical_bytes(self) -> bytes:
        """The bytes stored as :data:`GOLDEN_FILE`."""
        return canonical_json(self.document())

    def digest(self) -> str:
        """The digest the artifact store files this set under."""
        return document_digest(GOLDEN_FILE, self.document())

    def tagged(self, tag: str) -> list[GoldenTask]:
        """The tasks carrying ``tag``, in order."""
        return [t for t in self.tasks if tag in t.tags]

    @classmethod
    def from_json(cls, data: Any) -> GoldenSet:
        """Parse and check a golden set document; GoldenSetError says what is wrong."""
        if not isinstance(data, dict):
            raise GoldenSetError("a golden task set is a JSON object")
        _only_keys(data, {"kind", "family", "tasks"}, "golden task set")
        if data.get("kind") != GOLDEN_KIND:
            raise GoldenSetError(f"golden task set kind must be {GOLDEN_KIND!r}, found "
                                 f"{data.get('kind')!r}")
        family = data.get("family")
        if not isinstance(family, str) or not _NAME_RE.match(family):
            raise GoldenSetError("golden task set 'family' must be a name (A-Z a-z 0-9 . _ -, "
                                 "at most 64 characters)")
        raw_tasks = data.get("tasks")
        if not isinstance(raw_tasks, list) or not raw_tasks:
            raise GoldenSetError("golden task set 'tasks' must be a non-empty list")
        if len(raw_tasks) > MAX_TASKS:
            raise GoldenSetError(f"a golden task set holds at most {MAX_TASKS} tasks, found "
                                 f"{len(raw_tasks)}")
        tasks = tuple(_task(raw, i) for i, raw in enumerate(raw_tasks))
        seen: set[str] = set()
        prompts: dict[str, str] = {}
        for t in tasks:
            if t.id in seen:
                raise GoldenSetError(f"task id {t.id!r} appears twice")
            seen.add(t.id)
            first = prompts.setdefault(prompt_key(t.prompt), t.id)
            if first != t.id:
                raise GoldenSetError(f"task {t.id!r} repeats the prompt of task {first!r} "
                                     "(equal but for spacing or case): each task must ask "
                                     "something of its own")
        return cls(family, tasks)

    @classmethod
    def from_bytes(cls, raw: bytes) -> GoldenSet:
        """Parse a golden set file's bytes (at most :data:`MAX_GOLDEN_BYTES`, UTF-8 JSON)."""
        if len(raw) > MAX_GOLDEN_BYTES:
            raise GoldenSetError(f"a golden task set file is at most {MAX_GOLDEN_BYTES} bytes, "
                                 f"found {len(raw)}")
        try:
            data = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
        except (UnicodeDecodeError, ValueError):
            raise GoldenSetError("a golden task set file must be UTF-8 JSON") from None
        return cls.from_json(data)

    @classmethod
    def load(cls, path: Path) -> GoldenSet:
        """Read and check a golden set file."""
        p = Path(path)
        if not p.is_file():
            raise GoldenSetError("golden task set file not found")
        if p.stat().st_size > MAX_GOLDEN_BYTES:
            raise GoldenSetError(f"a golden task set file is at most {MAX_GOLDEN_BYTES} bytes")
        return cls.from_bytes(p.read_bytes())


def prompt_key(prompt: str) -> str:
    """What makes two prompts one (see the module notes): whitespace runs collapsed, case
    folded."""
    return " ".join(prompt.split()).casefold()


def _task(raw: Any, index: int) -> GoldenTask:
    where = f"task {index}"
    if not isinstance(raw, dict):
        raise GoldenSetError(f"{where}: a task is an object")
    _only_keys(raw, {"id", "prompt", "max_tokens", "tags", "checker"}, where)
    task_id = raw.get("id")
    if not isinstance(task_id, str) or not _NAME_RE.match(task_id):
        raise GoldenSetError(f"{where}: 'id' must be a name (A-Z a-z 0-9 . _ -)")
    where = f"task {task_id!r}"
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS:
        raise GoldenSetError(f"{where}: 'prompt' must be a string of at most "
                             f"{MAX_PROMPT_CHARS} characters")
    max_tokens = raw.get("max_tokens", DEFAULT_MAX_TOKENS)
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_NEW_TOKENS:
        raise GoldenSetError(f"{where}: 'max_tokens' must be a whole number from 1 to "
                             f"{MAX_NEW_TOKENS}, found {max_tokens!r}")
    tags = raw.get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) and _NAME_RE.match(t)
                                             for t in tags):
        raise GoldenSetError(f"{where}: 'tags' must be a list of names")
    checker_raw = raw.get("checker")
    if not isinstance(checker_raw, dict):
        raise GoldenSetError(f"{where}: 'checker' must be an object with a 'kind'")
    kind = checker_raw.get("kind")
    checker_cls = CHECKERS.get(kind) if isinstance(kind, str) else None
    if checker_cls is None:
        raise GoldenSetError(f"{where}: checker kind must be one of {', '.join(CHECKERS)}, "
                             f"found {kind!r}")
    checker = checker_cls.from_json(checker_raw, where)
    why = checker.trivial()
    if why is not None:
        raise GoldenSetError(f"{where}: a trivial {checker.kind} checker: {why}; it would pass "
                             "answers no task means")
    return GoldenTask(task_id, prompt, checker, max_tokens, tuple(tags))


def _only_keys(raw: Mapping[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(str(k) for k in raw if k not in allowed)
    if extra:
        raise GoldenSetError(f"{where}: unexpected field {extra[0]!r} (allowed: "
                             f"{', '.join(sorted(allowed))})")


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")
