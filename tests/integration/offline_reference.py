"""vLLM's offline `LLM` on the same model and settings: the reference for greedy output.

Run as a script (vLLM's CPU platform spawns processes, so it needs a __main__ guard):
    python tests/offline_reference.py MODEL_DIR REQUESTS_JSON OUTPUT_JSON
REQUESTS_JSON: {"prompts": [{"prompt", "max_tokens", "sampling"?}...],
                "chats": [[{role, content}...]...], "chat_max_tokens": N, "dtype"?: the model's
                (default float32; the MoE/MLA tiny models run in bfloat16),
                "conversations"?: [{"first", "first_max_tokens", "then", "max_tokens"}...]}
                ("sampling": more SamplingParams fields, by name)
OUTPUT_JSON: {"prompts": [{"text", "token_ids"}...], "chats": [...],
              "conversations": [{"first": {...}, "next": {...}}...]}
A conversation's next turn is its first prompt's token ids, the answer's, then `then`'s: the
tokens a client resending the history as token ids sends (each turn's "prompt_token_ids" too).
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
        model=model_dir,
        dtype=requests.get("dtype", "float32"),
        enforce_eager=True,
        seed=0,
        kv_cache_memory_bytes=GIB,
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
    answers = {kind: [answer(r) for r in outputs] for kind, outputs in results.items()}
    answers["conversations"] = conversations(llm, requests.get("conversations", []))
    with open(output_path, "w") as out:
        json.dump(answers, out)


def answer(result) -> dict:
    return {
        "text": result.outputs[0].text,
        "token_ids": list(result.outputs[0].token_ids),
        "prompt_token_ids": list(result.prompt_token_ids),
    }


def conversations(llm, requests: list[dict]) -> list[dict]:
    from vllm import SamplingParams

    if not requests:
        return []
    firsts = llm.generate(
        [c["first"] for c in requests],
        [SamplingParams(temperature=0.0, max_tokens=c["first_max_tokens"]) for c in requests],
    )
    tokenizer = llm.get_tokenizer()
    turns = [
        {
            "prompt_token_ids": [
                *first.prompt_token_ids,
                *first.outputs[0].token_ids,
                *tokenizer.encode(c["then"], add_special_tokens=False),
            ]
        }
        for c, first in zip(requests, firsts, strict=True)
    ]
    nexts = llm.generate(
        turns, [SamplingParams(temperature=0.0, max_tokens=c["max_tokens"]) for c in requests]
    )
    return [
        {"first": answer(first), "next": answer(after)}
        for first, after in zip(firsts, nexts, strict=True)
    ]


if __name__ == "__main__":
    main(*sys.argv[1:4])
