# Source on the device machine, from the repository root, after the GPU install (/tmp/sfi-env.sh):
# puts this checkout on Python's path as an installed distribution without building it (the device
# image's setuptools may be older than pyproject.toml needs): the repository root for sfi_vllm (its
# kernels subpackage is the link sfi_vllm/kernels -> kernels/), and a dist-info with the
# vllm.general_plugins entry point, so vLLM's plugin loader registers the backend in every process.
P=/tmp/sfi-path
mkdir -p "$P/sfi_vllm-0.1.0.dist-info"
printf 'Metadata-Version: 2.1\nName: sfi-vllm\nVersion: 0.1.0\n' > "$P/sfi_vllm-0.1.0.dist-info/METADATA"
printf '[vllm.general_plugins]\nsfi = sfi_vllm.plugin:register\n' > "$P/sfi_vllm-0.1.0.dist-info/entry_points.txt"
export PYTHONPATH="$PWD:$P${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
