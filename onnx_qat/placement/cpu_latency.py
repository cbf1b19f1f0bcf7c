"""Latency-aware placement for the ``ort-cpu`` target: quantize a site only where onnxruntime's
integer kernel is faster than float on this machine.

onnxruntime's integer CPU kernels do not win everywhere: depthwise convolutions and small GEMMs
often run slower as ``QLinearConv`` / ``MatMulIntegerToFloat`` than in float (DESIGN hazards;
measured on AVX2 and AVX-512 VNNI alike), and which ones lose depends on the CPU's instructions
(AVX2, AVX-512 VNNI, AMX), the onnxruntime version, the thread count and the shapes. So each
*site* (a weighted op the placement quantizes: Conv, Gemm, MatMul with a constant weight) is timed
here, at the model's shapes and the session's thread count, in two one-op models run by
onnxruntime with all optimizations on:

* a Conv as it sits between integer Convs of the form, reading and writing uint8: integer
  ``DQ(x), DQ(W) -> Conv -> Q`` (one ``QLinearConv``) against the float Conv, float in and out.
  (The float Conv cannot be timed between a DequantizeLinear and a QuantizeLinear: onnxruntime
  1.31 quantizes a float constant weight there itself and runs ``QLinearConv`` again.);
* a Gemm/MatMul, whose input usually comes from a float op: integer ``Q -> DQ(x), DQ(W) -> MatMul``
  (``MatMulIntegerToFloat`` / ``QGemm``, the input's QuantizeLinear counted) against float
  ``x -> MatMul(W) -> y``.

The two are run interleaved and their medians compared; a site stays float (rule ``CPU3``, reason
with both times) only when the integer median exceeds `FLOAT_MARGIN` (1.1) times the float one. A kind
measured slower in integer is measured a second time and each form keeps the lower of its two medians
(other jobs only ever add time): on a loaded machine one measurement put ResNet50's 7x7 stem Conv at
6.1 ms in integer against 4.0 ms in float, where in the model its ``QLinearConv`` takes 1.3-2.0 ms and
the float Conv 1.4-1.5 ms, and keeping it float cost the model about a third of its time.
Sites with the same op, shapes and attributes are measured once (ResNet50 has 53 Convs of 23 kinds).

One-op timings do not see everything a float site costs in the model: the dequantization of its
input and the quantization of its output, and what onnxruntime then fuses around it. So when some
site is kept float, [`onnx_qat.quantize`][onnx_qat.quantize.quantize] also builds the model with every
site integer (same ranges), times FP32 and both models interleaved at the end, and writes the faster
quantized one; the report says which (``whole_model.chosen``) and whether it beats FP32.

Measurements are kept in a *latency profile*, a JSON file keyed by site kind, written for one
machine: its CPU model, the CPU flags that select onnxruntime's integer kernels (``avx2``,
``avx512f``, ``avx512_vnni``, ``avx_vnni``, ``amx_int8``...), the onnxruntime version and the thread
count. By default each machine has its own file in ``~/.cache/onnx-qat/latency/`` (``$XDG_CACHE_HOME``
if set) named by a hash of that key, so a second run on the same machine measures nothing and a
VNNI machine measures its own. ``latency_profile=FILE`` (``--latency-profile``) reads and extends the
given file instead, e.g. one measured on the deployment machine (then used as it is, with a note when
its machine differs from this one).

Sources: onnxruntime's quantization docs ("Quantize ONNX models", section on x86 performance: u8s8
without VNNI saturates, VNNI and AMX kernels are faster) and the QDQ node-unit fusions of its CPU
provider (``QLinearConv``, ``QGemm``, ``MatMulIntegerToFloat``).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..errors import ConfigError
from ..graph.index import GraphIndex, weightless_copy
from .marks import Placement

logger = logging.getLogger(__name__)

RULE = "CPU3"
PROFILE_FORMAT = "onnx-qat-latency-profile"
PROFILE_VERSION = 1
#: CPU flags that decide which integer kernels onnxruntime's MLAS picks on x86 (and ARM dot products).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile",
                "amx_int8", "asimddp", "i8mm")
#: A site stays float only when its integer form takes more than this many times the float time: one
#: site's two medians differ by up to ~10% from run to run on a loaded machine, and a float site
#: between integer ones also costs its neighbours' fusions, which the one-op timing does not see.
FLOAT_MARGIN = 1.1
#: Op types timed as sites.
SITE_OPS = ("Conv", "Gemm", "MatMul")
#: Each kind is run until both forms have this many timed runs or this much time has passed.
_RUNS = (3, 15)
_SECONDS_PER_KIND = 0.25


# --------------------------------------------------------------------------- the machine
def machine_key(threads: int) -> Dict[str, object]:
    """What a measurement depends on: CPU model, kernel-selecting CPU flags, onnxruntime version,
    intra-op threads (0: onnxruntime's default, one per physical core).

    The flags are those of ``/proc/cpuinfo`` (what the OS supports) that, on x86-64, this process's
    CPUID instruction also reports (`cpuid_flags`; what onnxruntime's MLAS reads to pick its kernels):
    where the two differ (a CPUID mask, a hypervisor or kernel hiding a feature from one of them),
    the kernels onnxruntime runs follow both."""
    import onnxruntime

    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and ":" in line:
                flags |= set(line.split(":", 1)[1].split())
    except OSError:
        pass
    seen = cpuid_flags()
    if seen is not None:
        flags = {f for f in flags if f not in CPUID_BITS or f in seen}
    return {"cpu": model, "flags": sorted(f for f in KERNEL_FLAGS if f in flags),
            "onnxruntime": onnxruntime.__version__, "threads": int(threads)}


#: ``flag: (leaf, subleaf, register EAX=0 .. EDX=3, bit)`` of the x86 `KERNEL_FLAGS` in CPUID (Intel SDM
#: vol. 2A, CPUID leaf 07H; Linux ``arch/x86/include/asm/cpufeatures.h``), the bits onnxruntime's MLAS
#: tests in ``MLAS_PLATFORM`` (``onnxruntime/core/mlas/lib/platform.cpp``).
CPUID_BITS = {"avx2": (7, 0, 1, 5), "avx512f": (7, 0, 1, 16), "avx512bw": (7, 0, 1, 30),
              "avx512_vnni": (7, 0, 2, 11), "amx_tile": (7, 0, 3, 24), "amx_int8": (7, 0, 3, 25),
              "avx_vnni": (7, 1, 0, 4), "avx512_bf16": (7, 1, 0, 5)}
#: x86-64 System V machine code of ``void f(uint32_t leaf, uint32_t subleaf, uint32_t out[4])``: push rbx;
#: mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid; mov [r8], eax; mov [r8+4], ebx; mov [r8+8], ecx;
#: mov [r8+12], edx; pop rbx; ret.
_CPUID_CODE = bytes.fromhex("534989d089f889f10fa24189004189580441894808418950" "0c5bc3")
_cpuid_seen: Dict[str, Optional[frozenset]] = {}


def cpuid_flags() -> Optional[frozenset]:
    """The flags of `CPUID_BITS` that the CPUID instruction reports in this process (read once), or
    None where it is not run: not x86-64 POSIX, or executable memory refused (then ``/proc/cpuinfo``
    alone decides). Python cannot run CPUID itself, so the instruction is called from a page of
    executable memory (`_CPUID_CODE`)."""
    if "flags" not in _cpuid_seen:
        _cpuid_seen["flags"] = _read_cpuid()
    return _cpuid_seen["flags"]


def _read_cpuid() -> Optional[frozenset]:
    import ctypes
    import mmap

    if os.name != "posix" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    except (OSError, ValueError, AttributeError):  # W^X policies refuse it: /proc/cpuinfo alone
        return None
    try:
        page.write(_CPUID_CODE)
        address = ctypes.addressof(ctypes.c_char.from_buffer(page))
        function = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32,
                                    ctypes.POINTER(ctypes.c_uint32 * 4))(address)

        def run(leaf, subleaf):
            out = (ctypes.c_uint32 * 4)()
            function(leaf, subleaf, ctypes.byref(out))
            return tuple(out)

        top = run(0, 0)[0]
        regs = {(7, 0): run(7, 0) if top >= 7 else (0, 0, 0, 0)}
        regs[(7, 1)] = run(7, 1) if top >= 7 and regs[(7, 0)][0] >= 1 else (0, 0, 0, 0)
    finally:
        try:
            page.close()
        except BufferError:  # a view still alive: the page is freed with it
            pass
    return frozenset(flag for flag, (leaf, sub, reg, bit) in CPUID_BITS.items()
                     if regs[(leaf, sub)][reg] >> bit & 1)


def default_profile_path(threads: int) -> Path:
    """This machine's profile file in the cache directory (see the module docstring)."""
    key = machine_key(threads)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "onnx-qat" / "latency" / f"{digest}.json"


#: x86 CPU flags of int8 dot products summed straight into 32 bits (``vpdpbusd``, AMX tiles): no
#: 16-bit pair sums, so 8-bit weights behind uint8 inputs around 128 cannot saturate.
WIDE_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
#: Architectures whose MLAS integer kernels accumulate in 32 bits on every CPU (ARM64 NEON widens each
#: product, ``umlal``; UDOT/SDOT/UMMLA sum in 32 bits): no 16-bit pair saturation at all.
WIDE_ARCHES = ("aarch64", "arm64")
#: x86 architecture names (``platform.machine()``).
X86_ARCHES = ("x86_64", "amd64", "i386", "i686", "x86")
CPU_VNNI_CHOICES = (True, False, "auto")


def wide_dot_products(flags, arch: str) -> Tuple[bool, str]:
    """Whether onnxruntime's uint8 x int8 kernels sum products in 32 bits on a CPU with these
    ``flags`` (`KERNEL_FLAGS` as `machine_key` reads them) and architecture (``platform.machine()``), and
    why, in a few words.

    On x86 without VNNI/AMX, MLAS multiplies with ``vpmaddubsw`` (AVX2, AVX-512 core), which adds
    pairs of products in 16 bits with saturation; onnxruntime's quantization docs recommend
    ``reduce_range`` (7-bit weights) there and say it is not needed on CPUs with VNNI. ARM64 kernels
    widen first (NEON ``umlal``) or use dot-product instructions summing in 32 bits. Unknown
    architectures are treated as x86 without VNNI (7 bits: exact everywhere)."""
    arch = (arch or "").lower()
    wide = sorted(set(flags) & set(WIDE_DOT_FLAGS))
    if wide:
        return True, f"this CPU has {', '.join(wide)}: int8 dot products sum in 32 bits"
    if arch in WIDE_ARCHES:
        return True, (f"{arch}: onnxruntime's ARM64 integer kernels (NEON widening multiply-accumulate, "
                      "UDOT/SDOT) sum in 32 bits")
    if arch in X86_ARCHES:
        return False, ("this x86 CPU has no AVX-512 VNNI, AVX-VNNI or AMX: onnxruntime's uint8 x int8 "
                       "kernels add pairs of products in 16 bits (vpmaddubsw), which 8-bit weights can "
                       "saturate")
    return False, f"architecture {arch or 'unknown'!r}: 7-bit weights, exact on every kernel"


def resolve_cpu_vnni(value, profile=None, threads: int = 0) -> Dict[str, object]:
    """The ``cpu_vnni`` choice of [`onnx_qat.quantize`][onnx_qat.quantize.quantize]:
    ``{"cpu_vnni": bool, "weight_bits": 8 or 7, "chosen_by": "option" | "auto" | "latency profile",
    "reason": str}``.

    ``True``/``False`` force it. ``"auto"`` follows the machine the model is quantized on
    (`wide_dot_products` of `machine_key`'s flags and ``platform.machine()``), except that a given
    latency ``profile`` file measured on another machine that records a choice (``"cpu_vnni"``, see
    `LatencyProfile`) is followed: that file describes the deployment machine.

    Raises:
        ConfigError: ``value`` is none of True, False, ``"auto"``.
    """
    if not (isinstance(value, bool) or value == "auto"):
        raise ConfigError(f"cpu_vnni must be True, False or 'auto', got {value!r}")
    if isinstance(value, bool):
        why = ("given: the model will run on CPUs whose int8 dot products sum in 32 bits" if value else
               "given: the model may run on x86 CPUs without VNNI")
        return {"cpu_vnni": value, "weight_bits": 8 if value else 7, "chosen_by": "option", "reason": why}
    here = machine_key(threads)
    if profile is not None:
        loaded = LatencyProfile.load(profile, threads)
        recorded = loaded.cpu_vnni
        if recorded is not None and loaded.machine and loaded.machine != here:
            return {"cpu_vnni": bool(recorded["cpu_vnni"]), "weight_bits": 8 if recorded["cpu_vnni"] else 7,
                    "chosen_by": "latency profile",
                    "reason": f"latency profile {profile} (measured on {_describe(loaded.machine)}): "
                              f"{recorded.get('reason', '')}".rstrip(": ")}
    wide, why = wide_dot_products(here["flags"], platform.machine())
    return {"cpu_vnni": wide, "weight_bits": 8 if wide else 7, "chosen_by": "auto", "reason": why}


# --------------------------------------------------------------------------- the profile
@dataclass
class LatencyProfile:
    """Measured medians (microseconds) per site kind, for one machine (`machine_key`)."""

    machine: Dict[str, object]
    sites: Dict[str, Dict[str, float]] = field(default_factory=dict)
    path: Optional[Path] = None
    #: The ort-cpu weight width chosen on that machine (`resolve_cpu_vnni`: ``cpu_vnni``, ``reason``),
    #: or None when none was recorded.
    cpu_vnni: Optional[Dict[str, object]] = None
    #: Whole-model timings on this machine (`timed_or_cached`) by `timing_key`: each ``{"medians_ms":
    #: {model role: ms}, "quartiles_ms": {model role: [q1, q3]}, "rounds": n, "timed_at": ISO time (UTC)}``.
    whole_models: Dict[str, Dict[str, object]] = field(default_factory=dict)

    @classmethod
    def load(cls, path, threads: int) -> "LatencyProfile":
        """The profile in ``path``, or an empty one for this machine when the file does not exist.

        Raises:
            ConfigError: the file exists but is not a latency profile (one line saying why).
        """
        path = Path(path)
        if not path.exists():
            return cls(machine_key(threads), {}, path)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"latency profile {path}: not readable JSON ({exc})") from None
        if not isinstance(raw, dict) or raw.get("format") != PROFILE_FORMAT or \
                raw.get("version") != PROFILE_VERSION or not isinstance(raw.get("sites"), dict):
            raise ConfigError(f"latency profile {path}: not an {PROFILE_FORMAT} "
                              f"version {PROFILE_VERSION} file")
        machine = raw.get("machine") or {}
        if not isinstance(machine, dict):
            raise ConfigError(f"latency profile {path}: 'machine' must be an object")
        sites = {}
        for kind, entry in raw["sites"].items():
            entry = entry if isinstance(entry, dict) else {}
            values = entry.get("float_us"), entry.get("int_us")
            if not all(isinstance(v, (int, float)) and np.isfinite(v) and v > 0 for v in values):
                raise ConfigError(f"latency profile {path}: site {kind!r} needs positive float_us and int_us")
            sites[kind] = {"float_us": float(values[0]), "int_us": float(values[1])}
        recorded = raw.get("cpu_vnni")
        if recorded is not None and not (isinstance(recorded, dict)
                                         and isinstance(recorded.get("cpu_vnni"), bool)):
            raise ConfigError(f"latency profile {path}: 'cpu_vnni' needs a boolean 'cpu_vnni'")
        return cls(dict(machine), sites, path, recorded, _load_timings(path, raw.get("whole_models")))

    def save(self) -> None:
        """Write the profile to `path` (atomically; the folder is created)."""
        from ..io.files import write_json

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "machine": self.machine,
                               "sites": self.sites,
                               **({} if self.cpu_vnni is None else {"cpu_vnni": self.cpu_vnni}),
                               **({"whole_models": self.whole_models} if self.whole_models else {})})


def _load_timings(path: Path, raw) -> Dict[str, Dict[str, object]]:
    """The profile's ``"whole_models"`` section, validated (see `LatencyProfile.whole_models`).

    Raises:
        ConfigError: the section or one of its entries is malformed (one line naming it).
    """
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"latency profile {path}: 'whole_models' must be an object")
    found = {}
    for key, entry in raw.items():
        medians = entry.get("medians_ms") if isinstance(entry, dict) else None
        rounds = entry.get("rounds") if isinstance(entry, dict) else None
        whole = isinstance(rounds, int) and not isinstance(rounds, bool) and rounds > 0
        if not (whole and isinstance(medians, dict) and medians
                and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                        and np.isfinite(v) and v > 0 for v in medians.values())):
            raise ConfigError(f"latency profile {path}: whole-model timing {str(key)[:16]!r} needs positive "
                              "'medians_ms' per model and a whole number of 'rounds'")
        found[str(key)] = dict(entry)
    return found


# --------------------------------------------------------------------------- sites
@dataclass(frozen=True)
class Site:
    """One quantized weighted op: its node, op type and the kind it is measured as."""

    node: str
    op_type: str
    kind: str
    spec: Mapping = field(compare=False, repr=False)


def sites_of(index: GraphIndex, placement: Placement, shapes: Mapping[str, Tuple[int, ...]]) -> List[Site]:
    """The placement's quantized Conv/Gemm/MatMul nodes with a constant weight and a known input shape,
    in graph order, each with its kind (op, shapes, attributes)."""
    weighted = {w.node: w for w in placement.weights if w.input_index == 1}
    found = []
    for node in index.nodes:
        mark = weighted.get(node.name)
        if node.op_type not in SITE_OPS or mark is None or not node.standard or not node.inputs:
            continue
        x_shape = shapes.get(node.inputs[0])
        w_proto = index.constant_proto(node.inputs[1]) if len(node.inputs) > 1 else None
        if x_shape is None or w_proto is None or w_proto.data_type != 1:
            continue
        bias = len(node.inputs) > 2 and bool(node.inputs[2]) \
            and index.constant_proto(node.inputs[2]) is not None
        attrs = {a.name: _attr_value(a) for a in node.proto.attribute}
        spec = {"op": node.op_type, "x": list(x_shape), "w": [int(d) for d in w_proto.dims], "bias": bias,
                "attrs": attrs, "axis": mark.axis}
        found.append(Site(node.name, node.op_type, json.dumps(spec, sort_keys=True), spec))
    return found


def _attr_value(attribute):
    from onnx import helper

    value = helper.get_attribute_value(attribute)
    if isinstance(value, bytes):
        return value.decode()
    return list(value) if isinstance(value, (list, tuple)) else value


def input_shapes(model, batch: int, samples: Optional[Mapping[str, Sequence[int]]] = None
                 ) -> Dict[str, Tuple[int, ...]]:
    """Static shapes of every tensor of ``model`` (onnx shape inference); tensors whose shape stays
    unknown are left out. Symbolic or unknown dimensions of graph inputs are set to: ``batch`` for the
    first; for the others, the size one sample of the data has there (``samples``: graph input name ->
    the shape of one feed at batch 1, as the calibration data gives it, e.g. a detector's height and
    width), else 1. Without ``samples`` a model whose image size is symbolic would be timed on 1 x 1
    images, which says nothing of its speed at the sizes it runs at."""
    import onnx

    probe = weightless_copy(model)
    inits = {i.name for i in probe.graph.initializer}
    samples = samples or {}
    for value in probe.graph.input:
        if value.name in inits:
            continue
        dims = value.type.tensor_type.shape.dim
        given = tuple(samples.get(value.name, ()))
        for position, dim in enumerate(dims):
            if not dim.HasField("dim_value") or dim.dim_value <= 0:
                dim.Clear()
                if position == 0:
                    dim.dim_value = batch
                elif len(given) == len(dims) and given[position] > 0:
                    dim.dim_value = int(given[position])
                else:
                    dim.dim_value = 1
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True)
    except Exception as exc:  # noqa: BLE001 - shape inference failing leaves every site unmeasured
        logger.warning("latency placement: shape inference failed (%s); no site is timed", exc)
        return {}
    shapes = {}
    for value in list(inferred.graph.input) + list(inferred.graph.value_info) + list(inferred.graph.output):
        tensor_type = value.type.tensor_type
        dims = tensor_type.shape.dim
        if tensor_type.HasField("shape") and all(d.HasField("dim_value") and d.dim_value > 0 for d in dims):
            shapes[value.name] = tuple(int(d.dim_value) for d in dims)  # () for a declared scalar
    return shapes


# --------------------------------------------------------------------------- one-op models
def _site_models(spec: Mapping, seed: int = 0):
    """``(float model, integer model, float feed, integer feed)`` of one site kind."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    op, x_shape, w_shape = spec["op"], tuple(spec["x"]), tuple(spec["w"])
    w = (rng.standard_normal(w_shape) * 0.05).astype(np.float32)
    attrs = dict(spec["attrs"])
    out_channels = w_shape[0] if op == "Conv" or (op == "Gemm" and attrs.get("transB")) else w_shape[-1]
    b = (rng.standard_normal(out_channels) * 0.01).astype(np.float32)
    axis = spec.get("axis")
    reduce = None if axis is None else tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=reduce)
    w_scale = np.maximum(np.asarray(amax, np.float32) / 127.0, 1e-8).astype(np.float32)
    shape = [1] * w.ndim
    if axis is not None:
        shape[axis] = -1
    w_q = np.clip(np.round(w / w_scale.reshape(shape)), -127, 127).astype(np.int8)
    x = rng.uniform(0, 1, x_shape).astype(np.float32)
    names = ["x", "w"] + (["b"] if spec["bias"] else [])

    def build(nodes, inits, x_type, y_type):
        graph = helper.make_graph(nodes, "site", [helper.make_tensor_value_info("x", x_type, list(x_shape))],
                                  [helper.make_tensor_value_info("y", y_type, None)], inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 8
        return model

    bias_init = [numpy_helper.from_array(b, "b")] if spec["bias"] else []
    consts = [numpy_helper.from_array(w_q, "w_q"), numpy_helper.from_array(w_scale, "w_s"),
              numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), "w_zp"),
              numpy_helper.from_array(np.array(1.0 / 255, np.float32), "x_s"),
              numpy_helper.from_array(np.array(0, np.uint8), "x_zp"),
              numpy_helper.from_array(np.array(0.05, np.float32), "y_s"),
              numpy_helper.from_array(np.array(128, np.uint8), "y_zp")] + bias_init
    w_dq = helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_zp"], ["w"],
                            **({} if axis is None else {"axis": int(axis)}))
    op_inputs = ["x_dq", "w"] + (["b"] if spec["bias"] else [])
    if op == "Conv":  # uint8 in, uint8 out: QLinearConv, as between integer Convs of the form
        nodes = [helper.make_node("DequantizeLinear", ["x", "x_s", "x_zp"], ["x_dq"]), w_dq,
                 helper.make_node(op, op_inputs, ["y_f"], **attrs),
                 helper.make_node("QuantizeLinear", ["y_f", "y_s", "y_zp"], ["y"])]
        int_model, int_feed = build(nodes, consts, TensorProto.UINT8, TensorProto.UINT8), \
            np.round(x * 255).astype(np.uint8)
    else:  # float in (quantized here), float out: QGemm / MatMulIntegerToFloat
        nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_zp"], ["x_q"]),
                 helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_zp"], ["x_dq"]), w_dq,
                 helper.make_node(op, op_inputs, ["y"], **attrs)]
        int_model, int_feed = build(nodes, consts, TensorProto.FLOAT, TensorProto.FLOAT), x
    float_model = build([helper.make_node(op, names, ["y"], **attrs)],
                        [numpy_helper.from_array(w, "w")] + bias_init, TensorProto.FLOAT, TensorProto.FLOAT)
    return float_model, int_model, x, int_feed


def _session(model, threads: int):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    source = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def measure_kind(spec: Mapping, threads: int) -> Dict[str, float]:
    """Median run time (microseconds) of one site kind in float and in the integer form,
    interleaved (float, integer, float, ...), after one warm-up run of each."""
    float_model, int_model, float_feed, int_feed = _site_models(spec)
    runs = [(_session(float_model, threads), float_feed), (_session(int_model, threads), int_feed)]
    times: Tuple[List[float], List[float]] = ([], [])
    for session, feed in runs:
        session.run(None, {"x": feed})
    start = time.perf_counter()
    while len(times[0]) < _RUNS[1] and (len(times[0]) < _RUNS[0] or
                                         time.perf_counter() - start < _SECONDS_PER_KIND):
        for (session, feed), bucket in zip(runs, times):
            t0 = time.perf_counter()
            session.run(None, {"x": feed})
            bucket.append(time.perf_counter() - t0)
    return {"float_us": 1e6 * statistics.median(times[0]), "int_us": 1e6 * statistics.median(times[1])}


# --------------------------------------------------------------------------- the decision
@dataclass(frozen=True)
class LatencyDecision:
    """Which sites stay float for speed, and one record per site (node, kind's times, gain, source)."""

    kept_float: Tuple[str, ...]
    records: Tuple[dict, ...]
    profile_path: Optional[str]
    measured_kinds: int
    seconds: float
    notes: Tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"rule": RULE, "profile": self.profile_path, "kinds_measured": self.measured_kinds,
                "seconds": round(self.seconds, 3), "kept_float": list(self.kept_float),
                "sites": [dict(r) for r in self.records], "notes": list(self.notes)}


def decide(model, index: GraphIndex, placement: Placement, *, profile=None, threads: int = 0,
           batch: int = 1, save: bool = True, cpu_vnni: Optional[Mapping] = None,
           samples: Optional[Mapping[str, Sequence[int]]] = None,
           values: Optional[Mapping[str, np.ndarray]] = None) -> LatencyDecision:
    """Time each site of ``placement`` (or read it from the profile) and decide float or integer.

    Args:
        model: the float ``onnx.ModelProto`` ``index`` indexes.
        profile: a profile file path (read, extended with what is measured here, written back), or
            None for this machine's cache file (`default_profile_path`).
        threads: onnxruntime intra-op threads of the deployment session (0: its default).
        batch: the batch size symbolic first dimensions are timed at.
        save: write the extended profile back.
        samples: one feed's shape per graph input (`sample_shapes`): the sizes other symbolic
            dimensions are timed at (`input_shapes`).
        values: one feed of the data (`sample_feed`): the inputs of types other than float32 when a
            site's input shape needs one run of the model (`observed_shapes`).
        cpu_vnni: the weight-width choice (`resolve_cpu_vnni`); one made ``"auto"`` on this machine
            is recorded in the profile (``"cpu_vnni"``) when the profile is this machine's.
    """
    start = time.perf_counter()
    path = Path(profile) if profile is not None else default_profile_path(threads)
    loaded = LatencyProfile.load(path, threads)
    here = machine_key(threads)
    notes = []
    if loaded.sites and loaded.machine and loaded.machine != here:
        notes.append(f"latency profile {path} was measured on another machine or setup "
                     f"({_describe(loaded.machine)}); its times are used as they are "
                     f"(this one: {_describe(here)})")
    unsized = unsized_dimensions(model, samples or {})
    if unsized:
        notes.append(f"input {'; '.join(unsized)}: symbolic dimensions other than the batch whose size "
                     "neither --latency-shape, the calibration data nor the ScaleTable gives are timed at 1, "
                     "which says little of the model's speed at the sizes it runs at (give --latency-shape "
                     "INPUT=DIMS, in Python latency=LatencyOptions(shapes=...))")
    shapes = input_shapes(model, batch, samples)
    sites = sites_of(index, placement, shapes)
    unmeasurable = _unmeasurable(index, placement, sites)
    if unmeasurable:  # shape inference stopped short of them (e.g. behind a Reshape to a computed shape)
        unknown = sorted({index.by_name[n].inputs[0] for n in unmeasurable if index.by_name[n].inputs})
        observed = observed_shapes(model, batch, samples, unknown, threads, values, shapes)
        if observed:
            shapes = {**shapes, **observed}
            sites = sites_of(index, placement, shapes)
            before, unmeasurable = len(unmeasurable), _unmeasurable(index, placement, sites)
            logger.info("latency placement: %d site(s) timed at the input shapes one run of the float model "
                        "gave (shape inference left them unknown)", before - len(unmeasurable))
    measured, fresh = 0, {}
    for site in sites:
        if site.kind not in loaded.sites:
            loaded.sites[site.kind] = measure_kind(site.spec, threads)
            fresh[site.kind] = site.spec
            measured += 1
    for kind, spec in fresh.items():  # a kind measured slower in integer is measured once more
        times = loaded.sites[kind]
        if times["int_us"] > FLOAT_MARGIN * times["float_us"]:
            again = measure_kind(spec, threads)
            loaded.sites[kind] = {key: min(times[key], again[key]) for key in ("float_us", "int_us")}
    record = None
    if cpu_vnni is not None and cpu_vnni.get("chosen_by") == "auto" and (not loaded.machine
                                                                        or loaded.machine == here):
        record = {"cpu_vnni": bool(cpu_vnni["cpu_vnni"]), "reason": str(cpu_vnni["reason"])}
    if (measured or (record is not None and loaded.cpu_vnni != record)) and save:
        if not loaded.machine:
            loaded.machine = here
        if record is not None:
            loaded.cpu_vnni = record
        loaded.save()
    records, kept = [], []
    for site in sites:
        times = loaded.sites[site.kind]
        gain = times["float_us"] / times["int_us"]
        integer = times["int_us"] <= FLOAT_MARGIN * times["float_us"]
        if not integer:
            kept.append(site.node)
        records.append({"node": site.node, "op_type": site.op_type, "float_us": round(times["float_us"], 1),
                        "int_us": round(times["int_us"], 1), "gain": round(gain, 3),
                        "decision": "integer" if integer else "float", "kind": _short(site.spec)})
    if unmeasurable:
        notes.append(f"{len(unmeasurable)} quantized site(s) without a static input shape are quantized "
                     f"untimed (e.g. {unmeasurable[0]!r})")
    return LatencyDecision(tuple(kept), tuple(records), str(path), measured, time.perf_counter() - start,
                           tuple(notes))


def _describe(machine: Mapping) -> str:
    flags = ",".join(machine.get("flags") or []) or "no listed flags"
    return (f"{machine.get('cpu', '?')}, {flags}, onnxruntime {machine.get('onnxruntime', '?')}, "
            f"{machine.get('threads', '?')} threads")


def _short(spec: Mapping) -> str:
    """A readable kind: ``Conv x[1,64,56,56] w[64,1,3,3] group=64``."""
    extras = []
    if spec["op"] == "Conv":
        group, strides = spec["attrs"].get("group", 1), spec["attrs"].get("strides")
        extras += [f"group={group}"] if group != 1 else []
        extras += [f"strides={strides}"] if strides and any(s != 1 for s in strides) else []
    shape = ",".join(str(d) for d in spec["x"])
    weight = ",".join(str(d) for d in spec["w"])
    return " ".join([f"{spec['op']} x[{shape}] w[{weight}]"] + extras)


def kept_float_decisions(decision: LatencyDecision, index: GraphIndex):
    """The placement ``Decision`` records (action ``skip``, rule CPU3) of the sites kept float."""
    from .marks import Decision

    by_node = {r["node"]: r for r in decision.records}
    found = []
    for name in decision.kept_float:
        record, node = by_node[name], index.by_name[name]
        found.append(Decision(name, node.op_type, "skip", RULE,
                              f"kept float for speed: integer {record['int_us']:.0f} us vs float "
                              f"{record['float_us']:.0f} us on this CPU ({record['kind']})"))
    return tuple(found)


#: The whole-model timing goes on past its ``rounds`` while it has run for less than this many seconds
#: (up to `MAX_ROUNDS_FACTOR` x ``rounds``): on a loaded machine three rounds of a 20 ms model judged
#: EfficientNetB0's form slower than FP32 (20.5 ms against 18.2 ms) where interleaved runs of the same
#: models measured it 1.2-2x faster.
WHOLE_MODEL_SECONDS = 3.0
MAX_ROUNDS_FACTOR = 5


#: Whole-model timings a profile keeps (`LatencyProfile.whole_models`); older ones are dropped first.
MAX_WHOLE_MODEL_TIMINGS = 64


def time_models(models: Mapping[str, object], feeds: Mapping[str, np.ndarray], threads: int = 0,
                rounds: int = 5, seconds: float = 0.0) -> Dict[str, float]:
    """Median seconds per run of each model (protos), run interleaved ``rounds`` times after a warm-up,
    and more rounds (up to `MAX_ROUNDS_FACTOR` x ``rounds``) while less than ``seconds`` have passed."""
    return _interleaved(models, feeds, threads, rounds, seconds)[0]


def _interleaved(models, feeds, threads: int, rounds: int, seconds: float):
    """`time_models`' medians, the number of rounds run and each model's quartiles (seconds). Each round
    runs every model once, the order rotated from round to round (A B C, B C A, ...): on a many-core
    server the run after another session's differs by a few percent, which a fixed order gives one model."""
    sessions = {k: _session(m, threads) for k, m in models.items()}
    for session in sessions.values():
        session.run(None, dict(feeds))
    times: Dict[str, List[float]] = {k: [] for k in sessions}
    names = list(sessions)
    start = time.perf_counter()
    done = 0
    while done < rounds or (done < MAX_ROUNDS_FACTOR * rounds and time.perf_counter() - start < seconds):
        shift = done % len(names)
        for key in names[shift:] + names[:shift]:
            session = sessions[key]
            t0 = time.perf_counter()
            session.run(None, dict(feeds))
            times[key].append(time.perf_counter() - t0)
        done += 1
    quartiles = {k: tuple(float(q) for q in np.percentile(v, (25, 75))) for k, v in times.items()}
    return {k: statistics.median(v) for k, v in times.items()}, done, quartiles


def timing_key(models: Mapping[str, bytes], feeds: Mapping[str, np.ndarray], threads: int, batch: int,
               rounds: int) -> str:
    """What a whole-model timing depends on, hashed: each model's serialized bytes (sha256) under its
    role, the feeds' shapes, this machine (`machine_key`: CPU, kernel flags, onnxruntime version,
    ``threads``), the batch and the rounds asked for, and `WHOLE_MODEL_SECONDS`."""
    what = {"models": {name: hashlib.sha256(blob).hexdigest() for name, blob in sorted(models.items())},
            "feeds": {name: list(np.shape(value)) for name, value in sorted(feeds.items())},
            "machine": machine_key(threads), "batch": int(batch), "rounds": int(rounds),
            "seconds": WHOLE_MODEL_SECONDS}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def timed_or_cached(models: Mapping[str, object], feeds: Mapping[str, np.ndarray], options: "LatencyOptions"):
    """`_interleaved`'s medians and quartiles in milliseconds and its rounds for ``models`` (protos or
    serialized bytes), and where they come from: ``{"source": "measured" | "latency profile", "timed_at": ...,
    "profile": path}``.

    A timing of the very same models (`timing_key`: their bytes, the feeds' shapes, this machine,
    threads, batch, rounds) kept in the latency profile (``options.profile`` or this machine's cache
    file) is reused without running anything, unless ``options.retime``; a new timing is added to the
    profile (at most `MAX_WHOLE_MODEL_TIMINGS`, the oldest dropped). A profile measured on another
    machine keeps no timing of this one: there every timing is measured."""
    blobs = {k: m if isinstance(m, bytes) else m.SerializeToString() for k, m in models.items()}
    path = Path(options.profile) if options.profile is not None else default_profile_path(options.threads)
    profile = LatencyProfile.load(path, options.threads)
    here = machine_key(options.threads)
    cacheable = not profile.machine or profile.machine == here
    key = timing_key(blobs, feeds, options.threads, options.batch, options.rounds)
    entry = profile.whole_models.get(key) if cacheable and not options.retime else None
    if entry is not None and set(entry["medians_ms"]) == set(blobs):
        return (dict(entry["medians_ms"]), entry["rounds"], dict(entry.get("quartiles_ms") or {}),
                {"source": "latency profile", "timed_at": entry.get("timed_at"), "profile": str(path)})
    seconds, rounds, spread = _interleaved(blobs, feeds, options.threads, options.rounds, WHOLE_MODEL_SECONDS)
    medians = {k: 1e3 * v for k, v in seconds.items()}
    quartiles = {k: [1e3 * q for q in v] for k, v in spread.items()}
    timed_at = datetime.now(timezone.utc).isoformat(timespec="microseconds")
    if cacheable:
        if not profile.machine:
            profile.machine = here
        profile.whole_models.pop(key, None)
        profile.whole_models[key] = {"medians_ms": medians, "quartiles_ms": quartiles, "rounds": rounds,
                                     "timed_at": timed_at}
        by_age = sorted(profile.whole_models, key=lambda k: str(profile.whole_models[k].get("timed_at", "")))
        for old in by_age[:max(0, len(by_age) - MAX_WHOLE_MODEL_TIMINGS)]:
            del profile.whole_models[old]
        try:
            profile.save()
        except OSError as exc:  # a read-only profile (e.g. one shared from the deployment machine)
            logger.warning("latency profile %s: the whole-model timing is not kept (%s)", path, exc)
            return medians, rounds, quartiles, {"source": "measured", "timed_at": timed_at, "profile": None}
    return medians, rounds, quartiles, {"source": "measured", "timed_at": timed_at,
                                        "profile": str(path) if cacheable else None}


# --------------------------------------------------------------------------- the rewrite's two steps
@dataclass(frozen=True)
class LatencyOptions:
    """How [`onnx_qat.quantize`][onnx_qat.quantize.quantize] places by latency (``latency=`` keyword).

    Attributes:
        profile: the latency profile file to read and extend, or None for this machine's cache file.
        threads: onnxruntime intra-op threads the model will run with (0: onnxruntime's default).
        batch: batch size for symbolic first dimensions (the deployment batch).
        rounds: interleaved runs of the whole-model timing at the end (FP32 against the result), at
            least; it goes on while it has run for less than `WHOLE_MODEL_SECONDS` (at most
            `MAX_ROUNDS_FACTOR` x ``rounds``), and the report gives the rounds run.
        retime: time the whole model again even when the profile holds a timing of the very same
            models (`timed_or_cached`); the new timing replaces the kept one.
        shapes: ``{graph input: shape}``, the shape of one sample of each input named (e.g.
            ``{"x": (1, 3, 640, 640)}``): the sizes its symbolic dimensions other than the batch are
            timed at (a detector's image size), before those of the calibration data and those a
            ScaleTable from ``calibrate(..., target="ort-cpu")`` recorded (`timing_sizes`).
        allow_slower: write the fastest quantized model even when, after the whole-model guard, it
            still runs slower than FP32 (its median above FP32's upper quartile, `clearly_slower`); by
            default nothing is written then and `PlacementError` says so, as when every site is
            faster in float: the FP32 model is the fast form on this CPU.
    """

    profile: Optional[str] = None
    threads: int = 0
    batch: int = 1
    rounds: int = 3
    retime: bool = False
    shapes: Optional[Mapping[str, Sequence[int]]] = None
    allow_slower: bool = False

    @classmethod
    def resolve(cls, value) -> Optional["LatencyOptions"]:
        """``None``/``False``/``"off"``: no latency placement; ``True``/``"measure"``: this machine's
        cache; a path: that profile file; a LatencyOptions passes through.

        Raises:
            ConfigError: any other value.
        """
        if value is None or value is False or value == "off":
            return None
        if value is True or value == "measure":
            return cls()
        if isinstance(value, cls):
            if isinstance(value.threads, bool) or not isinstance(value.threads, int) or value.threads < 0 \
                    or isinstance(value.batch, bool) or not isinstance(value.batch, int) or value.batch < 1:
                raise ConfigError("latency options: threads must be a whole number >= 0 and batch >= 1")
            for name in ("retime", "allow_slower"):
                if not isinstance(getattr(value, name), bool):
                    raise ConfigError(f"latency options: {name} must be True or False, "
                                      f"not {getattr(value, name)!r}")
            for name, shape in dict(value.shapes or {}).items():
                whole = isinstance(shape, Sequence) and not isinstance(shape, (str, bytes)) and all(
                    isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 1 for d in shape)
                if not whole:
                    raise ConfigError(f"latency options: the shape of {name!r} must be whole numbers >= 1, "
                                      f"not {shape!r}")
            return value
        if isinstance(value, (str, os.PathLike)):
            return cls(profile=os.fspath(value))
        raise ConfigError(f"latency must be None, 'off', 'measure', a profile path or LatencyOptions, "
                          f"not {type(value).__name__}")


def place_by_latency(model, index: GraphIndex, placement: Placement, policy, config,
                     options: LatencyOptions, cpu_vnni: Optional[Mapping] = None,
                     samples: Optional[Mapping[str, Sequence[int]]] = None,
                     values: Optional[Mapping[str, np.ndarray]] = None
                     ) -> Tuple[Placement, LatencyDecision]:
    """Decide (`decide`) and, when some sites stay float, place again with them excluded; the
    placement decisions of those sites say rule CPU3 with both measured times. ``cpu_vnni``: the
    weight-width choice, recorded in the profile (see `decide`); ``samples``: one feed's shape per
    graph input (`sample_shapes`), the sizes symbolic dimensions other than the batch are timed at;
    ``values``: one feed (`sample_feed`), see `decide`."""
    import re
    from dataclasses import replace

    decision = decide(model, index, placement, profile=options.profile, threads=options.threads,
                      batch=options.batch, cpu_vnni=cpu_vnni, samples=samples, values=values)
    for note in decision.notes:
        logger.warning("%s", note)
    if not decision.kept_float:
        return replace(placement, notes=placement.notes + decision.notes), decision
    patterns = tuple(re.escape(name) for name in decision.kept_float)
    placed = policy.place(index, replace(config, exclude_nodes=tuple(config.exclude_nodes) + patterns))
    ours = {d.node: d for d in kept_float_decisions(decision, index)}
    decisions = tuple(ours.get(d.node, d) for d in placed.decisions)
    note = (f"ort-cpu latency placement: {len(decision.kept_float)} of {len(decision.records)} timed site(s) "
            f"kept float for speed (integer not faster on this CPU), e.g. {decision.kept_float[0]!r}")
    logger.info("%s", note)
    return replace(placed, decisions=decisions, notes=placed.notes + decision.notes + (note,)), decision


def _unmeasurable(index: GraphIndex, placement: Placement, sites: Sequence[Site]) -> List[str]:
    """The placement's quantized Conv/Gemm/MatMul nodes that are not among ``sites`` (no known input
    shape, or a weight that is not a float32 constant), sorted."""
    return sorted({w.node for w in placement.weights} - {s.node for s in sites}
                  & {n.name for n in index.nodes if n.op_type in SITE_OPS})


def observed_shapes(model, batch: int, samples: Optional[Mapping[str, Sequence[int]]],
                    tensors: Sequence[str], threads: int = 0,
                    values: Optional[Mapping[str, np.ndarray]] = None,
                    shapes: Optional[Mapping[str, Tuple[int, ...]]] = None) -> Dict[str, Tuple[int, ...]]:
    """The shapes ``tensors`` take in one run of the float ``model`` on `timing_feeds` (at the shapes the
    sites are timed at: ``batch``, ``samples``; ``values`` for inputs other than float32): for the sites
    onnx shape inference leaves without a static input shape (a Reshape to a shape computed from a Shape
    node, as exporters write attention and sequence models). Empty when the model cannot be fed that way
    or onnxruntime refuses it (those sites then stay untimed, as the note says). ``shapes``: `input_shapes`
    of the same ``model``, ``batch`` and ``samples`` when the caller has them (not inferred again)."""
    from ..graph.wire import field, framed, string

    feeds = timing_feeds(model, batch, samples, values, shapes)
    if isinstance(feeds, str) or not tensors:
        return {}
    present = {o.name for o in model.graph.output}
    # the model's bytes and, merged into its graph (ModelProto field 7), a GraphProto holding only the
    # further outputs (field 12, ValueInfoProto name 1): no copy of the model made or changed
    extra = field(b"\x3a", framed(b"\x62", [string(b"\x0a", t) for t in tensors if t not in present]))
    try:
        outputs = _session(model.SerializeToString() + extra, threads).run(list(tensors), feeds)
    except Exception as exc:  # noqa: BLE001 - onnxruntime's own errors: the sites stay untimed
        logger.info("latency placement: the float model did not run on timing inputs (%s)", exc)
        return {}
    return {t: tuple(int(d) for d in np.shape(v)) for t, v in zip(tensors, outputs)
            if isinstance(v, np.ndarray) and v.size > 0}


def sample_feed(data, model) -> Dict[str, np.ndarray]:
    """One feed of calibration ``data`` (any form `onnx_qat.io.data.load_data` takes) at batch 1, graph
    input name -> array: its shapes are the sizes symbolic dimensions are timed at (`sample_shapes`), its
    values the timing inputs of inputs that are not float32 (`timing_feeds`: token ids, bytes). From a
    directory or list of feeds, the first feed (a stateful model's initial state included). Empty when
    the data is an iterator or reader of feeds (read once: it is not read ahead here) or gives no feed.
    Raises what `load_data` raises on bad data."""
    from ..io.data import load_data
    from ..io.feeds import is_feed_source
    from ..io.layout import split_layout

    if data is None:
        return {}
    if not hasattr(data, "batches"):  # not loaded yet (a Dataset or a FeedStream has batches)
        source = split_layout(data)[0]
        if is_feed_source(source) and not isinstance(source, (str, os.PathLike, list, tuple)):
            return {}  # an iterator or a get_next() reader: read once, by calibration, not ahead here
        data = load_data(data, model, what="calibration data")
    if not getattr(data, "rereadable", True):
        return {}
    first = next(iter(data.batches(1)), {})  # a directory or list of feeds: its first feed, complete
    return {name: np.array(array) for name, array in first.items()}


#: ScaleTable metadata key: one calibration sample's shape per graph input (JSON), recorded by
#: ``calibrate(..., target="ort-cpu")`` for a later ``quantize --scales ... --latency``.
INPUT_SHAPES_KEY = "input_shapes"


def recorded_shapes(table) -> Dict[str, Tuple[int, ...]]:
    """The input shapes a ScaleTable recorded (`INPUT_SHAPES_KEY`); empty when it recorded none, or
    something that is not ``{name: [whole numbers >= 1]}`` (a warning then)."""
    text = (getattr(table, "metadata", None) or {}).get(INPUT_SHAPES_KEY)
    if not text:
        return {}
    try:
        found = json.loads(text)
        shapes = {str(k): tuple(int(d) for d in v) for k, v in found.items()
                  if isinstance(v, list) and all(isinstance(d, int) and d >= 1 for d in v)}
        if len(shapes) != len(found):
            raise ValueError("not lists of whole numbers >= 1")
    except (ValueError, TypeError, AttributeError) as exc:
        logger.warning("ScaleTable metadata %r is not {input: [dims]} (%s); not used", INPUT_SHAPES_KEY, exc)
        return {}
    return shapes


def timing_sizes(model, given: Optional[Mapping[str, Sequence[int]]] = None,
                 data: Optional[Mapping[str, Sequence[int]]] = None,
                 recorded: Optional[Mapping[str, Sequence[int]]] = None) -> Dict[str, Tuple[int, ...]]:
    """One sample's shape per graph input of ``model``, for `input_shapes`: ``given``
    (`LatencyOptions.shapes`) before ``data`` (`sample_shapes` of the calibration data) before
    ``recorded`` (`recorded_shapes` of the ScaleTable), input by input.

    Raises:
        ConfigError: a name in ``given`` that is not a graph input, or a shape that does not fit the
            input's declared rank and fixed dimensions."""
    inits = {i.name for i in model.graph.initializer}
    declared = {v.name: v.type.tensor_type.shape.dim for v in model.graph.input if v.name not in inits}
    for name, shape in (given or {}).items():
        if name not in declared:
            raise ConfigError(f"latency shape for {name!r}: the model has no such input "
                              f"(inputs: {', '.join(declared) or 'none'})")
        dims = declared[name]
        if len(shape) != len(dims) or any(d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != s
                                          for i, (d, s) in enumerate(zip(dims, shape)) if i > 0):
            wanted = ", ".join(str(d.dim_value) if d.HasField("dim_value") and d.dim_value > 0 else
                               (d.dim_param or "?") for d in dims)
            raise ConfigError(f"latency shape for {name!r}: {'x'.join(map(str, shape))} does not fit the "
                              f"input's shape [{wanted}]")
    merged: Dict[str, Tuple[int, ...]] = {}
    for source in (recorded, data, given):
        merged.update({k: tuple(int(d) for d in v) for k, v in (source or {}).items() if k in declared})
    return merged


def unsized_dimensions(model, sizes: Mapping[str, Sequence[int]]) -> List[str]:
    """``input (dims)`` for each graph input of ``model`` with symbolic dimensions other than the first
    that ``sizes`` does not give (`input_shapes` times them at 1: a detector's image as 1 x 1 pixels)."""
    inits = {i.name for i in model.graph.initializer}
    found = []
    for value in model.graph.input:
        dims = value.type.tensor_type.shape.dim
        if value.name in inits or len(tuple(sizes.get(value.name, ()))) == len(dims):
            continue
        open_dims = [d.dim_param or "?" for i, d in enumerate(dims)
                     if i > 0 and not (d.HasField("dim_value") and d.dim_value > 0)]
        if open_dims:
            found.append(f"{value.name} ({', '.join(open_dims)})")
    return found


def sample_shapes(data, model) -> Dict[str, Tuple[int, ...]]:
    """One feed's shape per graph input (batch 1) from calibration ``data``, for `input_shapes`: the
    shapes of `sample_feed`."""
    return {name: tuple(int(d) for d in np.shape(array)) for name, array in sample_feed(data, model).items()}


def timing_feeds(float_model, batch: int, samples: Optional[Mapping[str, Sequence[int]]] = None,
                 values: Optional[Mapping[str, np.ndarray]] = None,
                 shapes: Optional[Mapping[str, Tuple[int, ...]]] = None):
    """The inputs the whole model is timed on: for each graph input of ``float_model`` (a ModelProto or
    its serialized bytes), standard normal float32 values (seed 0) at its shape with symbolic batch
    dimensions set to ``batch`` and other symbolic dimensions to one sample's (``samples``, see
    `input_shapes`). An input of another type (token ids, a model reading bytes) takes one sample's values
    (``values``, `sample_feed`), repeated ``batch`` times along a symbolic batch dimension: random values
    would say nothing of the indices a Gather may take. A sentence saying why instead (the model is then
    not timed) when an input is of unknown shape, or of another type with no sample given (or one of
    another type or shape). ``shapes``: `input_shapes` of the same model, ``batch`` and ``samples``, when
    the caller has them (shape inference is not run again)."""
    import onnx

    if isinstance(float_model, bytes):
        float_model = onnx.load_from_string(float_model)
    if shapes is None:
        shapes = input_shapes(float_model, batch, samples)
    inits = {i.name for i in float_model.graph.initializer}
    values = values or {}
    feeds, rng = {}, np.random.default_rng(0)
    for value in float_model.graph.input:
        if value.name in inits:
            continue
        tensor_type = value.type.tensor_type
        if value.name not in shapes:
            return f"input {value.name!r} is not a tensor of known shape"
        if tensor_type.elem_type == onnx.TensorProto.FLOAT:
            feeds[value.name] = rng.standard_normal(shapes[value.name]).astype(np.float32)
            continue
        given = values.get(value.name)
        dims = tensor_type.shape.dim
        if given is not None and given.ndim and dims and not dims[0].HasField("dim_value") \
                and given.shape[0] == 1:
            given = np.repeat(given, shapes[value.name][0], axis=0)  # the symbolic batch
        wanted = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type)
        if given is None or given.dtype != wanted or tuple(given.shape) != shapes[value.name]:
            return (f"input {value.name!r} is not float32 and the calibration data gives no sample of it "
                    "at its type and shape")
        feeds[value.name] = given
    return feeds


def whole_model_timing(float_model, qdq_model, options: LatencyOptions,
                       alternative=None, feeds=None) -> Dict[str, object]:
    """FP32 (``float_model``: a ModelProto or its serialized bytes) against the quantized model,
    interleaved, at the options' batch and threads: medians (milliseconds), speed-up, and a plain
    verdict. ``alternative``: ``(model, ...)`` with every site integer, timed in the same runs; the
    faster of the two quantized models is ``chosen`` (``"latency placement"`` or
    ``"every site integer"``) and is the one the figures describe. The timing is `timed_or_cached`'s:
    ``source`` says whether it was measured now or comes from the latency profile (``timed_at``,
    ``profile``); ``quartiles_ms`` gives the spread of the FP32 and quantized runs, ``seconds`` what
    this call took, ``input_shapes`` the shapes the models were fed at. ``feeds``: `timing_feeds` of the
    float model, when the caller has them (then ``float_model``'s bytes are not parsed here)."""
    start = time.perf_counter()
    if feeds is None:
        feeds = timing_feeds(float_model, options.batch)
    if isinstance(feeds, str):
        return {"timed": False, "reason": feeds}
    models = {"fp32": float_model, "quantized": qdq_model}
    if alternative is not None:
        models["every site integer"] = alternative[0]
    medians, rounds, quartiles, origin = timed_or_cached(models, feeds, options)
    chosen = "latency placement"
    extra = {}
    if alternative is not None:
        extra = {"latency_placement_ms": round(medians["quantized"], 3),
                 "every_site_integer_ms": round(medians["every site integer"], 3)}
        if medians["every site integer"] < medians["quantized"]:
            chosen, medians["quantized"] = "every site integer", medians["every site integer"]
    speedup = medians["fp32"] / medians["quantized"]
    verdict = "faster than FP32" if speedup > 1.0 else "NOT faster than FP32"
    written = "every site integer" if chosen == "every site integer" else "quantized"
    spread = {"fp32": _ms(quartiles.get("fp32")), "quantized": _ms(quartiles.get(written))}
    return {"timed": True, "batch": options.batch, "threads": options.threads, "rounds": rounds,
            "fp32_ms": round(medians["fp32"], 3), "quantized_ms": round(medians["quantized"], 3),
            "speedup": round(speedup, 3), "verdict": verdict, "chosen": chosen, **extra,
            "quartiles_ms": {k: v for k, v in spread.items() if v is not None}, **origin,
            "input_shapes": {k: [int(d) for d in np.shape(v)] for k, v in feeds.items()},
            "seconds": round(time.perf_counter() - start, 3)}


def clearly_slower(whole: Mapping) -> bool:
    """True when a whole-model timing (`whole_model_timing`'s record, or the guard's figures that replace
    it) puts the quantized model's median above FP32's upper quartile: slower than 3 in 4 FP32 runs,
    not a tie within the runs' spread (without quartiles, above FP32's median)."""
    if not whole.get("timed"):
        return False
    fp32 = (whole.get("quartiles_ms") or {}).get("fp32")
    return float(whole["quantized_ms"]) > float(fp32[1] if fp32 else whole["fp32_ms"])


def _ms(pair):
    return None if not pair else [round(q, 3) for q in pair]


def fallback_sites(decision: "LatencyDecision", exclude=()) -> Tuple[str, ...]:
    """The sites the whole-model guard keeps float when the quantized model is not faster than FP32:
    the least-gaining half (at least one) of the sites the profile put in integer, by measured gain
    (float time / integer time), lowest first; ``exclude``: sites not to name (already float)."""
    integer = sorted((r for r in decision.records if r["decision"] == "integer" and r["node"] not in exclude),
                     key=lambda r: (r["gain"], r["node"]))
    if len(integer) < 2:  # dropping the only integer site leaves the FP32 model
        return ()
    return tuple(r["node"] for r in integer[:max(1, len(integer) // 2)])


def fallback_timing(float_model, current, fallback, options: LatencyOptions, feeds=None) -> Dict[str, object]:
    """FP32, the quantized model and its fallback (fewer sites integer), timed interleaved once as
    `whole_model_timing` times them: medians (milliseconds) and which quantized model is faster.
    ``feeds``: as for `whole_model_timing`."""
    if feeds is None:
        feeds = timing_feeds(float_model, options.batch)
    medians, rounds, quartiles, origin = timed_or_cached(
        {"fp32": float_model, "before": current, "fallback": fallback}, feeds, options)
    chosen = "fallback" if medians["fallback"] < medians["before"] else "unchanged"
    best = min(medians["fallback"], medians["before"])
    spread = {"fp32": _ms(quartiles.get("fp32")),
              "quantized": _ms(quartiles.get("fallback" if chosen == "fallback" else "before"))}
    return {"rounds": rounds, "fp32_ms": round(medians["fp32"], 3),
            "before_ms": round(medians["before"], 3),
            "fallback_ms": round(medians["fallback"], 3),
            "speedup": round(medians["fp32"] / best, 3), "chosen": chosen,
            "quartiles_ms": {k: v for k, v in spread.items() if v is not None}, **origin}


__all__ = ["LatencyProfile", "LatencyDecision", "LatencyOptions", "Site", "decide", "place_by_latency",
           "whole_model_timing", "machine_key", "default_profile_path",
           "sites_of", "input_shapes", "measure_kind", "time_models", "kept_float_decisions", "RULE",
           "KERNEL_FLAGS", "WIDE_DOT_FLAGS", "fallback_sites", "fallback_timing", "wide_dot_products",
           "resolve_cpu_vnni", "timed_or_cached", "timing_feeds", "sample_shapes", "sample_feed",
           "observed_shapes", "timing_key", "MAX_WHOLE_MODEL_TIMINGS", "INPUT_SHAPES_KEY", "recorded_shapes",
           "timing_sizes", "unsized_dimensions", "clearly_slower",
           "cpuid_flags", "CPUID_BITS"]
