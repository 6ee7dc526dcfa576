#!/usr/bin/env bash
# Set up (idempotent), then serve the OpenAI API on http://127.0.0.1:8000/v1.
# Arguments go to `pdserve serve` (see `pdserve serve --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/pdserve serve "$@"
