"""OpenAI-style errors: every failure the router returns has this body and a real status code.

Body: {"error": {"message", "type", "param", "code"}}. 4xx for the client's mistakes, 5xx only
for ours or the workers'. `kind` labels the error in the `pdserve_errors_total` metric.
"""

from dataclasses import dataclass
from enum import StrEnum


class ErrorKind(StrEnum):
    """What went wrong: the `kind` label of pdserve_errors_total, and what the flow acts on."""

    INVALID_REQUEST = "invalid_request"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH = "context_length"
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMITED = "rate_limited"
    WORKER_UNAVAILABLE = "worker_unavailable"  # the worker is marked down, another one tried
    PREFILL_UNAVAILABLE = "prefill_unavailable"  # a prefill leg's worker went away
    WORKER_ERROR = "worker_error"  # the worker or its engine failed the request
    KV_TRANSFER_FAILED = "kv_transfer_failed"  # the prompt's KV did not reach the decode worker
    TIMEOUT = "timeout"
    CLIENT_DISCONNECT = "client_disconnect"
    INTERNAL = "internal"  # a bug of the router's: the log has the details


class ErrorType(StrEnum):
    """OpenAI's error `type`."""

    INVALID_REQUEST = "invalid_request_error"
    SERVICE_UNAVAILABLE = "service_unavailable_error"
    RATE_LIMIT = "rate_limit_error"
    SERVER = "server_error"


class ErrorCode(StrEnum):
    """OpenAI's error `code` (vLLM's where OpenAI has none)."""

    INVALID_VALUE = "invalid_value"
    UNRECOGNIZED_ARGUMENT = "unrecognized_argument"
    MISSING_REQUIRED_PARAMETER = "missing_required_parameter"
    UNSUPPORTED_PARAMETER = "unsupported_parameter"
    MODEL_NOT_FOUND = "model_not_found"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    REQUEST_TOO_LARGE = "request_too_large"
    INVALID_API_KEY = "invalid_api_key"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    WORKER_UNAVAILABLE = "worker_unavailable"
    WORKER_ERROR = "worker_error"
    KV_TRANSFER_FAILED = "kv_transfer_failed"
    TIMEOUT = "timeout"
    INTERNAL_ERROR = "internal_error"


@dataclass
class OpenAIError(Exception):
    status: int
    message: str
    kind: ErrorKind
    type: ErrorType = ErrorType.INVALID_REQUEST
    param: str | None = None
    code: ErrorCode | None = None
    retry_after_s: int | None = None  # a 429's Retry-After

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
    message: str,
    param: str | None = None,
    code: ErrorCode | None = None,
    kind: ErrorKind = ErrorKind.INVALID_REQUEST,
) -> OpenAIError:
    return OpenAIError(400, message, kind, param=param, code=code)


def unsupported_parameter(param: str, why: str = "is not supported by pdserve") -> OpenAIError:
    return OpenAIError(
        400,
        f"'{param}' {why}",
        ErrorKind.UNSUPPORTED_PARAMETER,
        param=param,
        code=ErrorCode.UNSUPPORTED_PARAMETER,
    )


def model_not_found(model: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model '{model}' does not exist; this server serves '{served}'",
        ErrorKind.MODEL_NOT_FOUND,
        param="model",
        code=ErrorCode.MODEL_NOT_FOUND,
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
        ErrorKind.CONTEXT_LENGTH,
        param=param,
        code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
    )


def prompt_too_long(chars: int, max_chars: int, max_model_len: int, param: str) -> OpenAIError:
    """A prompt refused by its length in characters, before it is tokenized."""
    return OpenAIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, the "
        f"{param} has {chars} characters, more than {max_model_len} tokens can hold "
        f"({max_chars}). Please reduce the prompt.",
        ErrorKind.CONTEXT_LENGTH,
        param=param,
        code=ErrorCode.CONTEXT_LENGTH_EXCEEDED,
    )


def body_too_large(max_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"the request body is larger than {max_bytes >> 20} MiB",
        ErrorKind.INVALID_REQUEST,
        code=ErrorCode.REQUEST_TOO_LARGE,
    )


def body_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        408,
        f"the request body did not arrive within {seconds:g} s",
        ErrorKind.TIMEOUT,
        code=ErrorCode.TIMEOUT,
    )


def invalid_api_key(message: str) -> OpenAIError:
    return OpenAIError(401, message, ErrorKind.INVALID_API_KEY, code=ErrorCode.INVALID_API_KEY)


def worker_unavailable(message: str) -> OpenAIError:
    return OpenAIError(
        503,
        message,
        ErrorKind.WORKER_UNAVAILABLE,
        type=ErrorType.SERVICE_UNAVAILABLE,
        code=ErrorCode.WORKER_UNAVAILABLE,
    )


def prefill_lost(message: str) -> OpenAIError:
    """A prefill leg's worker went away before the prompt's KV was complete: the router tries
    another prefill worker (or the local path); the client sees this only if none is left."""
    return OpenAIError(
        503,
        message,
        ErrorKind.PREFILL_UNAVAILABLE,
        type=ErrorType.SERVICE_UNAVAILABLE,
        code=ErrorCode.WORKER_UNAVAILABLE,
    )


def too_many_requests(message: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(
        429,
        message,
        ErrorKind.RATE_LIMITED,
        type=ErrorType.RATE_LIMIT,
        code=ErrorCode.RATE_LIMIT_EXCEEDED,
        retry_after_s=retry_after_s,
    )


def worker_failed(message: str) -> OpenAIError:
    return OpenAIError(
        502, message, ErrorKind.WORKER_ERROR, type=ErrorType.SERVER, code=ErrorCode.WORKER_ERROR
    )


def kv_transfer_failed(message: str) -> OpenAIError:
    """The prompt's KV did not reach the decode worker, whose kv failure policy is `fail`."""
    return OpenAIError(
        502,
        message,
        ErrorKind.KV_TRANSFER_FAILED,
        type=ErrorType.SERVER,
        code=ErrorCode.KV_TRANSFER_FAILED,
    )


def request_timeout(seconds: float) -> OpenAIError:
    return OpenAIError(
        504,
        f"the request did not finish within {seconds:g} s",
        ErrorKind.TIMEOUT,
        type=ErrorType.SERVER,
        code=ErrorCode.TIMEOUT,
    )


def internal_error(error_id: str) -> OpenAIError:
    """A bug of the router's: the details go to the log, under an id the client gets."""
    return OpenAIError(
        500,
        f"internal error (id {error_id}); the router's log has the details",
        ErrorKind.INTERNAL,
        type=ErrorType.SERVER,
        code=ErrorCode.INTERNAL_ERROR,
    )
