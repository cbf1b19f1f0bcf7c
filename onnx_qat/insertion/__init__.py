"""The one inserter: placement marks + a ScaleTable + a format -> Q/DQ nodes, and the deployment
targets (``tensorrt``, ``ort-cpu``) as forms of the same marks.

Owns: :mod:`.inserter`, :mod:`.targets` (targets as data), :mod:`.forms` (target -> form object),
:mod:`.ort_cpu` (the onnxruntime CPU form).
May import: ``onnx_qat.io``, ``onnx_qat.graph``, ``onnx_qat.formats``, ``onnx_qat.placement``
(its marks), ``onnx_qat.scales``; never calibration, check or the accuracy tools.
"""
