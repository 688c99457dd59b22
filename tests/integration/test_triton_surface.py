"""Triton's own surface through the real tritonserver: a tenant reaches health, metadata, model
configuration and inference, and nothing else; the operator header unlocks the rest.

Each refusal is asserted on the restriction's own message, so these fail if the launch stops
passing ``--http-restricted-api`` / ``--grpc-restricted-protocol``.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from tritonclient.utils import InferenceServerException

from control.contracts.wire import ENGINE_MODEL, MODEL
from control.ops.clients import generate
from control.ops.triton_access import (
    GRPC_HEADER_PREFIX,
    OPERATOR_APIS,
    OPERATOR_HEADER,
    TENANT_APIS,
)
from control.ops.triton_server import TritonProcess, TritonUnavailable, find_triton
from tests.integration.conftest import Stack
from tests.required import unavailable

pytestmark = pytest.mark.triton

REFUSAL = {
    "http": f"This API is restricted, expecting header '{OPERATOR_HEADER}'",
    "grpc": "This protocol is restricted, expecting header "
            f"'{GRPC_HEADER_PREFIX}{OPERATOR_HEADER}'",
}
MODULES: dict[str, ModuleType] = {"http": httpclient, "grpc": grpcclient}
Headers = dict[str, str] | None


def _triton(stack: Stack) -> TritonProcess:
    assert stack.deployment.triton is not None
    return stack.deployment.triton


def _client(stack: Stack, protocol: str) -> Any:
    url = stack.http if protocol == "http" else stack.grpc
    return MODULES[protocol].InferenceServerClient(url)


def _operator_calls(c: Any, protocol: str) -> dict[str, Callable[[Headers], object]]:
    """One call per restricted operation a tenant might try."""
    # a CUDA IPC handle travels base64-encoded over HTTP and as raw bytes over gRPC
    handle = base64.b64encode(bytes(64)) if protocol == "http" else bytes(64)
    return {
        "load a model": lambda h: c.load_model(MODEL, headers=h),
        "unload a model": lambda h: c.unload_model(ENGINE_MODEL, headers=h),
        "list the repository": lambda h: c.get_model_repository_index(headers=h),
        "register system shared memory": lambda h: c.register_system_shared_memory(
            "tenant-probe", "/loraplane-tenant-probe", 64, headers=h),
        "register CUDA shared memory": lambda h: c.register_cuda_shared_memory(
            "tenant-probe", handle, 0, 64, headers=h),
        "read shared memory status": lambda h: c.get_system_shared_memory_status(headers=h),
        "change trace settings": lambda h: c.update_trace_settings(
            settings={"trace_level": ["TIMESTAMPS"], "trace_rate": "1"}, headers=h),
        "change log settings": lambda h: c.update_log_settings(
            {"log_verbose_level": 1}, headers=h),
        "read per-model statistics": lambda h: c.get_inference_statistics(
            MODEL, headers=h),
    }


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenant_cannot_reach_the_operator_apis(stack: Stack, protocol: str) -> None:
    token = _triton(stack).operator.token
    wrong = {k: "x" * len(v) for k, v in _triton(stack).operator_headers(protocol).items()}
    c = _client(stack, protocol)
    try:
        for what, call in _operator_calls(c, protocol).items():
            for headers in (None, wrong):
                with pytest.raises(InferenceServerException) as refused:
                    call(headers)
                message = refused.value.message() or ""
                assert REFUSAL[protocol] in message, f"{what}: {message}"
                assert token not in message
    finally:
        c.close()


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_tenant_still_reaches_health_metadata_config_and_inference(
        stack: Stack, protocol: str) -> None:
    c = _client(stack, protocol)
    try:
        assert c.is_server_live() and c.is_server_ready()
        assert c.is_model_ready(MODEL) and c.is_model_ready(ENGINE_MODEL)
        assert c.get_server_metadata()
        assert c.get_model_metadata(MODEL)
        assert c.get_model_config(MODEL)
    finally:
        c.close()
    url = stack.http if protocol == "http" else stack.grpc
    answer = generate(url, "Hello", stack.ticket("acme", "acme-alpha"), protocol=protocol,
                      max_tokens=4)
    assert answer.adapter_digest == stack.digests["alpha"]


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_the_operator_header_passes_the_restriction(stack: Stack, protocol: str) -> None:
    op = _triton(stack).operator_headers(protocol)
    c = _client(stack, protocol)
    region = shm.create_shared_memory_region("operator-probe", "/loraplane-operator-probe", 64)
    try:
        index = c.get_model_repository_index(headers=op)
        names = {m["name"] for m in index} if protocol == "http" \
            else {m.name for m in index.models}
        assert {MODEL, ENGINE_MODEL} <= names
        c.register_system_shared_memory("operator-probe", "/loraplane-operator-probe", 64,
                                        headers=op)
        try:
            status = c.get_system_shared_memory_status(headers=op)
            keys = {r["key"] for r in status} if protocol == "http" \
                else {r.key for r in status.regions.values()}
            assert "/loraplane-operator-probe" in keys
        finally:
            c.unregister_system_shared_memory("operator-probe", headers=op)
        assert c.get_trace_settings(headers=op)
        assert c.get_log_settings(headers=op)
        c.get_inference_statistics(MODEL, headers=op)
        # past the restriction, model control is still off: the models are fixed at start
        with pytest.raises(InferenceServerException) as refused:
            c.load_model(MODEL, headers=op)
        assert REFUSAL[protocol] not in (refused.value.message() or "")
    finally:
        c.close()
        shm.destroy_shared_memory_region(region)


def test_every_api_group_of_this_tritonserver_is_assigned(tmp_path: Path) -> None:
    """A Triton release that adds an API group fails here until it is given to one side."""
    try:
        binary = find_triton(tmp_path).binary
    except TritonUnavailable as e:
        unavailable("the real tritonserver", str(e))
    env = {**os.environ, "LD_LIBRARY_PATH": sysconfig.get_config_var("LIBDIR") or ""}
    help_run = subprocess.run([str(binary), "--help"], capture_output=True, text=True, env=env,
                              timeout=60)
    out = help_run.stdout + help_run.stderr  # tritonserver prints its usage on stderr
    for flag, label in (("--http-restricted-api", "Allowed APIs:"),
                        ("--grpc-restricted-protocol", "Allowed protocols:")):
        section = out.split(flag, 1)[1]
        listed = section.split(label, 1)[1].split("\n\n", 1)[0].split("\n  --", 1)[0]
        groups = {g.strip() for g in listed.replace("\n", " ").split(",")}
        assert groups == set(TENANT_APIS) | set(OPERATOR_APIS), groups
