"""Deployment targets: the forms the same placement and scales take in the output model.

A `Target` says which placement policy decides where Q/DQ goes and how the
inserted nodes look (integer types, zero points, clamping ranges). Two forms:

* ``"tensorrt"``: TensorRT explicit quantization, symmetric int8 everywhere (zero
  point 0, scale = amax / 127; activations clamp to [-128, 127], weights are stored in
  [-127, 127]); the scales of weights quantized from their own values are FP16 values
  (``weight_scale_grid``), as calibration's activation scales are; a per-channel constant Mul/Add
  after a quantized convolution is folded into its weight and bias first (``fold_scale_ops``).
* ``"ort-cpu"``: the same placement and scales for onnxruntime's CPU execution provider:
  activations uint8 with zero point 128 (bit-identical values, faster x86 kernels), or 0 where
  they are non-negative, and requantization points on quantized Conv outputs so onnxruntime
  forms ``QLinearConv``; a per-channel Mul/Add after a quantized Conv (an unfolded
  BatchNormalization) is folded into the Conv's quantized weight and bias first; a quantized MatMul
  is kept apart from its bias Add; with calibrated ranges, zero-point-0 tensors use the whole uint8
  grid and GEMM weights behind zero-point-128 inputs 7 bits (see `onnx_qat.insertion.ort_cpu`;
  ``onnx_qat.check(model, target="ort-cpu")`` checks the rules that apply to this form).

Targets are registered in `_TARGETS`; the inserter reads every dtype and zero point
from the target, never from constants of its own. A target is data only: it names its placement
policy (looked up by `onnx_qat.placement.policy.policy_for`) and its optional adapter (made by
`onnx_qat.insertion.adapters.make_adapter`), and imports neither, so the modules that read a target
never import back up. An adapter adjusts the placement and ScaleTable after ranges are known
(``calibration_tensors`` and ``adapt``), and may edit the graph after Q/DQ insertion (``adapt``'s
result's ``finish(edit)``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np

from ..errors import ConfigError


@dataclass(frozen=True)
class Target:
    """One deployment form of Q/DQ.

    Attributes:
        name: the ``target`` option value.
        description: one line for reports.
        activation_dtype: integer type of quantized activations (QuantizeLinear output).
        activation_zero_point: their zero point.
        policy: the name of the placement policy (a key of
            `onnx_qat.placement.policy.POLICIES`).
        adapter: None, or the name of the adapter (a key of `onnx_qat.insertion.adapters.ADAPTERS`): an
            object with ``calibration_tensors(index, placement)`` and ``adapt(index, placement,
            table, **calibrated)`` (see `onnx_qat.insertion.ort_cpu.OrtCpuAdapter`; when the ranges
            are calibrated in the same call and the adapter has ``nonnegative_inputs(model, data,
            placement)``, ``calibrated`` is ``nonnegative=<its result>, fine=True``; for a ScaleTable
            calibrated for the form, metadata `onnx_qat.scales.CALIBRATION_TARGET_KEY`, the same from
            ``nonnegative_bounds(index, placement, table)``); what ``adapt``
            returns may have a ``finish(edit)`` method, which ``onnx_qat.quantize`` calls with the
            `GraphEdit` after Q/DQ insertion
            (see `onnx_qat.insertion.ort_cpu.Adapted.finish`).
        weight_scale_grid: ``"fp16"``: the scales of weights whose range comes from their values are
            FP16 values, each the FP16 neighbour of ``amax / qmax`` that reconstructs its channel (or
            block) best, the weight quantized with it (`onnx_qat.formats.scale_grid.fp16_weight_scales`),
            so FP16 float parts store them unchanged; None: ``amax / qmax`` as float32.
        fold_scale_ops: True: a per-channel constant Mul/Add after a quantized Conv/ConvTranspose (an
            unfolded batch normalization) is folded into its float weight and bias before ranges and
            quantization (rule TRT1, `onnx_qat.graph.scale_folds`), as TensorRT fuses it at build time;
            False: the graph keeps them (the ``ort-cpu`` form folds its own way after insertion).
    """

    name: str
    description: str
    activation_dtype: type
    activation_zero_point: int
    policy: str = "tensorrt"
    adapter: Optional[str] = None
    weight_scale_grid: Optional[str] = None
    fold_scale_ops: bool = False

    def to_dict(self) -> dict:
        """JSON-ready description (used in reports). The weights' type and range are the numeric
        format's (`onnx_qat.formats.numeric`; INT8 for both targets): a target only adds the
        activations' form."""
        from ..formats.encoding import INT8_QRANGE

        return {
            "name": self.name,
            "description": self.description,
            "activation_dtype": np.dtype(self.activation_dtype).name,
            "activation_zero_point": self.activation_zero_point,
            "weight_dtype": "int8",
            "weight_range": list(INT8_QRANGE),
            "weight_scale_grid": self.weight_scale_grid,
        }


TENSORRT = Target(
    name="tensorrt",
    description="TensorRT explicit quantization: symmetric int8 Q/DQ, per-channel weights",
    activation_dtype=np.int8,
    activation_zero_point=0,
    policy="tensorrt",
    weight_scale_grid="fp16",
    fold_scale_ops=True,
)


ORT_CPU = Target(
    name="ort-cpu",
    description="onnxruntime CPU: uint8 activations with zero point 128, or 0 where non-negative, int8 "
                "per-channel weights, Conv outputs requantized for QLinearConv (per-channel Mul/Add after a "
                "Conv folded into it first), MatMuls kept apart from their bias Add",
    activation_dtype=np.uint8,
    activation_zero_point=128,
    policy="tensorrt",
    adapter="ort-cpu",
)

#: Registered targets by name.
_TARGETS: Dict[str, Target] = {"tensorrt": TENSORRT, "ort-cpu": ORT_CPU}


def get_target(target) -> Target:
    """The `Target` named ``target`` (a Target passes through)."""
    if isinstance(target, Target):
        return target
    if target is None:
        return TENSORRT
    found = _TARGETS.get(target)
    if found is None:
        known = ", ".join(sorted(_TARGETS))
        raise ConfigError(f"target {target!r} is not available in this version; available: {known}")
    return found
