"""The transformers engine's admission: what one prefill may take (transformers_scheduler.py)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from services.common.tiny import build_tiny_model, build_tokenizer
from services.rollout.engines import GenerationRequest, SamplingSpec
from services.rollout.engines.transformers_engine import TransformersEngine


def test_a_prefill_stays_within_max_num_batched_tokens_counting_its_padding() -> None:
    # The prompts of one prefill are left-padded to the longest: a long prompt followed by short
    # ones costs rows x longest, not the sum of their lengths. Counted unpadded, a 30-token prompt
    # and three 3-token ones "fit" 40 tokens and ran as a 4 x 30 prefill (120 tokens: on a GPU,
    # activations and attention scores many times what the budget was set to bound).
    tok = build_tokenizer()
    budget = 40
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok, max_num_seqs=8,
                                max_num_batched_tokens=budget)
    shapes: list[tuple[int, int]] = []
    forward = engine.model.forward

    def recording(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs["input_ids"]
        if ids.shape[1] > 1:  # a prefill (a decode step feeds one token per row)
            shapes.append((int(ids.shape[0]), int(ids.shape[1])))
        return forward(*args, **kwargs)

    engine.model.forward = recording
    long = list(tok.encode("x" * 30))[:30]
    assert len(long) == 30
    short = list(tok.encode("abc"))[:3]

    async def main() -> list[Any]:
        await engine.start()
        try:
            await engine.pause("keep")  # every request queues, then one admission sees them all
            tasks = [asyncio.create_task(engine.generate(GenerationRequest("long", long, SamplingSpec(max_tokens=2))))]
            tasks += [asyncio.create_task(engine.generate(GenerationRequest(f"s{i}", short, SamplingSpec(max_tokens=2))))
                      for i in range(5)]
            await asyncio.sleep(0.2)
            await engine.resume()
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)
        finally:
            await engine.close()

    outs = asyncio.run(main())
    assert all(len(o[0].token_ids) >= 1 for o in outs)  # every request ran
    assert sum(rows for rows, _ in shapes) == 6
    # One prompt is always admitted, whatever its length; more only while rows x width fits.
    assert all(rows == 1 or rows * width <= budget for rows, width in shapes), shapes


def test_a_prompt_id_outside_the_vocabulary_is_refused_and_the_engine_keeps_serving() -> None:
    # The embedding lookup of an id past the model's vocabulary raises in the scheduler thread (on
    # CUDA a device-side assert): it failed every request in flight and left the replica dead. A
    # tokenizer with tokens the model has no rows for (added special tokens, another tokenizer_path)
    # sends such ids; the request is refused instead, as vLLM refuses it.
    import pytest

    from services.common.errors import InvalidArgument

    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0)
    vocab = model.get_input_embeddings().weight.shape[0]
    engine = TransformersEngine(model, tok, max_num_seqs=4)
    prompt = list(tok.encode("question: 1+1="))

    async def main() -> Any:
        await engine.start()
        try:
            other = asyncio.create_task(engine.generate(GenerationRequest("other", prompt, SamplingSpec(max_tokens=8))))
            for bad in (vocab, -1):
                with pytest.raises(InvalidArgument, match="prompt_token_ids"):
                    await engine.generate(GenerationRequest(f"bad{bad}", [*prompt, bad], SamplingSpec(max_tokens=4)))
            return await asyncio.wait_for(other, 60), (await engine.health()).healthy
        finally:
            await engine.close()

    (out,), healthy = asyncio.run(main())
    assert healthy and len(out.token_ids) >= 1


def test_a_generate_cancelled_again_while_its_abort_is_queued_still_ends_its_samples() -> None:
    # A cancelled generate() queues its abort and awaits it; cancelled a second time there (a
    # drain after a lost lease, a timeout around a task group) it left, and took its request out
    # of the map the abort looked it up in, before the scheduler thread applied the abort: its
    # samples kept their slots to max_tokens, unowned, and held up every `wait` pause.
    import time

    tok = build_tokenizer()
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok, max_num_seqs=4, max_model_len=4096)
    forward = engine.model.forward

    def slow(*args: Any, **kwargs: Any) -> Any:  # the abort waits for the step in progress
        time.sleep(0.05)
        return forward(*args, **kwargs)

    engine.model.forward = slow
    engine._sched.eos_ids = set()  # the samples would run to max_tokens

    async def main() -> tuple[float, dict[str, Any]]:
        await engine.start()
        try:
            task = asyncio.create_task(engine.generate(
                GenerationRequest("twice", list(tok.encode("question: 1+1=")), SamplingSpec(n=2, max_tokens=3000))))
            for _ in range(100):  # until both samples decode
                await asyncio.sleep(0.02)
                if engine.stats()["running_seqs"] == 2:
                    break
            task.cancel()
            await asyncio.sleep(0)  # it queues its abort and awaits it
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            for _ in range(100):
                await asyncio.sleep(0.05)
                if engine.stats()["running_seqs"] == 0:
                    break
            return engine.stats()["running_seqs"], dict(engine._requests)
        finally:
            await engine.close()

    running, requests = asyncio.run(main())
    assert running == 0 and requests == {}


def test_a_tiny_temperature_is_served_as_greedy_and_the_engine_keeps_serving() -> None:
    # A temperature of 1e-45 divides every logit to +-inf; the NaN distribution made
    # torch.multinomial raise in the scheduler thread, failing the other request in flight and
    # every later one (the replica was dead). SamplingSpec accepts any temperature >= 0.
    tok = build_tokenizer()
    engine = TransformersEngine(build_tiny_model("qwen3", tok, seed=0), tok, max_num_seqs=4)
    prompt = list(tok.encode("question: 1+1="))

    async def main() -> Any:
        await engine.start()
        try:
            other = asyncio.create_task(engine.generate(GenerationRequest("other", prompt, SamplingSpec(max_tokens=8))))
            tiny = await asyncio.wait_for(engine.generate(
                GenerationRequest("tiny", prompt, SamplingSpec(n=2, temperature=1e-45, max_tokens=8))), 60)
            greedy = await asyncio.wait_for(engine.generate(
                GenerationRequest("greedy", prompt, SamplingSpec(temperature=0.0, max_tokens=8))), 60)
            return tiny, greedy, await asyncio.wait_for(other, 60), (await engine.health()).healthy
        finally:
            await engine.close()

    tiny, greedy, (out,), healthy = asyncio.run(main())
    assert healthy and len(out.token_ids) >= 1
    assert [s.token_ids for s in tiny] == [greedy[0].token_ids] * 2
