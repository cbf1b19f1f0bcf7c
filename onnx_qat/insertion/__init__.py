"""The one inserter: placement marks + a ScaleTable + a format -> Q/DQ nodes, and the deployment
targets (``tensorrt``, ``ort-cpu``) as forms of the same marks.

Owns: `inserter`, `subgraphs` (the inserter inside If/Loop/Scan bodies), `targets` (targets as data),
`adapters` (target -> the object adapting marks and scales to its form), `ort_cpu` (the onnxruntime
CPU form's adapter).
May import: ``onnx_qat.io``, ``onnx_qat.graph``, ``onnx_qat.formats``, ``onnx_qat.placement``
(its marks), ``onnx_qat.scales``; never calibration, check or the accuracy tools.
"""
