"""What the trainer's start-up relies on: the Serve replica's module and the rank actor's class
load without torch (the ranks are asked for before the replica's own imports), `meshrl train`'s
driver builds every application without torch (it imports them while Ray and Serve start, and
torch would hold its GIL for seconds), the pad id comes
from the checkpoint's config.json without transformers, and ranks of a trainer that failed to
start are taken down in every state."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.common.config import MeshConfig
from services.trainer import factory

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["services.trainer.deployment", "services.trainer.ranks"])
def test_the_modules_a_trainer_spawns_its_ranks_from_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_driver_builds_every_application_without_torch() -> None:
    code = (
        "import sys\n"
        "from meshrl.train import _app_builders\n"
        "from services.common.config import MeshConfig\n"
        "args = {'config': MeshConfig.model_validate({}).model_dump(mode='json'), 'run_dir': 'runs/x', 'session': 's'}\n"
        "names = [name for name, build in _app_builders() if build(args) is not None]\n"
        "print(names, sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['coordinator', 'param_server', 'reward', 'rollout', 'trainer'] []", out.stdout + out.stderr


def _cfg(path: Path) -> MeshConfig:
    return MeshConfig.model_validate({"actor_rollout_ref": {"model": {"path": str(path)}}})


@pytest.mark.parametrize(("fields", "want"), [
    ({"pad_token_id": 7, "eos_token_id": 3}, 7),
    ({"pad_token_id": None, "eos_token_id": [5, 6]}, 5),
    ({"text_config": {"eos_token_id": 11}}, 11),
])
def test_pad_token_id_reads_the_checkpoint_config(tmp_path: Path, fields: dict[str, Any], want: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", **fields}))
    monkeypatch.setitem(sys.modules, "transformers", None)  # any import of it would fail
    assert factory.pad_token_id(_cfg(tmp_path)) == want


class _Ranks:
    def __init__(self) -> None:
        self.killed = 0

    def kill(self) -> None:
        self.killed += 1


class _Group:
    def __init__(self) -> None:
        self.closed = 0

    async def close(self) -> None:
        self.closed += 1


def test_abandon_takes_ranks_down_whether_unstarted_starting_built_or_failed() -> None:
    async def scenario() -> tuple[int, int, bool, int]:
        unstarted = _Ranks()
        await factory._abandon(unstarted, None)  # type: ignore[arg-type]

        killed_on_cancel = _Ranks()

        async def slow_start() -> _Group:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                killed_on_cancel.kill()  # what SpawnedRanks.start does when cancelled
                raise
            return _Group()

        starting = asyncio.ensure_future(slow_start())
        await asyncio.sleep(0)
        await factory._abandon(killed_on_cancel, starting)  # type: ignore[arg-type]

        group = _Group()

        async def built() -> _Group:
            return group

        done = asyncio.ensure_future(built())
        await asyncio.wait([done])
        await factory._abandon(_Ranks(), done)  # type: ignore[arg-type]

        async def failed() -> _Group:
            raise RuntimeError("init_engine failed")

        bad = asyncio.ensure_future(failed())
        await asyncio.wait([bad])
        await factory._abandon(_Ranks(), bad)  # type: ignore[arg-type]  # no raise: start cleaned up
        return unstarted.killed, killed_on_cancel.killed, starting.cancelled(), group.closed

    assert asyncio.run(scenario()) == (1, 1, True, 1)


def test_a_rank_belongs_to_the_first_replica_that_claims_it_until_its_engine_is_built() -> None:
    from services.trainer.ranks import TrainWorker

    w = TrainWorker(0, 1)
    w._prewarm.join()
    assert w.claim("replica-a") and w.claim("replica-a")  # asking again (a retried call) is fine
    assert not w.claim("replica-b")  # a replica replacing a failed one spawns its own
    fresh = TrainWorker(0, 1)
    fresh.engine = object()  # type: ignore[assignment]  # built: no one may claim it
    assert not fresh.claim("replica-a")


class _Method:
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def remote(self, owner: str) -> Any:
        async def call() -> bool:
            if isinstance(self.answer, BaseException):
                raise self.answer
            if self.answer == "hang":
                await asyncio.sleep(3600)
            return bool(self.answer)

        return call()


class _Worker:
    def __init__(self, answer: Any) -> None:
        self.claim = _Method(answer)


@pytest.mark.parametrize(("answers", "claimed"), [
    ([True, True], True),
    ([True, False], False),  # one rank was another replica's
    ([True, RuntimeError("The actor died unexpectedly")], False),
    ([True, "hang"], False),  # never placed within the timeout
])
def test_given_ranks_are_claimed_whole_or_taken_down(answers: list[Any], claimed: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from services.trainer import ranks as ranks_mod

    killed: list[Any] = []
    monkeypatch.setattr(ranks_mod.ray, "kill", killed.append)
    monkeypatch.setattr(ranks_mod, "remove_placement_group", lambda pg: killed.append(pg))
    workers = [_Worker(a) for a in answers]
    given = ranks_mod.SpawnedRanks("cpu", workers, "pg")
    assert asyncio.run(given.claim("replica-a", timeout_s=0.2)) is claimed
    assert killed == ([] if claimed else [*workers, "pg"])


def _heads_cfg(tmp_path: Path, ulysses: int) -> MeshConfig:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 1, "intermediate_size": 64, "vocab_size": 128, "head_dim": 16}))
    return MeshConfig.model_validate({"actor_rollout_ref": {"model": {"path": str(tmp_path)},
                                                            "actor": {"ulysses_sequence_parallel_size": ulysses}}})


def test_rank_zero_checks_the_model_config_and_names_the_fix(tmp_path: Path) -> None:
    from services.common.errors import ConfigError
    from services.trainer.ranks import TrainWorker

    w = TrainWorker(0, 1)
    w.check_model(_heads_cfg(tmp_path, 2).model_dump(mode="json"))  # 2 divides 4 heads and 2 KV heads
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=3 must divide the attention heads"):
        w.check_model(_heads_cfg(tmp_path, 3).model_dump(mode="json"))


def test_a_rejection_on_rank_zero_reaches_the_replica_as_the_check_raised_it(tmp_path: Path) -> None:
    import ray

    from services.common.errors import ConfigError
    from services.trainer import ranks as ranks_mod

    rejection = ConfigError("actor_rollout_ref.actor.ulysses_sequence_parallel_size=3 must divide ...")

    class _Rank0:
        class check_model:  # an actor method: its `.remote`
            @staticmethod
            def remote(config: dict[str, Any]) -> Any:
                assert config["actor_rollout_ref"]["actor"]["ulysses_sequence_parallel_size"] == 3

                async def call() -> None:
                    raise ray.exceptions.RayTaskError("check_model", "Traceback ...", rejection)

                return call()

    async def scenario() -> None:
        await ranks_mod.SpawnedRanks("cpu", [_Rank0()], "pg").check_model(_heads_cfg(tmp_path, 3))

    with pytest.raises(ConfigError) as got:
        asyncio.run(scenario())
    assert got.value is rejection
