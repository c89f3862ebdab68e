"""This project's in-process engine, plain decoding, on a benchmark's prompts with as many in flight
as the load client keeps: the serving path's cost is the gap to it. Run in a fresh process by
``harness.run_engine``: ``python -m benchmarks.engine_run '<json: [engine keys, prompts, chat, batch,
max_tokens]>'``; prints ``RESULT {json}``."""

from __future__ import annotations

import json
import sys
import time

from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams


def main(arg: str) -> dict:
    cfg, prompts, chat, batch, max_tokens = json.loads(arg)
    engine = build_engine(EngineConfig(**cfg, max_batch_size=batch, speculation=SpeculationConfig(draft="none")))
    tok = engine.tokenizer
    ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True,
                                   return_dict=False) if chat else tok.encode(p) for p in prompts]
    params = GenerationParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(ids[:2], params)  # warm-up, as the load client's
    start = time.perf_counter()
    outs = engine.generate(ids, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"completed": len(outs), "duration": seconds, "total_output_tokens": tokens,
            "output_throughput": tokens / seconds}


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(sys.argv[1])))
