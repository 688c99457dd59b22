# loraplane control plane: gateway (tickets, OpenAI-compatible routes, /metrics, /v1/stats) and
# the projection follower. No GPU. Build from the repository root:
#   docker build -f docker/control.Dockerfile -t loraplane/control:0.1.0 .
# The Python of the Triton image, so the pinned wheels of docker/requirements.txt fit both.
ARG PYTHON_TAG=3.12-slim
FROM python:${PYTHON_TAG}

# Registration validates adapters with torch/safetensors: the CPU build of the pinned torch is
# enough here, installed first so nothing pulls the CUDA build.
ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN python -m pip install --no-cache-dir --upgrade pip \
 && python -m pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/loraplane
COPY docker/requirements.txt docker/requirements.txt
COPY pyproject.toml README.md ./
COPY control ./control
COPY projections ./projections
COPY backend ./backend
COPY model_repository ./model_repository
# The Triton image's pins as constraints: both images run the same versions of everything.
RUN python -m pip install --no-cache-dir -c docker/requirements.txt -e ".[postgres]"

# A dedicated unprivileged user, the Triton image's uid (both share the store volume); HOME is
# /tmp, the one writable scratch under docker/compose.yaml's read-only root filesystem.
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
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2)"]
CMD ["loraplane", "control-plane", "--bind", "0.0.0.0", "--gateway-port", "8080"]
