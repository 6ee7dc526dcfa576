"""The real `openai` client against the real router and real vLLM workers on CPU.

Greedy output through pdserve must equal vLLM's offline `LLM` on the same model: the offline
reference runs in its own process (it needs its own engine), once per session.
"""

import openai
import pytest
from transformers import AutoTokenizer

from tests.integration.conftest import SERVED_MODEL
from tests.integration.http_client import HTTP
from tests.integration.prompts import CHATS, MAX_TOKENS, PROMPTS, SAMPLING_CASES


@pytest.fixture(scope="session")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [SERVED_MODEL]


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_completion_matches_offline_vllm(client, offline_reference, index):
    expected = offline_reference["prompts"][index]
    response = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[index], max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].text == expected["text"]
    assert response.usage.completion_tokens == len(expected["token_ids"])


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_chat_matches_offline_vllm(client, offline_reference, index):
    expected = offline_reference["chats"][index]
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=CHATS[index], max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].message.content == expected["text"]
    assert response.choices[0].message.role == "assistant"
    assert response.usage.completion_tokens == len(expected["token_ids"])


def test_usage_counts_the_prompt_and_completion(client, tokenizer):
    prompt = PROMPTS[0]
    response = client.completions.create(
        model=SERVED_MODEL, prompt=prompt, max_tokens=5, temperature=0
    )
    usage = response.usage
    assert usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert usage.completion_tokens == 5 and response.choices[0].finish_reason == "length"
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # Under one 128-token KV block: nothing of it can come from a prefix cache.
    assert usage.prompt_tokens < 128 and usage.prompt_tokens_details.cached_tokens == 0


def test_chat_usage_counts_the_templated_prompt(client, tokenizer):
    messages = CHATS[0]
    response = client.chat.completions.create(
        model=SERVED_MODEL, messages=messages, max_tokens=3, temperature=0
    )
    templated = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert response.usage.prompt_tokens == len(
        tokenizer.encode(templated, add_special_tokens=False)
    )


def test_streamed_completion_equals_the_whole_one(client):
    kwargs = dict(model=SERVED_MODEL, prompt=PROMPTS[2], max_tokens=MAX_TOKENS, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == (
        whole.usage.completion_tokens
    )


def test_streamed_chat_equals_the_whole_one(client):
    kwargs = dict(model=SERVED_MODEL, messages=CHATS[2], max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert all(c.usage is None for c in chunks), "usage only when include_usage is asked"


def test_stop_strings_end_the_output(client):
    full = (
        client.completions.create(
            model=SERVED_MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0
        )
        .choices[0]
        .text
    )
    stop = full.strip().split()[1]
    cut = client.completions.create(
        model=SERVED_MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert full.startswith(cut.text)


def test_seeded_sampling_repeats(client):
    kwargs = dict(
        model=SERVED_MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=1.0, top_p=0.9, seed=1234
    )
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first


def test_top_k_passes_through(client):
    # top_k=1 is greedy whatever the temperature.
    greedy = (
        client.completions.create(
            model=SERVED_MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0
        )
        .choices[0]
        .text
    )
    top1 = client.completions.create(
        model=SERVED_MODEL,
        prompt=PROMPTS[0],
        max_tokens=8,
        temperature=1.5,
        extra_body={"top_k": 1},
    )
    assert top1.choices[0].text == greedy


@pytest.mark.parametrize("route", ["local", "disaggregated"])
@pytest.mark.parametrize("index", range(len(SAMPLING_CASES)))
def test_vllm_sampling_extensions_match_offline_vllm_on_both_paths(
    client, offline_reference, index, route
):
    prompt, sampling = SAMPLING_CASES[index]
    expected = offline_reference["sampling"][index]
    response = client.completions.create(
        model=SERVED_MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={k: v for k, v in sampling.items() if k not in ("stop",)},
        stop=sampling.get("stop"),
        extra_headers={"x-pdserve-route": route},
    )
    assert response.choices[0].text == expected["text"], sampling
    assert response.usage.completion_tokens == len(expected["token_ids"])


def test_the_sampling_cases_change_the_output(offline_reference):
    """Each case's output differs from plain greedy on its prompt: they test something."""
    plain = dict(zip(PROMPTS, offline_reference["prompts"], strict=True))
    for (prompt, sampling), out in zip(SAMPLING_CASES, offline_reference["sampling"], strict=True):
        assert out["text"] != plain[prompt]["text"], sampling


def test_tokenize_and_detokenize_as_vllms_server_has_them(server, client, tokenizer):
    base = server.url
    prompt = PROMPTS[1]
    reply = HTTP.post(f"{base}/tokenize", json={"prompt": prompt, "return_token_strs": True})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer.encode(prompt) and body["count"] == len(body["tokens"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    assert body["max_model_len"] == client.models.list().data[0].max_model_len
    # Messages: what the chat endpoint counts as its prompt.
    chat = HTTP.post(f"{base}/tokenize", json={"model": SERVED_MODEL, "messages": CHATS[1]})
    used = client.chat.completions.create(
        model=SERVED_MODEL, messages=CHATS[1], max_tokens=1, temperature=0
    ).usage.prompt_tokens
    assert chat.json()["count"] == used and chat.json()["token_strs"] is None
    back = HTTP.post(f"{base}/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": tokenizer.decode(body["tokens"])}
    version = HTTP.get(f"{base}/version").json()["version"]
    assert version.startswith("0.32")


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/tokenize", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"messages": CHATS[0], "continue_final_message": True}, 400, None),
        ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ],
)
def test_bad_tokenize_bodies_are_openai_errors(server, path, body, status, param):
    reply = HTTP.post(f"{server.url}{path}", json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and (param is None or error["param"] == param)
