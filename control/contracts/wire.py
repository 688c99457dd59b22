"""The names of the Triton model interface (DESIGN.md, "Triton model lora_llm"), defined once.

Clients, the gateway, the Triton models' Python code, the benchmarks and the hostile suite all
import these; nothing else spells them. ``model_repository/*/config.pbtxt`` cannot import Python,
so ``tests/backend/triton/test_wire_names.py`` checks that both models declare exactly
:data:`INPUTS` and :data:`OUTPUTS` under the names :data:`MODEL` and :data:`ENGINE_MODEL`.

Inputs follow the convention of Triton's LLM backends; the ticket travels as the request
parameter :data:`TICKET_PARAM`, or as the header :data:`TICKET_HEADER`, which Triton forwards to
the model because it matches :data:`FORWARDED_HEADERS`. Answers carry the request id and the
adapter digest as output tensors: Triton 2.51's Python backend cannot set response parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

# The unary front, and the model name every ticket is bound to.
MODEL = "lora_llm"
# The decoupled engine model behind it is the front's name with this suffix (a gateway
# configured for another model finds its engine the same way).
ENGINE_SUFFIX = "_stream"
ENGINE_MODEL = MODEL + ENGINE_SUFFIX

TICKET_PARAM = "lora_ticket"
TICKET_HEADER = "x-lora-ticket"
# Triton starts with this as --http-header-forward-pattern and --grpc-header-forward-pattern:
# headers matching it reach the model as request parameters; no other header does.
FORWARDED_HEADERS = "x-lora-.*"

TEXT_INPUT = "text_input"
MAX_TOKENS = "max_tokens"
TEMPERATURE = "temperature"
TOP_P = "top_p"
SEED = "seed"
STREAM = "stream"

TEXT_OUTPUT = "text_output"
REQUEST_ID = "request_id"
ADAPTER_DIGEST = "adapter_digest"


@dataclass(frozen=True)
class WireTensor:
    """One input or output of the models: its name, its Triton datatype as clients name it
    (``BYTES`` is config.pbtxt's ``TYPE_STRING``), and whether a request may leave it out."""

    name: str
    datatype: str
    optional: bool = False


# Both models declare these, in this order, batched; inputs with dims [-1] so that a tensor of
# the wrong length reaches the model and is refused there with a ledger row, outputs dims [1].
INPUTS: tuple[WireTensor, ...] = (
    WireTensor(TEXT_INPUT, "BYTES"),
    WireTensor(MAX_TOKENS, "INT32", optional=True),
    WireTensor(TEMPERATURE, "FP32", optional=True),
    WireTensor(TOP_P, "FP32", optional=True),
    WireTensor(SEED, "INT64", optional=True),
    WireTensor(STREAM, "BOOL", optional=True),
)
OUTPUTS: tuple[WireTensor, ...] = (
    WireTensor(TEXT_OUTPUT, "BYTES"),
    WireTensor(REQUEST_ID, "BYTES"),
    WireTensor(ADAPTER_DIGEST, "BYTES"),
)
INPUT_DATATYPES: dict[str, str] = {t.name: t.datatype for t in INPUTS}
OUTPUT_NAMES: tuple[str, ...] = tuple(t.name for t in OUTPUTS)
