"""Running models in onnxruntime: sessions (exact Q/DQ arithmetic or fused kernels, cancellable
runs) and ``compare``, the one comparator of two models' outputs.

Owns: `sessions`, `compare`.
May import: ``onnx_qat.io``, ``onnx_qat.graph``; never placement, insertion or the accuracy tools.
"""
