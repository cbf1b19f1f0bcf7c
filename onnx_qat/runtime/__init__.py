"""Running models in onnxruntime: sessions (exact Q/DQ arithmetic or fused kernels, cancellable
runs), a stateful model's state carried from run to run, and ``compare``, the one comparator of two
models' outputs.

Owns: `sessions`, `stateful` (state carried between runs), `compare`, `chunked` (a large model run
piece by piece), `interrupts` (onnxruntime calls that SIGINT/SIGTERM stop within a moment),
`workers` (independent work units on worker processes, results in submission order), `ray_workers`
(the same units as Ray actors on a cluster; Ray imported only there), `pool_base` (what both pools
share: the count check, a failed unit's answer, `map`).
May import: ``onnx_qat.io``, ``onnx_qat.graph``; never placement, insertion or the accuracy tools.
"""
