"""The sensitivity chart: a ranked horizontal bar plot (matplotlib, Agg backend, PNG).

Left panel: output cosine loss (1 - cosine, log scale) with only the site in INT8, most
sensitive site on top. Right panel: the cosine gained when only this site stays float (all
others INT8), against the all-INT8 model. Bars of one site share a row and a colour by kind.
Sites measured alone come first; sites known only through the group they were measured in
(`onnx_qat.accuracy.bisect`) come after a dashed line, with hatched bars, values marked
``≤`` and a legend entry saying what the hatching means. The title names the calibration
method and the evaluation samples.
"""
from __future__ import annotations

from ..errors import ConfigError

#: Colour per site kind (colour-blind safe, Okabe-Ito).
KIND_COLOURS = {"weighted": "#0072B2", "residual": "#E69F00", "pooling": "#009E73", "concat": "#CC79A7",
                "attention": "#D55E00", "other": "#999999"}
#: Hatching of the bars that show a group's figure rather than the site's own.
GROUP_HATCH = "///"
_FLOOR = 1e-7
#: Font sizes (points): readable when the PNG is shown scaled to a documentation page's width.
_TICK, _LABEL, _TITLE, _VALUE = 10, 11, 12, 9


def sensitivity_chart(result, path, top: int = 20, width: float = 12.0) -> None:
    """Write the chart of ``result`` (a
    [`SensitivityResult`][onnx_qat.accuracy.sensitivity.SensitivityResult]), ``width`` inches wide
    at 100 dpi (a narrower chart keeps its text readable where a page scales it down)."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("the sensitivity chart needs matplotlib (pip install matplotlib)") from None
    matplotlib.use("Agg", force=False)
    from matplotlib import pyplot as plt

    from ..io.files import atomic_output

    rows = list(result.sites[:top])[::-1]  # most sensitive at the top
    height = max(3.0, 0.36 * len(rows) + 2.0)
    fig, (left, right) = plt.subplots(1, 2, figsize=(width, height), sharey=True,
                                      gridspec_kw={"width_ratios": [3, 2]})
    _left_panel(left, rows)
    _right_panel(right, rows, result.all_int8.cosine, result.precision.upper())
    _group_divider((left, right), rows)
    bottom = _legend(fig, rows, columns=4 if width >= 10 else 2)
    shown = f"top {len(rows)} of {len(result.sites)}" if len(result.sites) > len(rows) else \
        f"all {len(rows)}"
    ranges = "given ScaleTable" if result.method == "given" else f"ranges calibrated with {result.method}"
    fig.suptitle(f"Quantization sensitivity, {shown} sites, most sensitive on top\n"
                 f"{ranges}; {result.num_eval_samples} evaluation samples", fontsize=_TITLE)
    fig.tight_layout(rect=(0, bottom, 1, 1))
    try:
        with atomic_output(path) as handle:
            fig.savefig(handle, format="png", dpi=100)
    finally:
        plt.close(fig)


def _grouped(site, attribute: str) -> bool:
    return getattr(site, attribute) > 1


def _style(site, attribute: str) -> dict:
    colour = KIND_COLOURS.get(site.site.kind, KIND_COLOURS["other"])
    if _grouped(site, attribute):
        return {"facecolor": "white", "edgecolor": colour, "hatch": GROUP_HATCH, "linewidth": 1.0}
    return {"facecolor": colour, "edgecolor": colour}


def _left_panel(ax, rows) -> None:
    loss = [max(1.0 - s.only.cosine, _FLOOR) for s in rows]
    y = list(range(len(rows)))
    for i, (site, value) in enumerate(zip(rows, loss)):
        ax.barh(i, value, **_style(site, "only_group"))
        mark = "≤" if _grouped(site, "only_group") else ""
        ax.text(value, i, f" {mark}{value:.1e}", va="center", fontsize=_VALUE)
    ax.set_xscale("log")
    ax.set_xlim(right=max(loss, default=1.0) * 12)  # room for the value labels
    ax.set_yticks(y, [f"{s.name[-34:]} ({s.site.op_type})" for s in rows], fontsize=_TICK)
    ax.tick_params(axis="x", labelsize=_TICK)
    ax.set_xlabel("output loss 1 - cosine\nwith only this site quantized (log)", fontsize=_LABEL)
    ax.grid(axis="x", which="major", alpha=0.3)


def _right_panel(ax, rows, base: float, fmt: str) -> None:
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    for i, site in enumerate(rows):
        ax.barh(i, site.all_but.cosine - base, alpha=0.85, **_style(site, "all_but_group"))
    ax.axvline(0.0, color="black", linewidth=0.6)
    ax.set_xlabel(f"cosine gained when only\nthis site stays float\n(all {fmt}: cosine {base:.6f})",
                  fontsize=_LABEL)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=_TICK)
    ax.xaxis.set_major_locator(MaxNLocator(3))
    # tick labels carry their own exponent: an axis offset text would sit on the axis label
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "0" if v == 0 else f"{v:.1e}"))


def _group_divider(axes, rows) -> None:
    """A dashed line between the sites measured alone (above) and those known by their group."""
    alone = [i for i, s in enumerate(rows) if not _grouped(s, "only_group")]
    grouped = [i for i, s in enumerate(rows) if _grouped(s, "only_group")]
    if alone and grouped and max(grouped) < min(alone):
        for ax in axes:
            ax.axhline(max(grouped) + 0.5, color="black", linestyle="--", linewidth=0.8)


def _legend(fig, rows, columns: int) -> float:
    """The legend under the panels (it never covers a bar); returns the figure height share it takes."""
    from matplotlib.patches import Patch

    kinds = sorted({s.site.kind for s in rows})
    handles = [Patch(color=KIND_COLOURS.get(k, KIND_COLOURS["other"]), label=f"{k} site") for k in kinds]
    if any(_grouped(s, "only_group") or _grouped(s, "all_but_group") for s in rows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch=GROUP_HATCH,
                             label="figure of a group of sites measured together\n(below the dashed line): "
                                   "the site alone\ncosts about that much or less"))
    columns = min(len(handles), columns)
    legend = fig.legend(handles=handles, loc="lower center", ncol=columns, fontsize=_VALUE, frameon=False)
    inches = legend.get_window_extent(fig.canvas.get_renderer()).height / fig.dpi
    return (inches + 0.1) / fig.get_figheight()


__all__ = ["sensitivity_chart", "KIND_COLOURS", "GROUP_HATCH"]
