"""OpenAI-style errors: every failure the router returns has this body and a real status code.

Body: {"error": {"message", "type", "param", "code"}}. 4xx for the client's mistakes, 5xx only
for ours or the workers'. `kind` labels the error in the `pdserve_errors_total` metric.
"""

from dataclasses import dataclass


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    kind: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def invalid_request(
    message: str, param: str | None = None, code: str | None = None, kind: str = "invalid_request"
) -> OpenAIError:
    return OpenAIError(400, message, kind, param=param, code=code)


def unsupported_parameter(param: str, why: str = "is not supported by pdserve") -> OpenAIError:
    return OpenAIError(
        400, f"'{param}' {why}", "unsupported_parameter", param=param, code="unsupported_parameter"
    )


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'",
        "model_not_found",
        param="model",
        code="model_not_found",
    )


def check_model(asked: str | None, served: str) -> None:
    """A 404 for a model this router does not serve (none named: the served one)."""
    if asked is not None and asked != served:
        raise model_not_found(asked, served)


def context_length_exceeded(
    prompt_tokens: int, max_tokens: int, max_model_len: int, param: str
) -> OpenAIError:
    return OpenAIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
        f"{max_tokens} for the completion). Please reduce the prompt or max_tokens.",
        "context_length",
        param=param,
        code="context_length_exceeded",
    )


def worker_unavailable(message: str) -> OpenAIError:
    return OpenAIError(
        503,
        message,
        "worker_unavailable",
        type="service_unavailable_error",
        code="worker_unavailable",
    )


def prefill_lost(message: str) -> OpenAIError:
    """A prefill leg's worker went away before the prompt's KV was complete: the router tries
    another prefill worker (or the local path); the client sees this only if none is left."""
    return OpenAIError(
        503,
        message,
        "prefill_unavailable",
        type="service_unavailable_error",
        code="worker_unavailable",
    )


def too_many_requests(message: str) -> OpenAIError:
    return OpenAIError(
        429, message, "rate_limited", type="rate_limit_error", code="rate_limit_exceeded"
    )


def worker_failed(message: str) -> OpenAIError:
    return OpenAIError(502, message, "worker_error", type="server_error", code="worker_error")


def request_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        504,
        f"the request did not finish within {seconds:g} s",
        "timeout",
        type="server_error",
        code="timeout",
    )
