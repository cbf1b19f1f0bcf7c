"""Running models in onnxruntime: sessions (exact Q/DQ arithmetic or fused kernels, cancellable
runs) and ``compare``, the one comparator of two models' outputs.

Owns: :mod:`.sessions`, :mod:`.compare`.
May import: ``onnx_qat.io``, ``onnx_qat.graph``; never placement, insertion or the accuracy tools.
"""
