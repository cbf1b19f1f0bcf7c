"""export_onnx: a trained Keras QAT model -> TensorRT-ready Q/DQ ONNX with the learned scales.

Steps (each checked; nothing is written unless all pass):

1. the float twin ([`tf_bridge.wrap.float_model`][]: same layers, trained weights,
   inference mode, no quantizers) is converted with tf2onnx at a pinned opset, each
   BatchNormalization kept as a Mul/Add beside its Conv (as Keras computes it);
2. every Keras quantizer is mapped to its ONNX tensor by structure (`tf_bridge.mapping`:
   layer scopes of the tf2onnx node names and the topology of both graphs; weight values with
   the BatchNorm fold factor confirm each weight);
3. [`onnx_qat.quantize`][onnx_qat.quantize.quantize] inserts exactly those Q/DQ pairs with those ranges (no
   recalibration). A target that needs ranges no Keras quantizer observes (``ort-cpu``:
   Conv outputs requantized for onnxruntime's integer kernels, typically before a residual
   Add) gets them from ``sample_data`` when the caller gives it (max |x|, as
   [`onnx_qat.calibrate`][onnx_qat.calibration.runner.calibrate] computes it); generated samples are never
   used as ranges;
4. parity: the Q/DQ model runs in onnxruntime against the Keras QAT model (run in TensorFlow); its
   difference must be at most 10% of the float ONNX model's difference from the Keras QAT model, at
   most ``ABS_LIMIT`` (2%) of the Keras output's range over the samples (so a float twin whose own
   output explodes cannot make a large difference pass), with top-1 agreement >= 99%. A failure
   names the layers where the two models part. TensorFlow and onnxruntime add a convolution's
   products in different orders; their sums differ in the last bit, a value lying on a quantizer's
   rounding boundary then moves by a whole step in one engine and not the other, and deeper layers
   carry that on. So when that comparison fails, the Keras QAT model's own graph (fake quantization
   included) is converted by tf2onnx and run in onnxruntime (`keras_qat_in_onnxruntime`), and
   the verdict has two parts (`split_parity`). **The export**: the Q/DQ model against that
   run, which shares its arithmetic, by the same three limits; this is where an error of the export
   would show. **The engines**: the two runs of the Keras model must agree within 10% of the float
   difference and 2% of the range, or within ``SENSITIVITY_FACTOR`` times the **rounding
   sensitivity** of the Q/DQ model (the same model with every convolution output, every reduction
   output and every computed tensor a quantizer reads changed by two units in the last place: the
   size of the cascade a last-bit difference starts in this network, the largest of three draws of
   the nudges' signs). The second way passes, named in the text
   ("TensorFlow and onnxruntime differ by a rounding cascade") and logged as a warning: the export
   is proven on equal arithmetic, and what remains is the Keras model's own non-reproducibility
   across engines, measured, not assumed. Beyond both, it fails. If the Keras graph cannot be
   converted, a difference from the run in TensorFlow that only the rounding sensitivity explains
   fails as a ``"rounding cascade"`` (nothing separates the export from the engines then). A target
   other than ``tensorrt`` (``ort-cpu``) is checked as deployed against the tensorrt form of the
   same scales (`deployed_parity`);
5. the Q/DQ model, its ScaleTable JSON (and optionally the float ONNX model) are
   written atomically, and [`onnx_qat.check`][onnx_qat.check.check] gives the TensorRT verdict.

One module per step: `tf_bridge.convert` (1), `tf_bridge.mapping` (2),
`tf_bridge.insert` (3), `tf_bridge.parity` (4), `tf_bridge.report` (5); their
public names are importable from here as before.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import replace
from types import MappingProxyType
from typing import List, Tuple

import numpy as np

from onnx_qat.errors import ExportError
from onnx_qat.io.files import check_output_path

from .convert import (GRAPPLER_PASSES, Tf2onnxLog, _tf2onnx_without_conv_folding,  # noqa: F401
                      check_converted, convert_float_twin)
from .insert import _quantize, _with_target_ranges
from .mapping import KerasOnnxMapping, map_quantizers
from .onnx_values import run_with_tensors
from .parity import (ABS_LIMIT, DEPLOYED_FACTOR, RATIO_LIMIT, ROUNDING_CASCADE,  # noqa: F401
                     SENSITIVITY_DRAWS, SENSITIVITY_FACTOR, TOP1_LIMIT, DeployedParity, LayerDiff,
                     OutputParity, Parity,
                     _fail_loudly, _parity, deployed_parity, keras_qat_in_onnxruntime, output_parity,
                     rounding_sensitivity, split_parity, worst_layers)
from .report import ExportReport

logger = logging.getLogger(__name__)

GENERATED_SAMPLES = 8


def check_exportable(model, where: str = "model") -> None:
    """Raise ExportError unless ``model`` (and every nested model) is Functional or Sequential."""
    import keras
    from keras.src.models.functional import Functional

    if not isinstance(model, keras.Model):
        raise ExportError(f"export_onnx: {where} must be a keras.Model, got {type(model).__name__}")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise ExportError(f"export_onnx: {where} '{model.name}' is a subclassed model "
                          f"({type(model).__name__}); "
                          "rebuild it as a Functional or Sequential model, quantize that with "
                          "tf_bridge.quantize_model, train it and export it")
    for layer in model.layers:
        if isinstance(layer, keras.Model):
            check_exportable(layer, "nested model")


def _input_arrays(q_model, sample_data) -> Tuple[List[np.ndarray], bool]:
    """Sample inputs as float32 arrays, one per model input (generated when None)."""
    specs = list(q_model.inputs)
    if sample_data is None:
        rng = np.random.default_rng(0)
        arrays = []
        for t in specs:
            shape = tuple(t.shape[1:])
            if any(d is None for d in shape):
                raise ExportError(f"export_onnx: input '{t.name}' has an unknown dimension {tuple(t.shape)}; "
                                  "give sample_data")
            arrays.append(rng.normal(0.0, 1.0, (GENERATED_SAMPLES, *shape)).astype(np.float32))
        return arrays, True
    arrays = list(sample_data) if isinstance(sample_data, (list, tuple)) else [sample_data]
    arrays = [np.asarray(a) for a in arrays]
    if len(arrays) != len(specs) or any(a.ndim != len(t.shape) for a, t in zip(arrays, specs)):
        raise ExportError(f"export_onnx: sample_data must be {len(specs)} array(s) shaped like the model "
                          f"input(s) {[tuple(t.shape) for t in specs]} with a batch axis")
    return [a.astype(np.float32) if a.dtype == np.float64 else a for a in arrays], False


def _paths(path, save_scales: bool, save_float: bool):
    out = check_output_path(path, what="output model")
    stem = out.name[:-5] if out.name.endswith(".onnx") else out.name
    scales = check_output_path(out.with_name(stem + ".scales.json"), inputs=(out,), what="scales") \
        if save_scales else None
    float_path = check_output_path(out.with_name(stem + ".float.onnx"), inputs=(out,), what="float model") \
        if save_float else None
    return out, scales, float_path


def export_onnx(q_model, path, *, opset: int = 17, target: str = "tensorrt", sample_data=None,
                save_scales: bool = True, save_float: bool = False, strict: bool = True,
                progress: bool = True, precision: str = "int8", float_dtype: str = "fp32") -> ExportReport:
    """Export a (trained, calibrated) Keras QAT model to a Q/DQ ONNX model with its learned scales.

    Args:
        q_model: a model returned by [`tf_bridge.quantize_model`][] (Functional or
            Sequential, nested models allowed), calibrated and/or trained.
        path: the Q/DQ ``.onnx`` file to write.
        opset: the ONNX opset tf2onnx converts to (>= 13).
        target: the [`onnx_qat.quantize`][onnx_qat.quantize.quantize] deployment target.
        sample_data: inputs for mapping and parity (an array, or a list with one array per
            model input); None generates 8 standard-normal samples. With a target that
            requantizes tensors no quantizer observes (``ort-cpu``), given data also supplies
            their ranges (max |x|); generated samples do not (those Convs keep a float output).
        save_scales: also write the ScaleTable JSON as ``<name>.scales.json`` beside ``path``
            (the learned ranges plus, for ``ort-cpu`` with ``sample_data``, the ranges of its
            requantization points, so ``onnx-qat quantize --scales`` gets the same model).
        save_float: also write the float ONNX model as ``<name>.float.onnx`` (its quantized
            weights snapped to the Keras int8 grid, so ``onnx-qat quantize`` with the scales
            reproduces the Q/DQ model).
        strict: raise when parity fails (nothing written); False writes the files and
            returns a failing report.
        progress: show progress on stderr.
        precision: ``"int8"`` (default) or ``"fp8"``: the same learned amax written as FP8 E4M3 Q/DQ
            (``onnx_qat.quantize(precision="fp8")``, target ``tensorrt``), with parity measured
            against the Keras model run with FP8 fake quantization (``tf_bridge.fake_quant.numerics``).
        float_dtype: the type of the float parts of the written model: ``"fp32"`` (default),
            ``"fp16"`` or ``"bf16"`` (target ``tensorrt``). Parity is measured with FP32 float parts;
            the Q/DQ model is then converted by [`onnx_qat.formats.float_parts.cast_float_parts`][]
            with the learned ranges, measured on ``sample_data`` against the float model (a node whose
            conversion costs more than 0.002 of output cosine stays FP32);
            `ExportReport.float_parts` lists the nodes kept FP32 with their reasons.

    Returns:
        An [`ExportReport`][tf_bridge.export.ExportReport] (paths, mapping table, parity, check verdict).

    Raises:
        ExportError: subclassed model, a weight or range that is NaN or Inf (named first),
            uncalibrated or unmappable quantizer (named),
            tf2onnx failure, or (``strict``) failed parity.
        OutputError: an output path cannot be written.
    """
    from onnx_qat.check import check
    from onnx_qat.io.models import load_model, save_model
    from onnx_qat.quantize import quantize

    from .describe import iter_quantizer_layers
    from .finite import check_finite
    from .wrap import float32_compute
    from .wrap import float_model as float_twin

    from .fake_quant import numerics

    if precision not in ("int8", "fp8"):
        raise ExportError(f"export_onnx: precision must be 'int8' or 'fp8', got {precision!r} (int4 is "
                          "weight-only: onnx-qat quantize --precision int4 on the float model)")
    if float_dtype not in ("fp32", "fp16", "bf16"):
        raise ExportError(f"export_onnx: float_dtype must be 'fp32', 'fp16' or 'bf16', got {float_dtype!r}")
    if float_dtype != "fp32" and target != "tensorrt":
        raise ExportError(f"export_onnx: float_dtype {float_dtype!r} is a TensorRT form; target {target!r} "
                          "keeps FP32 float parts")
    check_exportable(q_model)
    check_finite(q_model)
    if not any(True for _ in iter_quantizer_layers(q_model)):
        raise ExportError(f"export_onnx: model '{q_model.name}' has no tf_bridge quantizers; "
                          "quantize it with tf_bridge.quantize_model first")
    out, scales_path, float_path = _paths(path, save_scales, save_float)
    inputs, generated = _input_arrays(q_model, sample_data)
    step = _Steps(progress)
    step("float twin -> tf2onnx")
    with step.part("float twin"):
        twin = float_twin(q_model)
    with step.part("tf2onnx"):
        float_model = load_model(convert_float_twin(twin, opset))
    del twin
    feeds = {i.name: a for i, a in zip(float_model.graph.input, inputs)}
    step("map quantizers")
    with step.part("float ONNX model in onnxruntime"):
        float_values = run_with_tensors(float_model, feeds)
    # a mixed-precision model computes in float32 from here to the parity's end, as its twin does
    with float32_compute(q_model) as float32_layers:
        if float32_layers:
            logger.info("export_onnx: %d layer(s) of a mixed-precision policy exported and checked as their "
                        "float32 computation", len(float32_layers))
        mapping = map_quantizers(q_model, float_model)
        _refuse_without_qdq(mapping)
        table = mapping.scales if generated else _with_target_ranges(mapping, target, feeds)
        step("insert Q/DQ")
        result, reproducible = _quantize(quantize, float_model, mapping, target, table, precision)
        step("parity in onnxruntime")
        with numerics(precision), step.part("Keras QAT model in TensorFlow"):
            keras_out = q_model(inputs if len(inputs) > 1 else inputs[0], training=False)
        keras_tf = [np.asarray(v) for v in _outputs(keras_out)]
        reference = result if result.target == "tensorrt" else _quantize(quantize, float_model, mapping,
                                                                          "tensorrt", mapping.scales)[0]
        parity = _parity(q_model, mapping, reference, float_model, float_values, feeds, inputs, keras_tf,
                         opset, generated, part=step.part)
    if reference is not result:
        names = [o.name for o in float_model.graph.output]
        parity = replace(parity, deployed=deployed_parity(
            result.target, result.model, reference.model, feeds, names, keras_tf,
            [float_values[n] for n in names]))
    if not parity.passed:
        _fail_loudly(parity, strict)
    parts = None
    if float_dtype != "fp32":
        from onnx_qat.formats.float_parts import cast_float_parts

        with step.part(f"float parts in {float_dtype}"):
            parts = cast_float_parts(result.model, float_dtype, scales=table, data=feeds,
                                     reference=float_model)
        result = replace(result, model=parts.model, float_parts=parts)
    step("write")
    if float_path is not None:
        save_model(mapping.model, float_path, inputs=(out,))
    if scales_path is not None:
        table.save(scales_path)
    save_model(result.model, out)
    verdict = check(result.model, target=result.target)
    step.done()
    report = ExportReport(out, scales_path, float_path, int(opset), result.target, mapping.entries, parity,
                          verdict, MappingProxyType(dict(result.summary)),
                          reproducible and not mapping.baked, mapping.baked, tuple(result.requantization),
                          tuple(step.timings), parts, tuple(float32_layers))
    logger.info("%s", report)
    return report


def _refuse_without_qdq(mapping: KerasOnnxMapping) -> None:
    """A model whose quantizers give no Q/DQ pair at all (only weights without a quantized input,
    baked into float): TensorRT runs a Conv/MatMul in INT8 only with both quantized (placement rule
    4), so no INT8 model can be written; refused rather than written as a float model."""
    if mapping.placement.activations or mapping.placement.weights:
        return
    weights = ", ".join(e.keras for e in mapping.entries)
    raise ExportError(f"export_onnx: no Q/DQ pair to write: the only quantized tensors are weights whose "
                      f"layer input is not quantized ({weights}), and TensorRT runs a layer in INT8 only "
                      "with its input and weight quantized; quantize the inputs too (quantize_input=True)")


def _outputs(value) -> list:
    import keras

    return list(keras.tree.flatten(value))


class _Steps:
    """Progress lines on stderr (one per step, and the time each took at the end) and the seconds
    of every step and timed part (`ExportReport.timings`)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and os.environ.get("TF_BRIDGE_QUIET") is None
        self.count = 0
        self.timings: List[Tuple[str, float]] = []
        self._current: Tuple[str, float] = ("", 0.0)
        self._start = time.perf_counter()

    def __call__(self, what: str) -> None:
        self._close()
        self.count += 1
        self._current = (what, time.perf_counter())
        logger.info("export_onnx: %s", what)
        if self.enabled:
            print(f"export_onnx [{self.count}/5] {what}", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def part(self, what: str):
        """Time a part of the current step (recorded as ``"<step>: <part>"``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings.append((f"{self._current[0]}: {what}", time.perf_counter() - start))

    def _close(self) -> None:
        what, start = self._current
        if what:
            self.timings.append((what, time.perf_counter() - start))
            logger.info("export_onnx: %s took %.1f s", what, self.timings[-1][1])
            self._current = ("", 0.0)

    def done(self) -> None:
        self._close()
        if self.enabled:
            steps = ", ".join(f"{w} {t:.1f} s" for w, t in self.timings if ": " not in w)
            print(f"export_onnx: done in {time.perf_counter() - self._start:.1f} s ({steps})",
                  file=sys.stderr, flush=True)
