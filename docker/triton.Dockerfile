# loraplane Triton host: the official Triton server image, torch, peft and loraplane, with the
# model repository in place. Build from the repository root:
#   docker build -f docker/triton.Dockerfile -t loraplane/triton:0.1.0 .
#
# 24.10-py3 is Triton 2.51.0, the same server the test suite runs on the CPU (nvidia-pytriton
# 0.7.0 ships 2.51.0); it is Ubuntu 22.04 with Python 3.10 and CUDA 12.6. Its Python backend
# stub is built for that system Python, so loraplane is installed into it (no virtualenv).
ARG TRITON_TAG=24.10-py3
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}

# torch first and pinned, from the CUDA index: nothing else may pull its own build. The cu124
# wheels bring their own CUDA runtime and run on the image's 12.6 driver stack.
ARG TORCH_SPEC="torch==2.5.1"
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu124
RUN python3 -m pip install --no-cache-dir --upgrade pip \
 && python3 -m pip install --no-cache-dir "${TORCH_SPEC}" --index-url "${TORCH_INDEX}"

WORKDIR /opt/loraplane
COPY pyproject.toml README.md ./
COPY control ./control
COPY projections ./projections
COPY backend ./backend
COPY model_repository ./model_repository
# Editable, so the model repository and PYTHONPATH resolve to /opt/loraplane (see
# backend/triton_server.py). The tritonserver binary is the image's own /opt/tritonserver.
RUN python3 -m pip install --no-cache-dir -e ".[postgres]"

ENV LORAPLANE_HOME=/var/lib/loraplane \
    LORAPLANE_LOG_FORMAT=json \
    PYTHONUNBUFFERED=1
RUN mkdir -p /var/lib/loraplane/store
VOLUME ["/var/lib/loraplane"]
EXPOSE 8000 8001 8002
HEALTHCHECK --interval=10s --timeout=3s --start-period=300s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/v2/models/lora_llm/ready', timeout=2)"]
CMD ["loraplane", "triton-host", "--http-port", "8000", "--grpc-port", "8001", "--metrics-port", "8002"]
