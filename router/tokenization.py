"""Prompt -> token ids, in the router.

The router tokenizes so it can check the context length before any worker is involved, count
prompt tokens for routing, and send the same token ids wherever the request goes.
"""

from router.errors import invalid_request
from router.openai_types import ChatCompletionRequest, CompletionRequest


class PromptTokenizer:
    def __init__(self, model: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.vocab_size = len(self.tokenizer)

    def chat(self, request: ChatCompletionRequest) -> list[int]:
        """Apply the model's chat template, as vLLM's chat endpoint does."""
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in request.messages
        ]
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        # The template already holds the special tokens.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def completion(self, request: CompletionRequest) -> list[int]:
        prompt = request.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise invalid_request(
                    f"prompt token id {bad[0]} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})",
                    param="prompt",
                )
        if not token_ids:
            raise invalid_request("the prompt is empty", param="prompt")
        return token_ids
