"""Adapter-only versions over every transport (`meshrl bench weights --model`, at the 0.8M size):
grpc, object_store (Ray Serve), disk and gloo carry the descriptor and the adapter byte for byte,
and the manifest each registers says which base the adapter applies to."""

from __future__ import annotations

import json

import pytest

from meshrl.cli import main

pytestmark = pytest.mark.integration


def test_every_transport_carries_an_adapter_version(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "weights_lora.json"
    assert main(["bench", "weights", "--model", "qwen3", "--lora-rank", "8", "--rounds", "0", "--bucket-mb", "1",
                 "--transports", "grpc,object_store,disk,gloo", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["versions"]["lora_r8"]["bytes"] * 5 < r["versions"]["full"]["bytes"]
    for name in ("grpc", "object_store", "disk", "gloo"):
        case = r["transports"][name]
        assert "error" not in case, (name, case)
        for kind in ("full", "lora_r8"):
            assert case[kind]["verified"] is True, (name, kind)
        assert case["lora_r8"]["manifest_adapter_base"].startswith("tiny-qwen3:"), (name, case["lora_r8"])
        assert "manifest_adapter_base" not in case["full"], name
