"""The router runs without torch or vLLM, so its image needs neither (deploy/docker/Dockerfile's
`router` target, pyproject's dependencies without an extra): its command, its app and the real
SmolLM2 tokenizer, in a Python where importing torch, vLLM or accelerate fails."""

import json
import subprocess
import sys

from pdserve.model_store.store import ensure_model

WITHOUT_TORCH = """
import json, sys
for name in ("torch", "vllm", "accelerate"):
    sys.modules[name] = None  # an import fails; transformers finds no torch
from fastapi.testclient import TestClient
from pdserve.settings.router import RouterSettings
from router.app import create_app
from pdserve.cli import main  # `pdserve router` starts here
import router.command  # and runs this

app = create_app(RouterSettings(model="smollm2", worker_addresses=[]), sys.argv[1])
with TestClient(app) as client:
    tokens = client.post("/tokenize", json={"prompt": "Hello, world"}).json()["tokens"]
    models = [card["id"] for card in client.get("/v1/models").json()["data"]]
loaded = sorted(n for n, m in sys.modules.items() if m is not None and n.split(".")[0] in
                ("torch", "vllm", "accelerate"))
print(json.dumps({"tokens": tokens, "models": models, "loaded": loaded}))
"""


def test_the_router_serves_with_no_torch_or_vllm_importable():
    from transformers import AutoTokenizer  # here: it imports torch (~5 s), at collection too

    model = str(ensure_model("smollm2"))
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, model], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.splitlines()[-1])
    expected = AutoTokenizer.from_pretrained(model)("Hello, world")["input_ids"]
    assert answer == {"tokens": expected, "models": ["smollm2"], "loaded": []}
