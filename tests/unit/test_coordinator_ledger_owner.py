"""One coordinator process per ledger file.

Two coordinators on one ledger each rebuild their state from it once and then write their own over
the other's: both lease the same prompt positions, and each save of the run state rolls back the
other's cursor and counts (a sweep that set one coordinator.ledger_path for every run, a second
`meshrl train --resume` of a run still going, a Serve replacement replica while the old one still
runs its sweeper)."""

from __future__ import annotations

import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.errors import FailedPrecondition
from services.coordinator import ledger as ledger_mod

from .coord_helpers import make_core

REPO = Path(__file__).resolve().parents[2]
HOLD = "import sys\nfrom services.coordinator.ledger import Ledger\nL = Ledger(sys.argv[1])\nprint('open', flush=True)\nsys.stdin.read()\n"


def _holder(db: Path) -> subprocess.Popen[bytes]:
    """Another process (another coordinator) holding the ledger open until its stdin closes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(db)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stdout.readline() == b"open\n"
    return proc


def test_a_second_coordinator_process_on_the_same_ledger_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    db = tmp_path / "ledger.sqlite"
    make_core(db).ledger.close()
    monkeypatch.setattr(ledger_mod, "OWNER_WAIT_S", 0.3, raising=False)
    holder = _holder(db)
    try:
        with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} is in use by another coordinator \(pid {holder.pid} "):
            second = make_core(db)
            # what followed before: both lease the same prompts
            print("second coordinator leased", [lease.seq for lease in second.lease("r", 2, 0.0).leases])
    finally:
        holder.kill()
        holder.wait()
    # A coordinator that died (kill -9: a crashed replica) leaves the ledger to the next one at once.
    core = make_core(db)
    assert [lease.seq for lease in core.lease("r", 2, 0.0).leases] == [0, 1]
    core.ledger.close()


def test_a_coordinator_waits_for_the_one_it_replaces_to_let_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve starts a replacement replica while the old one shuts down: the new one waits."""
    db = tmp_path / "ledger.sqlite"
    monkeypatch.setattr(ledger_mod, "OWNER_WAIT_S", 30.0, raising=False)
    holder = _holder(db)
    assert holder.stdin is not None
    holder.stdin.close()  # it exits now, while the next one waits for the ledger
    core = make_core(db)
    assert holder.wait(timeout=30) == 0
    assert core.ledger.path == str(db)
    core.ledger.close()
    # in one process, opening the file again (a test's reopen) shares the one lock
    a, b = make_core(db), make_core(db)
    a.ledger.close()
    b.ledger.close()


# ---- what the file holds --------------------------------------------------------------------


def test_a_file_that_is_not_a_ledger_is_refused_naming_it(tmp_path: Path) -> None:
    """coordinator.ledger_path set to the wrong file: a file that is no SQLite database failed with
    sqlite3's 'file is not a database' (no path, no fix); another program's SQLite database got
    the ledger's tables written into it and a fresh run started on it."""
    garbage = tmp_path / "model.safetensors"
    garbage.write_bytes(b"\x00not a database" * 512)
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(garbage))} .*coordinator\.ledger_path"):
        make_core(garbage)
    other = tmp_path / "other.db"
    conn = sqlite3.connect(other)
    conn.execute("CREATE TABLE runs (name TEXT)")
    conn.commit()
    conn.close()
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(other))} is not a meshrl ledger"):
        make_core(other)
    conn = sqlite3.connect(other)
    assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["runs"], "tables written into it"
    conn.close()


def test_a_ledger_of_a_newer_schema_is_refused_and_one_from_before_versions_opens(tmp_path: Path) -> None:
    db = tmp_path / "ledger.sqlite"
    core = make_core(db)
    core.lease("r", 2, 0.0)
    core.ledger.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == ledger_mod.SCHEMA_VERSION
    conn.execute(f"PRAGMA user_version = {ledger_mod.SCHEMA_VERSION + 1}")
    conn.close()
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} was written by a newer meshrl"):
        make_core(db)
    # a ledger from before the schema version was kept (user_version 0) is this schema: it continues
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA user_version = 0")
    conn.close()
    again = make_core(db)
    assert again.in_flight == 2 and [lease.seq for lease in again.lease("r", 1, 1.0).leases] == [2]
    again.ledger.close()


@pytest.mark.parametrize("where", ["run_state", "totals"])
def test_a_ledger_whose_run_state_holds_fields_this_meshrl_lacks_is_refused_by_name(tmp_path: Path, where: str) -> None:
    # A newer meshrl that keeps one more run-state field (the JSON row, not the tables: the schema
    # version stays) was a bare TypeError from _State(**d) at a restart: no file, no way out.
    db = tmp_path / "ledger.sqlite"
    core = make_core(db)
    core.lease("r", 2, 0.0)
    state = core._state.to_json()
    (state["totals"] if where == "totals" else state)["added_later"] = 1
    with core.ledger.transaction():
        core.ledger.save_state(state)
    core.ledger.close()
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} was written by a newer meshrl.*added_later.*coordinator.ledger_path"):
        make_core(db)
    conn = sqlite3.connect(db)  # refused without a write: the newer meshrl continues on it
    assert "added_later" in conn.execute("SELECT json FROM run_state").fetchone()[0]
    conn.close()


# ---- the file under a running coordinator ----------------------------------------------------


@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_ledger_deleted_or_replaced_under_a_running_coordinator_fails_loudly(tmp_path: Path, how: str) -> None:
    """An operator's cleanup, a restored backup or a remounted volume: SQLite (WAL) went on writing
    to the file it had open, gone from coordinator.ledger_path or no longer the one there, and the
    health check went on reading it. Every RPC was acknowledged while a restart would read another
    ledger (or none: a fresh run from prompt 0). Now the health check and every write fail naming
    the path, and the refused write changes nothing."""
    db = tmp_path / "ledger.sqlite"
    core = make_core(db)
    core.lease("r", 1, 0.0)
    core.ledger.check_readable()
    if how == "deleted":
        db.unlink()
    else:
        other = tmp_path / "restored.sqlite"
        make_core(other).ledger.close()
        os.replace(other, db)
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} .*coordinator\.ledger_path"):
        core.ledger.check_readable()
    state = core._state.to_json()
    with pytest.raises(FailedPrecondition, match=r"coordinator\.ledger_path"):
        core.lease("r", 1, 0.0)
    assert core.in_flight == 1 and core._state.to_json() == state
    core.ledger.close()


# ---- a run continued on a ledger that is not there -------------------------------------------


@pytest.mark.parametrize("lost", ["missing", "empty file", "no run state"])
def test_a_run_continued_on_a_lost_ledger_is_refused_before_anything_is_written(tmp_path: Path, lost: str) -> None:
    """`meshrl train --resume` with the ledger deleted or coordinator.ledger_path pointing where it
    no longer is (a remounted volume): the coordinator created a fresh ledger and leased from
    prompt 0 beside the trainer's checkpoint of the old run; the loss showed, if ever, as a
    ResumeTrainer or CommitVersion refused later. Continuing refuses at start, writing nothing;
    a new run still creates its ledger."""
    from services.common.config import load_config
    from services.coordinator.factory import build_core

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(8)))
    cfg = load_config(None, [f"data.train_files=[{data}]", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    run_dir = tmp_path / "run"
    db = run_dir / "ledger.sqlite"
    if lost == "empty file":
        run_dir.mkdir()
        db.write_bytes(b"")
    elif lost == "no run state":
        ledger_mod.Ledger(db).close()
    def files() -> list[str] | None:  # the lock it takes (an empty side file) aside
        return sorted(p.name for p in run_dir.iterdir() if p.suffix != ".lock") if run_dir.exists() else None

    before = files()
    content = db.read_bytes() if db.exists() else None
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} .*coordinator\.ledger_path.*without --resume"):
        build_core(cfg, run_dir, session="b", resume=True)
    assert files() == before, "files created"
    assert (db.read_bytes() if db.exists() else None) == content, "the file was written"
    # a new run creates it; continuing that run then goes on where it stood
    core = build_core(cfg, tmp_path / "new", session="a")
    core.lease("r", 2, 0.0)
    core.ledger.close()
    again = build_core(cfg, tmp_path / "new", session="b", resume=True)
    assert again.in_flight == 2
    again.ledger.close()


def test_a_replica_serve_restarts_in_its_session_refuses_a_ledger_gone_from_its_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ledger deleted or moved under a running coordinator fails its health check
    (check_readable), and Serve restarts the replica with the same args: that replica created a
    fresh ledger at the path and leased from prompt 0 while the trainer went on at its step. A
    replica of a session that opened its ledger before (Ray's key-value store, which outlives
    replicas) continues that run and refuses; a new session creates its ledger."""
    from ray.experimental import internal_kv

    from services.common.config import load_config
    from services.coordinator import deployment

    kv: dict[tuple[object, object], object] = {}  # Ray's GCS key-value store
    monkeypatch.setattr(internal_kv, "_internal_kv_get", lambda key, *, namespace=None: kv.get((namespace, key)))
    monkeypatch.setattr(internal_kv, "_internal_kv_put",
                        lambda key, value, overwrite=True, *, namespace=None: kv.__setitem__((namespace, key), value))
    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(8)))
    cfg = load_config(None, [f"data.train_files=[{data}]", "actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    run_dir = tmp_path / "run"
    db = run_dir / "ledger.sqlite"
    first = deployment.open_servicer(cfg, str(run_dir), session="s")
    first.core.lease("r", 2, 0.0)
    first.core.ledger.close()
    restarted = deployment.open_servicer(cfg, str(run_dir), session="s")  # the ledger there: it goes on
    assert restarted.core.in_flight == 2
    restarted.core.ledger.close()
    for p in run_dir.glob("ledger.sqlite*"):
        p.unlink()
    with pytest.raises(FailedPrecondition, match=rf"ledger {re.escape(str(db))} does not exist.*coordinator\.ledger_path"):
        deployment.open_servicer(cfg, str(run_dir), session="s")
    assert not db.exists()
    fresh = deployment.open_servicer(cfg, str(run_dir), session="t")  # a new run (session) creates it
    assert fresh.core.in_flight == 0 and db.exists()
    fresh.core.ledger.close()


def test_meshrl_coordinator_serve_resume_refuses_a_ledger_gone_from_its_run_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`meshrl coordinator serve` (the plain gRPC server) had no --resume: restarted on a run
    whose ledger was lost (deleted, a volume not mounted), it created a fresh one and leased from
    prompt 0 beside the trainer's checkpoint. With --resume it continues the run's ledger, and
    refuses one that is not there before writing anything."""
    import asyncio

    from meshrl.cli import main
    from services.common.config import load_config
    from services.coordinator.server import CoordinatorServer

    data = tmp_path / "train.jsonl"
    data.write_text("".join(f'{{"prompt": "{i}+{i}="}}\n' for i in range(8)))
    overrides = [f"data.train_files=[{data}]", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "coordinator.port=0"]
    run_dir = tmp_path / "run"
    assert main(["coordinator", "serve", *overrides, "--run-dir", str(run_dir), "--resume"]) == 2
    assert "ledger" in (err := capsys.readouterr().err) and "does not exist" in err
    assert not (run_dir / "ledger.sqlite").exists() and not (run_dir / "config.resolved.yaml").exists()

    cfg = load_config(None, overrides)

    async def serve(resume: bool) -> int:
        server = CoordinatorServer(cfg, run_dir, resume=resume)
        in_flight = server.servicer.core.in_flight
        if not resume:
            server.servicer.core.lease("r", 2, 0.0)
        server.servicer.core.ledger.close()
        return in_flight

    asyncio.run(serve(resume=False))  # the first start creates the ledger
    assert asyncio.run(serve(resume=True)) == 2  # the restart goes on with its leases
