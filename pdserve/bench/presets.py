"""Named workloads: an existing generator with option values of its own, so that a regime can be
asked for by name and sent the same way by `pdserve bench` and scripts/compare_vllm.py.

- long-prompt: long prompts, short answers, every prompt its own random text (no prefix reuse),
  judged under a TTFT and a tight inter-token SLO: where disaggregated prefill/decode should win
  (Dynamo and MORI-IO report their gains in this regime).
- agentic: multi-turn chats whose every turn resends a long shared history (a document, a tool
  list) with a short new message: high prefix reuse, the control where aggregated (colocated)
  serving should win.

The values are sized for a 2-core CPU host running SmolLM2; docs/benchmarking.md gives each
one's full GPU shape. An option given on the command line wins over the preset's value.
"""

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Preset:
    generator: str  # the workload it runs as ("synthetic", "conversation", ...)
    values: dict[str, str | int | float]  # bench option (its argparse dest) -> value
    summary: str  # one line for --help


PRESETS = {
    "long-prompt": Preset(
        "synthetic",
        {"input_len": "1600", "output_len": "40", "slo": "ttft=6s,tpot=100ms"},
        "long prompts (1600 tokens), short answers (40), no prefix reuse",
    ),
    "agentic": Preset(
        "conversation",
        {
            "first_input_len": "1024",
            "input_len": "64",
            "output_len": "32",
            "conversations": 8,
            "turns": 6,
            "think_time": 0.5,
            "slo": "ttft=6s,tpot=100ms",
        },
        "chats resending a 1024-token history with 64-token messages, 32-token replies, 6 turns",
    ),
}

GENERIC_DEFAULTS: dict[str, str | int | float] = {
    "output_len": "128",
    "conversations": 8,
    "turns": 4,
    "think_time": 1.0,
}
"""Defaults of the options a preset sets, for every other workload (their argparse default is
None, so that a value given on the command line can be told from one left out)."""


def resolve(args: argparse.Namespace) -> None:
    """Turn `--workload NAME` into its generator (`args.workload`) and name (`args.preset`, None
    for a plain workload); every option left out (None) takes the preset's value, else its
    generic default."""
    preset = PRESETS.get(args.workload)
    vars(args).setdefault("preset", None)  # resolving twice keeps the name
    if preset:
        args.preset, args.workload = args.workload, preset.generator
    for name, value in {**GENERIC_DEFAULTS, **(preset.values if preset else {})}.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
