"""How the coordinator reads and issues prompts (services/common/data.py, the coordinator factory
and the ledger's fingerprint): the ledger pins the prompt stream (rows in order, shuffle, seed),
JSONL splits on newlines only, a bad row is a ConfigError naming its file and line, two epochs'
orders are cached, and data.filter_overlong_prompts drops what does not fit."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from services.common.config import load_config
from services.common.data import PromptStream, load_files, synthetic_records
from services.common.errors import ConfigError, FailedPrecondition
from services.coordinator.factory import build_core


def _jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _cfg(tmp_path: Path, files: list[Path], *extra: str):
    listed = ",".join(str(f) for f in files)
    return load_config(None, [
        f"data.train_files=[{listed}]", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "rollout.total_epochs=2", *extra,
    ])


def _issue(core, count: int, replica: str = "r") -> list[str]:
    """Lease `count` prompts (one call each) and return their texts."""
    texts = []
    for _ in range(count):
        grant = core.lease(replica, 1, now=0.0)
        assert len(grant.leases) == 1, grant.limit
        texts.append(grant.leases[0].prompt.text)
    return texts


def _restart_then_finish_epoch(tmp_path: Path, before, after) -> list[str] | None:
    """Issue half of epoch 0 under config BEFORE, restart the coordinator on the same ledger
    under config AFTER, issue the rest of epoch 0. None: the restart was refused."""
    run_dir = tmp_path / "run"
    core = build_core(before, run_dir, session="a")
    n = len(core.prompts)
    texts = _issue(core, n // 2)
    core.ledger.close()
    try:
        core = build_core(after, run_dir, session="b")
    except (FailedPrecondition, ConfigError):
        return None
    texts += _issue(core, n - n // 2)
    core.ledger.close()
    return texts


# ---- the ledger pins the prompt stream its positions index -------------------------------------


def test_restart_with_other_shuffle_seed_is_refused(tmp_path: Path) -> None:
    """Its positions would name other prompts: some issued twice in the epoch, some never."""
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+{i}="} for i in range(8)])
    assert _restart_then_finish_epoch(tmp_path, _cfg(tmp_path, [f], "data.seed=1"), _cfg(tmp_path, [f], "data.seed=2")) is None


def test_restart_with_train_files_reordered_is_refused(tmp_path: Path) -> None:
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}"} for i in range(4)])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}"} for i in range(4)])
    assert _restart_then_finish_epoch(
        tmp_path, _cfg(tmp_path, [a, b], "data.shuffle=false"), _cfg(tmp_path, [b, a], "data.shuffle=false")
    ) is None
    with pytest.raises(FailedPrecondition, match="other prompt data"):
        build_core(_cfg(tmp_path, [b, a], "data.shuffle=false"), tmp_path / "run", session="c")


def test_a_restart_on_the_same_data_goes_on_and_a_ledger_without_a_digest_takes_it(tmp_path: Path) -> None:
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": f"{i}+{i}="} for i in range(8)])
    texts = _restart_then_finish_epoch(tmp_path, _cfg(tmp_path, [f]), _cfg(tmp_path, [f]))
    assert texts is not None and sorted(texts) == sorted(f"{i}+{i}=" for i in range(8))  # each once
    # a ledger written before the digest was kept: continued, and the digest saved with it
    run_dir = tmp_path / "old"
    core = build_core(_cfg(tmp_path, [f]), run_dir, session="a")
    state = core._state
    digest = state.fingerprint.pop("data")
    with core.ledger.transaction():
        core.ledger.save_state(state.to_json())
    core.ledger.close()
    again = build_core(_cfg(tmp_path, [f]), run_dir, session="b")
    assert again._state.fingerprint["data"] == digest
    again.ledger.close()


# ---- JSONL lines are split on newlines only ---------------------------------------------------


@pytest.mark.parametrize("sep", ["\u2028", "\u2029", "\x85"])
def test_jsonl_value_with_unicode_line_separator_loads(tmp_path: Path, sep: str) -> None:
    text = f"first line{sep}second line"
    p = tmp_path / "train.jsonl"
    # valid JSON: json.dumps(ensure_ascii=False) writes these characters raw
    p.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\n", encoding="utf-8")
    ds = load_files([str(p)], split="train")
    assert len(ds) == 1 and ds[0].text == text


# ---- a bad row: a ConfigError that names the file and line, not a crash -------------------------


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("missing_key", b'{"prompt": "ok"}\n{"question": "no prompt column"}\n'),
        ("row_is_string", b'{"prompt": "ok"}\n"a prompt row that is a bare string"\n'),
        ("row_is_null", b'{"prompt": "ok"}\nnull\n'),
        ("row_is_number", b'{"prompt": "ok"}\n7\n'),
        ("bad_messages", b'{"prompt": "ok"}\n{"prompt": [{"role": "user"}]}\n'),
        ("extra_info_not_json", b'{"prompt": "ok"}\n{"prompt": "p", "extra_info": "index=3"}\n'),
        ("extra_info_list", b'{"prompt": "ok"}\n{"prompt": "p", "extra_info": [1, 2]}\n'),
        ("not_utf8", b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n'),
    ],
)
def test_bad_row_is_a_config_error_naming_the_file(tmp_path: Path, name: str, content: bytes) -> None:
    good = _jsonl(tmp_path / "good.jsonl", [{"prompt": "1+1="}])
    bad = tmp_path / f"bad_{name}.jsonl"
    bad.write_bytes(content)
    with pytest.raises(ConfigError) as info:
        load_files([str(good), str(bad)], split="train")
    assert bad.name in str(info.value), f"the error does not name the file: {info.value}"


# ---- the orders of the two epochs around a boundary are both kept ------------------------------


def test_alternating_epochs_do_not_reshuffle_the_whole_dataset_each_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 1000
    stream = PromptStream(synthetic_records("addition", n, digits=2, seed=0, split="train"), shuffle=True, seed=3)
    reference = [stream.index_of(s) for s in (5, n + 5)]
    shuffles = 0
    real = random.Random.shuffle

    def counting(self, x):
        nonlocal shuffles
        shuffles += 1
        return real(self, x)

    monkeypatch.setattr(random.Random, "shuffle", counting)
    # what lease() does at an epoch boundary: retried prompts of epoch 0 first, then fresh ones of epoch 1
    for _ in range(50):
        assert [stream.index_of(s) for s in (5, n + 5)] == reference
    assert shuffles <= 4, f"{shuffles} full O(N) shuffles of a {n}-row dataset for 100 lookups over two epochs"


# ---- data.filter_overlong_prompts ---------------------------------------------------------------


def test_filter_overlong_prompts_drops_what_does_not_fit_before_the_shuffle(tmp_path: Path) -> None:
    """verl's data.filter_overlong_prompts: prompts over max_prompt_length tokens (the model's
    tokenizer, the chat template as the rollout applies it) are dropped when loading; those kept
    keep their rows' prompt_ids. It was ignored: the rollout then refused the prompt on every
    replica (truncation=error) or trained it cut."""
    from services.common.data import val_dataset
    from services.common.tiny import build_tokenizer

    tok_dir = tmp_path / "tok"
    build_tokenizer().save_pretrained(tok_dir)
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}, {"prompt": "9+" * 400 + "1="},
                                          {"prompt": [{"role": "user", "content": "2+2="}]}])
    cfg = _cfg(tmp_path, [f], "data.max_prompt_length=64", "data.filter_overlong_prompts=true",
               "data.truncation=error", f"actor_rollout_ref.model.path={tok_dir}", f"data.val_files=[{f}]")
    core = build_core(cfg, tmp_path / "run", session="a")
    kept = {core.prompts.get(s).prompt_id for s in range(len(core.prompts))}
    assert len(core.prompts) == 2 and kept == {"train:0", "train:2"}
    val = val_dataset(cfg.data, cfg.actor_rollout_ref.model)
    assert val is not None and [r.prompt_id for r in val.records] == ["val:0", "val:2"]
    with pytest.raises(ConfigError, match="dropped every train prompt"):
        build_core(_cfg(tmp_path, [f], "data.max_prompt_length=1", "data.filter_overlong_prompts=true",
                        f"actor_rollout_ref.model.path={tok_dir}"), tmp_path / "run2", session="a")


def test_filter_overlong_prompts_counts_the_tools_the_agent_loop_renders(tmp_path: Path) -> None:
    """Multi-turn with tools: the agent loop renders the tool schemas into the prompt (the chat
    template's system block; verl's filter passes tools= too). Counted without them, a prompt that
    fit max_prompt_length here was over it at rollout, refused on every replica (truncation=error)."""
    from services.common.data import val_dataset
    from services.common.tiny import build_tokenizer
    from services.environment.factory import prompt_tools
    from services.environment.tools import load_tools
    from services.rollout.agent.chat import ChatRenderer

    tok = build_tokenizer(tools=True)
    # as Qwen's template does: the tools in a system block (the tiny template leaves them out)
    tok.chat_template = ("{%- if tools %}<|im_start|>system\n{%- for t in tools %}{{ t | tojson }}{%- endfor %}"
                         "<|im_end|>\n{%- endif %}" + tok.chat_template)
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    tools_yaml = Path(__file__).resolve().parents[2] / "configs" / "examples" / "tool_add_tools.yaml"
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}, {"prompt": [{"role": "user", "content": "2+2="}]}])
    schemas = [t.tool_schema.model_dump(exclude_none=True) for t in load_tools(str(tools_yaml))]
    rendered = ChatRenderer(tok, schemas).prompt_ids([{"role": "user", "content": "2+2="}])  # as the agent loop
    plain = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "2+2="}], add_generation_prompt=True,
                                                   tokenize=False), add_special_tokens=False))
    assert plain < len(rendered)
    limit = len(rendered) - 1  # what the messages alone fit, the rendered prompt does not
    cfg = _cfg(tmp_path, [f], f"data.max_prompt_length={limit}", "data.filter_overlong_prompts=true",
               "data.truncation=error", f"actor_rollout_ref.model.path={tok_dir}", f"data.val_files=[{f}]",
               "actor_rollout_ref.rollout.multi_turn.enable=true",
               f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}")
    with pytest.raises(ConfigError, match="dropped every train prompt"):
        build_core(cfg, tmp_path / "run", session="a")
    with pytest.raises(ConfigError, match="dropped every val prompt"):
        val_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg))
    # one token more and both fit: the text prompt counts as the user message the tool environment starts with
    core = build_core(_cfg(tmp_path, [f], f"data.max_prompt_length={limit + 1}", "data.filter_overlong_prompts=true",
                           f"actor_rollout_ref.model.path={tok_dir}", "actor_rollout_ref.rollout.multi_turn.enable=true",
                           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools_yaml}"),
                      tmp_path / "run2", session="a")
    assert len(core.prompts) == 2


def test_filter_overlong_prompts_counts_a_multi_turn_text_prompt_as_the_user_message_rendered(tmp_path: Path) -> None:
    """Multi-turn without tools: the agent loop still starts a text prompt as a user message
    rendered through the chat template (loop.run_group, tool_env.start). Counted as the raw text,
    the template's tokens were missed, and a prompt that passed the filter was over
    max_prompt_length at rollout, refused on every replica (truncation=error) or cut."""
    from services.common.data import val_dataset
    from services.common.tiny import build_tokenizer
    from services.environment.factory import prompt_tools
    from services.rollout.agent.chat import ChatRenderer

    tok = build_tokenizer()
    tok_dir = tmp_path / "tok"
    tok.save_pretrained(tok_dir)
    f = _jsonl(tmp_path / "train.jsonl", [{"prompt": "1+1="}])
    rendered = ChatRenderer(tok).prompt_ids([{"role": "user", "content": "1+1="}])  # as the agent loop
    assert len(tok.encode("1+1=", add_special_tokens=False)) < len(rendered)
    limit = len(rendered) - 1
    common = ("data.filter_overlong_prompts=true", "data.truncation=error", f"actor_rollout_ref.model.path={tok_dir}",
              f"data.val_files=[{f}]", "actor_rollout_ref.rollout.multi_turn.enable=true")
    cfg = _cfg(tmp_path, [f], f"data.max_prompt_length={limit}", *common)
    with pytest.raises(ConfigError, match="dropped every train prompt"):
        build_core(cfg, tmp_path / "run", session="a")
    with pytest.raises(ConfigError, match="dropped every val prompt"):
        val_dataset(cfg.data, cfg.actor_rollout_ref.model, prompt_tools(cfg))
    core = build_core(_cfg(tmp_path, [f], f"data.max_prompt_length={limit + 1}", *common), tmp_path / "run2", session="a")
    assert len(core.prompts) == 1
