"""Config loading: YAML + dotted overrides, verl names, errors that name the key and the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import load_config, parse_override, write_resolved_config
from services.common.errors import ConfigError


def test_defaults_are_valid_and_verl_named() -> None:
    cfg = load_config()
    assert cfg.actor_rollout_ref.actor.ppo_mini_batch_size == 256
    assert cfg.async_training.trigger_parameter_sync_step == 4
    assert cfg.async_training.staleness_threshold == 0.1
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 2048


def test_yaml_and_overrides(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"async_training": {"staleness_threshold": 0.3}, "data": {"max_response_length": 64}}))
    cfg = load_config(f, ["async_training.staleness_threshold=0.5", "+trainer.save_freq=10", "rollout.n=8",
                          "actor_rollout_ref.actor.optim.betas=[0.9, 0.95]"])
    assert cfg.async_training.staleness_threshold == 0.5
    assert cfg.data.max_response_length == 64
    assert cfg.trainer.save_freq == 10
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert cfg.actor_rollout_ref.actor.optim.betas == (0.9, 0.95)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["async_training.staleness_treshold=0.5"], "did you mean async_training.staleness_threshold"),
        (["async_training.staleness_threshold=-1"], "async_training.staleness_threshold"),
        (["actor_rollout_ref.rollout.n=1"], "actor_rollout_ref.rollout.n=4"),
        (["data.gen_batch_size=2"], "set data.gen_batch_size=1"),
        (["actor_rollout_ref.hybrid_engine=true"], "hybrid_engine=false"),
        (["data.train_batch_size=512"], "set data.train_batch_size=0"),
        (["data.max_prompt_length=abc"], "data.max_prompt_length"),
        (["nosuchsection.x=1"], "nosuchsection: unknown key"),
        (["rollout.n=8", "actor_rollout_ref.rollout.n=4"], "rollout.n=8 disagrees"),
        (["async_training.mode=sync", "async_training.staleness_threshold=0.5"], "staleness_threshold=0"),
        (["algorithm.rollout_correction.rollout_rs=seq_mean_k1"], "rollout_rs_threshold"),
        (["reward_model.overlong_buffer.enable=true"], "overlong_buffer.len"),
        (["trainer.resume_mode=resume_path"], "trainer.resume_from_path"),
        (["data.train_files=[]", "data.synthetic=null"], "set data.train_files or data.synthetic"),
        # a checkpoint the coordinator counts as trained must be one a run resumes from
        (["actor_rollout_ref.actor.checkpoint.save_contents=[model]"], "save_contents=['model'] lacks ['extra']"),
        (["actor_rollout_ref.actor.checkpoint.save_contents=[model,extra]",
          "actor_rollout_ref.actor.checkpoint.load_contents=[model,optimizer,extra]"], "loads ['optimizer'], which"),
    ],
)
def test_bad_config_names_key_and_fix(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert needle in str(info.value)


def test_checkpoint_load_contents_default_to_what_is_saved() -> None:
    cfg = load_config(None, ["actor_rollout_ref.actor.checkpoint.save_contents=[model,extra,hf_model]"])
    assert cfg.actor_rollout_ref.actor.checkpoint.load_contents == ["model", "extra"]  # verl: ${.save_contents}
    assert load_config().actor_rollout_ref.actor.checkpoint.load_contents == ["model", "optimizer", "extra"]


def test_override_syntax_errors() -> None:
    with pytest.raises(ConfigError, match="KEY=VALUE"):
        parse_override("async_training.staleness_threshold")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("a..b=1")
    with pytest.raises(ConfigError, match="is a value, not a section"):
        load_config(None, ["trainer.save_freq=3", "trainer.save_freq.x=1"])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_sync_mode_forces_on_policy() -> None:
    cfg = load_config(None, ["async_training.mode=sync"])
    assert cfg.async_training.staleness_threshold == 0 and cfg.async_training.trigger_parameter_sync_step == 1


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(None, ["async_training.staleness_threshold=0.25"])
    path = write_resolved_config(cfg, tmp_path)
    again = load_config(path)
    assert again == cfg


def test_every_field_is_documented() -> None:
    from pydantic import BaseModel

    from services.common.config import MeshConfig

    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(prefix + name)
            ann = field.annotation
            for t in (ann, *getattr(ann, "__args__", ())):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    walk(t, f"{prefix}{name}.")

    walk(MeshConfig, "")
    assert not missing, f"fields without a docstring: {missing}"


def test_errors_survive_pickling() -> None:
    """Errors cross Ray process boundaries (Serve replica -> proxy) by pickle."""
    import pickle

    from services.common import errors

    for exc in [errors.InvalidArgument("a.b", "bad"), errors.MissingDependency("x", "pip install y"),
                errors.NotFound("gone"), errors.ConfigError("c")]:
        again = pickle.loads(pickle.dumps(exc))
        assert type(again) is type(exc) and str(again) == str(exc)


def test_old_niceness_spellings_map_onto_the_tuning_section(tmp_path: Path) -> None:
    f = tmp_path / "old.yaml"
    f.write_text(yaml.safe_dump({"trainer_service": {"worker_nice": 0},
                                 "serve": {"ray_nice": 19, "rollout": {"num_cpus": 1, "nice": 19}}}))
    cfg = load_config(f, ["serve.reward.nice=18"])
    nice = cfg.tuning.nice
    assert (nice.trainer_ranks, nice.ray_daemons, nice.rollout, nice.reward, nice.coordinator) == (0, 19, 19, 18, None)
    assert cfg.serve.rollout.num_cpus == 1
    assert load_config(write_resolved_config(cfg, tmp_path)) == cfg
    with pytest.raises(ConfigError, match=r"serve\.rollout\.nice=19 and tuning\.nice\.rollout=0 disagree"):
        load_config(f, ["tuning.nice.rollout=0"])


def test_resolution_changes_no_validated_section() -> None:
    """verl's aliases and mode implications are resolved on the input: the validator only checks."""
    from services.common.config import MeshConfig

    cfg = MeshConfig.model_validate({"rollout": {"n": 8}, "async_training": {"mode": "sync"},
                                     "actor_rollout_ref": {"actor": {"loss_agg_mode": "seq-mean-token-sum-norm"}}})
    assert cfg.actor_rollout_ref.rollout.n == 8
    assert (cfg.async_training.staleness_threshold, cfg.async_training.trigger_parameter_sync_step) == (0, 1)
    assert cfg.actor_rollout_ref.actor.loss_scale_factor == cfg.data.max_response_length
    assert MeshConfig.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize(("overrides", "match"), [
    (["param_server.delta_sync=true"], "delta_sync needs a collective transport"),  # grpc by default
    (["param_server.delta_sync=true", "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
      "actor_rollout_ref.model.lora_rank=8"], "a LoRA run's versions are the adapter alone"),
])
def test_delta_sync_is_refused_where_receivers_may_skip_versions_or_versions_are_adapters(
        overrides: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, overrides)
    cfg = load_config(None, ["param_server.delta_sync=true", "actor_rollout_ref.rollout.checkpoint_engine.backend=gloo"])
    assert cfg.param_server.delta_sync


@pytest.mark.parametrize("key", ["mixed_precision", "model_dtype"])
def test_fp16_training_with_fsdp_is_refused(key: str) -> None:
    """The FSDP engine scales no loss: fp16 gradients of a loss divided by the mini-batch's token
    count underflow (a quarter of them exactly 0 at 1e6 tokens). Accepted, it trained on a
    corrupted gradient; megatron (its optimizer scales the loss) and bf16 stay allowed."""
    with pytest.raises(ConfigError, match=f"fsdp_config.{key}=fp16"):
        load_config(None, [f"actor_rollout_ref.actor.fsdp_config.{key}=fp16"])
    load_config(None, [f"actor_rollout_ref.actor.fsdp_config.{key}=bf16"])
    load_config(None, ["actor_rollout_ref.actor.strategy=megatron", f"actor_rollout_ref.actor.fsdp_config.{key}=fp16"])


@pytest.mark.parametrize("value", ["nan", ".nan"])
def test_a_nan_grad_clip_is_refused(value: str) -> None:
    """Both engines clip only where grad_clip > 0, and NaN > 0 is false: a NaN grad_clip (a typo'd
    sweep value, an unset variable read as .nan) was accepted and silently trained without any
    gradient clipping. 0 or a negative value stays the documented "off", inf "no limit"."""
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.grad_clip"):
        load_config(None, [f"actor_rollout_ref.actor.grad_clip={value}"])
    for ok in ("0", "-1", ".inf", "0.5"):
        load_config(None, [f"actor_rollout_ref.actor.grad_clip={ok}"])


def test_every_rank_builds_a_remote_code_model_with_trust_remote_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks other than 0 build the model on the meta device from its config; without
    trust_remote_code a custom-code model (registered only in the process that loaded the
    checkpoint) failed there: a multi-GPU run of one could not start."""
    import torch
    from transformers import AutoModelForCausalLM

    from services.common.config.actor_rollout_ref import ModelConfig
    from services.trainer.engines import hf_model

    seen: list[dict[str, object]] = []
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda *a, **kw: seen.append(kw))
    model = ModelConfig(path="/models/custom", trust_remote_code=True)
    hf_model.build_model(model, object(), dtype=torch.float32, attn="sdpa", materialize=False)
    assert seen and seen[0].get("trust_remote_code") is True
