"""Multi-turn trajectories in the trainer: environment tokens (loss_mask 0) are in the sequence the
model reads but carry no gradient and change no metric, under every loss aggregation, both loss
modes, bypass and decoupled corrections (TIS / MIS / rejection), KL and entropy terms, and every
advantage estimator; staleness and lengths count policy tokens."""

from __future__ import annotations

import itertools

import pytest
import torch

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.config.actor_rollout_ref import ActorConfig, PolicyLossConfig
from services.common.config.algorithm import AlgorithmConfig, RolloutCorrectionConfig
from services.common.errors import InvalidArgument
from services.common.tiny import build_tiny_model, build_tokenizer
from services.coordinator.convert import groups_from_request
from services.trainer.algos import (
    AGG_MODES,
    apply_rollout_correction,
    build_loss_fn,
    compute_advantages,
    loss_scale_counts,
)
from services.trainer.convert import agent_metrics, groups_to_batch
from services.trainer.engines.base import ForwardOutput, LossScale, SequenceBatch

PAD = 0
# One trajectory = assistant turn (mask 1), environment block (0), assistant turn (1).
MASKS = [
    [1, 1, 1, 0, 0, 0, 0, 1, 1],
    [1, 1, 0, 0, 0, 1, 1, 1, 1],
    [1, 1, 1, 1, 0, 0, 0, 1, 1],
    [1, 0, 0, 0, 1, 1, 1, 1, 1],
]


def trajectory_group(lease: str, seed: int, versions: tuple[int, int] = (3, 4)) -> common_pb2.TrajectoryGroup:
    g = torch.Generator().manual_seed(seed)
    grp = common_pb2.TrajectoryGroup(lease_id=lease, prompt_token_ids=[7, 8, 9, 10], prompt=common_pb2.Prompt(prompt_seq=seed))
    all_versions: list[int] = []
    for i, mask in enumerate(MASKS):
        ids = torch.randint(10, 90, (len(mask),), generator=g).tolist()
        lps = [float(-torch.rand((), generator=g)) - 0.05 if m else 0.0 for m in mask]
        # The first turn at the older version, the second at the newer one; environment tokens: -1.
        first_env = mask.index(0)
        vers = [(versions[0] if t < first_env else versions[1]) if m else -1 for t, m in enumerate(mask)]
        all_versions += [v for v in vers if v >= 0]
        grp.responses.add(sample_index=i, token_ids=ids, logprobs=lps, versions=vers, loss_mask=mask, reward=float(i % 2),
                          turn_starts=[0, first_env, first_env + mask[first_env:].index(1)], num_turns=2, tool_calls=1)
    grp.min_policy_version, grp.max_policy_version = min(all_versions), max(all_versions)
    return grp


def test_the_coordinator_counts_the_oldest_policy_token() -> None:
    req = coordinator_pb2.SubmitGroupsRequest(replica_id="r", groups=[trajectory_group("L1", 1)])
    (g,) = groups_from_request(req, max_groups=4, max_tokens=64)
    assert (g.min_version, g.max_version) == (3, 4)  # environment tokens' -1 ignored
    bad = coordinator_pb2.SubmitGroupsRequest(replica_id="r", groups=[trajectory_group("L1", 1)])
    del bad.groups[0].responses[2].loss_mask[-1]
    with pytest.raises(InvalidArgument) as err:
        groups_from_request(bad, max_groups=4, max_tokens=64)
    assert err.value.field == "groups[0].responses[2].loss_mask"
    policy_negative = coordinator_pb2.SubmitGroupsRequest(replica_id="r", groups=[trajectory_group("L1", 1)])
    policy_negative.groups[0].responses[0].versions[0] = -1
    with pytest.raises(InvalidArgument, match="negative policy version"):
        groups_from_request(policy_negative, max_groups=4, max_tokens=64)


def test_batch_mask_lengths_and_versions_are_the_policy_tokens() -> None:
    batch = groups_to_batch([trajectory_group("L1", 1), trajectory_group("L2", 2, versions=(5, 5))], PAD)
    p = 4
    for row, mask in enumerate(MASKS):
        assert batch.response_mask[row, p : p + len(mask)].tolist() == [float(m) for m in mask]
        assert batch.response_mask[row, :p].sum() == 0
        env = [p + t for t, m in enumerate(mask) if not m]
        assert batch.tensors["rollout_logprobs"][row, env].abs().sum() == 0
    assert batch.seq_tensors["response_length"].tolist() == [float(sum(m)) for m in MASKS] * 2
    assert batch.seq_tensors["min_version"].tolist() == [3] * 4 + [5] * 4
    m = agent_metrics(batch)
    # verl's num_turns (ToolAgentLoop: user turns + assistant turns + 1), as its num_turns/mean
    # plots it and extra_info.num_turns carries it: 2 assistant turns and 1 environment turn
    assert m["agent/num_turns/mean"] == 4.0 and m["agent/assistant_turns/mean"] == 2.0
    assert m["agent/tool_call_rate"] == 1.0
    assert m["agent/trajectory_length/mean"] == len(MASKS[0])
    assert loss_scale_counts(batch) == (2 * sum(sum(x) for x in MASKS), 8)


def _configs() -> list[tuple[str, ActorConfig, AlgorithmConfig]]:
    out = []
    variants = {
        "bypass": RolloutCorrectionConfig(),
        "bypass_tis_rs": RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="token_k1,seq_max_k2",
                                                 rollout_rs_threshold="1.5,0.3"),
        "bypass_reinforce_seq_is": RolloutCorrectionConfig(loss_type="reinforce", rollout_is="sequence", rollout_is_threshold=2.0),
        "decoupled_mis_rs": RolloutCorrectionConfig(bypass_mode=False, rollout_is="token", rollout_is_threshold=1.5,
                                                    rollout_is_mode="mask", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.5),
        "decoupled_icepop": RolloutCorrectionConfig(bypass_mode=False, rollout_is="token", rollout_is_threshold="0.5_2.0"),
    }
    for (name, rc), mode, loss_mode, kl in itertools.product(variants.items(), AGG_MODES, ("vanilla", "gspo"), ("low_var_kl", "k3+", "kl")):
        if loss_mode == "gspo" and rc.loss_type == "reinforce":
            continue
        actor = ActorConfig(
            loss_agg_mode=mode, loss_scale_factor=9, entropy_coeff=0.01, use_kl_loss=True,  # type: ignore[arg-type]
            kl_loss_coef=0.1, kl_loss_type=kl, clip_ratio_low=0.2, clip_ratio_high=0.28,  # type: ignore[arg-type]
            policy_loss=PolicyLossConfig(loss_mode=loss_mode),  # type: ignore[arg-type]
        )
        out.append((f"{name}-{mode}-{loss_mode}-{kl}", actor, AlgorithmConfig(rollout_correction=rc)))
    return out


CONFIGS = _configs()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    tok = build_tokenizer()
    return build_tiny_model("qwen3", tok, seed=0).float().eval()


def _forward(model: torch.nn.Module, batch: SequenceBatch) -> tuple[torch.Tensor, ForwardOutput]:
    """What the fsdp engine computes: logprobs and entropy at position t for token t, times the mask.
    Returns the logits (a leaf whose .grad the test reads) and the output."""
    with torch.no_grad():
        hidden = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logits = hidden.detach().clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    lp = logp_all.gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    zeros = torch.zeros_like(lp[:, :1])
    mask = batch.response_mask
    return logits, ForwardOutput(torch.cat([zeros, lp], 1) * mask, torch.cat([zeros, ent], 1) * mask)


def _prepare(batch: SequenceBatch, algo: AlgorithmConfig, model: torch.nn.Module) -> dict[str, float]:
    g = torch.Generator().manual_seed(11)
    mask = batch.response_mask
    batch.tensors["advantages"] = compute_advantages(batch, algo) * mask
    rollout = batch.tensors["rollout_logprobs"]
    if algo.rollout_correction.bypass_mode:
        batch.tensors["old_logprobs"] = rollout
    else:
        batch.tensors["old_logprobs"] = (rollout + torch.randn(rollout.shape, generator=g) * 0.2) * mask
    batch.tensors["ref_logprobs"] = (rollout + torch.randn(rollout.shape, generator=g) * 0.3) * mask
    return apply_rollout_correction(batch, algo)


def _garbage_outside(t: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(t.shape, generator=g) * 50 + 7
    return torch.where(mask.bool(), t, noise)


@pytest.mark.parametrize(("name", "actor", "algo"), CONFIGS, ids=[c[0] for c in CONFIGS])
def test_masked_tokens_get_exactly_zero_gradient_and_change_no_metric(
    name: str, actor: ActorConfig, algo: AlgorithmConfig, model: torch.nn.Module
) -> None:
    groups = [trajectory_group("L1", 1), trajectory_group("L2", 2)]
    batch = groups_to_batch(groups, PAD)
    corr = _prepare(batch, algo, model)
    loss_fn = build_loss_fn(actor, algo)
    tokens, seqs = loss_scale_counts(batch)
    scale = LossScale(num_tokens=tokens, num_seqs=seqs, dp_size=1)

    logits, out = _forward(model, batch)
    loss, metrics = loss_fn(out, batch, scale)
    loss.backward()
    assert logits.grad is not None
    # logits at position t-1 produce the distribution of token t: their gradient is zero exactly
    # when token t is not trained (prompt, environment, padding), and not zero for policy tokens.
    target_mask = batch.response_mask[:, 1:]
    grad = logits.grad[:, :-1]
    assert grad[target_mask == 0].abs().max().item() == 0.0, name
    assert grad[target_mask == 1].abs().sum(-1).gt(0).float().mean() > 0.5, name

    # Garbage in every per-token input at masked positions (what the environment tokens' values
    # could be) leaves the loss and every metric bit-identical.
    mask = batch.response_mask
    dirty = SequenceBatch(batch.input_ids, batch.attention_mask, mask,
                          tensors={k: _garbage_outside(v, mask, i) for i, (k, v) in enumerate(sorted(batch.tensors.items()))},
                          seq_tensors=batch.seq_tensors)
    assert out.entropy is not None
    dirty_out = ForwardOutput(_garbage_outside(out.logprobs.detach(), mask, 98), _garbage_outside(out.entropy.detach(), mask, 99))
    loss2, metrics2 = loss_fn(dirty_out, dirty, scale)
    assert loss2.item() == loss.item(), name
    assert metrics2 == metrics, name
    assert all(v == v for v in corr.values()), corr  # no NaN in the correction metrics


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_advantages_ignore_environment_tokens(estimator: str) -> None:
    batch = groups_to_batch([trajectory_group("L1", 1)], PAD)
    algo = AlgorithmConfig(adv_estimator=estimator)  # type: ignore[arg-type]
    adv = compute_advantages(batch, algo)
    assert adv[batch.response_mask == 0].abs().max().item() == 0.0
    # The same trajectories with the environment tokens cut out get the same advantages on the
    # policy tokens (outcome estimators; REINFORCE++ discounts over response tokens only).
    keep = batch.response_mask.bool()
    compact_rows = [torch.cat([batch.input_ids[i, :4], batch.input_ids[i, 4:][keep[i, 4:]]]) for i in range(batch.num_seqs)]
    width = max(len(r) for r in compact_rows)
    compact = SequenceBatch(
        input_ids=torch.stack([torch.nn.functional.pad(r, (0, width - len(r))) for r in compact_rows]),
        attention_mask=torch.ones(batch.num_seqs, width, dtype=torch.long),
        response_mask=torch.stack([torch.nn.functional.pad(torch.cat([torch.zeros(4), torch.ones(len(r) - 4)]), (0, width - len(r)))
                                   for r in compact_rows]),
        seq_tensors=batch.seq_tensors,
    )
    adv_compact = compute_advantages(compact, algo)
    for i in range(batch.num_seqs):
        assert torch.allclose(adv[i][keep[i]], adv_compact[i][compact.response_mask[i].bool()], atol=1e-6)
