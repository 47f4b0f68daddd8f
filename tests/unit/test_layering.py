"""The layering of services/, read from the source with `ast` (nothing is imported):

- services/common imports no service (it is the ground floor; the config tree included);
- the coordinator reaches no torch, no engine and no weight transport, directly or through what
  it imports at module level;
- the trainer and the rollout reach weights only through services/weights (never the param
  server's modules), and services/weights imports no service;
- there is one bucket type and one copy of each weight protocol;
- the trainer loop's settings are built from the trainer service's own section alone.

An import inside a function (a lazy import) counts for the module that makes it, not for the
modules that import that one; an import under `if TYPE_CHECKING:` does not count.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ROOT / "services"
_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> set[str]:
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, base] if base else package)
    # `from pkg import name` may import the submodule pkg.name: count both
    return {base} | {f"{base}.{alias.name}" for alias in node.names}


@cache
def imports(path: Path) -> tuple[frozenset[str], frozenset[str]]:
    """(module-level imports, imports inside functions) of one file."""
    module, is_package = _module(path), path.name == "__init__.py"
    eager: set[str] = set()
    lazy: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child, in_function)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            (lazy if in_function else eager).update(_imported(node, module, is_package))
        for child in ast.iter_child_nodes(node):
            visit(child, in_function or isinstance(node, _FUNCTIONS))

    visit(ast.parse(path.read_text(), str(path)), False)
    return frozenset(eager), frozenset(lazy)


def _file_of(module: str) -> Path | None:
    base = ROOT.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _files(package: Path) -> list[Path]:
    return sorted(package.rglob("*.py"))


def reached(start: list[Path]) -> dict[str, str]:
    """Every module the files in `start` import (their lazy imports too), and what those import
    at module level, transitively within this repository: {module: the file that imports it}."""
    seen: dict[str, str] = {}
    todo: list[tuple[str, Path, bool]] = [(_module(p), p, True) for p in start]
    done: set[Path] = set()
    while todo:
        _, path, with_lazy = todo.pop()
        if path in done:
            continue
        done.add(path)
        eager, lazy = imports(path)
        for name in sorted(eager | (lazy if with_lazy else frozenset())):
            seen.setdefault(name, str(path.relative_to(ROOT)))
            target = _file_of(name)
            if target is not None:
                todo.append((name, target, False))
    return seen


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_common_imports_no_service() -> None:
    bad = {
        f"{path.relative_to(ROOT)} -> {name}"
        for path in _files(SERVICES / "common")
        for name in imports(path)[0] | imports(path)[1]
        if _under(name, "services") and name != "services" and not _under(name, "services.common")
    }
    assert not bad, f"services/common must not import a service: {sorted(bad)}"


def test_coordinator_reaches_no_torch_engine_or_transport() -> None:
    seen = reached(_files(SERVICES / "coordinator"))
    bad = {
        f"{name} (imported by {by})"
        for name, by in seen.items()
        if _under(name, "torch", "services.weights", "services.param_server")
        or ".engines" in f".{name}." or name.endswith(".engines")
    }
    assert not bad, f"the coordinator must not load torch, an engine or a weight transport: {sorted(bad)}"


def test_trainer_and_rollout_reach_weights_only_through_the_weights_package() -> None:
    bad = {
        f"{path.relative_to(ROOT)} -> {name}"
        for package in ("trainer", "rollout")
        for path in _files(SERVICES / package)
        for name in imports(path)[0] | imports(path)[1]
        if _under(name, "services.param_server")
    }
    assert not bad, f"use services.weights (the param server keeps only its store and servicer): {sorted(bad)}"


def test_weights_package_imports_no_service() -> None:
    bad = {
        f"{path.relative_to(ROOT)} -> {name}"
        for path in _files(SERVICES / "weights")
        for name in imports(path)[0] | imports(path)[1]
        if _under(name, "services") and name != "services" and not _under(name, "services.common", "services.weights")
    }
    assert not bad, f"services/weights is shared by producers and consumers; it imports no service: {sorted(bad)}"


def _definitions(names: set[str]) -> list[str]:
    found = []
    for path in _files(SERVICES):
        for node in ast.parse(path.read_text(), str(path)).body:
            if isinstance(node, ast.ClassDef) and node.name in names:
                found.append(f"{path.relative_to(ROOT)}:{node.name}")
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            elif type(node).__name__ == "TypeAlias":  # `type Bucket = ...` (Python 3.12+)
                targets = [node.name]  # type: ignore[attr-defined]
            found += [f"{path.relative_to(ROOT)}:{t.id}" for t in targets if isinstance(t, ast.Name) and t.id in names]
    return found


def test_one_bucket_type_and_one_copy_of_each_weight_protocol() -> None:
    protocols = "services/weights/protocols.py"
    found = _definitions({"Bucket", "Buckets", "WeightBuckets", "WeightPublisher", "WeightFetcher"})
    assert sorted(found) == sorted(
        f"{protocols}:{name}" for name in ("Bucket", "Buckets", "WeightPublisher", "WeightFetcher")
    ), found


def test_trainer_loop_settings_read_only_the_trainer_service_section() -> None:
    """`loop_settings` (and the factory helpers it calls) take `trainer_service` (its `loop` filled
    from verl's keys at load) and run-time values, never the whole MeshConfig."""
    functions = {
        node.name: node
        for node in ast.parse((SERVICES / "trainer" / "factory.py").read_text()).body
        if isinstance(node, ast.FunctionDef)
    }
    fn = functions["loop_settings"]
    called = {n.func.id for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    helpers = [functions[name] for name in sorted(called & set(functions))]
    assert [h.name for h in helpers] == ["checkpoint_dir"], "update this test with the helpers loop_settings calls"
    params = {f"{f.name}({a.arg})": ast.unparse(a.annotation) for f in [fn, *helpers] for a in f.args.args if a.annotation}
    assert params["loop_settings(ts)"] == "TrainerServiceConfig"
    assert not {k: v for k, v in params.items() if "MeshConfig" in v}, params
    names = {n.id for f in [fn, *helpers] for n in ast.walk(f) if isinstance(n, ast.Name)}
    assert not names & {"cfg", "MeshConfig", "derive"}, names


def test_the_import_reader_sees_what_it_checks() -> None:
    """The checks above would pass vacuously if the reader missed imports: spot-check it."""
    eager, lazy = imports(SERVICES / "trainer" / "factory.py")
    assert "services.weights.transports.make_publisher" in lazy and "services.weights" in eager
    assert "services.common.config.param_server" in imports(SERVICES / "weights" / "transports" / "__init__.py")[0]
    seen = reached([SERVICES / "rollout" / "engines" / "transformers_engine.py"])
    assert "torch" in seen and "services.weights.protocols" in seen
