"""``onnx_qat.quantize``: float ONNX + ranges -> TensorRT-ready Q/DQ ONNX.

The public entry point. It resolves and checks the options, then either runs the rewrite
(`onnx_qat.rewrite.rewrite_model`: load -> place -> ranges -> insert -> save) or, with
``min_cosine``, automatic mixed precision (`onnx_qat.accuracy.mixed`), which itself calls the
same rewrite. The accuracy tools import `onnx_qat.rewrite`, never this module, so no import
runs back up. The caller's model object and input file are never changed.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Mapping, Optional

from .config import QuantizeConfig
from .errors import ConfigError
from .formats.numeric import get_format
from .io.layout import with_layout
from .placement.marks import Placement
from .runtime.ray_workers import shared_cluster
from .rewrite import (QUANTIZED_OPS, REPORT_FORMAT, REPORT_VERSION, QuantizeResult,  # noqa: F401
                      check_sources, nested_indexes, nothing_to_quantize, rewrite_model,
                      refuse_non_finite_weights, refuse_quantized, softmax_ranges,
                      without_unreached_branches)


@shared_cluster()
def quantize(model, output=None, *, scales=None, data=None, method: Optional[str] = None,
             config: Optional[QuantizeConfig] = None, target: Optional[str] = None, exclude_nodes=None,
             exclude_op_types=None, min_channels: Optional[int] = None,
             include_attention: Optional[bool] = None, calibration_options: Optional[Mapping] = None,
             report=None, progress: bool = True, placement: Optional[Placement] = None,
             precision: Optional[str] = None, block_size: Optional[int] = None,
             min_cosine: Optional[float] = None, max_float_sites: Optional[int] = None, eval_data=None,
             int4_method: Optional[str] = None, fp8_method: Optional[str] = None,
             float_dtype: Optional[str] = None, keep_io_types: bool = True,
             state: Optional[Mapping[str, str]] = None, batch_axis: Optional[Mapping[str, int]] = None,
             latency=None, cpu_vnni="auto", optimize: Optional[str] = None,
             workers: Optional[int] = None, ray=None, **calibration_kwargs) -> QuantizeResult:
    """Insert QuantizeLinear/DequantizeLinear pairs where the target (TensorRT) wants them, in the
    numeric format ``precision`` (INT8 by default; FP8 E4M3; INT4 weight-only).

    Args:
        model: path to a float ONNX model, an ``onnx.ModelProto`` or an ``onnx_graphsurgeon.Graph``
            (never mutated; a Graph is exported with ``gs.export_onnx``, e.g. after graph surgery).
        output: where to write the Q/DQ model (atomically, after ``onnx.checker`` passed on the
            bytes to write, or from given scales the edit's evidence, `onnx_qat.graph.delta`), or None to
            only return it.
        scales: a [`ScaleTable`][onnx_qat.scales.ScaleTable], the path of its JSON file, or a mapping
            ``{activation tensor: amax}`` (made into a ScaleTable of activation ranges; weights
            then take their own max).
        data: calibration data (anything [`onnx_qat.load_data`][onnx_qat.io.data.load_data] accepts); ranges
            are then computed with [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]. Give exactly
            one of ``scales`` and ``data`` (``precision="int4"`` needs neither: without ``data`` its weights
            are rounded to nearest; with ``data`` an activation-aware scale search runs first, see
            `onnx_qat.formats.awq`).
        method: calibration method when ``data`` is given: ``auto``, ``max``, ``percentile``,
            ``entropy`` or ``mse`` (see [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]). None:
            ``auto``. With ``min_cosine``, ``auto`` (the default) searches each activation tensor's range
            among ``auto``'s candidates together with the float sites (`onnx_qat.accuracy.ranges`);
            another method calibrates once and the search chooses only the float sites.
        config: a [`QuantizeConfig`][onnx_qat.config.QuantizeConfig]; the keywords ``target``,
            ``exclude_nodes``, ``exclude_op_types``, ``min_channels``, ``include_attention``,
            ``precision``, ``block_size``, ``int4_method`` and ``fp8_method`` override its fields.
        calibration_options: extra keywords for [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate]
            (e.g. ``batch_size``); further keyword arguments (``percentile=...``, ``batch_size=...``) are
            added to them.
        report: a path: also write [`QuantizeResult.to_report`][onnx_qat.rewrite.QuantizeResult.to_report] as
            JSON (atomically).
        progress: show progress bars on stderr.
        placement: a precomputed [`Placement`][onnx_qat.placement.marks.Placement] to insert
            instead of the target policy's (e.g. the one ``tf_bridge.export_onnx`` derives
            from a Keras QAT model). Its node names are the ones
            [`onnx_qat.place`][onnx_qat.placement.policy.place] uses; the placement options
            (``exclude_nodes``...) are then not applied.
        precision: ``"int8"`` (default), ``"fp8"`` (E4M3FN Q/DQ, scale amax / 448, opset >= 19)
            or ``"int4"`` (blockwise weight-only DequantizeLinear on MatMul/Gemm weights, opset
            21); see `onnx_qat.formats.numeric`.
        block_size: values per INT4 weight scale (default 128; ``precision="int4"``).
        int4_method: how INT4 weights are rounded: ``"rtn"``, ``"awq"`` or ``"gptq"`` (AWQ's
            scales, then error-compensating rounding on the calibration data's Hessians,
            `onnx_qat.formats.gptq`); default ``awq`` with ``data``, ``rtn`` without.
        fp8_method: how FP8 MatMul/Gemm weights are rounded: ``"rtn"`` (round to nearest, the
            default) or ``"gptq"`` (error-compensating rounding on each output channel's E4M3 grid,
            driven by ``data``'s activations, `onnx_qat.formats.gptq.apply_gptq_fp8`; needs ``data``).
        min_cosine: automatic mixed precision: leave the fewest sites (`onnx_qat.accuracy.sites`)
            in float so that the output cosine against the float model reaches this on
            ``eval_data`` (default: the last quarter of ``data``, then not calibrated on); the model
            built is measured again. ``QuantizeResult.accuracy`` tells which sites stay float and
            (``method="auto"``, the default) each quantized site's range candidate. With ``auto`` the
            minimum must also hold for a lower bound, over the evaluation samples and the first
            calibration samples, of the cosine as many new inputs would give
            (`onnx_qat.accuracy.judged`; ``accuracy["judged"]``), and the model written is the one
            the search measured (rule TRT1's folds not applied).
            Every ``precision``: with ``fp8`` the sites are the INT8 ones (plus the attention
            products), with ``int4`` a site is one weight's blockwise DequantizeLinear (AWQ runs
            once on the calibration part of ``data``; without ``data``, round to nearest).
        max_float_sites: with ``min_cosine``: at most this many sites in float (default: no limit).
        eval_data: with ``min_cosine`` or ``optimize``: the data the output cosine is measured on.
        float_dtype: the type of everything Q/DQ leaves in float: ``"fp32"`` (default), ``"fp16"``
            or ``"bf16"``, for every ``precision`` (TensorRT 11 builds strongly typed networks: FP32
            float parts run in FP32). The Q/DQ model is converted by
            [`onnx_qat.formats.float_parts.cast_float_parts`][] (opset raised to 19, to 22 for BF16), which
            keeps FP32 what must stay FP32 (ranges beyond the type, scales it cannot hold, ops TensorRT
            does not run in it, and, measured on the first samples of ``data``, any node whose
            conversion costs more than 0.002 of output cosine against the float model);
            `QuantizeResult.float_parts` lists them with their reasons.
        keep_io_types: with ``float_dtype`` ``fp16``/``bf16``: graph inputs and outputs keep their
            types, with a Cast at the boundary (default); False: they take ``float_dtype`` too.

        state: ``{output: input}`` of a stateful model (``{"stateN": "state"}`` for silero-vad):
            calibration (and the ``min_cosine`` search) run the data in order, each run's ``output``
            fed to the next run as ``input``; the first feed gives the initial state.
        batch_axis: ``{input: axis}`` for inputs whose batch axis is not the first (``{"state": 1}``).
        latency: ``target="ort-cpu"`` only: quantize a site (Conv, Gemm, MatMul) only where
            onnxruntime's integer kernel is faster than float on this machine, at the model's shapes
            (`onnx_qat.placement.cpu_latency`). None or ``"off"`` (default): every site the
            placement picks; ``"measure"`` (or True): time each kind of site once per machine and keep
            the times in this machine's cache file (keyed by CPU model, kernel-selecting CPU flags,
            onnxruntime version and threads); a path: that latency profile file, read and extended
            (e.g. one measured on the deployment machine); or a
            `LatencyOptions` (``threads``, ``batch`` of
            the deployment session, ``retime``). The result is timed against FP32 at the end
            (``QuantizeResult.latency``, the report's ``latency``); that timing is kept in the profile
            under a hash of the models' bytes, this machine, threads and batch, so an identical second
            run reuses it (``whole_model["source"]`` is ``"latency profile"``, not ``"measured"``;
            ``LatencyOptions(retime=True)`` times it again); when it is not faster, the
            least-gaining half of its integer sites is kept float too and the models are timed once
            more, the faster written (``latency["fallback"]``); a note says so plainly when the
            written model is still not faster, within FP32's spread; clearly slower (above FP32's upper
            quartile), nothing is written (`PlacementError`) unless ``LatencyOptions(allow_slower=True)``.
        cpu_vnni: ``target="ort-cpu"`` with ``data`` (or ``scales`` from ``calibrate(..., target="ort-cpu")``,
            whose ranges count as calibrated): the width of Conv/Gemm/MatMul weights behind zero-point-128
            inputs. ``"auto"`` (default): 8 bits when the machine quantizing the model sums int8 dot products
            in 32 bits (x86 AVX-512 VNNI, AVX-VNNI or AMX; ARM64), else 7 (a given latency profile from
            another machine that records its choice is followed instead); ``True``: 8 bits, the model will run
            on such CPUs only (more accurate; on an x86 CPU with AVX2 only, onnxruntime's 16-bit pair sums can
            then overflow); ``False``: 7 bits, exact on every CPU. The choice and why:
            ``QuantizeResult.ort_cpu`` and a note. See `onnx_qat.placement.cpu_latency.resolve_cpu_vnni`,
            `onnx_qat.insertion.ort_cpu`. With ``data`` the ``ort-cpu`` form's INT8 Conv biases also absorb
            the mean error of their rounded weights where that lowers the output error on the calibration data
            (rule CPU7, `onnx_qat.insertion.ort_cpu_bias`; ``QuantizeResult.ort_cpu["bias_correction"]``); a
            ScaleTable does not carry that correction, so with ``scales`` it is left out (a note).
        optimize: ``"accuracy"``: also run the post-training steps of `onnx_qat.accuracy.optimize`
            (cross-layer equalization, activation smoothing, each activation's range chosen among
            ``auto``'s candidates, each INT8 weighted op's integers and bias reconstructed on the
            quantized model's own inputs, or where that is undone each bias alone corrected), each
            kept only where it raises the output cosine on
            ``eval_data``
            (default: the last quarter of ``data``, then not calibrated on); ``QuantizeResult.accuracy``
            lists what each step gained. Needs ``data``; slower than the default (several calibrations
            and evaluation runs). Does not combine with ``min_cosine``, ``state``, ``latency`` or
            ``cpu_vnni``.
        workers: worker processes the calibration's batches are split over (contiguous parts, the
            collectors merged exactly: `onnx_qat.calibration.parallel`) and, with ``min_cosine``, the
            search's settings run on (`onnx_qat.accuracy.parallel`), each with its own sessions and
            ``cores // workers`` onnxruntime threads; the model written is identical for any count.
            ``1``: in this process. None (the default): one per usable core within memory, and this
            process alone when the work is estimated to be too short to gain from workers
            (docs/performance.md, "Work spread over cores and machines"). A stateful model (``state``)
            is calibrated in one process. Refused (`ConfigError`) where there is nothing to spread: a
            rewrite from ``scales`` without ``data`` or ``min_cosine``, and ``optimize``.
        ray: the same work as Ray actors instead of local processes: True for the cluster
            ``ray.init()`` finds (``RAY_ADDRESS``) or starts locally, or a cluster address
            (``"auto"``, ``"ray://HOST:10001"``); ``workers`` actors (None: one per CPU of the cluster).
            Needs the ``ray`` extra (`onnx_qat.runtime.ray_workers`).

    Raises:
        PlacementError: the model is already quantized, or nothing in it can be quantized,
            or a given ``placement`` names tensors or nodes the model does not have; with ``latency``,
            when every site is faster in float or the fastest quantized model is still slower than
            FP32 (nothing is written).
        ScalesError: the ScaleTable names unknown tensors or lacks a quantized activation.
        ModelError, DataError, OutputError, ConfigError: bad model, data, paths or options
            (ModelError also when ``onnx.checker`` refuses the model to write: nothing is written).
        AccuracyError: ``min_cosine`` cannot be reached within ``max_float_sites`` (nothing is written).
    """
    config = QuantizeConfig.from_options(config, target=target, exclude_nodes=exclude_nodes,
                                         exclude_op_types=exclude_op_types, min_channels=min_channels,
                                         include_attention=include_attention, precision=precision,
                                         block_size=block_size, int4_method=int4_method,
                                         fp8_method=fp8_method, float_dtype=float_dtype)
    if not isinstance(keep_io_types, bool):
        raise ConfigError(f"keep_io_types must be True or False, got {keep_io_types!r}")
    if config.float_dtype != "fp32":
        from .formats.float_parts import quantize_with_float_parts

        return quantize_with_float_parts(
            lambda: quantize(model, None, scales=scales, data=data, method=method,
                             config=replace(config, float_dtype="fp32"), progress=progress,
                             placement=placement,
                             min_cosine=min_cosine, max_float_sites=max_float_sites, eval_data=eval_data,
                             optimize=optimize, calibration_options=calibration_options,
                             state=state, batch_axis=batch_axis, latency=latency, cpu_vnni=cpu_vnni,
                             workers=workers, ray=ray, **calibration_kwargs),
            model, output, report, data=with_layout(data, state=state, batch_axis=batch_axis),
            float_dtype=config.float_dtype, keep_io_types=keep_io_types, inputs=(model, scales, data),
            progress=progress)
    fmt = get_format(config.precision)
    if config.int4_method in ("awq", "gptq") and data is None:
        raise ConfigError(f"int4_method {config.int4_method!r} needs calibration data (data, --data)")
    if config.fp8_method == "gptq" and data is None:
        raise ConfigError("fp8_method 'gptq' needs calibration data (data, --data)")
    if config.fp8_method == "gptq" and (min_cosine is not None or max_float_sites is not None):
        raise ConfigError("fp8_method 'gptq' does not combine with min_cosine (mixed precision rounds "
                          "FP8 weights to nearest)")
    if state and ((fmt.weight_only and data is not None) or config.fp8_method == "gptq"):
        raise ConfigError("state applies to calibration and the min_cosine search; the activation-aware "
                          "weight rounding (int4 awq/gptq, fp8 gptq) does not run stateful models")
    data = with_layout(data, state=state, batch_axis=batch_axis)
    eval_data = with_layout(eval_data, state=state, batch_axis=batch_axis)
    latency_options = _latency_options(latency, config, placement, min_cosine, max_float_sites, eval_data)
    if not (isinstance(cpu_vnni, bool) or (isinstance(cpu_vnni, str) and cpu_vnni == "auto")):
        raise ConfigError(f"cpu_vnni must be True, False or 'auto', got {cpu_vnni!r}")
    if cpu_vnni is True and (config.target != "ort-cpu" or min_cosine is not None
                             or (data is None and scales is None)):
        raise ConfigError("cpu_vnni applies to target 'ort-cpu' with calibration data (data) or a ScaleTable "
                          "calibrated for it, without min_cosine")
    if (workers is not None or ray not in (None, False)) and (
            optimize is not None or (data is None and min_cosine is None)):
        raise ConfigError("workers and ray spread calibration (data) and min_cosine's search; they do not "
                          "apply to a rewrite from scales alone or to optimize='accuracy'")
    if data is not None or min_cosine is not None:  # a rewrite from scales never loads calibration
        from .calibration.parallel import worker_spec

        workers = worker_spec(workers, ray)  # a bad count, or Ray missing: one line before any work
    calib_kw = {**dict(calibration_options or {}), **calibration_kwargs}
    check_sources(scales, data, method, calib_kw, weight_only=fmt.weight_only)
    if optimize is not None:
        from .accuracy.optimize import check_optimize, quantize_optimized

        check_optimize(optimize)
        if data is None or min_cosine is not None or max_float_sites is not None or placement is not None:
            raise ConfigError("optimize='accuracy' needs data, and does not combine with scales, min_cosine "
                              "or a placement")
        if state or latency_options is not None or cpu_vnni is True:
            raise ConfigError("optimize='accuracy' does not combine with state, latency or cpu_vnni")
        return quantize_optimized(model, output, data=data, eval_data=eval_data,
                                  method=method or _default_method(), config=config, calib_kw=calib_kw,
                                  report=report, progress=progress)
    if min_cosine is not None or max_float_sites is not None or eval_data is not None:
        from .accuracy.mixed import check_options, quantize_mixed

        check_options(min_cosine, max_float_sites)
        if min_cosine is None or placement is not None:
            raise ConfigError("eval_data applies with min_cosine; min_cosine does not take a placement")
        return quantize_mixed(model, output, min_cosine=min_cosine, max_float_sites=max_float_sites,
                              eval_data=eval_data, scales=scales, data=data, method=method or "auto",
                              config=config, calib_kw=calib_kw, report=report, progress=progress,
                              workers=workers)
    if data is not None:  # calibration's batches on `workers` processes (onnx_qat.calibration.parallel)
        calib_kw = {**calib_kw, "workers": workers}
    return rewrite_model(model, output, scales=scales, data=data,
                         method=method or (_default_method() if data is not None else None),
                         config=config, calib_kw=calib_kw, report=report, progress=progress,
                         placement=placement, latency=latency_options, cpu_vnni=cpu_vnni)


def _default_method() -> str:
    """The calibration method used when none is given (`onnx_qat.calibration.runner.DEFAULT_METHOD`),
    imported only when calibration runs: a rewrite from given scales does not load the calibration
    package."""
    from .calibration.runner import DEFAULT_METHOD

    return DEFAULT_METHOD


def _latency_options(latency, config: QuantizeConfig, placement, min_cosine, max_float_sites, eval_data):
    """The resolved ``latency`` option (`LatencyOptions` or
    None); ConfigError where it does not apply."""
    if latency is None or latency is False or latency == "off":
        return None
    from .placement.cpu_latency import LatencyOptions

    options = LatencyOptions.resolve(latency)
    if config.target != "ort-cpu" or config.precision != "int8":
        raise ConfigError("latency placement applies to target 'ort-cpu' with precision 'int8' "
                          f"(got target {config.target!r}, precision {config.precision!r})")
    if placement is not None:
        raise ConfigError("latency placement decides the placement itself: do not give one")
    if min_cosine is not None or max_float_sites is not None or eval_data is not None:
        raise ConfigError("latency placement does not combine with min_cosine (mixed precision)")
    return options
