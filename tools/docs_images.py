#!/usr/bin/env python3
"""Draw the images of the documentation that come from the code: ``docs/img/sensitivity.png``.

    python -m tools.docs_images

The sensitivity chart is that of the 24-Conv chain of ``tests.builders.outlier_channel_model``,
whose ``conv5`` is made sensitive on purpose (one input channel scaled up 300x, its weights down
as much: the float function is unchanged, its INT8 range is not), on 16 standard-normal samples
(seed 0; the last 4 held out for evaluation). Group bisection measures ``conv5`` alone and the
harmless sites in groups, so the chart shows both kinds of bar.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SENSITIVITY_CHART = ROOT / "docs" / "img" / "sensitivity.png"


def sensitivity_chart(path: Path = SENSITIVITY_CHART, top: int = 12):
    """Write the documentation's sensitivity chart (8 inches wide, so that its text stays readable
    in the page's column); return the result it shows."""
    import onnx_qat
    from onnx_qat.accuracy.chart import sensitivity_chart as draw
    from tests.builders import outlier_channel_model

    model = outlier_channel_model("conv5", convs=24, seed=0)
    data = {"input": np.random.default_rng(0).standard_normal((16, 16, 8, 8)).astype(np.float32)}
    result = onnx_qat.sensitivity(model, data, progress=False)
    draw(result, path, top=top, width=8.0)
    return result


def main() -> int:
    result = sensitivity_chart()
    print(result.table(top=12))
    print(f"wrote {SENSITIVITY_CHART.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
