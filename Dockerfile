# CUDA serving image: vLLM 0.26.0's official OpenAI server image plus sfi-vllm.
#   docker build -t sfi-vllm .
#   docker run --gpus all --ipc=host -p 8000:8000 sfi-vllm Qwen/Qwen3-4B \
#       --additional-config '{"sfi": {"preset": "balanced"}}'
# The arguments after the image name go to `vllm serve --attention-backend sfi`.
# The project's CI has no Docker engine and no GPU, so it never builds this image. Instead,
# tests/test_packaging.py copies exactly the paths named by the COPY lines below into an empty
# directory and builds the wheel there, so a file that pyproject.toml needs but the image lacks
# fails a test.
FROM vllm/vllm-openai:v0.26.0
COPY pyproject.toml README.md LICENSE /opt/sfi-vllm/
COPY sfi_vllm /opt/sfi-vllm/sfi_vllm
COPY configs /opt/sfi-vllm/configs
COPY kernels /opt/sfi-vllm/kernels
RUN pip install --no-cache-dir /opt/sfi-vllm && mkdir -p -m 1777 /tmp/sfi-metrics
# SFI's counters reach /metrics through prometheus_client's multiprocess mode, which needs an empty
# directory shared by the server's processes: a new container starts with this one empty (writable
# by any --user). `docker restart` keeps it with the old server's files, whose counts /metrics would
# then add: start a new container instead.
ENV PROMETHEUS_MULTIPROC_DIR=/tmp/sfi-metrics
ENTRYPOINT ["vllm", "serve", "--attention-backend", "sfi"]
