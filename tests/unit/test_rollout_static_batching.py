"""The transformers engine on a model whose cache cannot be sliced by row (Qwen3.5's gated
delta-net layers): static batches, same contract — n samples, max_tokens, logprobs that match a
plain forward pass on the same weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch

from services.rollout.engines.base import Finish, GenerationRequest, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine
from tests.recipe_minis import tiny_model_dir
from tests.rollout_helpers import wait_for


def test_static_batches_for_linear_attention_models(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("qwen3_5_text", tmp_path / "q35")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TransformersEngine(model, tok, max_num_seqs=4, seed=0)
    assert engine.static_batching
    prompts = [tok("12+3=", add_special_tokens=False)["input_ids"], tok("7+45=", add_special_tokens=False)["input_ids"],
               tok("1=", add_special_tokens=False)["input_ids"]]
    spec = SamplingSpec(n=2, temperature=0.8, max_tokens=5, seed=11)

    async def main() -> list[list]:
        await engine.start()
        try:
            return await asyncio.gather(*[engine.generate(GenerationRequest(f"r{i}", p, spec)) for i, p in enumerate(prompts)])
        finally:
            await engine.close()

    outs = asyncio.run(main())
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, samples in zip(prompts, outs, strict=True):
        assert len(samples) == 2
        for o in samples:
            assert 1 <= len(o.token_ids) <= 5 and len(o.logprobs) == len(o.token_ids) == len(o.versions)
            ids = torch.tensor([prompt + o.token_ids])
            with torch.no_grad():
                logits = reference(input_ids=ids).logits[0].float() / 0.8
            lp = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1].gather(-1, torch.tensor(o.token_ids)[:, None])[:, 0]
            assert torch.allclose(lp, torch.tensor(o.logprobs), atol=2e-4), (lp, o.logprobs)


def test_a_pause_leaves_samples_that_finished_in_the_batch_alone(tmp_path: Path) -> None:
    # Static batches keep finished rows until the whole batch is done; a keep pause and its resume
    # must touch only the rows still generating, not outputs the caller already has.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model_dir("qwen3_5_text", tmp_path / "q35")
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = TransformersEngine(model, tok, max_num_seqs=4, seed=0)
    assert engine.static_batching
    prompt = tok("hi", add_special_tokens=False)["input_ids"]

    async def main() -> tuple[list, list]:
        await engine.start()
        try:
            await engine.pause("keep")  # both requests queue, then start as one static batch
            short = asyncio.create_task(engine.generate(GenerationRequest("short", prompt, SamplingSpec(temperature=0.0, max_tokens=2))))
            long = asyncio.create_task(engine.generate(GenerationRequest("long", prompt, SamplingSpec(temperature=0.0, max_tokens=200))))
            await wait_for(lambda: engine.stats()["waiting_seqs"] == 2, 30, "both requests queued")
            await engine.resume()
            done = await short
            assert engine.request_started("long") and not long.done()
            await engine.pause("keep")
            await engine.resume()
            await engine.abort("long")
            return done, await long
        finally:
            await engine.close()

    short_out, long_out = asyncio.run(main())
    assert short_out[0].finish_reason == Finish.LENGTH and len(short_out[0].token_ids) == 2
    assert short_out[0].num_resumes == 0, "a sample delivered before the pause was counted as resumed"
    assert long_out[0].finish_reason == Finish.ABORT and long_out[0].num_resumes == 1
