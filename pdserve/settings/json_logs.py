"""Log lines for people (text, the default) or for a log pipeline (`PDSERVE_LOG_FORMAT=json`, set
in every Kubernetes pod): one JSON object per line, with the request id on every line logged
while a request is handled.

The request id lives in a context variable: the router's request flow and the worker's Generate
handler set it (`request_context`), and every line logged in that task, and in tasks it
starts, carries it. vLLM's own loggers, in the worker and in its engine processes (which inherit
the environment), use the same format through VLLM_LOGGING_CONFIG_PATH.
"""

import contextlib
import contextvars
import json
import logging
import os
from pathlib import Path

LOG_FORMAT_ENV = "PDSERVE_LOG_FORMAT"  # "text" (default) or "json"
TEXT_FORMAT = "%(asctime)s %(name)s %(message)s"
VLLM_CONFIG = Path(__file__).with_name("vllm_json_logging.json")
request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pdserve_request_id", default=None
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": request_id.get(),
            "pid": record.process,
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


@contextlib.contextmanager
def request_context(rid: str):
    """Lines logged inside carry `rid` as their request id."""
    token = request_id.set(rid)
    try:
        yield
    finally:
        request_id.reset(token)


def configure_logging() -> None:
    """This process's logging, in the format PDSERVE_LOG_FORMAT names (INFO and above)."""
    kind = os.environ.get(LOG_FORMAT_ENV, "text")
    if kind not in ("text", "json"):
        raise ValueError(f"{LOG_FORMAT_ENV}: 'text' or 'json', got {kind!r}")
    if kind == "text":
        logging.basicConfig(level=logging.INFO, format=TEXT_FORMAT)
        return
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    os.environ.setdefault("VLLM_LOGGING_CONFIG_PATH", str(VLLM_CONFIG))
