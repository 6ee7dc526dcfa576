#!/usr/bin/env bash
# Set up (idempotent), then run the whole test suite. Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
