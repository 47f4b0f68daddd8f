"""Prompt data: records, file loaders (JSONL and verl's parquet layout), the built-in synthetic
tasks, and the epoch/shuffle mapping from a prompt sequence number to a row.

A run's prompts form one stream: prompt `seq` is row `perm_e[seq % N]` of epoch `e = seq // N`,
with `perm_e` a seeded permutation (identity without shuffle). The mapping is a pure function of
(seq, N, seed), so a restarted coordinator hands out exactly the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from meshrl.v1 import common_pb2
from services.common.errors import ConfigError
from services.common.logging import get_logger

log = get_logger(__name__)


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
        # default=str as stream_digest: parquet binary/date/decimal values are not JSON types
        out.extra_info_json = json.dumps(record.extra_info, separators=(",", ":"), default=str)


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
        # the last two epochs' orders: near an epoch's end, retried prompts of epoch e and new
        # ones of e + 1 alternate, and one cached order would be rebuilt (O(N)) at every switch
        self._perms: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.dataset)

    def index_of(self, seq: int) -> int:
        n = len(self.dataset)
        epoch, offset = divmod(seq, n)
        if not self.shuffle:
            return offset
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(n))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
            self._perms[epoch] = perm
            for old in sorted(self._perms)[:-2]:
                del self._perms[old]
        return perm[offset]

    def get(self, seq: int) -> PromptRecord:
        return self.dataset[self.index_of(seq)]


def _record_from_row(row: Any, index: int, split: str, prompt_key: str, where: str = "",
                     source_key: str = "data_source") -> PromptRecord:
    """Row `index` of the split (its prompt_id) as a record; `where` names it in errors (file:line)."""
    where = where or f"{split} row {index}"
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a row must be a JSON object with a {prompt_key!r} column, got {type(row).__name__}")
    if prompt_key not in row:
        raise ConfigError(f"{where} has no {prompt_key!r} column; set data.prompt_key")
    prompt = row[prompt_key]
    messages: tuple[tuple[str, str], ...] = ()
    text = ""
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, Sequence):
        try:
            messages = tuple((str(m["role"]), str(m["content"])) for m in prompt)
        except (KeyError, TypeError) as exc:
            raise ConfigError(f"{where}: {prompt_key} must be a string or a list of {{role, content}}") from exc
        for i, m in enumerate(prompt):
            for key in ("role", "content"):
                # str() above would send the text "None" (a parquet struct's missing field) or a
                # list of content parts' Python repr to the model
                if m[key] is None:
                    raise ConfigError(f"{where}: {prompt_key}[{i}].{key} is null")
                if not isinstance(m[key], str):
                    raise ConfigError(f"{where}: {prompt_key}[{i}].{key} must be a string, got {type(m[key]).__name__} "
                                      "(a list of content parts: join its text into one string)")
    else:
        raise ConfigError(f"{where}: {prompt_key} must be a string or a list of chat messages")
    if not text and not messages:  # the rollout refuses it (InvalidArgument), stopping each replica it reaches
        raise ConfigError(f"{where}: {prompt_key} is empty")
    reward_model = _object_column(row, "reward_model", where)
    ground_truth = reward_model.get("ground_truth", row.get("ground_truth", ""))
    source = row.get(source_key, "")
    if source is None:  # str() would route it as the source "None": no scorer, a refusal at every lease
        raise ConfigError(f"{where}: {source_key} is null; set it in every row (it routes the reward function: "
                          "data.reward_fn_key names the column)")
    extra = _object_column(row, "extra_info", where)
    return PromptRecord(
        prompt_id=f"{split}:{index}",
        messages=messages,
        text=text,
        data_source=str(source),
        ability="" if row.get("ability") is None else str(row["ability"]),
        ground_truth="" if ground_truth is None else str(ground_truth),
        extra_info=dict(extra),
    )


def _object_column(row: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    """Column KEY of a row as an object: absent or null -> {}, a string holds its JSON (a CSV or
    pandas export stringifies nested columns); anything else fails, not taken as {} (reward_model's
    ground truth would be dropped, every response scored 0)."""
    value = row.get(key) or {}
    try:
        if isinstance(value, str):
            value = json.loads(value) if value.strip() else {}
        if not isinstance(value, dict):
            raise TypeError(type(value).__name__)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{where}: {key} must be an object (or a string holding a JSON object): {exc}") from None
    return value


def load_rows(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a JSONL or parquet file."""
    return [row for _, row in _numbered_rows(path)]


def _numbered_rows(path: str | Path) -> list[tuple[str, Any]]:
    """(file:line or file:row, row) of a JSONL or parquet file. JSONL is UTF-8, one value per
    line split on "\n" alone (U+2028 and kin are legal inside JSON strings)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"data file {p} does not exist")
    if p.suffix in (".jsonl", ".json"):
        rows = []
        with p.open(encoding="utf-8", newline="") as fh:
            lineno = 0
            try:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            rows.append((f"{p}:{lineno}", json.loads(line)))
                        except json.JSONDecodeError as exc:
                            raise ConfigError(f"{p}:{lineno} is not valid JSON: {exc}") from exc
            except UnicodeDecodeError as exc:
                raise ConfigError(f"{p}: not UTF-8 after line {lineno} ({exc.reason}); JSONL is read as UTF-8") from None
        return rows
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        return [(f"{p} row {i}", row) for i, row in enumerate(pq.read_table(p).to_pylist())]
    raise ConfigError(f"data file {p}: unsupported format {p.suffix!r}; use .jsonl or .parquet")


class RecordList:
    """An in-memory dataset."""

    def __init__(self, records: list[PromptRecord]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]


def load_files(files: Sequence[str], *, split: str, prompt_key: str = "prompt",
               reward_fn_key: str = "data_source") -> RecordList:
    """REWARD_FN_KEY (data.reward_fn_key): the column read as the record's data_source."""
    records: list[PromptRecord] = []
    for f in files:
        for where, row in _numbered_rows(f):
            records.append(_record_from_row(row, len(records), split, prompt_key, where, reward_fn_key))
    return RecordList(records)


def stream_digest(dataset: Dataset, *, shuffle: bool, seed: int) -> str:
    """What the prompt stream's positions mean: sha256 over every record in order, and the
    shuffle and seed (a coordinator's ledger keeps positions only; see CoordinatorSettings)."""
    h = hashlib.sha256(json.dumps({"shuffle": shuffle, "seed": seed if shuffle else None}).encode())
    for i in range(len(dataset)):
        r = dataset[i]
        h.update(json.dumps([r.prompt_id, r.messages, r.text, r.data_source, r.ability, r.ground_truth, r.extra_info],
                            sort_keys=True, separators=(",", ":"), default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


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
    max_digits: int | None = None, exclude: Collection[tuple[str, tuple[tuple[str, str], ...]]] = (),
) -> RecordList:
    """Prompts with verifiable answers. `addition`: "23+45=" -> "68". `copy`: "copy 3141:" -> "3141";
    with `length_tail_alpha` the copy strings have heavy-tailed lengths (`tail_length`, capped at
    `max_digits`, default 8 * digits), so the responses do too. `tool_add`: the chat message
    "123+456=" -> "579", for a policy with the calculator tool `add(a, b)` (multi-turn).
    Train and val use disjoint seeds (split is folded into the seed); prompts whose (text, messages)
    are in `exclude` (the train split's, for val) are skipped, so val is held out."""
    if length_tail_alpha is not None and name != "copy":
        raise ConfigError(f"length_tail_alpha applies to the copy task only, not {name!r}")
    cap = max_digits if max_digits is not None else 8 * digits
    rng = random.Random(f"{name}:{split}:{seed}")
    lo, hi = 10 ** (digits - 1) if digits > 1 else 0, 10**digits - 1
    records: list[PromptRecord] = []
    exclude = set(exclude)
    draws, max_draws = 0, (num if not exclude else 100 * num + 10_000)
    while len(records) < num:
        if draws >= max_draws:
            raise ConfigError(
                f"data.synthetic: only {len(records)} of num_val={num} {split} prompts of {name!r} with digits={digits} "
                "differ from the training prompts; raise data.synthetic.digits or lower num_train / num_val"
            )
        draws += 1
        i = len(records)
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
        if exclude and (records[-1].text, records[-1].messages) in exclude:
            records.pop()
    return RecordList(records)


ToolsFor = Callable[[str], Sequence[Mapping[str, Any]]]
"""data_source -> the tool schemas the chat template renders into that prompt, () for none
(multi-turn: every prompt is rendered as the agent loop does; services/environment/factory.
prompt_tools builds it from the config)."""


def train_dataset(data_cfg: Any, model_cfg: Any = None, tools_for: ToolsFor | None = None) -> RecordList:
    """The training prompts a `data` config section names (files, else the synthetic task);
    with data.filter_overlong_prompts, those that fit data.max_prompt_length under the model's
    tokenizer (`model_cfg`: actor_rollout_ref.model), counted with the tools `tools_for` gives."""
    if data_cfg.train_files:
        records = load_files(data_cfg.train_files, split="train", prompt_key=data_cfg.prompt_key,
                             reward_fn_key=data_cfg.reward_fn_key)
    else:
        syn = data_cfg.synthetic
        if syn is None:
            raise ConfigError("no prompt data: set data.train_files or data.synthetic")
        records = synthetic_records(syn.name, syn.num_train, digits=syn.digits, seed=syn.seed, split="train",
                                    length_tail_alpha=syn.length_tail_alpha, max_digits=syn.max_digits)
    return _filtered(records, data_cfg, model_cfg, "train", tools_for)


def val_dataset(data_cfg: Any, model_cfg: Any = None, tools_for: ToolsFor | None = None) -> RecordList | None:
    """The validation prompts (files, else the synthetic task's held-out split, else None),
    filtered as the training prompts are."""
    if data_cfg.val_files:
        return _filtered(load_files(data_cfg.val_files, split="val", prompt_key=data_cfg.prompt_key,
                                    reward_fn_key=data_cfg.reward_fn_key),
                         data_cfg, model_cfg, "val", tools_for)
    syn = data_cfg.synthetic
    if data_cfg.train_files or syn is None or syn.num_val <= 0:
        return None
    train = synthetic_records(syn.name, syn.num_train, digits=syn.digits, seed=syn.seed, split="train",
                              length_tail_alpha=syn.length_tail_alpha, max_digits=syn.max_digits)
    return _filtered(synthetic_records(syn.name, syn.num_val, digits=syn.digits, seed=syn.seed, split="val",
                                       length_tail_alpha=syn.length_tail_alpha, max_digits=syn.max_digits,
                                       exclude={(r.text, r.messages) for r in train.records}),
                     data_cfg, model_cfg, "val", tools_for)


def chat_prompt_text(messages: Sequence[dict[str, str]], text: str, tokenizer: Any,
                     tools: Sequence[Mapping[str, Any]] = ()) -> str:
    """A prompt as the model sees it: the chat template applied (with the generation prompt) to
    `messages`, or `text` verbatim."""
    if messages:
        return str(tokenizer.apply_chat_template(list(messages), tools=[dict(t) for t in tools] or None,
                                                 add_generation_prompt=True, tokenize=False))
    return text


def prompt_tokens(record: PromptRecord, tokenizer: Any, tools: Sequence[Mapping[str, Any]] | None = None) -> int:
    """Tokens of the prompt as the rollout encodes it: single-turn (`tools` None) as
    rollout/convert.encode_prompt; multi-turn (`tools` a sequence, () for none) as the agent loop
    does (agent/chat.ChatRenderer: the template renders the tools into the system prompt, and a
    text prompt is the first user message, as loop.run_group and the tool environment start it,
    with or without tools)."""
    messages = [{"role": r, "content": c} for r, c in record.messages]
    if tools is not None and not messages:
        messages = [{"role": "user", "content": record.text}]
    text = chat_prompt_text(messages, record.text, tokenizer, tools or ())
    return len(tokenizer.encode(text, add_special_tokens=False))


def _filtered(records: RecordList, data_cfg: Any, model_cfg: Any, split: str,
              tools_for: ToolsFor | None = None) -> RecordList:
    """data.filter_overlong_prompts (verl's): the prompts longer than max_prompt_length dropped,
    before the shuffle (the order of those kept is unchanged; their prompt_ids stay their rows')."""
    if not data_cfg.filter_overlong_prompts:
        return records
    if model_cfg is None or not (model_cfg.tokenizer_path or model_cfg.path):
        raise ConfigError("data.filter_overlong_prompts counts prompt tokens with the model's tokenizer: set "
                          "actor_rollout_ref.model.path (or tokenizer_path)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_cfg.tokenizer_path or model_cfg.path,
                                        trust_remote_code=model_cfg.trust_remote_code)
    limit = data_cfg.max_prompt_length
    # With tools, the prompt counted is the one the agent loop renders (verl's filter passes tools=
    # too): counted without them, a prompt that fit here overflowed max_prompt_length at rollout.
    kept = [r for r in records.records
            if prompt_tokens(r, tok, tools_for(r.data_source) if tools_for else None) <= limit]
    if not kept:
        raise ConfigError(f"data.filter_overlong_prompts dropped every {split} prompt: none fits "
                          f"data.max_prompt_length={limit} tokens")
    if len(kept) < len(records):
        log.info("overlong_prompts_filtered", split=split, dropped=len(records) - len(kept), kept=len(kept),
                 max_prompt_length=limit)
    return RecordList(kept)
