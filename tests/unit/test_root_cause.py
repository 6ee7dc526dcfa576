"""The root cause of a child's failure read from its log (pdserve/worker/root_cause.py), on the
shape of a real vLLM engine start that failed in a tensor-parallel rank (seen: `pdserve serve`
on a model whose checkpoint lacks a weight printed only the engine's wrapper)."""

from pdserve.worker.root_cause import root_cause

RANK = "(Worker_TP0 pid=11103) ERROR 12-05 22:00:55 [multiproc_executor.py:953] "
CORE = "(EngineCore pid=11089) ERROR 12-05 22:00:55 [core.py:1510] "
FAILED_START_LOG = f"""\
INFO 12-05 22:00:40 [model.py:1] loading the model
{RANK}WorkerProc failed to start.
{RANK}Traceback (most recent call last):
{RANK}  File "vllm/model_executor/model_loader/default_loader.py", line 564, in track_weights
{RANK}    raise ValueError(
{RANK}ValueError: Following weights were not initialized from checkpoint: {{'model.norm.weight'}}
{CORE}EngineCore failed to start.
{CORE}Traceback (most recent call last):
{CORE}  File "vllm/v1/executor/multiproc_executor.py", line 120, in wait_for_ready
{CORE}    raise e from None
{CORE}Exception: WorkerProc initialization failed due to an exception in a background process. \
See stack trace for root cause.
Traceback (most recent call last):
  File "vllm/v1/engine/utils.py", line 1431, in wait_for_engine_startup
    raise RuntimeError(
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {{}}
"""


def test_the_first_exception_that_is_no_wrapper_is_the_root_cause():
    assert root_cause(FAILED_START_LOG) == (
        "ValueError: Following weights were not initialized from checkpoint: {'model.norm.weight'}"
    )


def test_a_refusal_by_a_class_of_a_module_is_found_with_its_module():
    log = (
        "Traceback (most recent call last):\n"
        '  File "pdserve/worker/engine.py", line 3, in make_engine\n'
        "    find_layout(shape, None, heads, block_size, head_size)\n"
        "kv_transfer.kv_layout.LayoutError: a KV cache of shape (10, 16, 656) matches no known "
        "layout\n"
    )
    assert root_cause(log).startswith("kv_transfer.kv_layout.LayoutError: a KV cache of shape")


def test_only_wrappers_give_the_last_one_and_no_traceback_gives_none():
    only_wrapper = FAILED_START_LOG.split(f"{CORE}EngineCore failed")[1]
    assert root_cause(only_wrapper).startswith("RuntimeError: Engine core initialization failed")
    assert root_cause("INFO all good\nValueError: not after a traceback\n") is None
