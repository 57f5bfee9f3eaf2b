"""Generates the Python stubs in stagemesh/v1/ from protos/, the single source of truth.

Run `python -m stagemesh.protos` (or `make protos`) after editing a .proto file;
tests/test_protos.py fails while the committed stubs are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted((PROTO_DIR / "stagemesh" / "v1").glob("*.proto"))


def generate(out_dir: Path) -> list[Path]:
    """Writes *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_dir/stagemesh/v1/."""
    import grpc_tools

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_DIR)) for p in proto_files()],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return sorted((out_dir / "stagemesh" / "v1").glob("*_pb2*.py*"))


if __name__ == "__main__":
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written))
    sys.exit(0)
