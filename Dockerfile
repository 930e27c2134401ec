# syntax=docker/dockerfile:1
# gpulet: one image for every service. The service is the first argument:
#   docker run --rm IMAGE collector|health|reporter|allocator|device-plugin|alerts|...
#
# Build: docker build -t gpulet:0.1.0 .
# Stage 1 builds gpulet's wheel and installs it with all extras into a virtualenv;
# stage 2 is python-slim with that virtualenv only (no compiler, no pip cache).

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python -m venv /opt/gpulet
# The build inputs only (see .dockerignore): a change to tests or docs does not
# invalidate this layer.
COPY pyproject.toml README.md ./
COPY libs ./libs
COPY services ./services
RUN /opt/gpulet/bin/pip install --upgrade pip \
 && /opt/gpulet/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/gpulet/bin/pip install "$(ls /wheels/gpulet-*.whl)[all]" \
 && /opt/gpulet/bin/pip uninstall --yes pip setuptools

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="gpulet" \
      org.opencontainers.image.description="GPU node agent for Kubernetes, over NATS" \
      org.opencontainers.image.licenses="Apache-2.0"
# uid/gid 65532: the "nonroot" user of distroless images, which Kubernetes manifests
# commonly expect. The DaemonSet runs allocator and device-plugin as root (kubelet's
# sockets are root's); every other service runs as this user.
RUN groupadd --system --gid 65532 gpulet \
 && useradd --system --uid 65532 --gid 65532 --home-dir /var/lib/gpulet --no-create-home \
      --shell /usr/sbin/nologin gpulet \
 && mkdir -p /var/lib/gpulet \
 && chown 65532:65532 /var/lib/gpulet
COPY --from=builder /opt/gpulet /opt/gpulet
ENV PATH=/opt/gpulet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GPULET_STATE_DIR=/var/lib/gpulet
USER 65532:65532
WORKDIR /var/lib/gpulet
# /metrics, /healthz and /readyz (each sidecar of the DaemonSet uses its own port).
EXPOSE 5678
ENTRYPOINT ["gpulet"]
CMD ["--help"]
