"""``python -m onnx_qat``: the same as the ``onnx-qat`` command."""
from .cli import console_main

if __name__ == "__main__":
    console_main()
