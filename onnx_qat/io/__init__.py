"""The edges: loading and saving models (external data, opset and IR version, atomic writes),
reading data (``.npz`` a batch at a time, or a stream of feeds one run at a time, with its layout:
state fed back, batch axes), file safety, and TensorRT's calibration-cache text format.

Owns: `models`, `data`, `npz`, `feeds`, `layout`, `values`,
`files`, `tensorrt_cache`.
May import: ``onnx_qat.errors``, ``onnx_qat.graph`` and third-party libraries; no other stage.
"""
