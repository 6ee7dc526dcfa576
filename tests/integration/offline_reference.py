"""vLLM's offline `LLM` on the same model and settings: the reference for greedy output.

Run as a script (vLLM's CPU platform spawns processes, so it needs a __main__ guard):
    python tests/offline_reference.py MODEL_DIR REQUESTS_JSON OUTPUT_JSON
REQUESTS_JSON: {"prompts": [{"prompt", "max_tokens", "sampling"?}...],
                "chats": [[{role, content}...]...], "chat_max_tokens": N}
                ("sampling": more SamplingParams fields, by name)
OUTPUT_JSON: {"prompts": [{"text", "token_ids"}...], "chats": [...]}
"""

import json
import os
import sys

GIB = 1 << 30


def main(model_dir: str, requests_path: str, output_path: str) -> None:
    # The engine core and its model in this process: two processes (and imports of vLLM) fewer.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    requests = json.loads(open(requests_path).read())
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, seed=0, kv_cache_memory_bytes=GIB
    )
    prompts = requests["prompts"]
    results = {
        "prompts": llm.generate(
            [p["prompt"] for p in prompts],
            [
                SamplingParams(temperature=0.0, max_tokens=p["max_tokens"], **p.get("sampling", {}))
                for p in prompts
            ],
        ),
        "chats": llm.chat(
            requests["chats"],
            SamplingParams(temperature=0.0, max_tokens=requests["chat_max_tokens"]),
        ),
    }
    with open(output_path, "w") as out:
        json.dump(
            {
                kind: [
                    {"text": r.outputs[0].text, "token_ids": list(r.outputs[0].token_ids)}
                    for r in outputs
                ]
                for kind, outputs in results.items()
            },
            out,
        )


if __name__ == "__main__":
    main(*sys.argv[1:4])
