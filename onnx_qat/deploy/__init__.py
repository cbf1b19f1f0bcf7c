"""TensorRT deployment: the build, timing and verification behind ``onnx-qat deploy`` (and the old
``tools/deploy_tensorrt.py`` command line). TensorRT and CUDA are imported lazily, in
`backend` only.

Owns: `command` (arguments, gate, onnxruntime validation, report), `backend`.
May import: every other stage (it is the last one); nothing imports it but the CLI.
"""
