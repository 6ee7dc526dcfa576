"""vLLM's offline `LLM` on the same model and settings: the reference for greedy output.

Run as a script (vLLM's CPU platform spawns processes, so it needs a __main__ guard):
    python tests/integration/offline_reference.py JOBS_JSON
JOBS_JSON: [{"output": OUTPUT_JSON, "models": [MODEL_DIR...], "requests": REQUESTS}...]: the
           jobs in order, each job's answers written to its OUTPUT_JSON (whole: written beside
           it, then renamed) as soon as they are made (tests/integration/references.py)
REQUESTS: {"prompts": [{"prompt", "max_tokens", "sampling"?}...],
           "chats": [[{role, content}...]...], "chat_max_tokens": N,
           "conversations"?: [{"first", "first_max_tokens", "then", "max_tokens"}...],
           "dtype"?: the engine's (float32 unless given: the MoE models' is bfloat16)}
           ("sampling": more SamplingParams fields, by name)
OUTPUT_JSON: one object per MODEL_DIR, in order:
             {"prompts": [{"text", "token_ids"}...], "chats": [...],
              "conversations": [{"first": {...}, "next": {...}}...]}
A conversation's next turn is its first prompt's token ids, the answer's, then `then`'s: the
tokens a client resending the history as token ids sends (each turn's "prompt_token_ids" too).
The models run one after another in this process: vLLM is imported once (~8 s of a core here,
an engine of a tiny model ~4 s).
"""

import gc
import json
import os
import sys

GIB = 1 << 30


def main(jobs_path: str) -> None:
    # The engine core and its model in this process: two processes (and imports of vLLM) fewer.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for job in json.loads(open(jobs_path).read()):
        answers = []
        for model_dir in job["models"]:
            answers.append(model_answers(model_dir, job["requests"]))
            gc.collect()  # the engine's reference cycles: its KV cache goes before the next one's
        written = f"{job['output']}.part"
        with open(written, "w") as out:
            json.dump(answers, out)
        os.rename(written, job["output"])


def model_answers(model_dir: str, requests: dict) -> dict:
    """`requests` answered by one model's engine, which is gone when this returns."""
    from vllm import LLM, SamplingParams

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
    return answers


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
    main(*sys.argv[1:])
