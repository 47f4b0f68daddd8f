"""Checkpoint directories of a trainer run.

    <root>/global_step_<S>/            complete checkpoints (engine files + trainer_state.json)
    <root>/global_step_<S>.partial/    being written; renamed when complete, ignored otherwise
    <root>/global_step_<S>.abandoned-<hex>/   past the step a start went back to: kept, ignored
    <root>/resumed_from.json           the resume_from_path a start went back to (and its step)

A checkpoint is complete only once renamed, so a crash mid-save leaves the previous one as the
newest. `trainer_state.json` holds the loop's own state (local step, policy version).

A start that goes back (trainer.resume_mode=resume_path, or disable: to step 0) sets the complete
checkpoints past its step aside: they are another line of training, which neither `newest` (a
restart's resume) nor `rotate` may mix with this one's. resume_path's rollback is done once:
restarts with the same path (Serve restarting a crashed replica) resume from this line's newest
checkpoint past it, never from the path again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from services.common.errors import NotFound

STATE_FILE = "trainer_state.json"
_NAME = re.compile(r"^global_step_(\d+)$")
_REPLACED = re.compile(r"^global_step_(\d+)\.replaced-[0-9a-f]+$")
RESUMED_FROM = "resumed_from.json"


@dataclass(frozen=True)
class LoopState:
    """The trainer loop's part of a checkpoint."""

    step: int
    """Local trainer steps completed (FetchBatch steps)."""
    policy_version: int
    """Policy version the coordinator had committed when the checkpoint was taken."""
    optimizer_steps: int
    """Engine optimizer steps (LR schedule position)."""
    pending_filtered: list[str] = field(default_factory=list)
    """Lease ids dropped by dynamic sampling not yet reported to the coordinator."""


def partial_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}.partial"


def final_dir(root: Path, step: int) -> Path:
    return root / f"global_step_{step}"


def begin(root: Path, step: int) -> Path:
    """A fresh directory to write checkpoint `step` into."""
    tmp = partial_dir(root, step)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit(root: Path, step: int, state: LoopState) -> Path:
    """Write the loop state and make the checkpoint visible (atomic rename), durable first: the
    coordinator consumes the checkpoint's groups once it is reported, so after a power loss it
    must not be a renamed directory of truncated files. A checkpoint of the same step already
    there is replaced only once the new one is in place (moved aside, never deleted first)."""
    tmp = partial_dir(root, step)
    (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2))
    _fsync_tree(tmp)
    final = final_dir(root, step)
    old = None
    if final.exists():
        old = root / f"{final.name}.replaced-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    tmp.rename(final)
    _fsync_dir(root)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _fsync_tree(directory: Path) -> None:
    """Every file under `directory` and every directory's entries on stable storage."""
    for path in sorted(directory.rglob("*"), reverse=True):
        if path.is_file() and not path.is_symlink():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        elif path.is_dir():
            _fsync_dir(path)
    _fsync_dir(directory)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError:  # a filesystem that cannot fsync a directory (some network ones)
        pass
    finally:
        os.close(fd)


def newest(root: Path) -> Path | None:
    """The complete checkpoint with the highest step under root (None if there is none). A
    checkpoint moved aside by a commit that died before its replacement was renamed in is put
    back first."""
    if not root.is_dir():
        return None
    for p in sorted(root.iterdir()):
        m = _REPLACED.match(p.name)
        if m and (p / STATE_FILE).exists() and not final_dir(root, int(m.group(1))).exists():
            p.rename(final_dir(root, int(m.group(1))))
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)) and (p / STATE_FILE).exists()]
    return max(found)[1] if found else None


def read_state(path: Path) -> LoopState:
    f = path / STATE_FILE
    if not f.exists():
        raise NotFound(f"{path} is not a complete trainer checkpoint (no {STATE_FILE}); check trainer.resume_from_path")
    return LoopState(**json.loads(f.read_text()))


def rotate(root: Path, keep: int | None, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` complete checkpoints, never `protect` (the one just
    reported); returns what was deleted."""
    if keep is None or not root.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.match(p.name)))
    doomed = [p for _, p in found[:-keep] if p != protect] if len(found) > keep else []
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def set_aside_after(root: Path, step: int) -> list[Path]:
    """Rename the complete checkpoints past `step` to `<name>.abandoned-<hex>` (see the module
    docstring); returns their new paths."""
    if newest(root) is None:  # (also puts back a checkpoint a dead commit had moved aside)
        return []
    moved = []
    for p in sorted(root.iterdir()):
        m = _NAME.match(p.name)
        if m and int(m.group(1)) > step:
            aside = root / f"{p.name}.abandoned-{uuid.uuid4().hex[:8]}"
            p.rename(aside)
            moved.append(aside)
    if moved:
        _fsync_dir(root)
    return moved


@dataclass(frozen=True)
class ResumedFrom:
    path: str
    """resume_from_path; "" for resume_mode=disable (back to step 0)."""
    step: int
    session: str = ""
    """The run session (one per `meshrl train` or generated serve config) of the start that went back."""


def resumed_from(root: Path) -> ResumedFrom | None:
    """Where a start of this checkpoint directory went back to (resume_path, or disable), if any."""
    f = root / RESUMED_FROM
    try:
        return ResumedFrom(**json.loads(f.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def names_resume_path(recorded: str, path: Path) -> bool:
    """Whether a ResumedFrom's recorded path is `path`. `meshrl train` makes resume_from_path
    absolute (025c251); a run that recorded it relative before and is resumed after gets the
    absolute path, which the bare string comparison took for another one: the trainer went back
    to it again and set aside everything trained since. A relative record matches its tail."""
    if recorded == str(path):
        return True
    rec = Path(recorded)
    if not recorded or rec.is_absolute() or not path.is_absolute() or ".." in rec.parts:
        return False
    return path.parts[-len(rec.parts):] == rec.parts


def record_resumed_from(root: Path, mark: ResumedFrom | None) -> None:
    """Write (or, with None, remove) the mark, atomically."""
    f = root / RESUMED_FROM
    if mark is None:
        f.unlink(missing_ok=True)
        return
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f"{RESUMED_FROM}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.write_text(json.dumps(asdict(mark)))
    os.replace(tmp, f)
    _fsync_dir(root)
