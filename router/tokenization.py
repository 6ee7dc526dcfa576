"""Prompt -> token ids, in the router.

The router tokenizes so it can check the context length before any worker is involved, count
prompt tokens for routing, and send the same token ids wherever the request goes.
"""

import json
from pathlib import Path

from router.errors import invalid_request
from router.openai_types import ChatCompletionRequest, ChatMessage, CompletionRequest


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


class PromptTokenizer:
    def __init__(self, model: str) -> None:
        self.tokenizer = load_tokenizer(model)
        self.vocab_size = len(self.tokenizer)

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
        text = self.tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
        )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
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
