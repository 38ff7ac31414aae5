# The image the Helm chart (helm/cadenza) deploys.
#   CPU:  docker build -t cadenza .
#   GPU:  docker build -t cadenza:cuda --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 .
# (GPU nodes need the NVIDIA driver and container toolkit; the torch CUDA wheels carry the CUDA libraries.)
ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG TORCH_INDEX="https://download.pytorch.org/whl/cpu"

RUN useradd --uid 10001 --create-home cadenza
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service ./service
COPY kernels ./kernels
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX}" --extra-index-url https://pypi.org/simple "${TORCH_SPEC}" \
 && pip install --no-cache-dir .

USER cadenza
# Export the built-in voice's stage graphs at build time, so a pod is ready seconds after it starts.
RUN cadenza say "Warm up." -o /tmp/warm.wav && rm /tmp/warm.wav

EXPOSE 50051
ENTRYPOINT ["cadenza"]
# Every interface of the container (the server's own default is loopback, unreachable through -p).
# Add --tls-cert/--tls-key and/or --api-keys-file to secure it (without them a warning is logged).
CMD ["serve", "--host", "[::]", "--port", "50051"]
