#!/usr/bin/env bash
# Wheels for scripts/device_checks.sh on an offline GPU machine whose Python (3.12) already has torch, transformers,
# numpy, pyyaml, rich, matplotlib, safetensors, sympy, pyarrow and tensorboard but not pydantic: downloaded here
# into .whl/ (ignored by git), then carried there beside the working tree. The versions are the main venv's.
# Usage: bash scripts/device_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
ls -l .whl
