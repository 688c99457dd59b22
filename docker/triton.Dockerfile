# loraplane Triton host: the official Triton server image, the pinned Python packages of
# docker/requirements.txt (torch with CUDA 13.0) and loraplane, with the model repository in
# place. Build from the repository root:
#   docker build -f docker/triton.Dockerfile -t loraplane/triton:0.1.0 .
#
# 25.10-py3 is Ubuntu 24.04 with Python 3.12 and CUDA 13.0, the CUDA of the torch wheels pinned.
# 25.07 is the first release with the fixes for the August 2025 Python backend advisories
# (CVE-2025-23319, -23320, -23334): an older TRITON_TAG is refused below.
ARG TRITON_TAG=25.10-py3
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}
ARG TRITON_TAG
RUN case "${TRITON_TAG}" in \
      1[0-9].*|2[0-4].*|25.0[0-6]-*) \
        echo "TRITON_TAG=${TRITON_TAG} predates 25.07 (CVE-2025-23319, -23320, -23334)" >&2; \
        exit 1;; \
    esac

# Ubuntu 24.04 marks its Python as externally managed (PEP 668). Rather than
# --break-system-packages, which lets pip overwrite files that apt owns, everything goes into a
# virtual environment made from that same Python 3.12. The Python backend stub embeds the system
# interpreter and finds this environment through PATH: control/ops/triton_server.py puts the running
# interpreter's bin/ first, the same way the test suite's stub finds .venv.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /opt/loraplane
# Every package pinned, the one list tests/docker/test_image_dependencies.py resolves for this Python.
COPY docker/requirements.txt docker/requirements.txt
RUN python3 -m pip install --no-cache-dir -r docker/requirements.txt

COPY pyproject.toml README.md ./
COPY control ./control
COPY projections ./projections
COPY backend ./backend
COPY model_repository ./model_repository
# Editable, so the model repository and PYTHONPATH resolve to /opt/loraplane (see
# control/ops/triton_server.py); --no-deps, as every dependency is pinned above, and `pip check`
# fails the build if one is missing. The tritonserver binary is the image's /opt/tritonserver.
RUN python3 -m pip install --no-cache-dir --no-deps --no-build-isolation -e . \
 && python3 -m pip check

# The launcher, tritonserver and its Python backend run as this dedicated unprivileged user
# (fixed uid, so volumes and Kubernetes' runAsUser agree); docker/compose.yaml adds a read-only
# root filesystem. HOME is /tmp, the one writable scratch (a tmpfs there): caches of torch,
# the Triton compiler and Hugging Face go there. The home is the user's, so a new volume
# mounted on it starts owned by the user.
RUN groupadd --system --gid 10001 loraplane \
 && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /tmp \
      --shell /usr/sbin/nologin loraplane \
 && mkdir -p /var/lib/loraplane/store \
 && chown -R 10001:10001 /var/lib/loraplane
ENV LORAPLANE_HOME=/var/lib/loraplane \
    LORAPLANE_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp
USER 10001:10001
VOLUME ["/var/lib/loraplane"]
EXPOSE 8000 8001 8002
# The same check as docker/compose.yaml's Triton hosts (see there; tests/docker/test_docker_consistency.py
# holds the two to control/ops/triton_server.py's READY_PATHS and READY_TIMEOUT_S).
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import urllib.request as u; [u.urlopen('http://127.0.0.1:8000' + p, timeout=1) for p in ('/v2/health/ready', '/v2/models/lora_llm_stream/ready', '/v2/models/lora_llm/ready')]"]
# Not root, so tritonserver runs as this same user (control/ops/triton_user.py switches users
# only when started as root).
CMD ["loraplane", "triton-host", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
