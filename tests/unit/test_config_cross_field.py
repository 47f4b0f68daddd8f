"""Configs that used to load and then crash or misbehave at run time are refused at load, naming
the key and the fix; verl's `trainer.total_epochs` caps the run; numeric overrides of string keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from services.common.config import derive, dump_config, load_config
from services.common.errors import ConfigError


def test_autoscaling_min_above_max_is_refused_at_load() -> None:
    # Ray Serve refuses it only at deploy time, without naming the meshrl key.
    with pytest.raises(ConfigError, match=r"serve\.rollout\.autoscaling.*max_replicas"):
        load_config(None, ["serve.rollout.autoscaling.min_replicas=4"])


@pytest.mark.parametrize("override", ["serve.coordinator.num_replicas=2", "serve.trainer.autoscaling={max_replicas: 2}",
                                      "serve.param_server.num_replicas=3"])
def test_a_single_replica_service_refuses_more(override: str) -> None:
    # the coordinator, param server and trainer deployments are built with one replica
    with pytest.raises(ConfigError, match=r"runs as exactly one replica"):
        load_config(None, [override])


def test_lease_renew_interval_longer_than_lease_timeout_is_refused() -> None:
    # Leases expire (prompts re-issued, work thrown away) before the replica ever renews them.
    with pytest.raises(ConfigError, match=r"coordinator\.lease_timeout_s"):
        load_config(None, ["coordinator.replica_ttl_s=null", "rollout_worker.lease_renew_interval_s=900"])


def test_train_batch_size_outside_fully_async_is_not_silently_ignored() -> None:
    # sync mode: a step takes ppo_mini_batch_size * require_batches prompts; train_batch_size is read by nothing.
    with pytest.raises(ConfigError, match=r"data\.train_batch_size"):
        load_config(None, ["async_training.mode=sync", "data.train_batch_size=512",
                           "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    cfg = load_config(None, ["async_training.mode=sync", "data.train_batch_size=32",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    assert derive(cfg).required_samples == 32


def test_trainer_total_epochs_caps_the_run() -> None:
    # verl fully async: total_rollout_steps = min(rollout.total_rollout_steps, len(data) * trainer.total_epochs)
    cfg = load_config(None, ["trainer.total_epochs=1", "rollout.total_rollout_steps=100000"])
    assert derive(cfg, dataset_size=64).total_rollout_steps == 64
    with pytest.raises(ConfigError, match=r"trainer\.total_epochs=1 disagrees with rollout\.total_epochs=3"):
        load_config(None, ["trainer.total_epochs=1", "rollout.total_epochs=3"])
    # a resolved config loads again
    again = load_config(None, [f"{k}={v}" for k, v in (("trainer.total_epochs", 2),)])
    tree = yaml.safe_load(dump_config(again))
    assert tree["rollout"]["total_epochs"] == 2
    assert load_config(None).rollout.total_epochs == 10


def test_dumped_default_config_reloads(tmp_path: Path) -> None:
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(load_config(None)))
    load_config(p)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_total_training_steps_zero_or_negative_is_refused(value: str) -> None:
    # 0 versions -> total_steps 0, which the trainer reads as "no limit" (the opposite).
    with pytest.raises(ConfigError, match=r"trainer\.total_training_steps"):
        load_config(None, [f"trainer.total_training_steps={value}"])


def test_numeric_override_of_a_string_field() -> None:
    cfg = load_config(None, ["trainer.experiment_name=2024", "agent.command=[python, agent.py, --steps, 4]"])
    assert cfg.trainer.experiment_name == "2024"
    assert cfg.agent.command is not None and cfg.agent.command[-1] == "4"


@pytest.mark.parametrize("text", ["0123", "1.10", "2024_01", "12:30", "0x1f", "2024-01-02"])
def test_a_string_field_override_keeps_the_text_as_written(text: str) -> None:
    # YAML 1.1 reads these as 83, 1.1, 202401, 750 (sexagesimal), 31, a date: the run's name (its
    # directory, its tracker run) silently became another, or the date was refused.
    cfg = load_config(None, [f"trainer.experiment_name={text}", f"actor_rollout_ref.model.tokenizer_path={text}"])
    assert cfg.trainer.experiment_name == text and cfg.actor_rollout_ref.model.tokenizer_path == text
    # a non-string field still reads YAML: numbers and bools
    cfg = load_config(None, ["trainer.save_freq=1_000", "data.shuffle=off"])
    assert cfg.trainer.save_freq == 1000 and cfg.data.shuffle is False
    assert load_config(None, ["serve.bytecode_cache=off"]).serve.bytecode_cache == "off"  # its own on / off


@pytest.mark.parametrize(("overrides", "want"), [
    (["actor_rollout_ref.model.dtype=bfloat16"], "bfloat16"),
    ([], "float32"),
    (["actor_rollout_ref.model.dtype=bfloat16", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32"], "float32"),
])
def test_the_fsdp_master_dtype_survives_a_dumped_config(tmp_path: Path, overrides: list[str], want: str) -> None:
    # the services and --resume load the dumped config: an unset fsdp_config.model_dtype must
    # still mean model.dtype there
    from services.trainer.engines.hf_model import master_dtype

    cfg = load_config(None, overrides)
    p = tmp_path / "c.yaml"
    p.write_text(dump_config(cfg))
    for c in (cfg, load_config(p)):
        assert str(master_dtype(c.actor_rollout_ref.model, c.actor_rollout_ref.actor)) == f"torch.{want}"


@pytest.mark.parametrize("override", [
    # 0 passes: every step publishes the weights it started from; the run "succeeds", untrained.
    "actor_rollout_ref.actor.ppo_epochs=0",
    # range(0, n, -1) is empty: no micro-batch, nothing trained; 0 silently took the whole mini-batch.
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=-1",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=0",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=0",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=-1",
    # `meshrl plan` divided by the devices of an engine (ZeroDivisionError), the rollout by its TP
    "actor_rollout_ref.rollout.tensor_model_parallel_size=0",
    "actor_rollout_ref.rollout.data_parallel_size=0",
    # the run's prompts are capped at dataset_size x total_epochs: 0 rolls out nothing
    "rollout.total_epochs=0",
])
def test_batch_and_parallel_knobs_that_would_train_nothing_are_refused(override: str) -> None:
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{key}: Input should be greater than or equal to 1"):
        load_config(None, [override])


def test_max_model_len_that_leaves_no_room_after_a_prompt_is_refused() -> None:
    # A prompt within data.max_prompt_length but at or past max_model_len is rejected by the
    # engine as InvalidArgument, which stops the replica (bad input fails on every replica): each
    # replica that leases such a prompt stops, hours into a run. Below prompt + response stays
    # allowed (a sample then ends with `length` at the context limit).
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.rollout\.max_model_len=512 .*data\.max_prompt_length=512"):
        load_config(None, ["data.max_prompt_length=512", "actor_rollout_ref.rollout.max_model_len=512"])
    cfg = load_config(None, ["data.max_prompt_length=512", "data.max_response_length=512",
                             "actor_rollout_ref.rollout.max_model_len=600"])
    assert cfg.actor_rollout_ref.rollout.max_model_len == 600


@pytest.mark.parametrize(("overrides", "needle"), [
    # the trainer divides the logits by it: NaN log-probs, every step skipped (grad not finite)
    (["actor_rollout_ref.rollout.temperature=0"], r"actor_rollout_ref\.rollout\.temperature=0\.0: .*val_kwargs"),
    # the sampling check refuses it as bad input, which stops every replica that leases a prompt
    (["actor_rollout_ref.rollout.temperature=-1"], r"actor_rollout_ref\.rollout\.temperature=-1\.0"),
    # vLLM refuses (0, 0.01) as bad input: the replica stops
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.temperature=0.005"],
     r"actor_rollout_ref\.rollout\.temperature=0\.005: .*>= 0\.01"),
    # whatever the engine: the trainer's logits.float() / 1e-38 overflow (NaN loss every step), and
    # far above that its log-probs (-1e31 at 1e-30) make every importance ratio 0 or inf
    (["actor_rollout_ref.rollout.temperature=1e-38"], r"actor_rollout_ref\.rollout\.temperature=1e-38: .*>= 0\.01"),
    (["actor_rollout_ref.rollout.temperature=0.005"], r"actor_rollout_ref\.rollout\.temperature=0\.005: .*>= 0\.01"),
    # inf: the transformers engine samples uniformly, the trainer's log-probs are all -log(vocab)
    (["actor_rollout_ref.rollout.temperature=inf"], r"actor_rollout_ref\.rollout\.temperature=inf: .*finite"),
])
def test_training_temperature_that_cannot_train_is_refused(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
    assert load_config(None, ["actor_rollout_ref.rollout.temperature=0.01"])


@pytest.mark.parametrize(("overrides", "needle"), [
    # the sampling check refuses it as bad input: every validation Generate fails, at the first
    # test_freq step, hours into the run
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=-1"],
     r"actor_rollout_ref\.rollout\.val_kwargs\.temperature"),
    # vLLM refuses (0, 0.01) as bad input, as for the training temperature
    (["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
      "actor_rollout_ref.rollout.val_kwargs.temperature=0.005"],
     r"actor_rollout_ref\.rollout\.val_kwargs\.temperature=0\.005: .*>= 0\.01"),
    # inf samples uniformly: validation scores of noise
    (["actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.temperature=inf"],
     r"actor_rollout_ref\.rollout\.val_kwargs\.temperature=inf: .*finite"),
    (["actor_rollout_ref.rollout.val_kwargs.top_p=0"], r"actor_rollout_ref\.rollout\.val_kwargs\.top_p"),
    (["actor_rollout_ref.rollout.val_kwargs.top_k=-2"], r"actor_rollout_ref\.rollout\.val_kwargs\.top_k"),
    (["actor_rollout_ref.rollout.val_kwargs.n=0"], r"actor_rollout_ref\.rollout\.val_kwargs\.n"),
    # the training samples' own: refused by every replica that leases a prompt
    (["actor_rollout_ref.rollout.top_p=0"], r"actor_rollout_ref\.rollout\.top_p"),
    (["actor_rollout_ref.rollout.top_k=-2"], r"actor_rollout_ref\.rollout\.top_k"),
])
def test_sampling_the_engines_would_refuse_is_refused_at_load(overrides: list[str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
    # greedy (0) is validation's default, on either engine; do_sample=false ignores the temperature
    for name in ("transformers", "vllm"):
        assert load_config(None, [f"actor_rollout_ref.rollout.name={name}", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                  "actor_rollout_ref.rollout.val_kwargs.temperature=0"])
    assert load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.val_kwargs.temperature=0.005"])


def test_collective_receivers_default_to_the_rollout_replicas() -> None:
    # One weight fetcher per rollout replica joins the broadcast group (services/rollout/factory
    # default_fetcher). The default was rollout.nnodes x rollout.n_gpus_per_node: with an engine
    # of TP 4 on 8 devices (2 replicas, as in configs/recipes/qwen3_5_27b_grpo_fsdp) the sender
    # waited for 8 receivers where 2 check in, and no version ever went out.
    from services.weights.transports import collective_receivers

    cfg = load_config(None, ["actor_rollout_ref.rollout.checkpoint_engine.backend=nccl", "rollout.n_gpus_per_node=8",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=4", "serve.rollout.num_replicas=2",
                             "serve.rollout.num_gpus=4"])
    assert collective_receivers(cfg) == 2
    assert collective_receivers(cfg.model_copy(update={"param_server": cfg.param_server.model_copy(
        update={"collective_receivers": 3})})) == 3


def test_one_step_off_mode_in_the_config_means_what_train_mode_one_step_off_means() -> None:
    # `meshrl train --mode one_step_off` sets staleness 1, trigger 1, no partial rollout, eta 1;
    # the same mode written in the config (or as async_training.mode=one_step_off) kept the
    # fully async defaults (staleness 0.1, trigger 4): a fully async run labelled one_step_off.
    from meshrl.train import resolve_config

    at = load_config(None, ["async_training.mode=one_step_off"]).async_training
    want = resolve_config(None, [], mode="one_step_off").async_training
    fields = ("staleness_threshold", "trigger_parameter_sync_step", "partial_rollout", "max_staleness_versions")
    assert {f: getattr(at, f) for f in fields} == {f: getattr(want, f) for f in fields}
    assert at.staleness_threshold == 1.0 and at.trigger_parameter_sync_step == 1
    with pytest.raises(ConfigError, match=r"async_training\.mode=one_step_off .*trigger_parameter_sync_step=1"):
        load_config(None, ["async_training.mode=one_step_off", "async_training.trigger_parameter_sync_step=4"])


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_collective_transport_with_a_changing_rollout_replica_count_is_refused(backend: str) -> None:
    # The broadcast group's size is fixed when it forms (services/param_server/rendezvous.py): with
    # fewer replicas than receivers every broadcast waits for ranks that never check in; a replica
    # added above it finds the group full.
    with pytest.raises(ConfigError, match=r"serve\.rollout\.autoscaling\.min_replicas=1.*max_replicas=4.*grpc"):
        load_config(None, [f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}",
                           "serve.rollout.autoscaling={min_replicas: 1, max_replicas: 4}"])
    # a fixed count under autoscaling is one group size: the default receivers are that count
    from services.weights.transports import collective_receivers

    cfg = load_config(None, [f"actor_rollout_ref.rollout.checkpoint_engine.backend={backend}", "rollout.n_gpus_per_node=8",
                             "serve.rollout.autoscaling={min_replicas: 2, max_replicas: 2}"])
    assert collective_receivers(cfg) == 2
    load_config(None, ["actor_rollout_ref.rollout.checkpoint_engine.backend=grpc",
                       "serve.rollout.autoscaling={min_replicas: 1, max_replicas: 4}"])


def test_coordinator_response_bound_below_the_response_budget_is_refused() -> None:
    # coordinator.max_response_tokens refuses a submitted response (it truncates nothing): with it
    # below data.max_response_length every SubmitGroups call carrying one long response failed
    # whole, and the groups coalesced with it failed too.
    with pytest.raises(ConfigError, match=r"coordinator\.max_response_tokens=256.*data\.max_response_length=512"):
        load_config(None, ["coordinator.max_response_tokens=256", "data.max_response_length=512"])
    load_config(None, ["coordinator.max_response_tokens=512", "data.max_response_length=512"])


def test_rollout_weight_load_deadline_below_the_transfer_deadline_is_refused() -> None:
    # A replica's weight update (fetch + load) is cut at rollout_worker.weight_load_timeout_s and
    # retried with the same deadline: a version whose transfer needs the longer
    # param_server.transfer_timeout_s never loaded, and the replica stayed paused for the run.
    with pytest.raises(ConfigError, match=r"rollout_worker\.weight_load_timeout_s=600.*param_server\.transfer_timeout_s=1800"):
        load_config(None, ["param_server.transfer_timeout_s=1800", "param_server.hold_ttl_s=3600"])
    load_config(None, ["param_server.transfer_timeout_s=1800", "param_server.hold_ttl_s=3600",
                       "rollout_worker.weight_load_timeout_s=2400"])
