"""Small pure parts of the trainer: LR schedule, batching, group -> batch conversion, the
in-process publisher, checkpoint directories, config wiring."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.config import load_config
from services.common.config.actor_rollout_ref import OptimConfig
from services.common.errors import ConfigError, FailedPrecondition, InvalidArgument, NotFound
from services.trainer import checkpoints
from services.trainer.algos import dynamic_sampling_values
from services.trainer.convert import groups_to_batch, sequence_tensors
from services.trainer.engines.base import SequenceBatch
from services.trainer.engines.batching import balanced_partition, micro_batch_indices, pack, unpack_next_token
from services.trainer.engines.optim import lr_lambda
from services.trainer.factory import loop_settings, total_optimizer_steps
from services.trainer.publisher import build_publisher
from services.weights.in_process import InProcessPublisher, PublishedVersion
from tests.unit.trainer_fakes import make_group

# ---- LR schedule ---------------------------------------------------------------------------------


def test_warmup_never_trains_with_lr_zero() -> None:
    f = lr_lambda(OptimConfig(lr_warmup_steps=4), total_steps=0)
    assert [f(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_and_linear_decay_to_the_floor() -> None:
    cos = lr_lambda(OptimConfig(lr_warmup_steps=2, lr_scheduler_type="cosine", min_lr_ratio=0.1), total_steps=12)
    assert cos(1) == 1.0 and cos(2) == pytest.approx(1.0) and cos(12) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)
    assert cos(7) == pytest.approx(0.55)
    lin = lr_lambda(OptimConfig(lr_scheduler_type="linear"), total_steps=10)
    assert [round(lin(s), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]


def test_schedule_needing_the_total_fails_early_with_the_fix() -> None:
    with pytest.raises(ConfigError, match="total_training_steps"):
        lr_lambda(OptimConfig(lr_scheduler_type="cosine"), total_steps=0)
    with pytest.raises(ConfigError, match="total_training_steps"):
        lr_lambda(OptimConfig(lr_warmup_steps_ratio=0.1), total_steps=-1)
    with pytest.raises(ConfigError, match="warmup"):
        lr_lambda(OptimConfig(lr_warmup_steps=10, lr_scheduler_type="linear"), total_steps=10)


def test_total_optimizer_steps_is_known_from_the_run_length() -> None:
    cfg = load_config(None, [
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "async_training.require_batches=2",
        "async_training.trigger_parameter_sync_step=2", "rollout.total_rollout_steps=64",
        "actor_rollout_ref.actor.ppo_epochs=2",
    ])
    # 64 prompts / (4 per step * 2 steps per version) = 8 versions = 16 local steps; x 2 mini-batches x 2 epochs
    assert total_optimizer_steps(cfg, 1000) == 64
    cfg.actor_rollout_ref.actor.optim.total_training_steps = 7
    assert total_optimizer_steps(cfg, 1000) == 7


# ---- batching ------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(1, 6))
def test_balanced_partition_is_a_partition(weights: list[int], k: int) -> None:
    bins = balanced_partition(weights, k)
    assert len(bins) == k
    assert sorted(i for b in bins for i in b) == list(range(len(weights)))
    sums = [sum(weights[i] for i in b) for b in bins]
    assert max(sums) - min(sums) <= max(weights)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=20), st.integers(40, 120))
def test_token_budget_micro_batches_fit(lengths: list[int], budget: int) -> None:
    width = max(lengths)
    attn = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).long()
    batch = SequenceBatch(torch.zeros_like(attn), attn, attn.float())
    parts = micro_batch_indices(batch, max_tokens=budget)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= budget for p in parts)


def test_pack_unpack_round_trip() -> None:
    attn = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    packed = pack(SequenceBatch(ids, attn, attn.float()), multiple_of=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2]]
    # value at p concerns token p + 1: use the next token id as the value
    nxt = torch.roll(packed.input_ids[0], -1).float()
    out = unpack_next_token(nxt, packed, (3, 4))
    assert out.tolist() == [[0, 6, 7, 0], [0, 9, 0, 0], [0, 2, 3, 4]]


# ---- groups -> batch -----------------------------------------------------------------------------


def test_groups_to_batch_aligns_tokens_and_logprobs() -> None:
    g = make_group("a", [1.0, 0.0], prompt=(3, 4, 5), response_len=3)
    g.responses[0].logprobs[:] = [-0.1, -0.2, -0.3]
    groups = [g, make_group("b", [0.5, 0.5], seed=1)]
    b = groups_to_batch(groups, pad_token_id=0)
    assert b.num_seqs == 4
    assert b.input_ids[0, :6].tolist() == [3, 4, 5, *g.responses[0].token_ids]
    assert b.response_mask[0].tolist()[:7] == [0, 0, 0, 1, 1, 1, 0]
    assert b.tensors["rollout_logprobs"][0, 3:6].tolist() == pytest.approx([-0.1, -0.2, -0.3])
    assert b.seq_tensors["group_index"].tolist() == [0, 0, 1, 1]
    assert b.seq_tensors["reward"].tolist() == [1.0, 0.0, 0.5, 0.5]
    assert dynamic_sampling_values(b.seq_tensors, "acc").tolist() == [1.0, 0.0, 1.0, 1.0]
    assert dynamic_sampling_values(b.seq_tensors, "score").tolist() == [1.0, 0.0, 0.5, 0.5]
    light = sequence_tensors(groups)  # what the DAPO filter builds for a fetch: no token tensors
    assert light.keys() == b.seq_tensors.keys()
    assert all(torch.equal(light[k], b.seq_tensors[k]) for k in light)


def test_groups_to_batch_rejects_mismatched_logprobs() -> None:
    g = make_group("a", [1.0])
    del g.responses[0].logprobs[-1]
    with pytest.raises(InvalidArgument, match=r"responses\[0\]\.logprobs"):
        groups_to_batch([g], 0)


# ---- publisher -----------------------------------------------------------------------------------


def test_in_process_publisher_checksums_retains_and_notifies() -> None:
    seen: list[int] = []

    async def consumer(v: PublishedVersion) -> None:
        seen.append(v.version)

    pub = InProcessPublisher(retain_versions=2)
    pub.subscribe(consumer)

    async def go() -> list[str]:
        sums = []
        for v in (1, 2, 3):
            buckets = [[("a", torch.full((2, 2), float(v)))], [("b", torch.zeros(3))]]
            sums.append((await pub.publish(v, buckets)).manifest_checksum)
        with pytest.raises(FailedPrecondition):
            await pub.publish(3, [])
        return sums

    sums = asyncio.run(go())
    assert len(set(sums)) == 3 and seen == [1, 2, 3] and pub.versions == [2, 3]
    assert torch.equal(pub.get(3).weights["a"], torch.full((2, 2), 3.0)) and pub.get(3).ref.total_bytes == 28
    with pytest.raises(NotFound):
        pub.get(1)
    with pytest.raises(ConfigError, match=r"trainer_service\.publisher"):
        build_publisher("carrier_pigeon")
    assert isinstance(build_publisher("in_process"), InProcessPublisher)


# ---- checkpoints ---------------------------------------------------------------------------------


def test_checkpoint_dirs_newest_and_rotation(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    assert checkpoints.newest(root) is None
    for step in (1, 2, 3):
        checkpoints.begin(root, step)
        checkpoints.commit(root, step, checkpoints.LoopState(step, step, step * 2))
    checkpoints.begin(root, 4)  # crashed mid-save
    assert checkpoints.newest(root) == root / "global_step_3"
    assert checkpoints.read_state(root / "global_step_3") == checkpoints.LoopState(3, 3, 6)
    removed = checkpoints.rotate(root, 2)
    assert [p.name for p in removed] == ["global_step_1"]
    assert json.loads((root / "global_step_2" / checkpoints.STATE_FILE).read_text())["policy_version"] == 2
    with pytest.raises(NotFound, match="resume_from_path"):
        checkpoints.read_state(root / "global_step_4.partial")


def test_a_checkpoint_saved_again_is_never_gone_while_its_replacement_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving step 3 again (a rolled-back trainer reaching it anew): the old one was deleted
    before the new one was renamed in, so a crash between left no step 3 at all, while the
    coordinator had consumed its groups. Now the old one is moved aside and put back by newest()."""
    root = tmp_path / "ckpt"
    checkpoints.begin(root, 3)
    checkpoints.commit(root, 3, checkpoints.LoopState(3, 3, 6))
    checkpoints.begin(root, 3)
    real = Path.rename

    def dies_at_the_partial(self: Path, target: Path) -> Path:
        if self.name.endswith(".partial"):
            raise OSError("killed")
        return real(self, target)

    monkeypatch.setattr(Path, "rename", dies_at_the_partial)
    with pytest.raises(OSError, match="killed"):
        checkpoints.commit(root, 3, checkpoints.LoopState(3, 4, 6))
    monkeypatch.setattr(Path, "rename", real)
    assert checkpoints.newest(root) == root / "global_step_3"
    assert checkpoints.read_state(root / "global_step_3") == checkpoints.LoopState(3, 3, 6)
    checkpoints.begin(root, 3)
    checkpoints.commit(root, 3, checkpoints.LoopState(3, 4, 6))  # and a whole save replaces it
    assert checkpoints.read_state(checkpoints.newest(root)) == checkpoints.LoopState(3, 4, 6)  # type: ignore[arg-type]
    assert sorted(p.name for p in root.iterdir()) == ["global_step_3"]


def test_loop_settings_follow_the_config(tmp_path: Path) -> None:
    cfg = load_config(None, [
        "actor_rollout_ref.actor.ppo_mini_batch_size=3", "async_training.trigger_parameter_sync_step=2",
        "algorithm.rollout_correction.bypass_mode=false", "actor_rollout_ref.rollout.temperature=0.7",
        "trainer.save_freq=5", "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=16",
        "trainer_service.trainer_id=tx",
    ])
    s = loop_settings(cfg.trainer_service, tmp_path, 100, pad_id=0, vocab_size=None)
    assert (s.groups_per_step, s.trigger_parameter_sync_step, s.temperature, s.bypass_mode) == (3, 2, 0.7, False)
    assert (s.save_freq, s.bucket_bytes, s.trainer_id) == (5, 16 << 20, "tx")
    assert s.checkpoint_dir == tmp_path / "checkpoints" and s.metrics_path == tmp_path / "metrics" / "trainer.jsonl"


def test_check_batch_refuses_out_of_vocabulary_ids_and_non_finite_logprobs() -> None:
    import math

    import pytest

    from meshrl.v1 import common_pb2
    from services.common.errors import InvalidArgument
    from services.trainer.convert import check_batch, groups_to_batch

    def group(tokens: list[int], logprobs: list[float]) -> common_pb2.TrajectoryGroup:
        g = common_pb2.TrajectoryGroup(lease_id="l", prompt_token_ids=[1, 2])
        g.responses.add(token_ids=tokens, logprobs=logprobs, versions=[0] * len(tokens))
        return g

    check_batch(groups_to_batch([group([3, 4], [-0.1, -0.2])], pad_token_id=0), vocab_size=10)
    with pytest.raises(InvalidArgument, match="vocabulary"):
        check_batch(groups_to_batch([group([3, 12], [-0.1, -0.2])], pad_token_id=0), vocab_size=10)
    with pytest.raises(InvalidArgument, match="logprob"):
        check_batch(groups_to_batch([group([3, 4], [-0.1, math.nan])], pad_token_id=0), vocab_size=10)
    # Padding is not a token: a pad id at or above the vocabulary does not trip the check.
    check_batch(groups_to_batch([group([3], [-0.1]), group([3, 4], [-0.1, -0.2])], pad_token_id=99), vocab_size=10)


def test_a_collective_senders_announce_waits_out_a_coordinator_being_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The collective sender's announce (CommitVersion before the broadcast) met one UNAVAILABLE
    (the coordinator's replica replaced by Serve) and failed the trainer's loop; the README
    promises the trainer waits for a restarted coordinator. Retried like the loop's own commits;
    a non-transient refusal still fails at once."""
    from meshrl.v1 import common_pb2, coordinator_pb2
    from services.common import retry
    from services.common.errors import Unavailable
    from services.trainer.factory import version_announcer

    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(retry.asyncio, "sleep", no_sleep)

    class _Coordinator:
        def __init__(self, errors: list[Exception]) -> None:
            self.errors, self.calls = errors, 0

        async def commit_version(self, trainer_id: str, ref: common_pb2.WeightsRef) -> coordinator_pb2.CommitVersionResponse:
            self.calls += 1
            if self.errors:
                raise self.errors.pop(0)
            return coordinator_pb2.CommitVersionResponse(policy_version=ref.policy_version, stopping=ref.policy_version > 2)

    ref = common_pb2.WeightsRef(policy_version=2)
    restarting = _Coordinator([Unavailable("the coordinator is being replaced"), Unavailable("still")])
    assert asyncio.run(version_announcer(restarting, "t0", wait_s=60)(ref)) is True and restarting.calls == 3
    stopping = _Coordinator([])
    assert asyncio.run(version_announcer(stopping, "t0", wait_s=60)(common_pb2.WeightsRef(policy_version=3))) is False
    refused = _Coordinator([FailedPrecondition("version 2 is older than the committed 5")])
    with pytest.raises(FailedPrecondition):
        asyncio.run(version_announcer(refused, "t0", wait_s=60)(ref))
    assert refused.calls == 1
