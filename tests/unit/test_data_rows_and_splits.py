"""Prompt data: the synthetic val split is held out from train, data.reward_fn_key names the
data_source column, non-JSON extra_info values go on the wire, empty prompts fail at load."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest

from meshrl.v1 import common_pb2
from services.common.config import load_config
from services.common.data import load_files, prompt_to_proto, train_dataset, val_dataset
from services.common.errors import ConfigError


def test_synthetic_val_split_is_held_out_from_train() -> None:
    """data.synthetic.num_val is documented as held-out prompts, but with the default task
    (addition, 2 digits) ~40% of the val prompts were also training prompts."""
    cfg = load_config(None, [])
    train = train_dataset(cfg.data)
    val = val_dataset(cfg.data)
    assert val is not None and len(val) == cfg.data.synthetic.num_val
    seen = {(r.text, r.messages) for r in train.records}
    leaked = [r.prompt_id for r in val.records if (r.text, r.messages) in seen]
    assert not leaked, f"{len(leaked)}/{len(val)} validation prompts are training prompts"


def test_synthetic_val_that_cannot_be_held_out_is_a_config_error() -> None:
    # copy with 2 digits has 100 strings, all drawn by 4096 training prompts
    cfg = load_config(None, ["data.synthetic.name=copy", "data.synthetic.digits=2"])
    with pytest.raises(ConfigError, match="num_val"):
        val_dataset(cfg.data)


def test_reward_fn_key_names_the_data_source_column(tmp_path: Path) -> None:
    """data.reward_fn_key (verl: the column that routes the reward function) was ignored: the
    record's data_source always came from the `data_source` column."""
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "source": "openai/gsm8k", "data_source": "other"}) + "\n")
    cfg = load_config(None, [f"data.train_files=[{f}]", "data.reward_fn_key=source"])
    assert train_dataset(cfg.data)[0].data_source == "openai/gsm8k"
    cfg = load_config(None, [f"data.train_files=[{f}]"])
    assert train_dataset(cfg.data)[0].data_source == "other"


def test_parquet_extra_info_with_binary_and_date_values_goes_on_the_wire(tmp_path: Path) -> None:
    """A verl parquet whose extra_info struct holds a binary or date field loaded (the stream
    digest str()s such values), then every lease of that prompt failed: json.dumps TypeError."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{
        "prompt": [{"role": "user", "content": "hi"}], "data_source": "x",
        "reward_model": {"ground_truth": "1", "style": "rule"},
        "extra_info": {"index": 0, "blob": b"\x00\x01", "when": datetime.date(2024, 1, 1)},
    }]), p)
    ds = load_files([str(p)], split="train")
    out = common_pb2.Prompt()
    prompt_to_proto(0, ds[0], out)
    info = json.loads(out.extra_info_json)
    assert info["index"] == 0 and info["when"] == "2024-01-01"


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ('{"prompt": ""}', "prompt"),
        ('{"prompt": []}', "prompt"),
        ('{"prompt": [{"role": "user", "content": null}]}', "prompt[0].content"),
        ('{"prompt": [{"role": null, "content": "hi"}]}', "prompt[0].role"),
        ('{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}', "prompt[0].content"),
        ('{"prompt": [{"role": {"name": "user"}, "content": "hi"}]}', "prompt[0].role"),
        ('{"prompt": "hi", "data_source": null}', "data_source"),
    ],
)
def test_empty_prompt_row_is_a_config_error_naming_file_row_and_field(tmp_path: Path, line: str, field: str) -> None:
    """An empty prompt (or a message whose role/content is null) loaded: the rollout then refused it
    with InvalidArgument("prompt: empty") -- which stops a replica, on every replica it reached --
    or sent the literal text "None" to the model. A message content given as a list of parts
    (OpenAI's [{"type": "text", ...}]) went to the model as its Python repr, and a null
    data_source (a parquet column null in some rows) became the source "None": no scorer takes
    it, and the reward's refusal stopped each replica that leased the row, hours into the run."""
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ConfigError) as info:
        load_files([str(f)], split="train")
    msg = str(info.value)
    assert f"{f}:2" in msg and field in msg, msg


def test_a_bad_val_row_fails_the_run_before_it_starts(tmp_path: Path) -> None:
    """The driver read data.val_files at its first validation only: with val_before_train=false a
    bad row stopped the run test_freq versions in ("the driver failed"), after hours of training."""
    from meshrl.train import MeshRun, resolve_config

    good = tmp_path / "train.jsonl"
    good.write_text('{"prompt": "1+1="}\n')
    bad = tmp_path / "val.jsonl"
    bad.write_text('{"prompt": "2+2="}\n{"prompt": [{"role": "user", "content": null}]}\n')
    cfg = resolve_config(None, [f"data.train_files=[{good}]", f"data.val_files=[{bad}]", "trainer.test_freq=5",
                                "trainer.val_before_train=false"])
    with pytest.raises(ConfigError, match=f"{bad}:2"):
        MeshRun(cfg, tmp_path / "run", "fully_async")
    # without validation the val files are not read
    cfg = resolve_config(None, [f"data.train_files=[{good}]", f"data.val_files=[{bad}]", "trainer.test_freq=-1"])
    MeshRun(cfg, tmp_path / "run", "fully_async")


def test_reward_model_given_as_a_json_string_keeps_its_ground_truth(tmp_path: Path) -> None:
    """extra_info may be a string holding a JSON object (a CSV or pandas export stringifies the
    nested columns), but reward_model such a string was taken as no reward_model: every row's
    ground truth read as "", so every response scored 0 with nothing said. Any other non-object
    value was dropped the same way."""
    f = tmp_path / "train.jsonl"
    f.write_text(json.dumps({"prompt": "1+1=", "reward_model": json.dumps({"ground_truth": "2", "style": "rule"}),
                             "extra_info": json.dumps({"index": 0})}) + "\n")
    assert load_files([str(f)], split="train")[0].ground_truth == "2"
    f.write_text('{"prompt": "ok", "reward_model": {"ground_truth": "1"}}\n{"prompt": "1+1=", "reward_model": 2}\n')
    with pytest.raises(ConfigError, match=f"{f}:2: reward_model must be an object"):
        load_files([str(f)], split="train")
