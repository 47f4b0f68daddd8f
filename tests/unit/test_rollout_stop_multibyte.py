"""Stop strings whose characters take several tokens each. A byte-level BPE tokenizer without merges
for a character splits it into its UTF-8 bytes ('é' = 2 tokens, an emoji = 4), and a lone byte
decodes to U+FFFD: the window of trailing tokens decoded to look for a stop string must be counted in
bytes (services/rollout/engines/base.py `stop_window`), in the transformers engine and across a
partial rollout's boundary (`stop_across`) alike."""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.common.tiny import build_tiny_model
from services.rollout.engines import Finish, GenerationRequest, SamplingSpec
from services.rollout.engines.base import stop_across, stop_window
from services.rollout.engines.transformers_engine import TransformersEngine


def _byte_tokenizer() -> Any:
    """GPT-2's byte-level alphabet with no merges: every UTF-8 byte is one token."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    extra = (b for b in range(256) if b not in printable)
    chars = [chr(b) for b in printable] + [chr(256 + i) for i, _ in enumerate(extra)]
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3}
    for c in chars:
        vocab[c] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>")


def _script(model: Any, tokens: list[int], prompt_len: int) -> None:
    """Make `model` emit `tokens` in order (then repeat the last), whatever it was asked."""
    forward = model.forward

    def scripted(*args: Any, **kwargs: Any) -> Any:
        out = forward(*args, **kwargs)
        step = kwargs["position_ids"][:, -1] + 1 - prompt_len
        logits = torch.full_like(out.logits[:, -1, :], -1e4)
        for row in range(logits.shape[0]):
            logits[row, tokens[min(int(step[row]), len(tokens) - 1)]] = 0.0
        out.logits = logits[:, None, :]
        return out

    model.forward = scripted


def test_the_window_counts_bytes() -> None:
    assert stop_window(["ab"]) == 2
    assert stop_window(["é", "x"]) == 2
    assert stop_window(["</s>", "🙂"]) == 4


def _generate_scripted(tok: Any, text: str, stop: str) -> Any:
    """One greedy sample from a model scripted to write `text` and then "z"s, with `stop`."""
    model = build_tiny_model("qwen3", tok, seed=0)
    prompt = tok.encode("question:")
    _script(model, tok.encode(text + "z" * 30), len(prompt))
    engine = TransformersEngine(model, tok, max_num_seqs=2)

    async def run() -> Any:
        await engine.start()
        try:
            spec = SamplingSpec(temperature=0.0, max_tokens=20, stop=(stop,))
            return await engine.generate(GenerationRequest("s", prompt, spec))
        finally:
            await engine.close()

    (out,) = asyncio.run(run())
    return out


def test_the_transformers_engine_stops_at_a_multibyte_stop_string() -> None:
    tok = _byte_tokenizer()
    assert len(tok.encode("é")) == 2 and len(tok.encode("🙂")) == 4
    for stop, text in (("é", "xyé"), ("🙂", "a🙂"), ("né", "ané")):
        out = _generate_scripted(tok, text, stop)
        assert out.finish_reason == Finish.STOP, (stop, out.text)
        assert out.token_ids == tok.encode(text) and out.text == text


def test_a_multibyte_stop_string_split_by_the_boundary_is_found() -> None:
    tok = _byte_tokenizer()
    head = tok.encode("abé")  # the boundary falls between the two bytes of 'é'
    ids = head + tok.encode("zz")
    assert stop_across(tok.decode, ids, len(head) - 1, ("é",)) == len(head)
    emoji = tok.encode("a🙂")  # 1 + 4 tokens; the boundary after its first byte
    assert stop_across(tok.decode, emoji + tok.encode("z"), 2, ("🙂",)) == len(emoji)
    assert stop_across(tok.decode, ids, len(head) - 1, ("q",)) is None
