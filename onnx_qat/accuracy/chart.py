"""The sensitivity chart: a ranked horizontal bar plot (matplotlib, Agg backend, PNG).

Left panel: output cosine loss (1 - cosine, log scale) with only the site in INT8, most
sensitive site on top. Right panel: the cosine gained when only this site stays float (all
others INT8), against the all-INT8 model. Bars of one site share a row and a colour by kind.
"""
from __future__ import annotations

from ..errors import ConfigError

#: Colour per site kind (colour-blind safe, Okabe-Ito).
KIND_COLOURS = {"weighted": "#0072B2", "residual": "#E69F00", "pooling": "#009E73", "concat": "#CC79A7",
                "attention": "#D55E00", "other": "#999999"}
_FLOOR = 1e-7


def sensitivity_chart(result, path, top: int = 20) -> None:
    """Write the chart of ``result`` (a :class:`~onnx_qat.accuracy.sensitivity.SensitivityResult`)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("the sensitivity chart needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    from ..io.files import atomic_output

    rows = list(result.sites[:top])[::-1]  # most sensitive at the top
    labels = [f"{s.name[:32]} ({s.site.op_type})" for s in rows]
    colours = [KIND_COLOURS.get(s.site.kind, KIND_COLOURS["other"]) for s in rows]
    loss = [max(1.0 - s.only.cosine, _FLOOR) for s in rows]
    base = result.all_int8.cosine
    gain = [s.all_but.cosine - base for s in rows]
    height = max(2.5, 0.32 * len(rows) + 1.4)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, height), sharey=True,
                                      gridspec_kw={"width_ratios": [3, 2]})
    y = range(len(rows))
    left.barh(y, loss, color=colours)
    left.set_xscale("log")
    left.set_xlim(right=max(loss) * 6)  # room for the value labels
    left.set_yticks(list(y), labels, fontsize=8)
    left.set_xlabel("output loss 1 - cosine, only this site INT8 (log)")
    left.grid(axis="x", which="major", alpha=0.3)
    for i, value in enumerate(loss):
        left.text(value, i, f" {value:.1e}", va="center", fontsize=7)
    right.barh(y, gain, color=colours, alpha=0.8)
    right.axvline(0.0, color="black", linewidth=0.6)
    right.set_xlabel(f"cosine gained when only this site stays float\n(all INT8: cosine {base:.6f})")
    right.grid(axis="x", alpha=0.3)
    right.xaxis.set_major_locator(MaxNLocator(4))
    # tick labels carry their own exponent: an axis offset text would sit on the axis label
    right.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.1e}"))
    kinds = sorted({s.site.kind for s in rows})
    left.legend(handles=[Patch(color=KIND_COLOURS.get(k, KIND_COLOURS["other"]), label=k) for k in kinds],
                loc="lower right", fontsize=8, title="site kind", title_fontsize=8)
    shown = f"top {len(rows)} of {len(result.sites)}" if len(result.sites) > len(rows) else \
        f"all {len(rows)}"
    fig.suptitle(f"Quantization sensitivity, {shown} sites (most sensitive on top; "
                 f"{result.num_eval_samples} eval samples, method {result.method})", fontsize=10)
    fig.tight_layout()
    try:
        with atomic_output(path) as handle:
            fig.savefig(handle, format="png", dpi=110)
    finally:
        plt.close(fig)


__all__ = ["sensitivity_chart", "KIND_COLOURS"]
