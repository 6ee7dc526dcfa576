#!/usr/bin/env bash
# Set up (idempotent), check style with ruff, then run the test suite: the unit tier on every core
# (pytest-xdist: a file per process, the files importing vLLM on one: tests/xdist_groups.py),
# then the integration tier as two streams side by side (tests/integration/conftest.py: STREAMS).
# Arguments go to a single pytest run instead (`tests/unit` for the unit tier alone).
set -euo pipefail
cd "$(dirname "$0")/.."
# Compiled modules and pytest's rewritten test files cached in __pycache__ (git ignores it): with
# PYTHONDONTWRITEBYTECODE set, as some hosts do, every test process and every worker, router and
# engine process the tests start compiled pdserve's modules again (seconds of a core each).
unset PYTHONDONTWRITEBYTECODE
scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache
docs=$(NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .cache/docs-site 2>&1) || { echo "$docs"; exit 1; }
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
# Two processes more than cores: a process waiting out a deadline (many tests do, for a second
# or three) leaves its core to another (2 cores: 57-63 s on 4 processes, 61-66 s on 3).
.venv/bin/python -m pytest tests/unit tests/gpu -n "$(($(nproc) + 2))"
exec .venv/bin/python -m pytest tests/integration -n 2
