# CUDA serving image: vLLM 0.26.0's official OpenAI server image plus sfi-vllm.
#   docker build -t sfi-vllm .
#   docker run --gpus all -p 8000:8000 sfi-vllm Qwen/Qwen3-4B --additional-config '{"sfi": {"preset": "balanced"}}'
# Not built or run in this project's CI: its machines have no Docker engine and no GPU.
FROM vllm/vllm-openai:v0.26.0
COPY pyproject.toml README.md /opt/sfi-vllm/
COPY sfi_vllm /opt/sfi-vllm/sfi_vllm
COPY configs /opt/sfi-vllm/configs
RUN pip install --no-cache-dir /opt/sfi-vllm
ENTRYPOINT ["vllm", "serve", "--attention-backend", "sfi"]
