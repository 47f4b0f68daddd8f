"""`trainer_service.loop`: the trainer loop's one section, filled from verl's keys at load
(resolve.py `LOOP_KEYS`), refused as input, left out of dumps; `loop_settings` built from it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.common.config import MeshConfig, derive, dump_config, load_config
from services.common.config.actor_rollout_ref import ActorConfig, ActorRolloutRefConfig
from services.common.config.resolve import LOOP_KEYS
from services.common.config.trainer_loop import TrainerLoopConfig
from services.common.config.trainer_service import TrainerServiceConfig
from services.common.errors import ConfigError
from services.trainer.core import LoopSettings
from services.trainer.factory import loop_settings

# LoopSettings field -> (the verl override that sets it to a non-default value, the value the loop gets).
TRACED: dict[str, tuple[list[str], Any]] = {
    "groups_per_step": (["actor_rollout_ref.actor.ppo_mini_batch_size=3", "async_training.require_batches=2"], 6),
    "mini_batches_per_step": (["async_training.require_batches=2"], 2),
    "ppo_epochs": (["actor_rollout_ref.actor.ppo_epochs=3"], 3),
    "shuffle": (["actor_rollout_ref.actor.shuffle=true"], True),
    "trigger_parameter_sync_step": (["async_training.trigger_parameter_sync_step=2"], 2),
    "save_freq": (["trainer.save_freq=5"], 5),
    "temperature": (["actor_rollout_ref.rollout.temperature=0.7"], 0.7),
    "bypass_mode": (["algorithm.rollout_correction.bypass_mode=false"], False),
    "use_kl_loss": (["actor_rollout_ref.actor.use_kl_loss=true"], True),
    "filter_metric": (["algorithm.filter_groups.metric=score"], "score"),
    "max_num_gen_batches": (["algorithm.filter_groups.max_num_gen_batches=7"], 7),
    "bucket_bytes": (["actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16"], 16 << 20),
    "resume_mode": (["trainer.resume_mode=disable"], "disable"),
    "resume_from_path": (["trainer.resume_mode=resume_path", "trainer.resume_from_path=/ck/global_step_3"],
                         "/ck/global_step_3"),
    "seed": (["trainer.seed=7"], 7),
    "checkpoint_dir": (["trainer.default_local_dir=/ck"], Path("/ck")),
    # 40 prompts, 2 per step, trigger 4: 5 versions, 20 local steps (dataset of 100 x 10 epochs: no cap)
    "total_steps": (["rollout.total_rollout_steps=40", "actor_rollout_ref.actor.ppo_mini_batch_size=2"], 20),
}
# Run-time values, and the trainer service's own keys.
RUNTIME = {"pad_token_id", "vocab_size", "session"}
OWN: dict[str, tuple[list[str], Any]] = {
    "trainer_id": (["trainer_service.trainer_id=tx"], "tx"),
    "fetch_timeout_ms": (["trainer_service.fetch_timeout_ms=7"], 7),
    "max_checkpoints_to_keep": (["trainer_service.max_checkpoints_to_keep=9"], 9),
    "coordinator_wait_s": (["trainer_service.coordinator_wait_s=3"], 3.0),
    "overlap": (["trainer_service.overlap=true"], True),
    "metrics_path": (["trainer_service.metrics_file=m.jsonl"], Path("/run/m.jsonl")),
    "hf_export_dir": (["trainer_service.hf_export_dir=null"], None),
}


def _settings(overrides: list[str]) -> LoopSettings:
    return loop_settings(load_config(None, overrides).trainer_service, "/run", 100, pad_id=0, vocab_size=None)


def test_every_loop_setting_is_traced_to_a_key() -> None:
    names = {f.name for f in dataclasses.fields(LoopSettings)}
    assert names == set(TRACED) | RUNTIME | set(OWN)


@pytest.mark.parametrize("name", sorted({**TRACED, **OWN}))
def test_each_loop_setting_follows_its_key(name: str) -> None:
    overrides, want = {**TRACED, **OWN}[name]
    assert getattr(_settings([]), name) != want, "the override must change the default"
    assert getattr(_settings(overrides), name) == want


def test_runtime_values_are_passed_through() -> None:
    s = loop_settings(load_config().trainer_service, "/run", 100, pad_id=5, vocab_size=77, session="s1")
    assert (s.pad_token_id, s.vocab_size, s.session) == (5, 77, "s1")


def test_the_section_repeats_each_verl_key_type_and_default() -> None:
    assert set(LOOP_KEYS) == set(TrainerLoopConfig.model_fields)
    for name, (key, model) in LOOP_KEYS.items():
        source = model.model_fields[key.rsplit(".", 1)[-1]]
        field = TrainerLoopConfig.model_fields[name]
        assert (field.annotation, field.default) == (source.annotation, source.default), name
    assert MeshConfig().trainer_service.loop == TrainerLoopConfig()


def test_sync_mode_reaches_the_loop() -> None:
    assert load_config(None, ["async_training.mode=sync"]).trainer_service.loop.trigger_parameter_sync_step == 1


def test_setting_the_section_is_an_error_naming_the_verl_key() -> None:
    with pytest.raises(ConfigError, match=r"set actor_rollout_ref\.actor\.ppo_epochs=3 instead of trainer_service\.loop\.ppo_epochs"):
        load_config(None, ["trainer_service.loop.ppo_epochs=3"])
    with pytest.raises(ConfigError, match=r"trainer_service\.loop is not input.*trainer_service\.loop\.nope is no key"):
        load_config(None, ["trainer_service.loop.nope=1"])
    with pytest.raises(ValidationError, match=r"trainer_service\.loop is not input"):
        MeshConfig.model_validate({"trainer_service": {"loop": {}}})


def test_a_bad_verl_value_is_reported_once_under_its_own_key() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["actor_rollout_ref.actor.ppo_epochs=many"])
    assert "actor_rollout_ref.actor.ppo_epochs" in str(err.value) and "trainer_service.loop" not in str(err.value)


def test_direct_construction_derives_the_section() -> None:
    cfg = MeshConfig(actor_rollout_ref=ActorRolloutRefConfig(actor=ActorConfig(ppo_epochs=2)), trainer={"save_freq": 3})
    assert (cfg.trainer_service.loop.ppo_epochs, cfg.trainer_service.loop.save_freq) == (2, 3)
    # Another config's trainer_service brings its own keys, not its loop: the loop follows this tree.
    other = MeshConfig(trainer_service=cfg.trainer_service)
    assert (other.trainer_service.loop.ppo_epochs, other.trainer_service.loop.save_freq) == (1, -1)
    assert TrainerServiceConfig().loop == TrainerLoopConfig()


def test_a_dump_leaves_the_section_out_and_loads_again_with_edits(tmp_path: Path) -> None:
    cfg = load_config(None, ["trainer.save_freq=5"])
    data = yaml.safe_load(dump_config(cfg))
    assert "loop" not in data["trainer_service"]
    assert MeshConfig.model_validate(cfg.model_dump(mode="json")) == cfg
    data["trainer"]["save_freq"] = 9  # what absolute_paths / wire do to a dump before loading it again
    assert MeshConfig.model_validate(data).trainer_service.loop.save_freq == 9


@settings(max_examples=60, deadline=None)
@given(
    mini=st.integers(1, 8), require=st.integers(1, 3), trigger=st.integers(1, 4), rollout_steps=st.integers(1, 500),
    epochs=st.integers(1, 5), cap=st.none() | st.integers(1, 20), size=st.none() | st.integers(1, 200),
)
def test_run_length_agrees_with_derive(
    mini: int, require: int, trigger: int, rollout_steps: int, epochs: int, cap: int | None, size: int | None,
) -> None:
    cfg = load_config(None, [
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}", f"async_training.require_batches={require}",
        f"async_training.trigger_parameter_sync_step={trigger}", f"rollout.total_rollout_steps={rollout_steps}",
        f"rollout.total_epochs={epochs}", f"trainer.total_training_steps={'null' if cap is None else cap}",
    ])
    d, loop = derive(cfg, dataset_size=size), cfg.trainer_service.loop
    assert (loop.groups_per_step, loop.total_local_steps(size)) == (d.required_samples, d.total_local_steps)


def test_kl_in_reward_builds_the_reference_and_the_loop_applies_it() -> None:
    """algorithm.use_kl_in_reward alone (no use_kl_loss): the engine gets a reference policy and
    the algorithm its KL-in-reward step (the FSDP factory built the reference for use_kl_loss only)."""
    from services.trainer.factory import algorithm_from_config, engine_spec

    plain = load_config(None, [])
    assert engine_spec(plain, "cpu", 64).ref is None and algorithm_from_config(plain).reward_kl is None
    cfg = load_config(None, ["algorithm.use_kl_in_reward=true"])
    assert engine_spec(cfg, "cpu", 64).ref is not None
    assert algorithm_from_config(cfg).reward_kl is not None
    with pytest.raises(ConfigError, match=r"kl_ctrl\.type=adaptive"):
        load_config(None, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.type=adaptive"])
