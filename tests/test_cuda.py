"""The torch runner on CUDA (``engine.device: cuda``): runs where a GPU is present, skipped elsewhere.
The same losslessness checks as on CPU: speculative greedy output equals plain decoding on the GPU
and Hugging Face's on the CPU, in fp32."""

from __future__ import annotations

import pytest
import torch

from serve_app.config import EngineConfig, SpeculationConfig
from serve_app.engine.factory import build_engine
from serve_app.engine.request import GenerationParams
from serve_app.speculation.types import SamplingParams
from tests.helpers import hf_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_engine(target, draft, k=4):
    return build_engine(EngineConfig(model=str(target), device="cuda", dtype="float32", max_batch_size=4,
                                     max_seq_len=256,
                                     speculation=SpeculationConfig(draft=str(draft), num_speculative_tokens=k)))


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_greedy_speculation_on_cuda_equals_plain_decoding_and_hf(tiny_models, method):
    engine = cuda_engine(tiny_models["qwen3"], tiny_models["qwen3_near"])
    prompts = [[5, 6, 7, 8], list(range(20, 40)), [9] * 6]
    plain = engine.generate(prompts, GenerationParams(max_tokens=32, method="none"))
    spec = engine.generate(prompts, GenerationParams(max_tokens=32, method=method))
    assert [s.token_ids for s in spec] == [p.token_ids for p in plain]
    assert plain[0].token_ids == hf_greedy(tiny_models["qwen3"], prompts[0], 32)
    assert engine.verifier.runner.model.lm_head.weight.is_cuda


def test_sampled_speculation_on_cuda_is_reproducible(tiny_models):
    engine = cuda_engine(tiny_models["qwen3"], tiny_models["qwen3_near"])
    params = GenerationParams(max_tokens=24, method="draft", sampling=SamplingParams(temperature=0.8, seed=5))
    first = engine.generate([[5, 6, 7]], params)[0].token_ids
    assert engine.generate([[5, 6, 7]], params)[0].token_ids == first
