"""Prompt data: records, file loaders (JSONL and verl's parquet layout), the built-in synthetic
tasks, and the epoch/shuffle mapping from a prompt sequence number to a row.

A run's prompts form one stream: prompt `seq` is row `perm_e[seq % N]` of epoch `e = seq // N`,
with `perm_e` a seeded permutation (identity without shuffle). The mapping is a pure function of
(seq, N, seed), so a restarted coordinator hands out exactly the same prompts.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshrl.v1 import common_pb2
from services.common.errors import ConfigError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt row. Exactly one of `messages` / `text` is non-empty."""

    prompt_id: str
    messages: tuple[tuple[str, str], ...] = ()
    text: str = ""
    data_source: str = ""
    ability: str = ""
    ground_truth: str = ""
    extra_info: dict[str, Any] = field(default_factory=dict)


def prompt_to_proto(seq: int, record: PromptRecord, out: common_pb2.Prompt) -> None:
    """Fill `out` (a Prompt inside a message being built) with prompt `seq`'s record."""
    out.prompt_seq = seq
    out.prompt_id = record.prompt_id
    for role, content in record.messages:
        out.messages.add(role=role, content=content)
    out.text = record.text
    out.data_source = record.data_source
    out.ability = record.ability
    out.ground_truth = record.ground_truth
    if record.extra_info:
        out.extra_info_json = json.dumps(record.extra_info, separators=(",", ":"))


class Dataset(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> PromptRecord: ...


class PromptStream:
    """Maps prompt sequence numbers to records over epochs (see module docstring)."""

    def __init__(self, dataset: Dataset, *, shuffle: bool, seed: int) -> None:
        if len(dataset) == 0:
            raise ConfigError("the prompt dataset is empty; check data.train_files")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self._perm_epoch = -1
        self._perm: list[int] = []

    def __len__(self) -> int:
        return len(self.dataset)

    def index_of(self, seq: int) -> int:
        n = len(self.dataset)
        epoch, offset = divmod(seq, n)
        if not self.shuffle:
            return offset
        if epoch != self._perm_epoch:
            perm = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perm, self._perm_epoch = perm, epoch
        return self._perm[offset]

    def get(self, seq: int) -> PromptRecord:
        return self.dataset[self.index_of(seq)]


def _record_from_row(row: dict[str, Any], index: int, split: str, prompt_key: str) -> PromptRecord:
    if prompt_key not in row:
        raise ConfigError(f"{split} row {index} has no {prompt_key!r} column; set data.prompt_key")
    prompt = row[prompt_key]
    messages: tuple[tuple[str, str], ...] = ()
    text = ""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, Sequence):
        try:
            messages = tuple((str(m["role"]), str(m["content"])) for m in prompt)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{split} row {index}: {prompt_key} must be a string or a list of {{role, content}}") from exc
    else:
        raise ConfigError(f"{split} row {index}: {prompt_key} must be a string or a list of chat messages")
    reward_model = row.get("reward_model") or {}
    ground_truth = reward_model.get("ground_truth", row.get("ground_truth", "")) if isinstance(reward_model, dict) else ""
    extra = row.get("extra_info") or {}
    if isinstance(extra, str):
        extra = json.loads(extra) if extra.strip() else {}
    return PromptRecord(
        prompt_id=f"{split}:{index}",
        messages=messages,
        text=text,
        data_source=str(row.get("data_source", "")),
        ability=str(row.get("ability", "")),
        ground_truth="" if ground_truth is None else str(ground_truth),
        extra_info=dict(extra),
    )


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL or parquet file."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file {p} does not exist")
    if p.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(p.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"{p}:{lineno} is not valid JSON: {exc}") from exc
        return rows
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(p).to_pylist())
    raise ConfigError(f"data file {p}: unsupported format {p.suffix!r}; use .jsonl or .parquet")


class RecordList:
    """An in-memory dataset."""

    def __init__(self, records: list[PromptRecord]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


def load_files(files: Sequence[str], *, split: str, prompt_key: str = "prompt") -> RecordList:
    records: list[PromptRecord] = []
    for f in files:
        for row in load_rows(f):
            records.append(_record_from_row(row, len(records), split, prompt_key))
    return RecordList(records)


# ---- built-in synthetic tasks -----------------------------------------------------------------

ADDITION_SOURCE = "meshrl/addition"
COPY_SOURCE = "meshrl/copy"
TOOL_ADD_SOURCE = "meshrl/tool_add"


def tail_length(rng: random.Random, digits: int, alpha: float, max_digits: int) -> int:
    """A heavy-tailed length: Pareto(alpha) scaled so the minimum is `digits`, capped at `max_digits`
    (P(len > x) = (digits / x)^alpha for digits <= x < max_digits)."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(max_digits, int(digits * u ** (-1.0 / alpha)))


def synthetic_records(
    name: str, num: int, *, digits: int, seed: int, split: str, length_tail_alpha: float | None = None,
    max_digits: int | None = None,
) -> RecordList:
    """Prompts with verifiable answers. `addition`: "23+45=" -> "68". `copy`: "copy 3141:" -> "3141";
    with `length_tail_alpha` the copy strings have heavy-tailed lengths (`tail_length`, capped at
    `max_digits`, default 8 * digits), so the responses do too. `tool_add`: the chat message
    "123+456=" -> "579", for a policy with the calculator tool `add(a, b)` (multi-turn).
    Train and val use disjoint seeds (split is folded into the seed)."""
    if length_tail_alpha is not None and name != "copy":
        raise ConfigError(f"length_tail_alpha applies to the copy task only, not {name!r}")
    cap = max_digits if max_digits is not None else 8 * digits
    rng = random.Random(f"{name}:{split}:{seed}")
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    records = []
    for i in range(num):
        if name == "addition":
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            records.append(
                PromptRecord(
                    prompt_id=f"{split}:{i}", text=f"{a}+{b}=", data_source=ADDITION_SOURCE,
                    ability="math", ground_truth=str(a + b), extra_info={"a": a, "b": b},
                )
            )
        elif name == "tool_add":
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            records.append(
                PromptRecord(
                    prompt_id=f"{split}:{i}", messages=(("user", f"{a}+{b}="),), data_source=TOOL_ADD_SOURCE,
                    ability="math", ground_truth=str(a + b), extra_info={"a": a, "b": b},
                )
            )
        elif name == "copy":
            length = digits if length_tail_alpha is None else tail_length(rng, digits, length_tail_alpha, cap)
            s = "".join(rng.choice("0123456789") for _ in range(length))
            records.append(
                PromptRecord(
                    prompt_id=f"{split}:{i}", text=f"copy {s}:", data_source=COPY_SOURCE,
                    ability="copy", ground_truth=s,
                )
            )
        else:
            raise ConfigError(f"unknown synthetic task {name!r}; use addition, copy or tool_add")
    return RecordList(records)


def train_dataset(data_cfg: Any) -> RecordList:
    """The training prompts a `data` config section names (files, else the synthetic task)."""
    if data_cfg.train_files:
        return load_files(data_cfg.train_files, split="train", prompt_key=data_cfg.prompt_key)
    syn = data_cfg.synthetic
    if syn is None:
        raise ConfigError("no prompt data: set data.train_files or data.synthetic")
    return synthetic_records(syn.name, syn.num_train, digits=syn.digits, seed=syn.seed, split="train",
                             length_tail_alpha=syn.length_tail_alpha, max_digits=syn.max_digits)


def val_dataset(data_cfg: Any) -> RecordList | None:
    """The validation prompts (files, else the synthetic task's held-out split, else None)."""
    if data_cfg.val_files:
        return load_files(data_cfg.val_files, split="val", prompt_key=data_cfg.prompt_key)
    syn = data_cfg.synthetic
    if data_cfg.train_files or syn is None or syn.num_val <= 0:
        return None
    return synthetic_records(syn.name, syn.num_val, digits=syn.digits, seed=syn.seed, split="val",
                             length_tail_alpha=syn.length_tail_alpha, max_digits=syn.max_digits)
