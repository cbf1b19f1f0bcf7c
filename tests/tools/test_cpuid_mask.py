"""The CPUID mask of ``tools/bench/cpuid_mask.c`` (the cpu_models_avx2 benchmark's AVX2 path): built with
the system C compiler, loaded with LD_PRELOAD into a child process, the CPUID instruction there reports
the AVX-512, VNNI and AMX bits clear and every other bit as the CPU has it.

Skipped, with the reason, where it cannot run: not Linux x86-64, no ``cpuid_fault`` flag in
/proc/cpuinfo (many CI runners and hypervisors do not pass CPUID faulting through), no C compiler."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import isa

ROOT = Path(__file__).resolve().parents[2]


def bits(*positions):
    return sum(1 << p for p in positions)


#: What the "avx2" mask clears, per (leaf, subleaf) and register (EAX..EDX), written out from the Intel
#: SDM's CPUID leaf 07H table (independently of the C source's constants).
CLEARED = {
    (7, 0): (0, bits(16, 17, 21, 26, 27, 28, 30, 31), bits(1, 6, 11, 12, 14), bits(2, 3, 8, 22, 23, 24, 25)),
    (7, 1): (bits(4, 5, 21, 23), 0, 0, bits(4, 5, 8, 10, 19)),
}
LEAVES = ((0, 0), (1, 0), (7, 0), (7, 1), (0xD, 0))
PROBE = """
import json, sys
from tools.bench import isa
lib = isa._loaded_library()
regs = {f"{l},{s}": isa.cpuid(lib, l, s) for l, s in %r}
from onnx_qat.placement.cpu_latency import cpuid_flags
print(json.dumps({"regs": regs, "report": isa.report(), "flags": sorted(cpuid_flags() or ())}))
""" % (LEAVES,)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    why = isa.why_unavailable()
    if why:
        pytest.skip(why)
    if isa.compiler() is None:
        pytest.skip("no C compiler to build tools/bench/cpuid_mask.c")
    return isa.build_shim(tmp_path_factory.mktemp("cpuid"))


def _probe(library, mask):
    env = {**os.environ, **isa.masked_env(library, mask), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    out["regs"] = {tuple(int(v) for v in k.split(",")): v for k, v in out["regs"].items()}
    return out


def test_avx2_mask_clears_exactly_the_listed_bits(library):
    raw, masked = _probe(library, "off"), _probe(library, "avx2")
    assert raw["report"]["state"] == 0 and masked["report"]["state"] == 1
    assert masked["report"]["traps"] > 0  # CPUID really trapped (numpy's import, the probe's own calls)
    for leaf in LEAVES:
        for reg in range(4):
            clear = CLEARED.get(leaf, (0, 0, 0, 0))[reg]
            # leaf 1 EBX bits 24-31: the initial APIC ID of the core the instruction ran on
            same = 0x00FFFFFF if (leaf, reg) == ((1, 0), 1) else 0xFFFFFFFF
            assert masked["regs"][leaf][reg] & same == raw["regs"][leaf][reg] & ~clear & same, (leaf, reg)
    if not raw["report"]["cpuid"]["avx512f"]:
        pytest.skip("this CPU has no AVX-512: the mask changes nothing visible here")
    seen = masked["report"]["cpuid"]
    assert seen["avx2"] and not any(seen[b] for b in isa.CLEARED["avx2"]), seen
    assert masked["report"]["numpy"]["AVX512F"] is False and masked["report"]["numpy"]["AVX2"] is True
    assert raw["report"]["numpy"]["AVX512F"] is True
    # the latency placement's own reading (what chooses 7- or 8-bit weights and keys the profile)
    assert masked["flags"] == ["avx2"], masked["flags"]
    assert "avx512f" in raw["flags"]


def test_avx2_vnni_mask_keeps_avx_vnni(library):
    raw, masked = _probe(library, "off"), _probe(library, "avx2-vnni")
    assert masked["report"]["cpuid"]["avx_vnni"] == raw["report"]["cpuid"]["avx_vnni"]
    assert not masked["report"]["cpuid"]["avx512f"] and not masked["report"]["cpuid"]["amx_int8"]
    eax_71 = masked["regs"][(7, 1)][0]
    assert eax_71 == raw["regs"][(7, 1)][0] & ~bits(5, 21, 23)


def test_an_unmasked_process_is_refused():
    """The benchmark's child checks the mask before measuring: without the library it refuses."""
    if isa._loaded_library() is not None:
        pytest.skip("this test process itself runs under the mask library")
    assert isa.report()["mask"] is None
    with pytest.raises(isa.Unavailable, match="not active"):
        isa.check_masked("avx2")


def test_the_bit_tables_agree():
    """tools.bench.isa and the latency placement read the same bits."""
    from onnx_qat.placement.cpu_latency import CPUID_BITS

    for flag, where in CPUID_BITS.items():
        assert isa.BITS[flag] == where, flag


SATURATION = """
import json
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
import onnxruntime as ort
import onnx_qat

rng = np.random.default_rng(%d)
# image (>= 0: zero point 0, the whole uint8 grid) -> Conv 3x3 -> Relu -> Conv 1x1: weights of one sign
# and large, as a pair sum of 16-bit products needs to overflow (2 x 255 x 127 > 32767)
w1 = rng.uniform(0.5, 1.0, (16, 8, 3, 3)).astype(np.float32)
w2 = rng.uniform(0.5, 1.0, (16, 16, 1, 1)).astype(np.float32)
graph = helper.make_graph(
    [helper.make_node("Conv", ["x", "w1"], ["c1"], pads=[1, 1, 1, 1]),
     helper.make_node("Relu", ["c1"], ["r1"]), helper.make_node("Conv", ["r1", "w2"], ["y"])], "sat",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 8, 12, 12])],
    [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 16, 12, 12])],
    [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
model.ir_version = 8
data = rng.uniform(0, 1, (16, 8, 12, 12)).astype(np.float32)

def run(proto, optimize):
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": data})[0]

out = {}
for name, vnni in (("auto", "auto"), ("8-bit", True)):
    result = onnx_qat.quantize(model, data={"x": data}, method="max", target="ort-cpu", progress=False,
                               cpu_vnni=vnni)
    kernels, exact = run(result.model, True), run(result.model, False)
    out[name] = {"vnni": bool(result.ort_cpu["cpu_vnni"]),
                 "kernel_vs_exact": float(np.abs(kernels - exact).max() / np.abs(exact).max())}
print(json.dumps(out))
"""


@pytest.mark.parametrize("seed", [0, 1])
def test_auto_width_on_the_avx2_path_is_exact_where_8_bit_weights_saturate(library, seed):
    """Under the avx2 mask ``cpu_vnni="auto"`` reads this process's CPUID (no VNNI) and gives 7-bit
    weights, also behind zero-point-0 inputs: onnxruntime's kernels then compute the same outputs as
    the exact Q/DQ arithmetic (graph optimizations off). 8-bit weights (``cpu_vnni=True``) behind the
    Relu output saturate the kernels' 16-bit pair sums there."""
    env = {**os.environ, **isa.masked_env(library, "avx2"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SATURATION % seed], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["auto"]["vnni"] is False and out["8-bit"]["vnni"] is True
    assert out["auto"]["kernel_vs_exact"] < 1e-3, out
    assert out["8-bit"]["kernel_vs_exact"] > 0.05, out  # saturated sums: far off the exact arithmetic
