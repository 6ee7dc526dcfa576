#!/usr/bin/env bash
# Set up (idempotent), check style with ruff, then run the test suite. Arguments go to pytest
# (`tests/unit` for the unit tier alone).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest "$@"
