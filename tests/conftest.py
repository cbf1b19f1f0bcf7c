"""Settings for the whole test suite."""
import os

# Every model the rewrite writes with an edit's evidence (onnx_qat.graph.delta) is validated by the evidence
# and by onnx.checker in full as well: a model the evidence passes and the checker refuses fails the test.
os.environ.setdefault("ONNX_QAT_FULL_CHECK", "both")
