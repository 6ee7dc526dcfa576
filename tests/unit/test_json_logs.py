"""PDSERVE_LOG_FORMAT=json: every line a process logs is one JSON object, the request id on the
lines logged while a request is handled (also in tasks it starts), and vLLM's loggers, set up
from the config file vLLM is pointed at, write the same format."""

import json
import os
import subprocess
import sys

import pytest

from pdserve.settings.json_logs import LOG_FORMAT_ENV, configure_logging

SCRIPT = """
import asyncio, json, logging, logging.config, os
from pdserve.settings.json_logs import configure_logging, request_context

configure_logging()
log = logging.getLogger("pdserve.test")
log.info("before")

async def child():
    log.info("in a task it started")

async def handle():
    with request_context("req-7"):
        log.info("in the handler")
        await asyncio.create_task(child())
    log.info("after")

asyncio.run(handle())
# What vLLM does with VLLM_LOGGING_CONFIG_PATH in each of its processes.
with open(os.environ["VLLM_LOGGING_CONFIG_PATH"]) as file:
    logging.config.dictConfig(json.load(file))
logging.getLogger("vllm.engine").info("from vllm")
log.warning("pdserve still logs")
"""


def test_json_lines_carry_the_request_id_in_the_request_only():
    env = {**os.environ, LOG_FORMAT_ENV: "json"}
    env.pop("VLLM_LOGGING_CONFIG_PATH", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=60
    )
    lines = [json.loads(line) for line in done.stderr.splitlines()]
    assert [(line["logger"], line["message"], line["request_id"]) for line in lines] == [
        ("pdserve.test", "before", None),
        ("pdserve.test", "in the handler", "req-7"),
        ("pdserve.test", "in a task it started", "req-7"),
        ("pdserve.test", "after", None),
        ("vllm.engine", "from vllm", None),
        ("pdserve.test", "pdserve still logs", None),
    ]
    assert {line["level"] for line in lines} == {"INFO", "WARNING"}


def test_text_is_the_default_format():
    env = {k: v for k, v in os.environ.items() if k != LOG_FORMAT_ENV}
    done = subprocess.run(
        [sys.executable, "-c",
         "from pdserve.settings.json_logs import configure_logging; import logging;"
         "configure_logging(); logging.getLogger('pdserve.test').info('plain')"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.stderr.rstrip().endswith("pdserve.test plain")


def test_an_unknown_format_is_refused(monkeypatch):
    monkeypatch.setenv(LOG_FORMAT_ENV, "xml")
    with pytest.raises(ValueError, match="PDSERVE_LOG_FORMAT"):
        configure_logging()
