"""The GPU worker's choice of vLLM's model runner (pdserve/worker/gpu_environment.py): the V1
runner, where pdserve's connectors were tested, unless the user chose."""

import logging

from pdserve.worker.gpu_environment import MODEL_RUNNER_ENV, pin_model_runner


def test_a_gpu_worker_with_a_connector_runs_the_v1_runner_and_says_so(caplog):
    environ = {}
    with caplog.at_level(logging.INFO, "pdserve.worker"):
        pin_model_runner(has_connector=True, cpu=False, environ=environ)
    assert environ == {MODEL_RUNNER_ENV: "0"}
    assert "V1 model runner" in caplog.text


def test_no_connector_or_a_cpu_worker_leaves_vllm_its_default():
    for has_connector, cpu in ((False, False), (True, True)):
        environ = {}
        pin_model_runner(has_connector, cpu, environ)
        assert environ == {}


def test_the_users_choice_stands_with_a_warning_for_v2(caplog):
    environ = {MODEL_RUNNER_ENV: "1"}
    with caplog.at_level(logging.INFO, "pdserve.worker"):
        pin_model_runner(has_connector=True, cpu=False, environ=environ)
    assert environ == {MODEL_RUNNER_ENV: "1"}
    assert "not tested" in caplog.text
