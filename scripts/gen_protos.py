"""Generate Python stubs (+ mypy stubs) for protos/meshrl/v1 into meshrl/v1/.

    python scripts/gen_protos.py            # regenerate in place
    python scripts/gen_protos.py --out DIR  # generate into DIR (the staleness test compares)

The protoc bundled with grpcio-tools decides the generated code, so the version is pinned in
requirements/cpu.txt (grpcio-tools 1.84: its stubs import on grpcio >= 1.84, the GPU host's).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "meshrl" / "v1").glob("*.proto"))


def generate(out: Path) -> None:
    from grpc_tools import protoc  # dev dependency

    out.mkdir(parents=True, exist_ok=True)
    scripts_dir = Path(sysconfig.get_path("scripts"))
    mypy_plugin = shutil.which("protoc-gen-mypy") or str(scripts_dir / "protoc-gen-mypy")
    mypy_grpc_plugin = shutil.which("protoc-gen-mypy_grpc") or str(scripts_dir / "protoc-gen-mypy_grpc")
    grpc_include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{grpc_include}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--plugin=protoc-gen-mypy={mypy_plugin}",
        f"--plugin=protoc-gen-mypy_grpc={mypy_grpc_plugin}",
        f"--mypy_out={out}",
        f"--mypy_grpc_out={out}",
        *[str(p.relative_to(PROTO_ROOT)) for p in proto_files()],
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args()
    generate(args.out)
    gen_dir = args.out / "meshrl" / "v1"
    (gen_dir / "__init__.py").touch()
    print(f"generated {len(list(gen_dir.glob('*_pb2*.py')))} modules in {gen_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
