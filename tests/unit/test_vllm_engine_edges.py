"""The vLLM engine at its edges (marker `vllm`): an abort right after submit, greedy n>1 streaming
every copy, temperatures vLLM would clamp, a stop string that is a special token."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from services.rollout.engines import Finish, GenerationRequest, SamplingSpec
from tests.rollout_helpers import LoopThread, build_engine, reference_logprobs

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(model: Any, tok: Any, loop: LoopThread, tmp_path_factory: Any) -> Iterator[Any]:
    eng = build_engine("vllm", model, tok, str(tmp_path_factory.mktemp("engine-vllm-review")))
    loop.run(eng.start(), timeout_s=600)
    yield eng
    loop.run(eng.close())


def _prompt(tok: Any, text: str = "question: 12+13=") -> list[int]:
    return list(tok.encode(text))


def test_abort_right_after_submit_aborts(engine: Any, tok: Any, loop: LoopThread) -> None:
    """abort() returns True for a request generate() has registered; it must end it even while
    vLLM is still processing its inputs (not let it run to max_tokens)."""
    spec = SamplingSpec(temperature=0.0, max_tokens=200)
    full = loop.run(engine.generate(GenerationRequest("early-ref", _prompt(tok), spec)))[0]
    assert full.finish_reason == Finish.LENGTH, "the reference runs to max_tokens"

    async def scenario() -> Any:
        task = asyncio.create_task(engine.generate(GenerationRequest("early", _prompt(tok), spec)))
        await asyncio.sleep(0)  # generate() registered the request; vLLM still processing inputs
        assert await engine.abort("early")
        one = await asyncio.wait_for(task, 120)
        task2 = asyncio.create_task(engine.generate(GenerationRequest("early2", _prompt(tok), spec)))
        await asyncio.sleep(0)
        partial = await asyncio.wait_for(engine.abort_all(), 120)
        two = await asyncio.wait_for(task2, 120)
        return one, partial, two

    one, partial, two = loop.run(scenario())
    assert one[0].finish_reason == Finish.ABORT and len(one[0].token_ids) < 200
    assert set(partial) == {"early2"}
    assert two[0].finish_reason == Finish.ABORT and len(two[0].token_ids) < 200


def test_abort_right_after_submit_ends_every_sample(engine: Any, tok: Any, loop: LoopThread) -> None:
    """With n > 1 vLLM fans one request out into n child requests; an abort right after submit
    must end every child, not only those vLLM had registered when the abort came."""
    spec = SamplingSpec(n=4, temperature=1.0, max_tokens=200, seed=3)

    async def scenario() -> Any:
        task = asyncio.create_task(engine.generate(GenerationRequest("early-n", _prompt(tok), spec)))
        await asyncio.sleep(0)
        assert await engine.abort("early-n")
        return await asyncio.wait_for(task, 120)

    outs = loop.run(scenario())
    assert sorted(o.index for o in outs) == [0, 1, 2, 3]
    for o in outs:
        assert o.finish_reason != Finish.LENGTH and len(o.token_ids) < 200, f"sample {o.index} ran on"


def test_greedy_n_copies_stream_every_sample(engine: Any, tok: Any, loop: LoopThread) -> None:
    """on_token is called for every token of every sample (contract), greedy n > 1 included."""
    seen: list[tuple[int, int]] = []
    req = GenerationRequest("greedy-stream", _prompt(tok), SamplingSpec(n=3, temperature=0.0, max_tokens=8),
                            on_token=lambda i, t, lp: seen.append((i, t)))
    outs = loop.run(engine.generate(req))
    for o in outs:
        assert [t for i, t in seen if i == o.index] == o.token_ids, f"sample {o.index}"


@pytest.mark.parametrize("t", [1e-6, 5e-3])
def test_small_positive_temperature(engine: Any, model: Any, tok: Any, loop: LoopThread, t: float) -> None:
    """vLLM raises a temperature in (0, 0.01) to 0.01: the engine either reports
    log_softmax(logits / T) as the trainer recomputes it, or refuses the request."""
    from services.common.errors import InvalidArgument

    prompt = _prompt(tok)
    try:
        outs = loop.run(engine.generate(GenerationRequest(f"small-t-{t}", prompt,
                                                          SamplingSpec(n=2, temperature=t, max_tokens=8, seed=1))))
    except InvalidArgument:
        return
    assert len(outs) == 2
    for o in outs:
        ref = reference_logprobs(model, prompt, o.token_ids, t)
        assert (ref - torch.tensor(o.logprobs)).abs().max().item() < 2e-2


def test_stop_string_of_a_special_token(engine: Any, tok: Any, loop: LoopThread) -> None:
    """Stop strings are matched on the sampled text with special tokens (as the transformers
    engine and stop_across do): a sample that writes <|im_start|> stops there."""
    stop = "<|im_start|>"
    sid = tok.convert_tokens_to_ids(stop)
    assert sid != tok.eos_token_id
    prompt = _prompt(tok, "chat:")
    found = None
    for seed in range(40):
        spec = SamplingSpec(temperature=1.0, max_tokens=64, seed=seed)
        o = loop.run(engine.generate(GenerationRequest(f"sp-ref-{seed}", prompt, spec)))[0]
        if sid in o.token_ids:
            found = (spec, o)
            break
    assert found is not None, "no sample wrote the special token"
    spec, ref = found
    cut = ref.token_ids.index(sid) + 1
    import dataclasses

    o = loop.run(engine.generate(GenerationRequest("sp-stop", prompt, dataclasses.replace(spec, stop=(stop,)))))[0]
    assert o.finish_reason == Finish.STOP
    assert o.token_ids == ref.token_ids[:cut]
