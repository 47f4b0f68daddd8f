"""`meshrl pretrain`: the built-in example's warm start — a tiny Qwen3 trained by supervised
fine-tuning on the synthetic task, so that RL starts from a policy that knows the answer format
and is right some of the time. Nothing is downloaded: the model and tokenizer are built here.

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common.data import RecordList, synthetic_records
from services.common.logging import get_logger

log = get_logger(__name__)


@dataclass(frozen=True)
class PretrainSpec:
    """Everything that determines the warm-start checkpoint."""

    task: str = "addition"
    digits: int = 2
    arch: str = "qwen3"
    steps: int = 500
    batch_size: int = 64
    lr: float = 3e-3
    seed: int = 0
    num_examples: int = 4096

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def cache_dir() -> Path:
    return Path(os.environ.get("MESHRL_CACHE_DIR", Path.home() / ".cache" / "meshrl"))


def checkpoint_path(spec: PretrainSpec) -> Path:
    return cache_dir() / f"tiny-{spec.arch}-{spec.task}{spec.digits}-{spec.key()}"


def _sft_examples(records: RecordList, tok: Any) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos token ids, number of prompt tokens)."""
    out = []
    for r in records.records:
        prompt = tok(r.text, add_special_tokens=False)["input_ids"]
        answer = tok(r.ground_truth, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        out.append((prompt + answer, len(prompt)))
    return out


def train_sft(spec: PretrainSpec, out_dir: Path) -> dict[str, float]:
    """Train and save an HF checkpoint (model + tokenizer) to out_dir. Returns final metrics."""
    import torch
    import torch.nn.functional as F

    from services.common.tiny import build_tiny_model, build_tokenizer, save_pretrained_pair

    torch.manual_seed(spec.seed)
    rng = random.Random(spec.seed)
    tok = build_tokenizer()
    model = build_tiny_model(spec.arch, tok, seed=spec.seed)
    # The SFT data uses a seed disjoint from the RL prompts (which use data.synthetic.seed).
    examples = _sft_examples(
        synthetic_records(spec.task, spec.num_examples, digits=spec.digits, seed=10_000 + spec.seed, split="sft"), tok
    )
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.0)
    model.train()
    t0 = time.monotonic()
    loss_val = float("nan")
    for step in range(spec.steps):
        batch = rng.sample(examples, spec.batch_size)
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), -100, dtype=torch.long)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, n_prompt) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            labels[i, n_prompt : len(seq)] = torch.tensor(seq[n_prompt:])
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_val = float(loss.item())
        if step % 50 == 0:
            log.info("pretrain_step", step=step, loss=round(loss_val, 4))
    model.eval()
    save_pretrained_pair(model, tok, out_dir)
    metrics = {"loss": loss_val, "seconds": time.monotonic() - t0}
    (out_dir / "meshrl_pretrain.json").write_text(json.dumps({"spec": asdict(spec), "metrics": metrics}, indent=2))
    return metrics


def ensure_pretrained(spec: PretrainSpec | None = None) -> Path:
    """The cached warm-start checkpoint for `spec`, trained now if absent (atomic: written to a
    temporary directory and renamed, so concurrent callers never see a half-written one)."""
    spec = spec or PretrainSpec()
    path = checkpoint_path(spec)
    if (path / "meshrl_pretrain.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    train_sft(spec, tmp)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
