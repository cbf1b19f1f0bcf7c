"""The edges: loading and saving models (external data, opset and IR version, atomic writes),
reading data (``.npz`` a batch at a time) and file safety.

Owns: :mod:`.models`, :mod:`.data`, :mod:`.npz`, :mod:`.files`.
May import: ``onnx_qat.errors``, ``onnx_qat.graph`` and third-party libraries; no other stage.
"""
