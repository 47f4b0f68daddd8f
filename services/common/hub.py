"""Model paths that are Hugging Face hub ids (`Qwen/Qwen3-8B`) as well as directories.

`resolve_model_path` turns a hub id into the local snapshot directory through huggingface_hub:
its cache (HF_HOME / HF_HUB_CACHE), HF_HUB_OFFLINE honoured (then only the cache is looked at),
and a download of the model's files otherwise. Every service then loads one local directory, so
engines that need files on disk (megatron's checkpoint reader) work the same as those that
would resolve hub ids themselves. Without network and without the model in the cache the error
says so and names the fix.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from services.common.errors import ConfigError
from services.common.logging import get_logger

log = get_logger(__name__)

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
"""`org/name`, as the hub spells repository ids (a bare `name` is taken as a path)."""

# What a model snapshot needs: configs, weights, tokenizer files, chat templates, remote code.
PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja", "*.py", "*.md"]


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_model_path(path: str, *, key: str = "actor_rollout_ref.model.path", revision: str | None = None) -> str:
    """A local directory for `path`: the directory itself, or the hub id's cached (or downloaded)
    snapshot. Raises ConfigError naming `key` when it is neither, or when the hub id is not cached
    and the hub cannot be reached."""
    local = Path(path).expanduser()
    if local.exists():
        return str(local)
    if not HUB_ID.match(path):
        raise ConfigError(f"{key}: {path!r} is neither an existing directory nor a hub id like 'Qwen/Qwen3-8B'")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    cache = os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE
    offline = _offline()
    try:
        resolved = snapshot_download(path, revision=revision, cache_dir=cache, local_files_only=offline,
                                     allow_patterns=PATTERNS)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled) as exc:
        why = "HF_HUB_OFFLINE is set" if offline else "the hub cannot be reached"
        raise ConfigError(
            f"{key}: hub id {path!r} is not in the Hugging Face cache ({cache}) and {why}; download it where "
            f"there is network (`hf download {path}`, then copy the cache or point HF_HOME at it) or give a "
            f"local directory"
        ) from exc
    except HfHubHTTPError as exc:  # includes RepositoryNotFoundError, GatedRepoError
        raise ConfigError(f"{key}: hub id {path!r} could not be fetched: {exc}") from exc
    log.info("model_resolved", key=key, hub_id=path, path=resolved, offline=offline)
    return resolved
