"""The committed stubs in stagemesh/v1/ are what protos/ generates today."""

from __future__ import annotations

from pathlib import Path

from stagemesh import protos

STUB_DIR = Path("stagemesh") / "v1"
STALE = "the committed stubs in stagemesh/v1/ are stale: run `make protos` and commit the result"


def committed_stubs() -> dict[Path, bytes]:
    return {STUB_DIR / p.name: p.read_bytes() for p in sorted((protos.ROOT / STUB_DIR).glob("*_pb2*.py*"))}


def test_generated_stubs_equal_the_committed_ones(tmp_path):
    """Regenerating from protos/ changes no byte and adds or drops no file."""
    returned = protos.generate(tmp_path)
    generated = {p.relative_to(tmp_path): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    assert generated, "protoc wrote nothing"
    assert sorted(p.relative_to(tmp_path) for p in returned) == sorted(generated)

    committed = committed_stubs()
    assert sorted(generated) == sorted(committed), f"{STALE} (files differ)"
    stale = [str(path) for path, data in generated.items() if committed[path] != data]
    assert not stale, f"{STALE} (contents differ: {', '.join(stale)})"


def test_every_proto_has_its_stubs():
    """Each protos/stagemesh/v1/*.proto has its _pb2.py, _pb2.pyi and _pb2_grpc.py committed."""
    committed = committed_stubs()
    for proto in protos.proto_files():
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert STUB_DIR / f"{proto.stem}{suffix}" in committed, STALE
