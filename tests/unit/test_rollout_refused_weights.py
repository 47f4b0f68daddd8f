"""A weight or adapter bucket the transformers engine refuses changes nothing: the adapter stays
in place (the worker resumes generation on the old version after a refusal)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from services.common.errors import InvalidArgument
from services.common.tiny import build_tiny_model
from services.rollout.engines import GenerationRequest, SamplingSpec
from services.weights import iterate_buckets
from tests.lora_helpers import random_adapter
from tests.rollout_helpers import LoopThread, build_engine


def _engine(tok: Any, loop: LoopThread, tmp_path: Any) -> Any:
    model = build_tiny_model("qwen3", tok, seed=0)
    eng = build_engine("transformers", model, tok, str(tmp_path))
    loop.run(eng.start())
    return eng


async def _load(engine: Any, version: int, bucket: Any) -> int:
    await engine.pause("abort")
    try:
        return int(await engine.load_weights(version, iterate_buckets([bucket])))
    finally:
        await engine.resume()


def _greedy(engine: Any, tok: Any, loop: LoopThread, rid: str) -> list[float]:
    out = loop.run(engine.generate(GenerationRequest(rid, list(tok.encode("same as before")),
                                                     SamplingSpec(max_tokens=8, temperature=0.0))))
    return out[0].logprobs


def test_refused_full_weights_bucket_leaves_the_adapter_in_place(tok: Any, loop: LoopThread, tmp_path: Any) -> None:
    """A full-weights version refused at its first bucket (unknown name) must change nothing: the
    worker resumes generation on the old version after such a refusal."""
    engine = _engine(tok, loop, tmp_path)
    try:
        adapter, _ = random_adapter(engine.model, seed=1)
        loop.run(_load(engine, 1, adapter))
        before = _greedy(engine, tok, loop, "a")
        bad = [("model.no_such_weight", torch.zeros(3))]
        with pytest.raises(InvalidArgument):
            loop.run(_load(engine, 2, bad))
        assert engine.version == 1
        assert _greedy(engine, tok, loop, "b") == before, "a refused version must leave the weights unchanged"
    finally:
        loop.run(engine.close())


def test_refused_adapter_bucket_leaves_the_adapter_in_place(tok: Any, loop: LoopThread, tmp_path: Any) -> None:
    """An adapter version whose first bucket holds a bad tensor after good ones is refused
    (InvalidArgument, re-raised as a refusal by the engine): nothing may have been copied."""
    engine = _engine(tok, loop, tmp_path)
    try:
        v1, _ = random_adapter(engine.model, seed=1)
        v2, _ = random_adapter(engine.model, seed=2)
        loop.run(_load(engine, 1, v1))
        before = _greedy(engine, tok, loop, "a")
        name, t = v2[-1]
        v2 = [*v2, (name, torch.zeros(t.shape[0] + 1, *t.shape[1:]))]  # wrong shape, last
        with pytest.raises(InvalidArgument):
            loop.run(_load(engine, 2, v2))
        assert engine.version == 1
        assert _greedy(engine, tok, loop, "b") == before, "a refused version must leave the weights unchanged"
    finally:
        loop.run(engine.close())
