"""Adapter-only versions over every transport (`meshrl bench weights --model`, at the 0.8M size):
grpc, disk and gloo (and, in the slow tier, object_store through Ray Serve) carry the descriptor
and the adapter byte for byte, and the manifest each registers says which base it applies to."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshrl.cli import main

pytestmark = pytest.mark.integration


def _check(tmp_path: Path, transports: tuple[str, ...]) -> None:
    out = tmp_path / "weights_lora.json"
    assert main(["bench", "weights", "--model", "qwen3", "--lora-rank", "8", "--rounds", "0", "--bucket-mb", "1",
                 "--transports", ",".join(transports), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["versions"]["lora_r8"]["bytes"] * 5 < r["versions"]["full"]["bytes"]
    for name in transports:
        case = r["transports"][name]
        assert "error" not in case, (name, case)
        for kind in ("full", "lora_r8"):
            assert case[kind]["verified"] is True, (name, kind)
        assert case["lora_r8"]["manifest_adapter_base"].startswith("tiny-qwen3:"), (name, case["lora_r8"])
        assert "manifest_adapter_base" not in case["full"], name


def test_grpc_disk_and_gloo_carry_an_adapter_version(tmp_path: Path) -> None:
    _check(tmp_path, ("grpc", "disk", "gloo"))


@pytest.mark.slow
def test_object_store_carries_an_adapter_version(tmp_path: Path) -> None:
    _check(tmp_path, ("object_store",))
