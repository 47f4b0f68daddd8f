"""`meshrl pretrain`: the built-in example's warm start — a tiny Qwen3 trained by supervised
fine-tuning on the synthetic task, so that RL starts from a policy that knows the answer format
and is right some of the time. Nothing is downloaded: the model and tokenizer are built here.

`tool_add` (the agentic task) trains on partly formatted traces: a `tool_fraction` of the examples
call the calculator and answer with its result,

    <|im_start|>user\n123+456=<|im_end|>\n<|im_start|>assistant\n
    <tool_call>{"name":"add","arguments":{"a":123,"b":456}}</tool_call><|im_end|>      (trained)
    \n<|im_start|>user\n<tool_response>\n579\n</tool_response><|im_end|>\n<|im_start|>assistant\n
                                                                           (environment: not trained)
    579<|im_end|>                                                                      (trained)

and the others answer in their head (`579<|im_end|>`), which a 0.8M model mostly gets wrong on
three digits: RL has to discover that calling the tool pays. The traces are tokenized exactly as
the rollout's agent loop tokenizes a trajectory (services/rollout/agent/chat.py).

The result is cached under `$MESHRL_CACHE_DIR` (default `~/.cache/meshrl`) in a directory named by
a hash of everything that determines it, so every run (and every Ray worker) with the same
settings reuses the same files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import time
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.bytecode import cache_root
from services.common.data import RecordList, synthetic_records
from services.common.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class PretrainSpec:
    """Everything that determines the warm-start checkpoint."""

    task: str = "addition"
    digits: int = 2
    arch: str = "qwen3"
    steps: int = 2000
    """At most this many steps (the example's warm start stops earlier, at `stop_loss`)."""
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    num_examples: int = 4096
    length_tail_alpha: float | None = None
    """`copy` only: heavy-tailed string lengths (data.synthetic.length_tail_alpha)."""
    max_digits: int | None = None
    """Longest string with `length_tail_alpha` (data.synthetic.max_digits)."""
    warmup_steps: int | None = None
    """Linear learning-rate warm-up over this many steps; null: none."""
    tool_fraction: float | None = None
    """`tool_add` only: fraction of the traces that call the tool; null: 0.3."""
    stop_loss_on: str | None = None
    """Whose loss `stop_loss` reads: null: every trained token's; `tool`: `tool_add`'s tool-calling
    traces' only (their operands must be copied right for RL to start; see TASK_DEFAULTS)."""
    stop_loss: float | None = 0.45
    """Stop before `steps` once the mean loss of the last 50 steps is below this: a partly trained
    warm start, so RL has room to improve (a fully trained copy policy is right ~95% of the time).
    A loss, not a step count: on two-digit addition the loss drops sharply once the carry is
    learned, and where in a fixed budget that happens depends on the machine's arithmetic (500
    steps, the old default, ended at loss 0.74 and a greedy accuracy of 0.12 on a 2026-11-27
    sandbox, where the same code had given ~0.47 before; 0.45 is reached at step ~670 there)."""

    @classmethod
    def for_task(cls, task: str = "addition", **fields: Any) -> PretrainSpec:
        """The spec of `task` with its own defaults (TASK_DEFAULTS) for the fields not given."""
        given = {k: v for k, v in fields.items() if v is not None}
        return cls(task=task, **{**TASK_DEFAULTS.get(task, {}), **given})

    def key(self) -> str:
        # Fields added later are left out while unset, so earlier checkpoints keep their names.
        fields = {k: v for k, v in asdict(self).items() if not (k in _LATER_FIELDS and v is None)}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


_LATER_FIELDS = ("length_tail_alpha", "max_digits", "warmup_steps", "stop_loss", "tool_fraction", "stop_loss_on")
TOOL_FRACTION = 0.3
STOP_ON = (None, "tool")
# tool_add stops on its tool traces' loss. The loss of every token mixes two parts that learn apart:
# the tool traces' (a copied template and operands: ~0.03 a token once the operands are copied
# right ~95% of the time) and the head answers' (0.75-0.95 a token: three-digit sums a 0.8M model
# mostly cannot do). At one mixed loss the tool traces' differs twofold between SFT seeds (0.04 and
# 0.09-0.10 at a mixed 0.26-0.28 on this sandbox), and so between machines: the old bar, a mixed
# 0.2, let a CI machine start RL from a policy whose calls paid ~0.3 of the time (first batch:
# reward 0.06 at a tool-call rate of 0.20; ~0.85 of the calls paid on this sandbox's), and it did not
# take up the tool in 28 steps. Batches stay mixed: batched by length (traces apart from direct
# answers) the policy learned neither (reward 0 after 800 steps).
TASK_DEFAULTS: dict[str, dict[str, Any]] = {"tool_add": {"stop_loss": 0.03, "stop_loss_on": "tool"}}


def checkpoint_path(spec: PretrainSpec) -> Path:
    tail = "" if spec.length_tail_alpha is None else "tail"
    return cache_root() / f"tiny-{spec.arch}-{spec.task}{spec.digits}{tail}-{spec.key()}"


Example = tuple[list[int], list[int], bool]
"""(token ids, loss mask, whether `stop_loss` reads this example's loss)."""


def _sft_examples(records: RecordList, tok: Any) -> list[Example]:
    """(prompt + answer + eos token ids, loss mask: 1 on the answer, counted)."""
    out = []
    for r in records.records:
        prompt = tok(r.text, add_special_tokens=False)["input_ids"]
        answer = tok(r.ground_truth, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt + answer, [0] * len(prompt) + [1] * len(answer), True))
    return out


def tool_add_trace(tok: Any, a: int, b: int, *, use_tool: bool) -> tuple[list[int], list[int]]:
    """One `tool_add` trace (see the module docstring): (ids, loss mask), tokenized like the
    rollout tokenizes a trajectory."""
    from services.rollout.agent.chat import ChatRenderer

    r = ChatRenderer(tok)
    msgs = [{"role": "user", "content": f"{a}+{b}="}]
    prompt = r.prompt_ids(msgs)
    if not use_tool:
        answer = r.encode(f"{a + b}{tok.eos_token}")
        return prompt + answer, [0] * len(prompt) + [1] * len(answer)
    call = f'<tool_call>{{"name":"add","arguments":{{"a":{a},"b":{b}}}}}</tool_call>'
    call_ids = r.encode(call + tok.eos_token)
    env = r.env_ids(msgs, {"role": "assistant", "content": call}, [{"role": "tool", "content": str(a + b)}], tok.eos_token)
    answer = r.encode(f"{a + b}{tok.eos_token}")
    ids = prompt + call_ids + env + answer
    return ids, [0] * len(prompt) + [1] * len(call_ids) + [0] * len(env) + [1] * len(answer)


def _tool_add_examples(records: RecordList, tok: Any, fraction: float, rng: random.Random,
                       stop_on: str | None) -> list[Example]:
    out = []
    for r in records.records:
        use_tool = rng.random() < fraction
        ids, mask = tool_add_trace(tok, int(r.extra_info["a"]), int(r.extra_info["b"]), use_tool=use_tool)
        out.append((ids, mask, use_tool or stop_on is None))
    return out


def train_sft(spec: PretrainSpec, out_dir: Path, *, device: str = "cpu") -> dict[str, float]:
    """Train (on `device`) and save an HF checkpoint (model + tokenizer, fp32) to out_dir. Returns
    final metrics."""
    import torch

    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    if spec.stop_loss_on not in STOP_ON or (spec.stop_loss_on == "tool" and spec.task != "tool_add"):
        raise ValueError(f"stop_loss_on={spec.stop_loss_on!r}: null, or 'tool' with task tool_add")
    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tools = spec.task == "tool_add"
    tok = build_tokenizer(tools=tools)
    model = build_tiny_model(spec.arch, tok, seed=spec.seed).to(device)
    # The SFT data uses a seed disjoint from the RL prompts (which use data.synthetic.seed).
    records = synthetic_records(spec.task, spec.num_examples, digits=spec.digits, seed=10_000 + spec.seed, split="sft",
                                length_tail_alpha=spec.length_tail_alpha, max_digits=spec.max_digits)
    if tools:
        fraction = TOOL_FRACTION if spec.tool_fraction is None else spec.tool_fraction
        examples = _tool_add_examples(records, tok, fraction, random.Random(spec.seed + 7), spec.stop_loss_on)
    else:
        examples = _sft_examples(records, tok)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    warmup = spec.warmup_steps or 0
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    model.train()
    t0 = time.monotonic()
    loss_val = float("nan")
    recent: deque[float] = deque(maxlen=50)
    steps_done = 0
    # A heavy tail would pad most rows of a random batch to its one long string: batch neighbours in
    # length order instead: the window of the sorted examples around a random one (clamped at the
    # ends, so the longest strings are drawn about as often as any other).
    by_length = sorted(examples, key=lambda e: len(e[0])) if spec.length_tail_alpha is not None else None
    for step in range(spec.steps):
        if by_length is not None:
            n = len(by_length)
            start = min(max(0, rng.randrange(n) - spec.batch_size // 2), n - spec.batch_size)
            batch = by_length[start : start + spec.batch_size]
        else:
            batch = rng.sample(examples, spec.batch_size)
        opt.zero_grad()
        loss_val, watched_loss = _sft_backward(model, batch, tok.pad_token_id, device)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if watched_loss is not None:  # the loss `stop_loss` reads (every trained token's, unless stop_loss_on)
            recent.append(watched_loss)
        steps_done = step + 1
        if step % 50 == 0:
            log.info("pretrain_step", step=step, loss=round(loss_val, 4), watched_loss=round(recent[-1], 4) if recent else None)
        if spec.stop_loss is not None and len(recent) == recent.maxlen and sum(recent) / len(recent) < spec.stop_loss:
            log.info("pretrain_stop_loss", step=step, mean_loss_50=round(sum(recent) / len(recent), 5))
            break
    model.eval()
    save_pretrained_pair(model.to("cpu"), tok, out_dir)
    metrics = {"loss": loss_val, "mean_loss_last_50": sum(recent) / max(1, len(recent)), "steps": steps_done,
               "seconds": time.monotonic() - t0}
    (out_dir / "meshrl_pretrain.json").write_text(json.dumps({"spec": asdict(spec), "metrics": metrics}, indent=2))
    return metrics


def _sft_backward(model: Any, batch: list[Example], pad_id: int, device: str, *,
                  split: bool = True) -> tuple[float, float | None]:
    """Accumulate the gradient of `batch`'s mean token loss into `model`: (that loss, the mean over
    the rows `stop_loss` reads, None if it reads none).

    In at most two forward passes of rows of like length (`split`): tool_add mixes ~100-token tool
    traces with ~20-token head answers, and one pass padded every row to the longest (2.3x the
    tokens). Rows are independent and each pass's loss is divided by the whole batch's trained
    tokens, so the gradient is the one of the whole batch."""
    import torch.nn.functional as F

    chunks = [_tensors(c, pad_id, device) for c in (_like_lengths(batch) if split else [batch])]
    total = sum(int((c[1][:, 1:] != -100).sum()) for c in chunks)
    loss_sum = watched_sum = 0.0
    watched_n = 0
    for ids, labels, attn, counted in chunks:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        target = labels[:, 1:]
        token_loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100,
                                     reduction="none").view_as(target)
        chunk_loss = token_loss.sum()
        (chunk_loss / total).backward()
        watched = (target != -100) & counted[:, None]
        loss_sum += float(chunk_loss.detach())
        watched_sum += float((token_loss.detach() * watched).sum())
        watched_n += int(watched.sum())
    return loss_sum / total, (watched_sum / watched_n if watched_n else None)


def _like_lengths(batch: list[Example]) -> list[list[Example]]:
    """`batch` as one or two lists of rows of like length: split where the two padded passes cost
    fewest tokens, if that saves a quarter of one pass's."""
    rows = sorted(batch, key=lambda e: len(e[0]))
    n, longest = len(rows), len(rows[-1][0])
    cost, k = min(((k * len(rows[k - 1][0]) + (n - k) * longest, k) for k in range(1, n)), default=(n * longest, n))
    return [rows[:k], rows[k:]] if cost < 0.75 * n * longest else [batch]


def _tensors(batch: list[Example], pad_id: int, device: str) -> tuple[Any, Any, Any, Any]:
    """(input ids, labels (-100: not trained), attention mask, whether `stop_loss` reads each row)
    of `batch`, right-padded to its longest row."""
    import torch

    width = max(len(ids) for ids, _, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    counted = torch.tensor([c for _, _, c in batch], dtype=torch.bool)
    for i, (seq, mask, _) in enumerate(batch):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        labels[i, : len(seq)] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(seq), -100)
    return ids.to(device), labels.to(device), attn.to(device), counted.to(device)


def ensure_pretrained(spec: PretrainSpec | None = None, *, device: str = "cpu") -> Path:
    """The cached warm-start checkpoint for `spec`, trained now if absent (atomic: written to a
    temporary directory and renamed, so concurrent callers never see a half-written one)."""
    spec = spec or PretrainSpec()
    path = checkpoint_path(spec)
    if (path / "meshrl_pretrain.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    train_sft(spec, tmp, device=device)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
