"""Structured JSON logs and OpenTelemetry tracing, shared by the gateway and the Triton hosts.

Configured by environment variables, off or quiet by default:

``LORAPLANE_LOG_FORMAT``   ``json`` (one JSON object per line) or ``text``.
``LORAPLANE_TRACES``       ``off`` (default), ``console``, ``otlp`` (OTLP/HTTP to
                           ``OTEL_EXPORTER_OTLP_ENDPOINT``; needs ``opentelemetry-exporter-otlp``),
                           or ``file:/path/spans.jsonl`` (one span per line; tests, debugging).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

LOG_FORMAT_ENV = "LORAPLANE_LOG_FORMAT"
TRACES_ENV = "LORAPLANE_TRACES"
TRACEPARENT = "traceparent"


# --- logs -------------------------------------------------------------------------------------

_STANDARD_ATTRS = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and any ``extra=`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in vars(record).items():
            if k not in _STANDARD_ATTRS and not k.startswith("_"):
                out[k] = v if isinstance(v, str | int | float | bool | type(None)) else str(v)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, separators=(",", ":"))


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """Configure the root logger once per process: JSON lines by default for servers."""
    fmt = (fmt or os.environ.get(LOG_FORMAT_ENV) or "json").lower()
    if fmt not in ("json", "text"):
        raise ValueError(f"{LOG_FORMAT_ENV} is json or text, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json"
                         else logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level or os.environ.get("LORAPLANE_LOG_LEVEL", "INFO"))


# --- traces -----------------------------------------------------------------------------------

_providers: dict[tuple[str, str], Any] = {}
_providers_lock = threading.Lock()


class _FileSpanExporter:
    """Appends each finished span as one JSON line; several processes may share one file."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        lines = "".join(json.dumps(json.loads(s.to_json()), separators=(",", ":")) + "\n"
                        for s in spans)
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(lines)  # one write per batch: lines from two processes never interleave
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def tracer(service: str, spec: str | None = None) -> Any:
    """An OpenTelemetry tracer for ``service`` as ``LORAPLANE_TRACES`` configures; a no-op
    tracer when tracing is off. Providers are per (service, spec), not the global one, so a
    test process can run two gateways."""
    from opentelemetry import trace

    spec = (spec if spec is not None else os.environ.get(TRACES_ENV, "off")).strip()
    if spec in ("", "off", "none"):
        return trace.NoOpTracer()
    with _providers_lock:
        provider = _providers.get((service, spec))
        if provider is None:
            provider = _make_provider(service, spec)
            _providers[(service, spec)] = provider
    return provider.get_tracer("loraplane")


def _make_provider(service: str, spec: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        ConsoleSpanExporter,
        SimpleSpanProcessor,
    )

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if spec == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif spec.startswith("file:"):
        exporter: Any = _FileSpanExporter(Path(spec[5:]))
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif spec == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(f"{TRACES_ENV}=otlp needs the opentelemetry-exporter-otlp "
                             "package") from None
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        raise ValueError(f"{TRACES_ENV} is off, console, otlp or file:PATH, not {spec!r}")
    return provider


def traceparent_of(span: Any) -> str | None:
    """The W3C ``traceparent`` value naming ``span`` as parent, or None for a no-op span."""
    ctx = span.get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parent_context(traceparent: str | None) -> Any:
    """The OpenTelemetry context a ``traceparent`` value names (None: a new trace)."""
    if not traceparent:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract({TRACEPARENT: traceparent})


@contextmanager
def span(tracer_: Any, name: str, attributes: Mapping[str, Any] | None = None,
         context: Any = None) -> Iterator[Any]:
    """Start a span (a no-op one when tracing is off) with the given attributes."""
    with tracer_.start_as_current_span(name, context=context) as s:
        for k, v in (attributes or {}).items():
            if v is not None:
                s.set_attribute(k, v)
        yield s
