"""Step 5 of [`tf_bridge.export_onnx`][]: what was written and proved, as
[`ExportReport`][tf_bridge.report.ExportReport]."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Tuple

from .mapping import MappingEntry
from .parity import Parity


@dataclass(frozen=True)
class ExportReport:
    """What [`export_onnx`][tf_bridge.export_onnx] wrote and proved.

    Attributes:
        path: the Q/DQ ONNX model.
        scales_path: its ScaleTable JSON (None with ``save_scales=False``).
        float_path: the float ONNX model (None unless ``save_float=True``).
        opset, target: as requested.
        mapping: one `MappingEntry` per Keras quantizer.
        parity: the `Parity` verdict against the Keras QAT model.
        check: the [`onnx_qat.check.CheckReport`][] of the Q/DQ model under the rules of
            its ``target`` (``onnx_qat.check(model, target=...)``).
        summary: counts from [`onnx_qat.quantize`][onnx_qat.quantize.quantize].
        cli_reproducible: True when ``onnx-qat quantize <float> --scales <json>`` (the default
            placement) gives this very model; False when the Keras placement differs from the
            default one (the Q/DQ model then comes from the Keras placement).
        baked: weights stored fake-quantized in float (their inputs are not quantized).
        requantization: for a target other than ``tensorrt``, the records of the points it adds
            (`onnx_qat.quantize.QuantizeResult.requantization`: tensor, Conv, amax, its
            source, ``status``); a ``not requantized`` Conv keeps a float output.
        timings: ``(step, seconds)`` in order: the five steps of [`export_onnx`][tf_bridge.export_onnx] and,
            named ``"<step>: <part>"``, the timed parts of a step (the parity's runs).
        float_parts: with ``float_dtype`` ``fp16``/``bf16``: the
            [`FloatPartsResult`][onnx_qat.formats.float_parts.FloatPartsResult] (nodes kept FP32 with their
            reasons, output cosines measured); None with FP32 float parts.
        float32_layers: the layers of a Keras mixed-precision policy (``mixed_float16``,
            ``mixed_bfloat16``) that the export computed in float32: the float twin converted to ONNX
            and the Keras QAT model the parity ran, so that both compute the same float32 function of
            the same (float32) variables; empty for a float32 model.
    """

    path: Path
    scales_path: Optional[Path]
    float_path: Optional[Path]
    opset: int
    target: str
    mapping: Tuple[MappingEntry, ...]
    parity: Parity
    check: object = field(repr=False)
    summary: Mapping[str, int] = field(default_factory=dict)
    cli_reproducible: bool = False
    baked: Tuple[str, ...] = ()
    requantization: Tuple[dict, ...] = field(default=(), repr=False)
    timings: Tuple[Tuple[str, float], ...] = field(default=(), repr=False)
    float_parts: Optional[object] = field(default=None, repr=False)
    float32_layers: Tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """Parity passed and the check of the target's rules found no error."""
        return self.parity.passed and (self.check is None or bool(self.check))

    def mapping_table(self) -> str:
        """The mapping as text: quantizer, what it quantizes, ONNX tensor(s), fold factor, note."""
        rows = [("quantizer", "keras", "onnx", "fold |factor|", "note")]
        for e in self.mapping:
            fold = "" if e.fold_factor is None else (
                "1" if e.fold_factor == (1.0, 1.0) else f"{e.fold_factor[0]:.3g}..{e.fold_factor[1]:.3g}")
            rows.append((e.quantizer, e.keras, ", ".join(e.onnx_tensors), fold, e.note))
        widths = [min(max(len(r[i]) for r in rows), 48) for i in range(4)]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows)

    def __str__(self) -> str:
        causes = sorted({o.cause for o in self.parity.outputs if o.cause and not o.passed})
        verdict = "PASSED" if self.passed else "FAILED" + (f" ({', '.join(causes)})" if causes else "")
        if self.passed and any(o.engines_cascade for o in self.parity.outputs):
            verdict += " (TensorFlow and onnxruntime differ on the Keras model by a rounding cascade)"
        lines = [f"export_onnx: {verdict} | {self.path}",
                 f"  {len(self.mapping)} quantizer(s) mapped; {self.summary.get('activations', 0)} "
                 f"activation Q/DQ pair(s), {self.summary.get('weights', 0)} weight(s); opset {self.opset}, "
                 f"target {self.target}"]
        lines += [f"  parity: {o}" for o in self.parity.outputs]
        lines += [f"  deployed: {d}" for d in self.parity.deployed]
        lines += [f"  worst layer: {w}" for w in self.parity.worst_layers]
        if self.requantization:
            lines.append(f"  requantization ({self.target}): {self._requantization_summary()}")
        label = "check" if self.target == "tensorrt" else f"check ({self.target} rules)"
        lines.append(f"  {label}: {self.check.summary()}" if self.check is not None else
                     f"  {label}: not run")
        if self.scales_path is not None:
            lines.append(f"  scales: {self.scales_path}" + (
                " (onnx-qat quantize <float model> --scales reproduces the model)"
                if self.cli_reproducible else
                " (the Keras placement differs from onnx-qat's default one)"))
        if self.float_path is not None:
            lines.append(f"  float model: {self.float_path}")
        if self.baked:
            lines.append(f"  baked weights (input not quantized): {', '.join(self.baked)}")
        if self.float32_layers:
            lines.append(f"  mixed precision: {len(self.float32_layers)} layer(s) computing in "
                         "float16/bfloat16 in Keras were exported and checked as their float32 computation "
                         f"(e.g. {self.float32_layers[0]})")
        return "\n".join(lines)

    def _requantization_summary(self) -> str:
        statuses = [r.get("status", "") for r in self.requantization]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
        floats = [r["tensor"] for r in self.requantization if r.get("status") == "not requantized"]
        if not floats:
            return counts
        hint = "give sample_data" if self.parity.generated_inputs else "no range"
        return f"{counts} (float output, {hint}: {', '.join(floats)})"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"path": str(self.path),
                "scales_path": None if self.scales_path is None else str(self.scales_path),
                "float_path": None if self.float_path is None else str(self.float_path), "opset": self.opset,
                "target": self.target, "passed": self.passed, "mapping": [e.to_dict() for e in self.mapping],
                "parity": self.parity.to_dict(),
                "check": None if self.check is None else self.check.to_dict(), "summary": dict(self.summary),
                "cli_reproducible": self.cli_reproducible, "baked": list(self.baked),
                "requantization": [dict(r) for r in self.requantization],
                "timings": [[w, round(t, 3)] for w, t in self.timings],
                "float32_layers": list(self.float32_layers)}
