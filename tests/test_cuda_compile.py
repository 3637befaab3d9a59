"""The CUDA kernel sources compile for the H200 (sm_90) with nvcc, and the hot kernels don't spill.

Runs in CI without a GPU: only the compiler is needed. The ptxas report (-Xptxas -v) gives
registers and spills per entry point; spills in the attention kernels and the W8A16 / W4A16
matmul would put their inner loops through local memory, so any spill there fails the test. A second test compiles the
exact text that `cuda_ops` hands to NVRTC at run time (header pasted in, one dtype / head dim
per module), when cupy and libnvrtc are installed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[1] / "pdserve" / "runtime" / "kernels" / "cuda"
SOURCES = sorted(CUDA_DIR.glob("*.cu"))
HOT_PREFIXES = ("paged_decode_attention_", "prefill_attention_", "quant_matmul_")
ARCH = "sm_90"
NVCC = shutil.which("nvcc")

needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: CUDA sources not compiled")


def _compile(src: Path, out_dir: Path) -> subprocess.CompletedProcess[str]:
    cmd = [NVCC, f"-arch={ARCH}", "--cubin", "-std=c++17", "-Xptxas", "-v",
           "-o", str(out_dir / f"{src.stem}.cubin"), str(src)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240)


def parse_ptxas(report: str) -> dict[str, dict[str, int]]:
    """Entry point -> {registers, spill_stores, spill_loads, stack} from an -Xptxas -v report."""
    stats: dict[str, dict[str, int]] = {}
    current = None
    for line in report.splitlines():
        if m := re.search(r"Function properties for (\w+)", line):
            current = stats.setdefault(m.group(1), {})
        elif current is not None and (m := re.search(
                r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            current.update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                           spill_loads=int(m.group(3)))
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
    return stats


@pytest.fixture(scope="module")
def nvcc_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess[str]]:
    """All sources compiled once, two at a time (CI has two cores)."""
    out_dir = tmp_path_factory.mktemp("cubin")
    with ThreadPoolExecutor(max_workers=2) as pool:
        # Largest first so that the two workers finish together.
        order = sorted(SOURCES, key=lambda p: -p.stat().st_size)
        results = dict(zip([p.name for p in order], pool.map(lambda p: _compile(p, out_dir), order)))
    return results


def test_sources_present() -> None:
    names = {p.name for p in SOURCES}
    assert {"paged_attention.cu", "prefill_attention.cu", "cache_ops.cu", "norm_rope_act.cu",
            "quant_matmul.cu"} <= names


@needs_nvcc
@pytest.mark.parametrize("name", [p.name for p in SOURCES])
def test_nvcc_compiles(name: str, nvcc_results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    res = nvcc_results[name]
    assert res.returncode == 0, f"nvcc failed on {name}:\n{res.stdout}\n{res.stderr}"
    assert "warning" not in res.stderr.lower(), f"nvcc warnings on {name}:\n{res.stderr}"
    stats = parse_ptxas(res.stderr)
    assert stats, f"no ptxas report for {name}:\n{res.stderr}"
    for fn, s in sorted(stats.items()):
        print(f"{fn}: {s.get('registers')} registers, {s.get('spill_stores')} B spill stores, "
              f"{s.get('spill_loads')} B spill loads, {s.get('stack')} B stack")


@needs_nvcc
@pytest.mark.parametrize("name", ["paged_attention.cu", "prefill_attention.cu", "quant_matmul.cu"])
def test_hot_kernels_do_not_spill(name: str, nvcc_results: dict[str, subprocess.CompletedProcess[str]]) -> None:
    res = nvcc_results[name]
    assert res.returncode == 0, f"nvcc failed on {name}:\n{res.stdout}\n{res.stderr}"
    stats = parse_ptxas(res.stderr)
    hot = {fn: s for fn, s in stats.items() if fn.startswith(HOT_PREFIXES)}
    assert hot, f"no attention entry points found in {name}:\n{res.stderr}"
    spilling = {fn: s for fn, s in hot.items() if s.get("spill_stores") or s.get("spill_loads")}
    assert not spilling, f"register spills in {name}: {spilling}\n{res.stderr}"
    for fn, s in hot.items():
        assert "spill_stores" in s and "registers" in s, f"incomplete ptxas report for {fn}:\n{res.stderr}"


def _nvrtc():
    """cupy's NVRTC bindings when both cupy and libnvrtc are installed, else None."""
    try:
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415
        nvrtc.getVersion()
    except Exception:  # cupy absent, or libnvrtc not found
        return None
    return nvrtc


@pytest.mark.parametrize(("filename", "dtype", "head_dim"), [
    ("paged_attention.cu", "f16", 128),
    ("paged_attention.cu", "bf16", 160),  # a head dim outside the CI list goes through PDS_HEAD_DIM
    ("prefill_attention.cu", "bf16", 128),
    ("cache_ops.cu", None, None),
    ("norm_rope_act.cu", "f32", None),
    ("quant_matmul.cu", "bf16", None),
])
def test_nvrtc_compiles_runtime_source(filename: str, dtype: str | None, head_dim: int | None) -> None:
    """What cuda_ops compiles at run time (header inlined, filters set) builds under NVRTC."""
    nvrtc = _nvrtc()
    if nvrtc is None:
        pytest.skip("cupy or libnvrtc not installed: NVRTC compile not checked")
    pytest.importorskip("torch")
    try:
        from pdserve.runtime.kernels import cuda_ops  # noqa: PLC0415
    except ImportError as exc:
        pytest.skip(f"cuda_ops not importable: {exc}")
    source = cuda_ops.kernel_source(filename)
    assert '#include "common.cuh"' not in source
    options = (*cuda_ops.compile_options(dtype, head_dim), f"-arch={ARCH}")
    prog = nvrtc.createProgram(source, filename, (), ())
    try:
        nvrtc.compileProgram(prog, options)
    except Exception as exc:
        pytest.fail(f"NVRTC failed on {filename} {options}: {exc}\n{nvrtc.getProgramLog(prog)}")
    finally:
        log = nvrtc.getProgramLog(prog)
        nvrtc.destroyProgram(prog)
    assert "warning" not in log.lower(), log
