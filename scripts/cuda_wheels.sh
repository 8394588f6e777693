# Sourced by the scripts that need nvcc without a CUDA toolkit:
#
#   . scripts/cuda_wheels.sh && cuda_from_pypi CACHE_DIR [PYTHON]
#
# Installs nvcc from PyPI's CUDA 13.0 wheels into CACHE_DIR/cuda13 once (pinned: unpinned
# wheels drift to versions cudarc does not know) and exports PATH, CUDA_ROOT, CUDA_PATH,
# CUDA_TOOLKIT_ROOT_DIR and NVCC_APPEND_FLAGS for it (CUDA_ROOT is the toolkit's root).
cuda_from_pypi() {
  local dir="$1/cuda13" py="${2:-python3}"
  if [ ! -x "$dir/nvidia/cu13/bin/nvcc" ]; then
    echo "== installing nvcc (CUDA 13.0 wheels from PyPI) into $dir"
    "$py" -m pip install --quiet --disable-pip-version-check --no-deps --target "$dir" \
      nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
      nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
  fi
  local cu="$dir/nvidia/cu13"
  # The wheels split the toolkit: headers of cccl/crt/runtime live beside nvcc's own.
  export PATH="$cu/bin:$PATH"
  export CUDA_ROOT="$cu" CUDA_PATH="$cu" CUDA_TOOLKIT_ROOT_DIR="$cu"
  export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:-} -I$cu/include"
}
