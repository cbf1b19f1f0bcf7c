#!/usr/bin/env python3
"""The old command line of the TensorRT deployment tool; the tool itself is
`onnx_qat.deploy.command` (``python tools/deploy_tensorrt.py MODEL.onnx --engine OUT.engine``)."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from onnx_qat.deploy.command import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
