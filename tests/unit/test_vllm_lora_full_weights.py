"""vLLM with LoRA (marker `vllm`): full weights load on a LoRA engine, and requests queued across
the update do not run with the dropped adapter."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.common.tiny import build_tiny_model
from services.rollout.engines import GenerationRequest, SamplingSpec
from services.weights import iterate_buckets
from services.weights.in_process import model_named_tensors
from tests.lora_helpers import random_adapter
from tests.rollout_helpers import LoopThread, build_engine, reference_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(model: Any, tok: Any, loop: LoopThread, tmp_path_factory: Any) -> Iterator[Any]:
    eng = build_engine("vllm", model, tok, str(tmp_path_factory.mktemp("lora-review")),
                       enable_lora=True, max_lora_rank=8, max_loras=1)
    loop.run(eng.start(), timeout_s=600)
    yield eng
    loop.run(eng.close())


def test_full_weights_after_adapter_drop_it_for_queued_requests(engine: Any, model: Any, tok: Any, loop: LoopThread) -> None:
    bucket, _ = random_adapter(model, seed=3, scale=0.5)
    new_model = build_tiny_model("qwen3", tok, seed=5)
    prompt = list(tok.encode("question: 1+2="))

    async def scenario() -> Any:
        await engine.pause("abort")
        await engine.load_weights(engine.version + 1, iterate_buckets([bucket]))
        await engine.resume()
        await engine.pause("abort")
        # queued while paused, before the full weights come
        task = asyncio.create_task(engine.generate(GenerationRequest("queued", prompt, SamplingSpec(max_tokens=16, seed=1))))
        await asyncio.sleep(0.2)
        await engine.load_weights(engine.version + 1, iterate_buckets([model_named_tensors(new_model)]))
        await engine.resume()
        return await asyncio.wait_for(task, 120)

    o = loop.run(scenario())[0]
    fresh = loop.run(engine.generate(GenerationRequest("fresh", prompt, SamplingSpec(max_tokens=16, seed=1))))[0]
    ref = reference_logprobs(new_model, prompt, fresh.token_ids, 1.0)
    assert (ref - torch.tensor(fresh.logprobs)).abs().max().item() < 2e-2, "the new full weights are loaded"
    assert set(o.versions) == {engine.version}
    ref = reference_logprobs(new_model, prompt, o.token_ids, 1.0)
    assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 2e-2, "generated with the old adapter on the new base"


def test_full_weights_load_on_a_lora_engine(engine: Any, model: Any, tok: Any, loop: LoopThread) -> None:
    """With enable_lora vLLM wraps the linear layers (".base_layer"); a full-weight update on CPU
    must still load and repack them."""
    new_model = build_tiny_model("qwen3", tok, seed=9)
    prompt = list(tok.encode("hello"))

    async def load() -> None:
        await engine.pause("abort")
        await engine.load_weights(engine.version + 1, iterate_buckets([model_named_tensors(new_model)]))
        await engine.resume()

    loop.run(load())
    o = loop.run(engine.generate(GenerationRequest("full-on-lora", prompt, SamplingSpec(max_tokens=16, seed=2))))[0]
    ref = reference_logprobs(new_model, prompt, o.token_ids, 1.0)
    assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 2e-2
