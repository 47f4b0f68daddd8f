"""examples/grafana/meshrl.json shows every family the services export and names no other."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.prometheus_families import ALL, scraped_name

pytestmark = pytest.mark.unit

DASHBOARD = Path(__file__).resolve().parents[2] / "examples" / "grafana" / "meshrl.json"


def test_the_dashboard_covers_every_family_and_no_unknown_one() -> None:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    used = {m for e in exprs for m in re.findall(r"\bray_meshrl_[a-z_]+", e)}
    known = {scraped_name(f) for f in ALL}
    reward_endpoints = {"ray_meshrl_reward_endpoint_waiting_items", "ray_meshrl_reward_endpoint_open"}
    assert used - known - reward_endpoints == set(), "the dashboard names families nobody exports"
    assert known - used == set()
    assert reward_endpoints <= used  # exported per external endpoint only
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
