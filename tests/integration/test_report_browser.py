"""report.html in a real headless Chromium (Debian's package): the page loads from the one file,
every plot decodes (naturalWidth > 0), the tables are there. Talks to the browser over the
DevTools protocol on loopback (websockets, a dependency of Ray Serve's stack)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from meshrl.report import write_report
from tests.report_fixtures import make_run_dir

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0"]


class Page:
    """One page target over the DevTools protocol (Runtime.evaluate only)."""

    def __init__(self, ws: Any) -> None:
        self._ws = ws
        self._id = 0

    def evaluate(self, expression: str) -> Any:
        self._id += 1
        self._ws.send(json.dumps({"id": self._id, "method": "Runtime.evaluate",
                                  "params": {"expression": expression, "returnByValue": True}}))
        while True:
            msg = json.loads(self._ws.recv(timeout=30))
            if msg.get("id") == self._id:
                result = msg["result"]
                assert "exceptionDetails" not in result, result
                return result["result"].get("value")


def _devtools_port(profile: Path, proc: subprocess.Popen[bytes], deadline: float) -> int:
    marker = profile / "DevToolsActivePort"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"chromium exited with {proc.returncode}")
        if marker.exists() and marker.read_text().strip():
            return int(marker.read_text().split()[0])
        time.sleep(0.1)
    raise AssertionError("chromium did not open its DevTools port within 60 s")


@pytest.mark.skipif(CHROMIUM is None, reason="needs Debian's chromium (apt-get install -y chromium; .ci/run installs it)")
def test_report_renders_in_chromium_with_every_plot_loaded(tmp_path: Path) -> None:
    a = make_run_dir(tmp_path / "async", agent=True)
    b = make_run_dir(tmp_path / "sync", mode="sync", steps=30)
    report = write_report([a, b], tmp_path / "out")
    assert not (tmp_path / "out" / "plots").exists()  # nothing beside the one file
    profile = tmp_path / "profile"
    assert CHROMIUM is not None
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", report.resolve().as_uri()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        port = _devtools_port(profile, proc, deadline)
        page_ws = None
        while page_ws is None and time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                targets = json.load(resp)
            page_ws = next((t["webSocketDebuggerUrl"] for t in targets
                            if t.get("type") == "page" and t.get("url", "").endswith("report.html")), None)
            if page_ws is None:
                time.sleep(0.2)
        assert page_ws, "no page target for report.html"
        from websockets.sync.client import connect

        with connect(page_ws, max_size=None, open_timeout=30) as ws:
            page = Page(ws)
            # The target may still show its first blank document, already "complete".
            while not page.evaluate("location.href.endsWith('report.html') && document.readyState === 'complete'"):
                assert time.monotonic() < deadline, "report.html did not finish loading"
                time.sleep(0.2)
            images = page.evaluate(
                "Array.from(document.images).map(i => ({alt: i.alt, complete: i.complete, w: i.naturalWidth,"
                " h: i.naturalHeight, data: i.src.startsWith('data:image/png;base64,')}))")
            text = page.evaluate("document.body.innerText")
            tables = page.evaluate("document.querySelectorAll('table').length")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert len(images) >= 12, images  # reward, tokens/s, idle, sync, staleness, val, val per source, agent
    broken = [i for i in images if not (i["complete"] and i["w"] > 0 and i["h"] > 0 and i["data"])]
    assert not broken, broken
    for expected in ("Validation per data source", "openai/gsm8k", "meshrl/addition", "mean@1",
                     "Balanced: every prompt issued", "groups at staleness 1", "trainer idle ratio",
                     "Agent metrics", "agent/num_turns/mean", "Key config", "Qwen/Qwen3-8B"):
        assert expected in text, expected
    assert tables >= 10
