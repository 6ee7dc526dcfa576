"""Settings: the command line, `--settings-json` and the cluster file read into the same models,
so a knob's default is the same everywhere, and a bad value is refused by its flag's name."""

import argparse

import pytest

from pdserve.cli import build_parser
from pdserve.settings.base import ConfigError
from pdserve.settings.cluster_file import parse_cluster
from pdserve.settings.command_line import add_arguments, add_settings_json, from_arguments
from pdserve.settings.router import POLICIES as POLICY_NAMES
from pdserve.settings.router import RouterSettings
from pdserve.settings.worker import WorkerSettings
from router.workers.policies import POLICIES


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_arguments(parser, WorkerSettings)
    add_settings_json(parser)
    return parser


def test_no_flags_give_the_models_defaults():
    assert from_arguments(WorkerSettings, worker_parser().parse_args([])) == WorkerSettings()


def test_flags_fill_nested_engine_settings():
    args = worker_parser().parse_args(
        ["--role", "decode", "--kv-cache-gib", "1", "--max-model-len", "64", "--heartbeat", "3"]
    )
    settings = from_arguments(WorkerSettings, args)
    assert (settings.role, settings.heartbeat_s) == ("decode", 3.0)
    assert (settings.engine.kv_cache_gib, settings.engine.max_model_len) == (1.0, 64)


def test_a_launcher_document_round_trips_and_flags_beside_it_win():
    sent = WorkerSettings(role="prefill", port=0, worker_id="prefill-0")
    args = worker_parser().parse_args(
        ["--settings-json", sent.model_dump_json(), "--port", "7000", "--seed", "5"]
    )
    got = from_arguments(WorkerSettings, args)
    assert got.model_copy(update={"port": 0, "engine": sent.engine}) == sent
    assert (got.port, got.engine.seed) == (7000, 5)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-cache-gib", "0"], "--kv-cache-gib: must be > 0, got 0.0"),
        (["--tensor-parallel-size", "0"], "--tensor-parallel-size: must be an integer >= 1"),
        (["--heartbeat", "-1"], "--heartbeat: must be > 0"),
        (["--settings-json", "{nope"], "--settings-json: not valid JSON"),
        (["--settings-json", '{"rol": "decode"}'], "rol: unknown field"),
    ],
)
def test_a_bad_value_is_refused_by_its_flag(argv, message):
    with pytest.raises(ConfigError) as caught:
        from_arguments(WorkerSettings, worker_parser().parse_args(argv))
    assert message in str(caught.value)


def test_the_cluster_file_and_the_command_line_share_defaults():
    file = parse_cluster({})
    assert file.worker_settings("decode", "redis://r").engine == WorkerSettings().engine
    router = file.router_settings("redis://r")
    assert router.model_copy(update={"registry": "", "cluster": "pdserve"}) == RouterSettings(
        served_model_name="smollm2"
    )


def test_every_routing_policy_name_has_a_policy():
    assert set(POLICY_NAMES) == set(POLICIES)


def test_serve_refuses_a_bad_engine_value_before_starting_anything(capsys):
    args = build_parser().parse_args(["serve", "--kv-cache-gib", "-2"])
    assert args.run(args) == 2
    assert "--kv-cache-gib: must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kind, sent",
    [
        (WorkerSettings, parse_cluster({}).worker_settings("decode", "redis://r")),
        (RouterSettings, parse_cluster({}).router_settings("redis://r")),
        (RouterSettings, RouterSettings(worker_addresses=["127.0.0.1:1", "127.0.0.1:2"])),
    ],
)
def test_every_settings_document_a_launcher_sends_reads_back_equal(kind, sent):
    parser = argparse.ArgumentParser()
    add_arguments(parser, kind)
    add_settings_json(parser)
    args = parser.parse_args(["--settings-json", sent.model_dump_json()])
    assert from_arguments(kind, args) == sent
