"""The committed stubs in pdserve/v1 must be exactly what `make protos` generates from protos/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos" / "pdserve" / "v1"
STUB_DIR = ROOT / "pdserve" / "v1"
STUB_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _generate(out: Path) -> None:
    """Run the same protoc command as the Makefile's `protos` target, writing under `out`."""
    protos = sorted(str(p.relative_to(ROOT)) for p in PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files under {PROTO_DIR}"
    cmd = [sys.executable, "-m", "grpc_tools.protoc", "-Iprotos",
           f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *protos]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)


def _stubs(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.endswith(STUB_SUFFIXES)}


def test_committed_stubs_match_protos(tmp_path: Path) -> None:
    _generate(tmp_path)
    fresh_dir = tmp_path / "pdserve" / "v1"
    fresh, committed = _stubs(fresh_dir), _stubs(STUB_DIR)
    missing = sorted(fresh - committed)
    stale = sorted(committed - fresh)
    assert not missing, f"generated stubs missing from pdserve/v1: {missing}; run `make protos`"
    assert not stale, f"stubs in pdserve/v1 without a .proto: {stale}; delete them and run `make protos`"
    for name in sorted(fresh):
        if (fresh_dir / name).read_bytes() != (STUB_DIR / name).read_bytes():
            raise AssertionError(f"pdserve/v1/{name} differs from protos/; run `make protos`")


def test_stubs_import() -> None:
    from pdserve.v1 import gateway_pb2_grpc, kvstore_pb2_grpc, worker_pb2_grpc  # noqa: F401
    from pdserve.v1.common_pb2 import SamplingParams

    params = SamplingParams()
    assert not params.HasField("max_tokens")  # optional: "unset" is visible so defaults apply
