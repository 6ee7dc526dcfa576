"""Prompt -> token ids, in the router.

The router tokenizes so it can check the context length before any worker is involved, count
prompt tokens for routing, and send the same token ids wherever the request goes.

Tokenizing costs about a second of a core per MiB of text, so a long prompt never runs on the
event loop (which would stall /health and every stream, security review H2): requests are
admitted in `TokenizerThreads`, a few threads of their own (HF's fast tokenizers let go of the
GIL while they encode). Only a small body with one prompt (at most ~0.5 ms of work, less than
the hand-off to a thread costs) is admitted on the loop: router/flow/admission.py's
`admits_inline`. And a prompt longer in characters than the context can hold in tokens (each
token is at most `max_token_chars` long) is refused before it is tokenized.
"""

import asyncio
import contextvars
import functools
import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from router.http.errors import invalid_request, prompt_too_long
from router.http.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest

TOKENIZE_THREADS = min(4, os.cpu_count() or 1)  # admissions (and /tokenize calls) at once
MIN_TOKEN_CHARS = 16  # the bound on one token's length is never taken below this


class TokenizerThreads:
    """Runs a function off the event loop, in one of a few threads kept for it; its caller's
    context (the request's trace and log id) goes with it."""

    def __init__(self, threads: int = TOKENIZE_THREADS) -> None:
        self.executor = ThreadPoolExecutor(threads, thread_name_prefix="pdserve-tokenize")

    async def run(self, function: Callable, *args, **kwargs):
        call = functools.partial(contextvars.copy_context().run, function, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self.executor, call)


def load_tokenizer(model: str):
    """The tokenizer AutoTokenizer gives for `model`, without its import of torch where the
    answer is known: a local folder whose tokenizer_config.json names `TokenizersBackend` (as
    transformers 5 saves a fast tokenizer) with no custom class (`auto_map`) and a
    tokenizer.json is loaded by that class directly. AutoTokenizer's module imports torch
    (~4 s of a core of the router's ~6 s start); the class alone does not. Anything else (a hub
    id, another class, a custom or Mistral tokenizer) goes through AutoTokenizer."""
    folder = Path(model)
    config = folder / "tokenizer_config.json"
    if config.is_file() and (folder / "tokenizer.json").is_file():
        settings = json.loads(config.read_text())
        if settings.get("tokenizer_class") == "TokenizersBackend" and "auto_map" not in settings:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(model)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def longest_token_chars(tokenizer) -> int:
    """The most characters of text one token stands for: its vocabulary's longest entry (a
    byte-level entry has a character per byte, so no fewer than the text's), special tokens
    included; never below MIN_TOKEN_CHARS."""
    return max(MIN_TOKEN_CHARS, max(map(len, tokenizer.get_vocab()), default=0))


def fast_encode(tokenizer) -> Callable[[str, bool], list[int]] | None:
    """`(text, add_special_tokens) -> ids` straight from the Rust tokenizer behind a fast HF
    tokenizer (a TokenizersBackend), set once as transformers sets it for each call with no
    truncation nor padding: the same ids without transformers' batch and BatchEncoding around
    one prompt (half of what tokenizing a short prompt cost, ~3% of the router's CPU for a short
    request). None for any other tokenizer, or one whose class encodes its own way (a custom
    class overriding `encode` or `_encode_plus`): those go through their own `encode`."""
    from tokenizers import Tokenizer
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        not isinstance(backend, Tokenizer)
        or not isinstance(tokenizer, TokenizersBackend)
        or type(tokenizer).encode is not PreTrainedTokenizerBase.encode
        or type(tokenizer)._encode_plus is not TokenizersBackend._encode_plus
    ):
        return None
    backend.no_truncation()
    backend.no_padding()
    backend.encode_special_tokens = tokenizer.split_special_tokens

    def encode(text: str, add_special_tokens: bool) -> list[int]:
        return backend.encode(text, add_special_tokens=add_special_tokens).ids

    return encode


class PromptTokenizer:
    """`max_model_len()`: the context of the smallest worker (0: none known yet, no check)."""

    def __init__(self, model: str, max_model_len: Callable[[], int] = lambda: 0) -> None:
        self.tokenizer = load_tokenizer(model)
        self._fast_encode = fast_encode(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.max_model_len = max_model_len
        self.max_token_chars = longest_token_chars(self.tokenizer)

    def check_length(self, chars: int, param: str) -> None:
        """A 400 for text too long for the context whatever its tokens, before they are made."""
        context = self.max_model_len()
        if context and chars > context * self.max_token_chars:
            raise prompt_too_long(chars, context * self.max_token_chars, context, param)

    def chat(self, request: ChatCompletionRequest) -> list[int]:
        """Apply the model's chat template, as vLLM's chat endpoint does."""
        return self.chat_ids(
            request.messages,
            request.add_generation_prompt,
            request.continue_final_message,
            request.add_special_tokens,
        )

    def chat_ids(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The templated conversation's token ids (the template holds the special tokens; more
        only with add_special_tokens, as vLLM does)."""
        if add_generation_prompt and continue_final_message:
            raise invalid_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        conversation = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in messages
        ]
        self.check_length(sum(len(m["content"]) for m in conversation), "messages")
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
        self.check_length(len(text), "messages")
        return self._encode(text, add_special_tokens)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.check_length(len(text), "prompt")
        return self._encode(text, add_special_tokens)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if self._fast_encode is not None:
            return self._fast_encode(text, add_special_tokens)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def token_strs(self, token_ids: list[int]) -> list[str]:
        return self.tokenizer.convert_ids_to_tokens(token_ids)

    def detokenize(self, token_ids: list[int]) -> str:
        """Text of `token_ids` (a 400 naming the first one outside the vocabulary)."""
        self._check_vocabulary(token_ids, "tokens")
        return self.tokenizer.decode(token_ids)

    def _check_vocabulary(self, token_ids: list[int], param: str) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise invalid_request(
                f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})",
                param=param,
            )

    def completion_prompts(self, request: CompletionRequest) -> list[list[int]]:
        """Each prompt of the request (one, or a batch) as token ids."""
        prompts = []
        for prompt in request.prompts():
            if isinstance(prompt, str):
                token_ids = self.text_ids(prompt, request.add_special_tokens)
            else:
                token_ids = prompt
                self._check_vocabulary(token_ids, "prompt")
            if not token_ids:
                raise invalid_request("the prompt is empty", param="prompt")
            prompts.append(token_ids)
        return prompts

    def token_text(self, token_id: int) -> str:
        """One token's text, as vLLM's server decodes a token it has no text for."""
        return self.tokenizer.decode([token_id])
