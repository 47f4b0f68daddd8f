"""serve.bytecode_cache: when the mesh's processes get a byte-code prefix, and that Python then
compiles a module once into it (services/common/bytecode.py)."""

from __future__ import annotations

import os
import py_compile
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from meshrl.train import resolve_config
from services.common import bytecode
from services.common.config import MeshConfig


@pytest.fixture
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An importable package with sources only (no __pycache__), standing in for torch."""
    root = tmp_path / "site"
    src = root / "fakelib"
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 41 + 1\n")
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setattr(bytecode, "PACKAGES", ("fakelib",))
    monkeypatch.setenv("MESHRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    return src


def test_auto_gives_a_prefix_when_sources_have_no_byte_code_and_writing_is_off(
        pkg: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert not bytecode.writes_bytecode()
    assert bytecode.compiled_in_place("fakelib") is False
    env = bytecode.worker_env("auto", local_ray=True)
    assert env == {"PYTHONPYCACHEPREFIX": str(tmp_path / "cache" / "pycache"), "PYTHONDONTWRITEBYTECODE": ""}
    # A joined cluster's workers live in another environment: auto leaves them alone.
    assert bytecode.worker_env("auto", local_ray=False) == {}


def test_auto_changes_nothing_where_byte_code_is_there_or_will_be(pkg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bytecode, "writes_bytecode", lambda: True)  # whatever this test runner's -B says
    assert bytecode.compiled_in_place("fakelib") is True  # writable, writing on: the first import caches it
    assert bytecode.worker_env("auto", local_ray=True) == {}
    monkeypatch.setattr(bytecode, "writes_bytecode", lambda: False)
    assert bytecode.worker_env("auto", local_ray=True) != {}
    py_compile.compile(str(pkg / "__init__.py"), cfile=str(pkg / "__pycache__" / Path(
        bytecode.importlib.util.cache_from_source(str(pkg / "__init__.py"))).name))
    assert bytecode.compiled_in_place("fakelib") is True  # shipped byte code: a prefix would hide it
    assert bytecode.worker_env("auto", local_ray=True) == {}


def test_auto_respects_a_prefix_already_set_and_missing_packages(pkg: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")
    assert bytecode.worker_env("auto", local_ray=True) == {}
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    monkeypatch.setattr(bytecode, "PACKAGES", ("no_such_package_meshrl",))
    assert bytecode.compiled_in_place("no_such_package_meshrl") is None
    assert bytecode.worker_env("auto", local_ray=True) == {}


def test_off_and_an_explicit_directory(tmp_path: Path) -> None:
    assert bytecode.worker_env("off", local_ray=True) == {}
    assert bytecode.worker_env(str(tmp_path / "bc"), local_ray=False) == {
        "PYTHONPYCACHEPREFIX": str(tmp_path / "bc"), "PYTHONDONTWRITEBYTECODE": ""}
    assert MeshConfig().serve.bytecode_cache == "auto"


def test_the_config_key_takes_off_unquoted_and_makes_a_directory_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # YAML (overrides and config files) reads an unquoted off as False.
    assert resolve_config(None, ["serve.bytecode_cache=off"]).serve.bytecode_cache == "off"
    assert resolve_config(None, ["serve.bytecode_cache=auto"]).serve.bytecode_cache == "auto"
    monkeypatch.chdir(tmp_path)  # each Ray worker has its own working directory: the driver's is kept
    assert resolve_config(None, ["serve.bytecode_cache=pyc"]).serve.bytecode_cache == str(tmp_path / "pyc")
    with pytest.raises(ValidationError, match="bytecode_cache"):
        MeshConfig.model_validate({"serve": {"bytecode_cache": " "}})


def test_a_process_with_that_environment_compiles_once_into_the_prefix(pkg: Path, tmp_path: Path) -> None:
    """The real interpreter: with PYTHONDONTWRITEBYTECODE=1 inherited, the worker environment turns
    writing on (an empty value) and the module's byte code lands under the prefix, not beside it."""
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(pkg.parent)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = "import sys, fakelib; print(fakelib.VALUE, sys.flags.dont_write_bytecode)"
    plain = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert plain.stdout.split() == ["42", "1"]
    prefix = tmp_path / "cache" / "pycache"
    assert not prefix.exists()
    env.update(bytecode.worker_env(str(prefix), local_ray=True))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["42", "0"]
    # The prefix mirrors the source's absolute path (the stdlib's modules land there too).
    compiled = list((prefix / str(pkg).lstrip("/")).glob("__init__*.pyc"))
    assert len(compiled) == 1
    assert not (pkg / "__pycache__").exists()
    stamp = compiled[0].stat().st_mtime_ns
    subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert compiled[0].stat().st_mtime_ns == stamp  # read, not compiled again
