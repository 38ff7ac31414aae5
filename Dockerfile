# The CPU image the Helm chart (helm/cadenza) deploys; Dockerfile.gpu is the CUDA one.
#   docker build -t cadenza:0.1.0 .
# Layers from the least to the most often changed: CPU torch, the other dependencies (from
# pyproject.toml, and README.md because pyproject names it as the package description), then the
# code, so a code change reuses the torch and dependency layers.
ARG PYTHON=3.11

FROM python:${PYTHON}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
ARG TORCH_VERSION=2.13.0
RUN python -m venv /opt/venv \
 && /opt/venv/bin/pip install --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}"
WORKDIR /src
# The dependencies: the project installed once with empty packages (then removed), so this layer
# changes only with pyproject.toml. With the kokoro extra: the Kokoro voices' English frontend
# (misaki, spaCy's small English model), for voices installed with `cadenza voices install kokoro`.
COPY pyproject.toml README.md ./
RUN mkdir service kernels && touch service/__init__.py kernels/__init__.py \
 && /opt/venv/bin/pip install ".[kokoro]" \
 && /opt/venv/bin/pip uninstall --yes cadenza \
 && rm -r service kernels
COPY service ./service
COPY kernels ./kernels
RUN /opt/venv/bin/pip install --no-deps .
# The built-in voice's ONNX stage exports (and their INT8 decoder stages, for --int8), made now at
# a fixed path any user can read: the server looks there before its writable cache (a pod's
# read-only root, a random UID).
RUN /opt/venv/bin/cadenza say "Warm up." --int8 --cache-dir /opt/cadenza/onnx -o /tmp/warm.wav \
 && rm /tmp/warm.wav \
 && chmod -R a+rX /opt/cadenza /opt/venv

FROM python:${PYTHON}-slim-bookworm
LABEL org.opencontainers.image.title="cadenza" \
      org.opencontainers.image.description="Cadenza streaming text-to-speech gRPC server (CPU)" \
      org.opencontainers.image.licenses="GPL-3.0-or-later"
RUN groupadd --gid 10001 cadenza && useradd --uid 10001 --gid 10001 --create-home cadenza
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/cadenza/onnx /opt/cadenza/onnx
ENV PATH=/opt/venv/bin:$PATH PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /home/cadenza
USER 10001:10001
EXPOSE 50051 9464
# grpc.health.v1 through `cadenza health` (no torch import; grpc_health_probe is not in the image).
# The start period covers loading and warming up; TLS deployments probe with --tls-ca (see README).
HEALTHCHECK --interval=30s --timeout=10s --start-period=300s --retries=3 \
  CMD ["cadenza", "health", "--addr", "127.0.0.1:50051"]
ENTRYPOINT ["cadenza"]
# Every interface of the container (the server's own default is loopback, unreachable through -p).
# Add --tls-cert/--tls-key and/or --api-keys-file to secure it (without them a warning is logged).
CMD ["serve", "--host", "[::]", "--port", "50051"]
