"""Fuzzing the request parameter parser and the adapter validator (10,000 cases each by default).

Zero crashes: only the documented exception (RequestRefused, ValidationFailed) ever escapes.
Zero invalid inputs accepted: whatever is accepted is checked against an independent oracle
(for adapters, the safetensors library itself and the LoRA shape rules written out again here).
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from safetensors.numpy import load_file

from backend.serving.service import RequestRefused, ticket_from_parameters
from backend.serving.ticket_param import MAX_DEPTH
from control.app.validation import CONFIG_FILE, WEIGHTS_FILE, BaseInfo, validate_adapter
from control.domain import ValidationFailed
from control.tools.hostile.artifacts import synth_adapter
from tests.fuzzing import CASES, FUZZ_EXAMPLES, fuzz

# -- request parameters ------------------------------------------------------------------------

NAMES = ["lora_ticket", "x-lora-ticket", "X-Lora-Ticket", "LORA_TICKET", "lora_ticket ",
         "lora-ticket", "x_lora_ticket", "adapter", "adapter_path", "x-lora-adapter", "digest",
         "alias", "../lora_ticket"]
VALUES = st.one_of(
    st.sampled_from(["T1", "T2", "", "v4.public.x", "/etc/passwd", "file:///store/sha256/x",
                     "sha256:" + "c" * 64, "acme-alpha", "http://evil/a.safetensors"]),
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20),
    st.lists(st.text(max_size=4), max_size=2), st.dictionaries(st.text(max_size=4),
                                                               st.text(max_size=4), max_size=2),
)


@st.composite
def _raw_parameters(draw: st.DrawFn) -> str | dict[object, object] | None:
    kind = draw(st.integers(0, 5))
    if kind == 0:
        return draw(st.none() | st.text(max_size=300))
    pairs = draw(st.lists(st.tuples(st.sampled_from(NAMES) | st.text(max_size=12), VALUES),
                          max_size=5))
    if kind == 1:
        return {k: v for k, v in pairs}
    if kind == 2:  # built by hand, so keys can repeat
        return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"
    if kind == 3:  # around the documented limit, and far past it
        depth = draw(st.integers(MAX_DEPTH - 3, MAX_DEPTH + 3) | st.integers(1, 100_000))
        return '{"lora_ticket":"T1","x":' + "[" * depth + "]" * depth + "}"
    if kind == 4:  # a dict with keys that are not strings (a caller handing in objects)
        return {draw(st.integers() | st.none() | st.sampled_from(NAMES)): draw(VALUES)}
    return json.dumps(draw(VALUES))


def _pairs_checked(pairs: list[tuple[str, object]]) -> dict[str, object]:
    if len({k for k, _ in pairs}) != len(pairs):
        raise ValueError("dup")
    return dict(pairs)


def _depth(value: object) -> int:
    """Containers nested in a parsed value, the outermost counting 1 (walked with a stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, level = todo.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        todo.extend((child, level + 1) for child in children)
    return deepest


def _expected(raw: str | dict[object, object] | None) -> str | None:
    """The ticket a correct parser returns, or None for a refusal (written independently)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            params = json.loads(raw, object_pairs_hook=_pairs_checked)
        except (ValueError, RecursionError):
            return None
    else:
        params = raw
    if not isinstance(params, dict) or _depth(params) > MAX_DEPTH:
        return None
    values = [v for k, v in params.items()
              if isinstance(k, str) and k.lower() in ("lora_ticket", "x-lora-ticket")]
    if not values or not all(isinstance(v, str) for v in values) or len(set(values)) != 1:
        return None
    return str(values[0])


@fuzz
@given(_raw_parameters())
def _fuzz_parameters(raw: str | dict[object, object] | None) -> None:
    CASES["parameters"] += 1
    want = _expected(raw)
    if want is None:
        with pytest.raises(RequestRefused):
            ticket_from_parameters(raw)  # type: ignore[arg-type]
    else:
        assert ticket_from_parameters(raw) == want  # type: ignore[arg-type]


def test_fuzz_request_parameter_parser() -> None:
    before = CASES["parameters"]
    _fuzz_parameters()
    assert CASES["parameters"] - before >= FUZZ_EXAMPLES


def test_parameter_parser_regressions() -> None:
    """Cases the fuzzer is aimed at, pinned."""
    for raw in ('{"lora_ticket":"A","lora_ticket":"B"}',  # which one wins? neither
                '{"lora_ticket":"A","X-Lora-Ticket":"B"}',  # header in another case
                '{"lora_ticket":"A","x":' + "[" * 50_000 + "]" * 50_000 + "}"):
        with pytest.raises(RequestRefused):
            ticket_from_parameters(raw)


def _nested(depth: int) -> str:
    """Parameters whose containers nest ``depth`` deep: the object, then ``depth - 1`` arrays."""
    return '{"lora_ticket":"T1","x":' + "[" * (depth - 1) + "]" * (depth - 1) + "}"


def test_nesting_limit_is_a_number_not_the_stack() -> None:
    """The same parameters get the same answer however deep the caller's stack already is.

    ``json`` alone runs out of stack at a depth that depends on its caller, so the front and the
    engine models could disagree on one request (a CI run found it: the fuzzer's oracle, called a
    few frames higher, parsed what the parser refused).
    """
    assert ticket_from_parameters(_nested(MAX_DEPTH)) == "T1"
    # Brackets inside a string nest nothing.
    assert ticket_from_parameters('{"lora_ticket":"T1","x":"' + "[{" * 500 + '"}') == "T1"
    for depth in (MAX_DEPTH + 1, 200, 600, 5_000):
        with pytest.raises(RequestRefused):
            ticket_from_parameters(_nested(depth))

    def deep_call(frames: int, raw: str) -> str:
        if frames > 0:
            return deep_call(frames - 1, raw)
        try:
            return ticket_from_parameters(raw)
        except RequestRefused as e:
            return "refused:" + e.reason

    room = sys.getrecursionlimit() - 150
    for depth in (MAX_DEPTH, MAX_DEPTH + 1, 400):
        raw = _nested(depth)
        shallow = deep_call(0, raw)
        assert deep_call(room - 60, raw) == shallow, depth


# -- adapter validator -------------------------------------------------------------------------

SHAPES = {"model.layers.0.self_attn.q_proj": [8, 8], "model.layers.0.self_attn.v_proj": [8, 8],
          "model.layers.0.mlp.up_proj": [16, 8]}
BASE = BaseInfo(name="tiny", digest="sha256:" + "a" * 64, tokenizer_digest="sha256:" + "b" * 64,
                linear_shapes=SHAPES)
MAX_RANK = 4
_VALID_DIR = synth_adapter(Path(tempfile.mkdtemp(prefix="lp-fuzz-")) / "valid", SHAPES,
                           BASE.digest, rank=2, targets=("q_proj", "v_proj"), seed=1)
VALID_CONFIG = json.loads((_VALID_DIR / CONFIG_FILE).read_text())
VALID_WEIGHTS = (_VALID_DIR / WEIGHTS_FILE).read_bytes()
_WORK = Path(tempfile.mkdtemp(prefix="lp-fuzz-work-"))


def _lookup(ref: str) -> BaseInfo | None:
    return BASE if ref in ("tiny", BASE.digest) else None


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 10) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                max_size=3),
    max_leaves=5,
)


@st.composite
def _config(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 3))
    if kind == 0:
        return json.dumps(VALID_CONFIG).encode()
    if kind == 1:
        return draw(st.binary(max_size=200))
    c = dict(VALID_CONFIG)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from([*sorted(c), "use_dora", "modules_to_save", "rank_pattern",
                                    "layers_to_transform", "bias"]))
        if draw(st.booleans()):
            c.pop(key, None)
        else:
            c[key] = draw(_json_values | st.sampled_from(
                [1, 2, 4, 8, ["q_proj"], ["q_proj", "v_proj", "up_proj"], "q_proj", ["lm_head"],
                 BASE.digest, "tiny", "LORA", 0.5, math.inf]))
    text = json.dumps(c)  # NaN/Infinity appear as bare constants: must be refused
    if kind == 3:
        text = text[:-1] + ', "r": 2}'  # a duplicate key
    return text.encode()


@st.composite
def _weights(draw: st.DrawFn) -> bytes:
    raw = bytearray(VALID_WEIGHTS)
    n = int.from_bytes(raw[:8], "little")
    kind = draw(st.integers(0, 6))
    if kind == 0:
        return bytes(raw)
    if kind == 1:  # flip bytes anywhere (header or data)
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return bytes(raw)
    if kind == 2:  # flip bytes in the data only: weights change, NaN/inf patterns possible
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(8 + n, len(raw) - 1))] = draw(st.sampled_from([0x7F, 0xFF, 0x80,
                                                                                 0xC0, 0x00]))
        return bytes(raw)
    if kind == 3:
        cut = draw(st.integers(0, len(raw)))
        return bytes(raw[:cut]) + draw(st.binary(max_size=64))
    if kind == 4:  # rewrite the header's JSON
        header = json.loads(raw[8:8 + n])
        key = draw(st.sampled_from(sorted(header)))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
        value = draw(_json_values | st.sampled_from(["F16", "I32", "BF16", "F64", [2, 8], [8, 2],
                                                     [0, 64], [2**40, 2**40]]))
        if field is None or not isinstance(header[key], dict):
            header[draw(st.text(max_size=40))] = value
        else:
            header[key][field] = value
        new = json.dumps(header).encode()
        return len(new).to_bytes(8, "little") + new + bytes(raw[8 + n:])
    if kind == 5:
        return draw(st.integers(0, 2**64 - 1)).to_bytes(8, "little") + bytes(raw[8:])
    return draw(st.binary(max_size=300))


def _oracle_valid(config_bytes: bytes, weights: Path) -> str | None:
    """None if this adapter is valid; else why not (independent of control.app.validation)."""
    try:
        config = json.loads(config_bytes.decode("utf-8"), object_pairs_hook=_pairs_checked,
                            parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return "config json"
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return "peft_type"
    r, alpha, targets = config.get("r"), config.get("lora_alpha"), config.get("target_modules")
    if type(r) is not int or not 1 <= r <= MAX_RANK:
        return "rank"
    if type(alpha) not in (int, float) or not (math.isfinite(alpha) and alpha > 0):
        return "alpha"
    if isinstance(targets, str):
        targets = [targets]
    if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
        return "targets"
    if config.get("base_model_name_or_path") not in ("tiny", BASE.digest):
        return "base"
    try:
        tensors = load_file(str(weights))
    except Exception:
        return "safetensors"
    def hit(m: str) -> bool:
        return any(m == t or m.endswith("." + t) for t in targets)
    if not all(any(hit(m) for m in SHAPES) and t for t in targets):
        return "phantom target"
    want = {}
    for m, (o, i) in SHAPES.items():
        if hit(m):
            want[f"base_model.model.{m}.lora_A.weight"] = [r, i]
            want[f"base_model.model.{m}.lora_B.weight"] = [o, r]
    if {k: list(v.shape) for k, v in tensors.items()} != want:
        return "tensors"
    if not all(v.dtype.kind == "f" and np.isfinite(v).all() for v in tensors.values()):
        return "values"
    return None


@fuzz
@given(_config(), _weights())
def _fuzz_validator(config: bytes, weights: bytes) -> None:
    CASES["validator"] += 1
    d = _WORK / "adapter"
    d.mkdir(exist_ok=True)
    (d / CONFIG_FILE).write_bytes(config)
    (d / WEIGHTS_FILE).write_bytes(weights)
    try:
        validate_adapter(d, lookup_base=_lookup, max_rank=MAX_RANK)
    except ValidationFailed as e:
        assert str(_WORK) not in e.message
        return
    why = _oracle_valid(config, d / WEIGHTS_FILE)
    assert why is None, f"validator accepted an invalid adapter ({why})"


def test_fuzz_adapter_validator() -> None:
    before = CASES["validator"]
    _fuzz_validator()
    assert CASES["validator"] - before >= FUZZ_EXAMPLES
