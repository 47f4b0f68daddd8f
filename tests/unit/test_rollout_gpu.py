"""The transformers rollout engine on CUDA (marker `gpu`; scripts/gpu/rollout.sh runs these)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.engines import Finish, GenerationRequest, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine
from services.weights import iterate_buckets
from services.weights.in_process import model_named_tensors

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _ref(model: Any, prompt: list[int], tokens: list[int], temperature: float) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(tokens, device="cuda")[:, None]).squeeze(-1).cpu()


def _run(engine: TransformersEngine, coro: Any) -> Any:
    async def main() -> Any:
        await engine.start()
        try:
            return await coro()
        finally:
            await engine.close()

    return asyncio.run(main())


def test_cuda_logprobs_match_forward() -> None:
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0).to("cuda")
    engine = TransformersEngine(model, tok, device="cuda", max_num_seqs=32)
    prompt = list(tok.encode("question: 1+2="))

    async def go() -> Any:
        spec = SamplingSpec(n=4, temperature=0.8, top_k=10, top_p=0.95, max_tokens=32, seed=1)
        return await engine.generate(GenerationRequest("a", prompt, spec))

    outs = _run(engine, go)
    for o in outs:
        diff = (_ref(model, prompt, o.token_ids, 0.8) - torch.tensor(o.logprobs)).abs().max().item()
        assert diff < 1e-3, diff


def test_cuda_slot_refill_many_requests() -> None:
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0).to("cuda")
    engine = TransformersEngine(model, tok, device="cuda", max_num_seqs=8)

    async def go() -> Any:
        reqs = [
            engine.generate(GenerationRequest(f"r{i}", list(tok.encode(f"q{i}")), SamplingSpec(n=2, max_tokens=4 + 20 * (i % 3), seed=i)))
            for i in range(24)
        ]
        return await asyncio.gather(*reqs)

    outs = _run(engine, go)
    for i, group in enumerate(outs):
        for o in group:
            assert len(o.token_ids) <= 4 + 20 * (i % 3)
            assert o.finish_reason in (Finish.STOP, Finish.LENGTH)


def test_cuda_weight_load_in_place() -> None:
    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0).to("cuda")
    new = build_tiny_model("qwen3", tok, seed=3)
    engine = TransformersEngine(model, tok, device="cuda")
    ptr = next(model.parameters()).data_ptr()

    async def go() -> Any:
        await engine.pause("abort")
        n = await engine.load_weights(1, iterate_buckets([model_named_tensors(new)]))
        await engine.resume()
        return n

    assert _run(engine, go) > 0
    assert next(model.parameters()).data_ptr() == ptr, "loaded in place, no rebuild"
    for (name, a), b in zip(model.state_dict().items(), new.state_dict().values(), strict=True):
        assert torch.equal(a.cpu(), b), name


def test_cuda_memory_stats() -> None:
    tok = build_tokenizer()
    engine = TransformersEngine(build_tiny_model("qwen3", tok).to("cuda"), tok, device="cuda")
    stats = engine.stats()
    assert stats["total_bytes"] > 0 and stats["allocated_bytes"] > 0
