"""Everything that touches TensorRT or CUDA for ``onnx-qat deploy`` (`onnx_qat.deploy.command`).

TensorRT and cuda-python are optional (``pip install ".[tensorrt]"`` in the checkout) and
are imported lazily, inside the functions that need them, so this module
imports on any machine. Missing packages or a missing GPU raise
[`onnx_qat.errors.TensorRTUnavailable`][] with one line saying what to
install.

Build modes (see `choose_build_mode`):

* ``strongly-typed`` — TensorRT >= 10: the network is created with
  ``NetworkDefinitionCreationFlag.STRONGLY_TYPED``; tensor types come from the
  ONNX model and its Q/DQ nodes (explicit quantization). No calibrator, no INT8
  flag. (TensorRT Developer Guide, "Explicit Quantization" and "Strongly Typed
  Networks".) TensorRT 11 builds nothing else: the flag is deprecated there and
  ignored (strong typing is always on), and ``BuilderFlag.FP16``/``INT8`` are
  removed (TensorRT 11 migration guide, "Strongly Typed Networks Are Now
  Required", "Removed Python APIs"); ``--fp16`` then means FP16 float parts,
  which `onnx_qat.deploy.command` writes into the model before the build.
* ``weakly-typed`` — TensorRT 10 with ``--fp16``: a strongly typed network
  cannot take ``BuilderFlag.FP16``, so layers the Q/DQ nodes leave in float are
  allowed to run in FP16 through the INT8 + FP16 builder flags (still no
  calibrator: the Q/DQ scales are used).
* ``flag-based`` — TensorRT 8.6 and 9: ``EXPLICIT_BATCH`` network with
  ``BuilderFlag.INT8`` (and ``FP16`` with ``--fp16``), no calibrator.

CUDA memory, streams and events go through cuda-python's runtime bindings
(``cuda.bindings.runtime``, or ``cuda.cudart`` in cuda-python < 12.6).

The layer-information analysis (`analyse_layers`) is pure Python on the
engine inspector's JSON and is used and tested without TensorRT.
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from onnx_qat.errors import ConfigError, ModelError, QatError, TensorRTUnavailable, brief

logger = logging.getLogger(__name__)

#: One line telling users how to get TensorRT (used in every "missing" message).
INSTALL_HINT = ('to build the engine, install it on a machine with an NVIDIA GPU and driver: '
                'pip install ".[tensorrt]" in the onnx-qat checkout (the tensorrt and cuda-python wheels; '
                'or from NVIDIA\'s index: pip install tensorrt --extra-index-url https://pypi.nvidia.com)')
#: Oldest TensorRT the flag-based build supports (name-based I/O API, explicit quantization).
MIN_TENSORRT = (8, 6)

STRONGLY_TYPED = "strongly-typed"
WEAKLY_TYPED = "weakly-typed"
FLAG_BASED = "flag-based"


# --------------------------------------------------------------------------- settings and results
@dataclass(frozen=True)
class ShapeProfile:
    """Min/opt/max shapes of one network input for the optimization profile."""

    name: str
    min: Tuple[int, ...]
    opt: Tuple[int, ...]
    max: Tuple[int, ...]

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"name": self.name, "min": list(self.min), "opt": list(self.opt), "max": list(self.max)}


@dataclass(frozen=True)
class BuildSettings:
    """How to build the engine (every field comes from a command-line option)."""

    fp16: bool = False
    workspace_bytes: Optional[int] = None
    #: the model's Q/DQ form (``int8``, ``fp8`` or ``int4``, see `model_precision`): FP8 and INT4
    #: networks are built strongly typed (TensorRT >= 10), their types read from the Q/DQ nodes.
    precision: str = "int8"
    profiles: Tuple[ShapeProfile, ...] = ()
    timing_cache: Optional[bytes] = None
    verbose: bool = False


@dataclass(frozen=True)
class BuildResult:
    """A serialized engine and what was done to build it."""

    engine: bytes
    timing_cache: Optional[bytes]
    mode: str
    tensorrt_version: str
    seconds: float
    warnings: Tuple[str, ...] = ()
    device: str = ""
    precision: str = "int8"

    def to_dict(self) -> dict:
        """JSON-ready summary (the engine bytes themselves are written to the engine file)."""
        return {"mode": self.mode, "precision": self.precision, "tensorrt_version": self.tensorrt_version,
                "device": self.device,
                "seconds": round(self.seconds, 3), "engine_bytes": len(self.engine),
                "warnings": list(self.warnings[:20])}


@dataclass(frozen=True)
class LayerSummary:
    """Per-layer precision of a built engine, from the engine inspector.

    Attributes:
        total: layers counted (no-op layers excluded).
        int8: layers whose first input tensor is INT8.
        fp8: layers whose first input tensor is FP8.
        higher: layers computing in FP32/FP16/BF16 (higher precision than INT8).
        other: layers on integer/bool tensors (shape arithmetic) or of unknown format.
        by_precision: count per precision name.
        higher_precision_layers: names of the ``higher`` layers (first 50).
        unfused_qdq: ONNX Q/DQ node names TensorRT kept as standalone layers.
        detailed: whether the engine had DETAILED profiling verbosity (otherwise
            only names are known and precisions are not).
    """

    total: int
    int8: int
    higher: int
    other: int
    fp8: int = 0
    by_precision: Dict[str, int] = field(default_factory=dict)
    higher_precision_layers: Tuple[str, ...] = ()
    unfused_qdq: Tuple[str, ...] = ()
    detailed: bool = True

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"total": self.total, "int8": self.int8, "fp8": self.fp8, "higher_precision": self.higher,
                "other": self.other,
                "by_precision": dict(sorted(self.by_precision.items())),
                "higher_precision_layers": list(self.higher_precision_layers),
                "unfused_qdq": list(self.unfused_qdq), "detailed": self.detailed}


# --------------------------------------------------------------------------- imports and availability
def import_tensorrt():
    """Import and return the ``tensorrt`` module or raise TensorRTUnavailable (one line)."""
    try:
        import tensorrt as trt  # noqa: PLC0415 (optional dependency, imported lazily)
    except ImportError as exc:
        detail = "" if getattr(exc, "name", None) in ("tensorrt", None) else f" ({exc})"
        raise TensorRTUnavailable(f"TensorRT is not installed{detail}; {INSTALL_HINT}") from None
    except Exception as exc:  # a broken install (missing libnvinfer.so...) raises OSError and others
        raise TensorRTUnavailable(
            f"TensorRT cannot be loaded ({brief(exc, None, first_line=True)}); {INSTALL_HINT}") from None
    if version_tuple(trt.__version__) < MIN_TENSORRT:
        raise TensorRTUnavailable(f"TensorRT {trt.__version__} is too old; this script needs TensorRT >= 8.6 "
                                  f"(>= 10 recommended); {INSTALL_HINT}")
    return trt


def import_cudart():
    """Import cuda-python's runtime bindings or raise TensorRTUnavailable (one line)."""
    try:
        from cuda.bindings import runtime as cudart  # noqa: PLC0415  (cuda-python >= 12.6)
        return cudart
    except ImportError:
        pass
    try:
        from cuda import cudart  # noqa: PLC0415  (cuda-python < 12.6)
        return cudart
    except ImportError as exc:
        raise TensorRTUnavailable(f"cuda-python is not installed ({exc}); it is needed for GPU memory "
                                  f"and timing; {INSTALL_HINT}") from None


def require_gpu(cudart=None) -> str:
    """Return the name of CUDA device 0 or raise TensorRTUnavailable when no GPU is usable."""
    cudart = cudart or import_cudart()
    err, count = cudart.cudaGetDeviceCount()
    if _failed(cudart, err) or count < 1:
        raise TensorRTUnavailable(f"no CUDA GPU is available ({_err_name(err)}); TensorRT engines are "
                                  f"built and run on an NVIDIA GPU; {INSTALL_HINT}")
    err, props = cudart.cudaGetDeviceProperties(0)
    if _failed(cudart, err):
        return "cuda:0"
    name = props.name
    return name.decode(errors="replace").rstrip("\0") if isinstance(name, bytes) else str(name)


def version_tuple(text: str) -> Tuple[int, ...]:
    """``'10.3.0.26'`` -> ``(10, 3, 0, 26)`` (non-numeric parts ignored)."""
    return tuple(int(p) for p in re.findall(r"\d+", str(text))[:4])


def choose_build_mode(version: str, fp16: bool, precision: str = "int8") -> str:
    """The build mode for a TensorRT version: see the module docstring. FP8 and INT4 Q/DQ models build
    strongly typed only (TensorRT 10: the FP8/INT4 types come from the network, not from builder flags).
    TensorRT >= 11 builds strongly typed whatever is asked (``fp16`` there means FP16 float parts in
    the model, see `converts_float_parts`).

    Raises:
        ConfigError: FP8/INT4 with ``fp16`` on TensorRT 10 (weakly typed) or with TensorRT < 10.
    """
    major = version_tuple(version)[0] if version_tuple(version) else 0
    if major >= 11:
        return STRONGLY_TYPED
    if precision != "int8":
        if major < 10:
            raise ConfigError(f"{precision} Q/DQ models need TensorRT >= 10 (strongly typed network); "
                              f"found TensorRT {version}")
        if fp16:
            raise ConfigError(f"{precision} Q/DQ models build as strongly typed networks, which take no "
                              "--fp16 flag on TensorRT 10; drop it (or give the model FP16 float parts: "
                              "onnx-qat quantize --float-dtype fp16; TensorRT 11 converts them itself)")
        return STRONGLY_TYPED
    if major >= 10:
        return WEAKLY_TYPED if fp16 else STRONGLY_TYPED
    return FLAG_BASED


def converts_float_parts(version: Optional[str], fp16: bool) -> bool:
    """Whether ``--fp16`` means converting the model's float parts to FP16 before the build: on
    TensorRT >= 11 (strongly typed only, no FP16 builder flag). False without TensorRT (``version``
    None: the build stops before it anyway) and on older versions (which take the FP16 flag)."""
    major = version_tuple(version)[0] if version and version_tuple(version) else 0
    return bool(fp16) and major >= 11


def installed_tensorrt_version() -> Optional[str]:
    """The version of the TensorRT that `import_tensorrt` finds, or None when there is none."""
    try:
        return str(import_tensorrt().__version__)
    except TensorRTUnavailable:
        return None


def _failed(cudart, err) -> bool:
    return err != cudart.cudaError_t.cudaSuccess


def _err_name(err) -> str:
    return getattr(err, "name", str(err))


def _check_cuda(cudart, result, what: str):
    """Unpack a cuda-python ``(err, *values)`` tuple; raise QatError naming ``what`` on failure."""
    err, values = result[0], result[1:]
    if _failed(cudart, err):
        raise QatError(f"CUDA call {what} failed: {_err_name(err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else values


# --------------------------------------------------------------------------- logger
def _make_logger(trt, verbose: bool):
    """A TensorRT ILogger that forwards to ``logging`` and keeps errors and warnings for messages."""

    class _Logger(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.errors: List[str] = []
            self.warnings: List[str] = []

        def log(self, severity, msg):  # noqa: D401  (TensorRT callback)
            if severity in (trt.ILogger.Severity.INTERNAL_ERROR, trt.ILogger.Severity.ERROR):
                self.errors.append(str(msg).strip())
                logger.error("TensorRT: %s", msg)
            elif severity == trt.ILogger.Severity.WARNING:
                self.warnings.append(str(msg).strip())
                logger.warning("TensorRT: %s", msg)
            elif verbose:
                logger.debug("TensorRT: %s", msg)

    return _Logger()


# --------------------------------------------------------------------------- build
def build_engine(model_bytes: Optional[bytes], model_path: str, settings: BuildSettings) -> BuildResult:
    """Parse an ONNX model with TensorRT's ONNX parser and build a serialized engine.

    Args:
        model_bytes: the serialized ONNX model (the same model onnxruntime validated), or
            None to let the parser read ``model_path`` itself (models over 2 GB).
        model_path: its path, for messages and for external weights next to it.
        settings: build options.

    Raises:
        TensorRTUnavailable: TensorRT, cuda-python or a GPU is missing.
        ModelError: the ONNX parser rejected the model (first errors named).
        ConfigError: an option does not fit this TensorRT version or the network's inputs.
        QatError: the builder failed (its first error message shown).
    """
    trt = import_tensorrt()
    device = require_gpu()
    mode = choose_build_mode(trt.__version__, settings.fp16, settings.precision)
    trt_logger = _make_logger(trt, settings.verbose)
    start = time.perf_counter()
    builder = trt.Builder(trt_logger)
    if builder is None:
        raise TensorRTUnavailable(f"TensorRT could not create a builder (no usable GPU?); {INSTALL_HINT}")
    network = builder.create_network(_network_flags(trt, mode))
    parser = trt.OnnxParser(network, trt_logger)
    _parse(parser, model_bytes, model_path)
    config = _make_config(trt, builder, network, settings, mode)
    cache = _attach_timing_cache(config, settings.timing_cache)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        detail = trt_logger.errors[0] if trt_logger.errors else "no error message from TensorRT"
        raise QatError(f"TensorRT could not build an engine from {model_path}: {detail}")
    cache_bytes = bytes(memoryview(cache.serialize())) if cache is not None else None
    return BuildResult(engine=bytes(memoryview(serialized)), timing_cache=cache_bytes, mode=mode,
                       tensorrt_version=str(trt.__version__), seconds=time.perf_counter() - start,
                       warnings=tuple(trt_logger.warnings), device=device, precision=settings.precision)


def _network_flags(trt, mode: str) -> int:
    flags = trt.NetworkDefinitionCreationFlag
    if mode == STRONGLY_TYPED and hasattr(flags, "STRONGLY_TYPED"):
        return 1 << int(flags.STRONGLY_TYPED)
    if mode == FLAG_BASED and hasattr(flags, "EXPLICIT_BATCH"):
        return 1 << int(flags.EXPLICIT_BATCH)
    return 0  # TensorRT 10 weakly typed: networks are always explicit batch


def _parse(parser, model_bytes: Optional[bytes], model_path: str) -> None:
    """Run the ONNX parser; raise ModelError listing its first errors on one line."""
    ok = (parser.parse(model_bytes, model_path) if model_bytes is not None
          else parser.parse_from_file(model_path))
    if ok:
        return
    messages = []
    for index in range(min(parser.num_errors, 3)):
        err = parser.get_error(index)
        node = ""
        node_name = getattr(err, "node_name", None)  # TensorRT >= 10
        operator = getattr(err, "node_operator", None)
        if callable(node_name) and node_name():
            node = f"node {node_name()!r}" + (f" ({operator()})" if callable(operator) and operator() else "")
        elif err.node() >= 0:
            node = f"node #{err.node()}"
        messages.append(f"{node + ': ' if node else ''}{' '.join(str(err.desc()).split())}")
    more = f" (+{parser.num_errors - 3} more)" if parser.num_errors > 3 else ""
    raise ModelError(f"TensorRT's ONNX parser rejected {model_path}: "
                     f"{'; '.join(messages) or 'unknown error'}{more}")


def _make_config(trt, builder, network, settings: BuildSettings, mode: str):
    config = builder.create_builder_config()
    if settings.workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings.workspace_bytes))
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    if mode in (WEAKLY_TYPED, FLAG_BASED):
        for flag in ("INT8",) + (("FP16",) if settings.fp16 else ()):
            if not hasattr(trt.BuilderFlag, flag):
                raise ConfigError(f"TensorRT {trt.__version__} has no BuilderFlag.{flag}; drop --fp16 "
                                  f"and give the model FP16 casts instead (strongly typed networks take "
                                  f"types from the model)")
            config.set_flag(getattr(trt.BuilderFlag, flag))
    profile = _make_profile(builder, network, settings.profiles)
    if profile is not None:
        config.add_optimization_profile(profile)
    return config


def _make_profile(builder, network, profiles: Sequence[ShapeProfile]):
    """One optimization profile covering every network input with a dynamic dimension."""
    given = {p.name: p for p in profiles}
    profile = builder.create_optimization_profile()
    used = False
    for index in range(network.num_inputs):
        tensor = network.get_input(index)
        dims = tuple(tensor.shape)
        spec = given.get(tensor.name)
        if spec is None and any(d < 0 for d in dims):
            raise ConfigError(f"network input {tensor.name!r} has dynamic shape {list(dims)}; give it with "
                              f"--shapes {tensor.name}:MIN,OPT,MAX "
                              f"(e.g. 1x3x224x224,8x3x224x224,32x3x224x224)")
        if spec is None:
            continue
        profile.set_shape(tensor.name, spec.min, spec.opt, spec.max)
        used = True
    return profile if used else None


def _attach_timing_cache(config, cache_bytes: Optional[bytes]):
    """Create (or load) a timing cache and attach it to ``config``; return it."""
    cache = config.create_timing_cache(cache_bytes or b"")
    if cache is None and cache_bytes:
        logger.warning("the timing cache could not be loaded (another TensorRT version?); starting a new one")
        cache = config.create_timing_cache(b"")
    if cache is not None:
        config.set_timing_cache(cache, ignore_mismatch=False)
    return cache


# --------------------------------------------------------------------------- run and time
class EngineRunner:
    """Run a serialized engine on NumPy feeds with cuda-python memory and CUDA-event timing.

    Use as a context manager so device memory, stream and events are released.
    """

    def __init__(self, engine_bytes: bytes, verbose: bool = False):
        self.trt = import_tensorrt()
        self.cudart = import_cudart()
        require_gpu(self.cudart)
        self._logger = _make_logger(self.trt, verbose)
        self.runtime = self.trt.Runtime(self._logger)
        self.engine = self.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            detail = self._logger.errors[0] if self._logger.errors else "unknown error"
            raise QatError(f"TensorRT could not load the engine it just built: {detail}")
        self.context = self.engine.create_execution_context()
        self.stream = _check_cuda(self.cudart, self.cudart.cudaStreamCreate(), "cudaStreamCreate")
        self._buffers: Dict[str, Tuple[int, int]] = {}  # name -> (device pointer, bytes)
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        mode_in = self.trt.TensorIOMode.INPUT
        self.inputs = tuple(n for n in names if self.engine.get_tensor_mode(n) == mode_in)
        self.outputs = tuple(n for n in names if self.engine.get_tensor_mode(n) != mode_in)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Free device memory and the stream."""
        for pointer, _ in self._buffers.values():
            self.cudart.cudaFree(pointer)
        self._buffers.clear()
        if self.stream is not None:
            self.cudart.cudaStreamDestroy(self.stream)
            self.stream = None

    def _device(self, name: str, nbytes: int) -> int:
        pointer, size = self._buffers.get(name, (None, 0))
        if pointer is None or size < nbytes:
            if pointer is not None:
                self.cudart.cudaFree(pointer)
            pointer = _check_cuda(self.cudart, self.cudart.cudaMalloc(max(nbytes, 1)), "cudaMalloc")
            self._buffers[name] = (pointer, max(nbytes, 1))
        return pointer

    def _bind(self, feed: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Set shapes and addresses, copy inputs to the device; return host output arrays."""
        cudart, h2d = self.cudart, self.cudart.cudaMemcpyKind.cudaMemcpyHostToDevice
        for name in self.inputs:
            array = np.ascontiguousarray(feed[name],
                                         dtype=self.trt.nptype(self.engine.get_tensor_dtype(name)))
            self.context.set_input_shape(name, array.shape)
            pointer = self._device(name, array.nbytes)
            _check_cuda(cudart,
                        cudart.cudaMemcpyAsync(pointer, array.ctypes.data, array.nbytes, h2d, self.stream),
                        "cudaMemcpyAsync")
            self.context.set_tensor_address(name, pointer)
        host = {}
        for name in self.outputs:
            shape = tuple(self.context.get_tensor_shape(name))
            host[name] = np.empty(shape, dtype=self.trt.nptype(self.engine.get_tensor_dtype(name)))
            self.context.set_tensor_address(name, self._device(name, host[name].nbytes))
        return host

    def _enqueue(self) -> None:
        if not self.context.execute_async_v3(int(self.stream)):
            raise QatError("TensorRT execute_async_v3 failed; re-run with --verbose for TensorRT's log")

    def infer(self, feed: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
        """Run one batch and return its outputs (host arrays)."""
        cudart = self.cudart
        host = self._bind(feed)
        self._enqueue()
        d2h = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
        for name, array in host.items():
            pointer = self._buffers[name][0]
            _check_cuda(cudart,
                        cudart.cudaMemcpyAsync(array.ctypes.data, pointer, array.nbytes, d2h, self.stream),
                        "cudaMemcpyAsync")
        _check_cuda(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        return host

    def time(self, feed: Mapping[str, np.ndarray], iterations: int, warmup: int) -> List[float]:
        """GPU latency in milliseconds of ``iterations`` runs after ``warmup`` runs (CUDA events).

        Inputs are copied to the device once; each figure is the enqueue-to-finish GPU
        time of one batch, without host/device copies.
        """
        cudart = self.cudart
        self._bind(feed)
        _check_cuda(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        for _ in range(warmup):
            self._enqueue()
        _check_cuda(cudart, cudart.cudaStreamSynchronize(self.stream), "cudaStreamSynchronize")
        start = _check_cuda(cudart, cudart.cudaEventCreate(), "cudaEventCreate")
        end = _check_cuda(cudart, cudart.cudaEventCreate(), "cudaEventCreate")
        times = []
        try:
            for _ in range(iterations):
                _check_cuda(cudart, cudart.cudaEventRecord(start, self.stream), "cudaEventRecord")
                self._enqueue()
                _check_cuda(cudart, cudart.cudaEventRecord(end, self.stream), "cudaEventRecord")
                _check_cuda(cudart, cudart.cudaEventSynchronize(end), "cudaEventSynchronize")
                times.append(float(_check_cuda(cudart, cudart.cudaEventElapsedTime(start, end),
                                               "cudaEventElapsedTime")))
        finally:
            cudart.cudaEventDestroy(start)
            cudart.cudaEventDestroy(end)
        return times

    def layer_information(self) -> str:
        """The engine inspector's JSON description of every layer."""
        inspector = self.engine.create_engine_inspector()
        try:
            inspector.execution_context = self.context
        except AttributeError:  # older bindings name it ``context``
            inspector.context = self.context
        return inspector.get_engine_information(self.trt.LayerInformationFormat.JSON)


# --------------------------------------------------------------------------- layer analysis (pure Python)
_PRECISION_WORDS = (  # checked in order; the first word found in "Format/Datatype" names the precision
    ("bfloat16", "BF16"), ("int8", "INT8"), ("uint8", "UINT8"), ("fp8", "FP8"), ("fp16", "FP16"),
    ("half", "FP16"), ("fp32", "FP32"), ("float", "FP32"), ("int32", "INT32"), ("int64", "INT64"),
    ("bool", "BOOL"),
)
_HIGHER = {"FP32", "FP16", "BF16"}
_QDQ_LAYER_TYPES = {"scale", "quantize", "dequantize", "quantizelinear", "dequantizelinear"}
_NOOP_TYPES = {"noop", "no-op", "no_op"}


#: ONNX element types of the FP8 and 4-bit integer forms.
_FP8_TYPES, _INT4_TYPES = frozenset({17, 18, 19, 20}), frozenset({21, 22})


def model_precision(model) -> str:
    """``"fp8"`` when the ONNX model holds FP8 initializers (FP8 Q/DQ), ``"int4"`` when it holds INT4
    weights (weight-only), else ``"int8"``."""
    types = {t.data_type for t in model.graph.initializer}
    if types & _FP8_TYPES:
        return "fp8"
    return "int4" if types & _INT4_TYPES else "int8"


def tensor_precision(fmt: str) -> str:
    """Precision named by an inspector ``Format/Datatype`` string
    (``'Row major linear FP32'`` -> ``'FP32'``)."""
    words = re.findall(r"[a-z0-9]+", str(fmt).lower())
    for token, name in _PRECISION_WORDS:
        if token in words:
            return name
    return "UNKNOWN"


def _layer_origins(layer: Mapping) -> List[str]:
    """ONNX node names a fused layer came from (``Metadata`` when present, else the ``+``-joined name)."""
    meta = layer.get("Metadata")
    if isinstance(meta, str) and "ONNX Layer:" in meta:
        return [m.strip() for m in re.findall(r"ONNX Layer:\s*([^\]\x1e]+)", meta)]
    return [part.strip() for part in str(layer.get("Name", "")).split(" + ") if part.strip()]


def analyse_layers(info_json: str, qdq_nodes: Iterable[str] = ()) -> LayerSummary:
    """Count layers by precision and name Q/DQ nodes that TensorRT kept as standalone layers.

    Args:
        info_json: ``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``.
        qdq_nodes: names of the QuantizeLinear/DequantizeLinear nodes of the ONNX model.

    A layer's precision is that of its first input tensor (its compute type for
    convolutions and GEMMs). A Q/DQ node is "not fused" when a layer whose origins
    are only Q/DQ nodes converts between INT8 and a float type.
    """
    try:
        doc = json.loads(info_json)
    except ValueError:
        raise QatError("the engine inspector returned text that is not JSON") from None
    layers = doc.get("Layers", []) if isinstance(doc, dict) else []
    qdq = set(qdq_nodes)
    counts: Dict[str, int] = {}
    higher_names, unfused = [], []
    detailed = any(isinstance(layer, dict) for layer in layers)
    for layer in layers:
        if not isinstance(layer, dict):  # LAYER_NAMES_ONLY engines list bare names
            continue
        kind = str(layer.get("ParameterType") or layer.get("LayerType") or "").lower()
        if kind in _NOOP_TYPES:
            continue
        inputs = [t for t in layer.get("Inputs", []) if isinstance(t, dict)]
        outputs = [t for t in layer.get("Outputs", []) if isinstance(t, dict)]
        precision = tensor_precision(inputs[0].get("Format/Datatype", "")) if inputs else "UNKNOWN"
        counts[precision] = counts.get(precision, 0) + 1
        if precision in _HIGHER:
            higher_names.append(str(layer.get("Name", "?")))
        origins = _layer_origins(layer)
        if origins and _is_standalone_qdq(kind, origins, qdq, inputs, outputs):
            unfused.extend(o for o in origins if o in qdq or not qdq)
    total = sum(counts.values()) if detailed else len(layers)
    int8, fp8 = counts.get("INT8", 0), counts.get("FP8", 0)
    higher = sum(counts.get(p, 0) for p in _HIGHER)
    return LayerSummary(total=total, int8=int8, higher=higher, fp8=fp8,
                        other=(total - int8 - fp8 - higher) if detailed else 0,
                        by_precision=counts, higher_precision_layers=tuple(higher_names[:50]),
                        unfused_qdq=tuple(sorted(set(unfused))), detailed=detailed)


def _is_standalone_qdq(kind: str, origins: Sequence[str], qdq: set, inputs, outputs) -> bool:
    """A layer that only carries Q/DQ nodes and converts between INT8 (or FP8) and float."""
    only_qdq = all(o in qdq for o in origins) if qdq else kind in _QDQ_LAYER_TYPES
    if not only_qdq or not inputs or not outputs:
        return False
    int8_in = tensor_precision(inputs[0].get("Format/Datatype", "")) in ("INT8", "FP8")
    int8_out = tensor_precision(outputs[0].get("Format/Datatype", "")) in ("INT8", "FP8")
    return int8_in != int8_out


__all__ = [
    "ShapeProfile", "BuildSettings", "BuildResult", "LayerSummary", "EngineRunner", "INSTALL_HINT",
    "import_tensorrt", "import_cudart", "require_gpu", "choose_build_mode", "version_tuple", "build_engine",
    "analyse_layers", "tensor_precision", "STRONGLY_TYPED", "WEAKLY_TYPED", "FLAG_BASED",
    "converts_float_parts", "installed_tensorrt_version", "compare_precisions", "PrecisionComparison",
]


# --------------------------------------------------------------------------- precision map vs engine (pure)
#: Inspector precision each precision-map entry should show on its layer's first input (INT4 weight-only
#: layers read float activations: not compared).
_EXPECTED_ENGINE = {"int8": "INT8", "fp8": "FP8", "fp16": "FP16", "bf16": "BF16", "fp32": "FP32"}


@dataclass(frozen=True)
class PrecisionRow:
    """One compute node: the precision map's word and the engine layer that runs it."""

    node: str
    op_type: str
    expected: str
    layer: str = ""
    engine: str = ""
    status: str = "missing"   # "agrees", "differs", "missing" (no layer names it), "not compared"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"node": self.node, "op_type": self.op_type, "precision_map": self.expected,
                "layer": self.layer, "engine": self.engine, "status": self.status}


@dataclass(frozen=True)
class PrecisionComparison:
    """The precision map (from the ONNX model, before the build) beside the engine inspector's layers."""

    rows: Tuple[PrecisionRow, ...] = ()
    detailed: bool = True

    def count(self, status: str) -> int:
        """Rows of ``status``."""
        return sum(row.status == status for row in self.rows)

    def differing(self) -> Tuple[PrecisionRow, ...]:
        """The rows whose engine layer runs in another precision than the map says."""
        return tuple(row for row in self.rows if row.status == "differs")

    def summary(self, limit: int = 5) -> str:
        """One line: how many nodes agree, differ, are missing; the first differences named."""
        if not self.detailed:
            return "precision map vs engine: not compared (the engine has no detailed layer information)"
        shown = ", ".join(f"{r.node} (map {r.expected}, engine {r.engine})" for r in self.differing()[:limit])
        return (f"precision map vs engine: {self.count('agrees')} of {len(self.rows)} compute nodes agree, "
                f"{self.count('differs')} differ, {self.count('missing')} in no layer (folded), "
                f"{self.count('not compared')} not compared" + (f"; differ: {shown}" if shown else ""))

    def to_dict(self) -> dict:
        """JSON-ready form, layer by layer."""
        return {"detailed": self.detailed, "agree": self.count("agrees"), "differ": self.count("differs"),
                "missing": self.count("missing"), "not_compared": self.count("not compared"),
                "rows": [row.to_dict() for row in self.rows]}


def compare_precisions(precision_map, info_json: str) -> PrecisionComparison:
    """Put each compute node of ``precision_map`` ([`onnx_qat.check.precision.PrecisionMap`][])
    beside the engine layer that runs it (found by the ONNX node names in the inspector's layer
    ``Metadata`` or layer name) and the precision of that layer's first input.

    A node the map says runs quantized (INT8/FP8) agrees when its layer reads INT8/FP8; a float node
    when its layer reads that float type. Weight-only INT4 nodes are not compared (their layers read
    float activations). Nodes in no layer were folded or removed by TensorRT.
    """
    try:
        doc = json.loads(info_json)
    except ValueError:
        raise QatError("the engine inspector returned text that is not JSON") from None
    layers = doc.get("Layers", []) if isinstance(doc, dict) else []
    detailed = any(isinstance(layer, dict) for layer in layers)
    by_node: Dict[str, Tuple[str, str]] = {}
    for layer in layers:
        if not isinstance(layer, dict):
            continue
        inputs = [t for t in layer.get("Inputs", []) if isinstance(t, dict)]
        precision = tensor_precision(inputs[0].get("Format/Datatype", "")) if inputs else "UNKNOWN"
        for origin in _layer_origins(layer):
            by_node.setdefault(origin, (str(layer.get("Name", "?")), precision))
    rows = []
    for entry in precision_map.nodes:
        expected = _EXPECTED_ENGINE.get(entry.precision)
        found = by_node.get(entry.node)
        if found is None:
            rows.append(PrecisionRow(entry.node, entry.op_type, entry.precision))
        elif expected is None or not detailed:
            rows.append(PrecisionRow(entry.node, entry.op_type, entry.precision, found[0], found[1],
                                     "not compared"))
        else:
            status = "agrees" if found[1] == expected else "differs"
            rows.append(PrecisionRow(entry.node, entry.op_type, entry.precision, found[0], found[1], status))
    return PrecisionComparison(tuple(rows), detailed)
