"""`meshrl bench rollout`: generated tokens/s on a long-tailed length mix, each engine against its
plain baseline on the same prompts in the same run.

    transformers engine (slot refill)  vs  model.generate in fixed batches of the same slot count
    vllm engine (AsyncLLM, per-sample) vs  bare vllm LLM.generate (needs .venv-vllm)

The mix: `prompts` chat prompts x n samples; most requests may generate `short_tokens`, a
`long_fraction` of them `long_tokens` (the tail). Lengths end at max_tokens or EOS, whichever first;
tokens/s counts the tokens each side returns (for `generate`, a row's tokens up to its own
max_tokens / EOS: what the caller would keep). The tiny model is random, so EOS comes at ~1/vocab
per token and adds its own tail.
"""

from __future__ import annotations

import asyncio
import platform
import random
import statistics
import time
from typing import Any

import torch

from services.common.tiny import build_tiny_model, build_tokenizer


def _workload(tok: Any, prompts: int, short_tokens: int, long_tokens: int, long_fraction: float, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    ids, max_tokens = [], []
    for i in range(prompts):
        msgs = [{"role": "user", "content": f"question {i}: what is {rng.randint(10, 99)}+{rng.randint(10, 99)}?"}]
        ids.append(list(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False))))
        max_tokens.append(long_tokens if rng.random() < long_fraction else short_tokens)
    return ids, max_tokens


def _useful(row: list[int], max_tokens: int, eos: int) -> int:
    row = row[:max_tokens]
    return row.index(eos) + 1 if eos in row else len(row)


def _bench_generate(model: Any, tok: Any, prompts: list[list[int]], max_tokens: list[int], n: int, slots: int) -> tuple[int, float]:
    device = next(model.parameters()).device
    per = max(1, slots // n)
    tokens = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(prompts), per):
            ps, ms = prompts[b : b + per], max_tokens[b : b + per]
            enc = tok.pad({"input_ids": ps}, return_tensors="pt", padding_side="left").to(device)
            out = model.generate(
                **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(ms),
                num_return_sequences=n, pad_token_id=tok.pad_token_id,
            )
            gen = out[:, enc["input_ids"].shape[1] :].tolist()
            for i, row in enumerate(gen):
                tokens += _useful(row, ms[i // n], tok.eos_token_id)
    return tokens, time.perf_counter() - t0


def _bench_hf_continuous(model: Any, tok: Any, prompts: list[list[int]], max_tokens: list[int], n: int, slots: int) -> tuple[int, float]:
    """transformers' own continuous batching (ContinuousBatchingManager), per-request max tokens,
    sized like the reference measurement (ecosystem.md §10: num_blocks=64, max_batch_tokens=512)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen_cfg = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(max_tokens),
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    cb_cfg = ContinuousBatchingConfig(num_blocks=64, max_batch_tokens=512, max_requests_per_batch=slots)
    manager = model.init_continuous_batching(generation_config=gen_cfg, continuous_batching_config=cb_cfg)
    manager.start()
    try:
        t0 = time.perf_counter()
        want = 0
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            for j in range(n):
                manager.add_request(p, request_id=f"{i}-{j}", max_new_tokens=m)
                want += 1
        tokens = 0
        for _ in range(want):
            res = manager.get_result(timeout=600)
            if res is None:
                raise RuntimeError("transformers continuous batching returned no result")
            tokens += len(res.generated_tokens)
        return tokens, time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=30)


async def _bench_engine(engine: Any, prompts: list[list[int]], max_tokens: list[int], n: int, tag: str) -> tuple[int, float]:
    from services.rollout.engines import GenerationRequest, SamplingSpec

    t0 = time.perf_counter()
    outs = await asyncio.gather(*(
        engine.generate(GenerationRequest(f"{tag}-{i}", p, SamplingSpec(n=n, temperature=1.0, max_tokens=m)))
        for i, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))
    ))
    dt = time.perf_counter() - t0
    return sum(len(o.token_ids) for group in outs for o in group), dt


def bench_transformers(
    prompts: int, n: int, slots: int, short_tokens: int, long_tokens: int, long_fraction: float, repeats: int,
    device: str = "cpu",
) -> dict[str, Any]:
    from services.rollout.engines.transformers_engine import TransformersEngine

    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0).to(device).eval()
    ids, mts = _workload(tok, prompts, short_tokens, long_tokens, long_fraction, seed=0)

    async def run() -> dict[str, Any]:
        engine = TransformersEngine(model, tok, device=device, max_num_seqs=slots, seed=0)
        await engine.start()
        await _bench_engine(engine, ids[:4], [8] * 4, n, "warm")
        _bench_generate(model, tok, ids[:4], [8] * 4, n, slots)
        eng_rates, gen_rates = [], []
        for r in range(repeats):  # interleaved, so background load hits both sides alike
            t, dt = await _bench_engine(engine, ids, mts, n, f"r{r}")
            eng_rates.append(t / dt)
            t2, dt2 = await asyncio.to_thread(_bench_generate, model, tok, ids, mts, n, slots)
            gen_rates.append(t2 / dt2)
        await engine.close()
        eng, gen = statistics.median(eng_rates), statistics.median(gen_rates)
        hf_cb: dict[str, Any]
        try:
            t3, dt3 = await asyncio.to_thread(_bench_hf_continuous, model, tok, ids, mts, n, slots)
            hf_cb = {"tokens_per_s": round(t3 / dt3, 1), "ratio_engine_over_it": round(eng / (t3 / dt3), 3)}
        except Exception as exc:  # noqa: BLE001 - reported in the JSON, the other numbers stand
            hf_cb = {"error": repr(exc)}
        return {
            "transformers_continuous_batching": hf_cb,
            "engine_tokens_per_s": round(eng, 1),
            "generate_tokens_per_s": round(gen, 1),
            "ratio": round(eng / gen, 3),
            "engine_runs": [round(x, 1) for x in eng_rates],
            "generate_runs": [round(x, 1) for x in gen_rates],
            "target_ratio": 1.5,
        }

    return asyncio.run(run())


def bench_vllm(prompts: int, n: int, slots: int, short_tokens: int, long_tokens: int, long_fraction: float, repeats: int) -> dict[str, Any]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        return {"skipped": f"vllm not importable ({exc}); run in .venv-vllm (scripts/setup_vllm.sh)"}
    import tempfile

    from vllm import LLM, SamplingParams

    from services.rollout.engines.vllm_engine import VLLMEngine, save_model_dir

    tok = build_tokenizer()
    model = build_tiny_model("qwen3", tok, seed=0)
    path = save_model_dir(model, tok, tempfile.mkdtemp(prefix="meshrl-bench-vllm-"))
    ids, mts = _workload(tok, prompts, short_tokens, long_tokens, long_fraction, seed=0)
    common = dict(model=path, max_model_len=512, dtype="float32", max_num_seqs=slots, enable_prefix_caching=True, seed=0)

    llm = LLM(**common)  # type: ignore[arg-type]
    params = [SamplingParams(n=n, temperature=1.0, max_tokens=m, logprobs=0) for m in mts]
    reqs = [{"prompt_token_ids": p} for p in ids]
    llm.generate(reqs[:4], params[:4], use_tqdm=False)

    # Both engines stay up and the rounds interleave, so background load hits both alike. The
    # AsyncLLM lives on a loop in its own thread.
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def on_loop(coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    engine = VLLMEngine(dict(common), tok)  # streaming DELTA outputs, the worker's default
    final = VLLMEngine(dict(common), tok, stream=False)  # one output per sample at the end
    for e in (engine, final):
        on_loop(e.start())
        on_loop(_bench_engine(e, ids[:4], [8] * 4, n, "warm"))

    def bare_round() -> float:
        t0 = time.perf_counter()
        outs = llm.generate(reqs, params, use_tqdm=False)
        return sum(len(c.token_ids) for o in outs for c in o.outputs) / (time.perf_counter() - t0)

    def engine_round(e: Any, tag: str) -> float:
        t, dt = on_loop(_bench_engine(e, ids, mts, n, tag))
        return t / dt

    bare_rates: list[float] = []
    eng_rates: list[float] = []
    final_rates: list[float] = []
    for r in range(repeats):
        # Rotate the order each round so that no side always runs first.
        for k in range(3):
            case = (r + k) % 3
            if case == 0:
                bare_rates.append(bare_round())
            elif case == 1:
                eng_rates.append(engine_round(engine, f"d{r}"))
            else:
                final_rates.append(engine_round(final, f"f{r}"))
    for e in (engine, final):
        on_loop(e.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    llm.llm_engine.engine_core.shutdown()  # type: ignore[attr-defined]
    eng, bare = statistics.median(eng_rates), statistics.median(bare_rates)
    return {
        "engine_tokens_per_s": round(eng, 1),
        "bare_llm_generate_tokens_per_s": round(bare, 1),
        "ratio": round(eng / bare, 3),
        "median_of_round_ratios": round(statistics.median(e / b for e, b in zip(eng_rates, bare_rates, strict=True)), 3),
        "engine_final_only_tokens_per_s": round(statistics.median(final_rates), 1),
        "final_only_ratio": round(statistics.median(final_rates) / bare, 3),
        "engine_runs": [round(x, 1) for x in eng_rates],
        "engine_final_only_runs": [round(x, 1) for x in final_rates],
        "bare_runs": [round(x, 1) for x in bare_rates],
        "target_ratio": 0.95,
    }


def run_benchmark(
    *,
    engines: tuple[str, ...] = ("transformers", "vllm"),
    prompts: int = 48,
    n: int = 4,
    slots: int = 64,
    short_tokens: int = 16,
    long_tokens: int = 192,
    long_fraction: float = 0.125,
    repeats: int = 3,
    device: str = "cpu",
) -> dict[str, Any]:
    torch.manual_seed(0)
    result: dict[str, Any] = {
        "benchmark": "rollout",
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "prompts": prompts, "n": n, "slots": slots, "short_tokens": short_tokens, "long_tokens": long_tokens,
            "long_fraction": long_fraction, "repeats": repeats, "model": "tiny qwen3 (services/common/tiny.py)",
            "device": device,
        },
    }
    args = (prompts, n, slots, short_tokens, long_tokens, long_fraction, repeats)
    if "transformers" in engines:
        result["transformers"] = bench_transformers(*args, device=device)
    if "vllm" in engines:
        result["vllm"] = bench_vllm(*args)
    return result
