"""Rate-distortion plots (needs matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from typing import Any, Collection, Sequence

from kvcodec.errors import InvalidInputError

# Perplexity changes span -0.1% to +50%: linear within +-LINEAR_PCT of zero (where the good codecs sit and where a
# sign matters), logarithmic beyond, with a labelled tick at each of these values in range.
LINEAR_PCT = 1.0
TICKS_PCT = (-5, -2, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500)
# Where a point's label may go, in points from the point, nearest first: beside, above, below, then further out.
LABEL_OFFSETS = [(dx * s, dy * s) for s in (1, 2, 3.2, 4.6) for dx, dy in
                 ((5, 2), (5, -9), (-5, 2), (-5, -9), (0, 7), (0, -14), (12, -3), (-12, -3))]


def rate_distortion_plot(rows: Sequence, path: str, title: str = "", separate: Collection[str] = ()) -> None:
    """Bits per element against perplexity change: each codec's configs joined by a line, except the rows
    named in ``separate`` (ablations), drawn as lone crosses.  Lower left is better, and the axes say so."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError:
        raise InvalidInputError("plotting needs matplotlib: pip install 'kvcodec[plot]'") from None
    fig, ax = plt.subplots(figsize=(10, 7), dpi=120)
    families: dict[str, list] = {}
    for r in rows:
        if r.codec not in separate:
            families.setdefault(r.codec.split(":")[0], []).append(r)
    for name, rs in families.items():
        rs = sorted(rs, key=lambda r: r.bits_per_element)
        ax.plot([r.bits_per_element for r in rs], [100 * r.ppl_change for r in rs], "o-", label=name, zorder=3)
    lone = [r for r in rows if r.codec in separate]
    if lone:
        ax.plot([r.bits_per_element for r in lone], [100 * r.ppl_change for r in lone], "kx", label="ablations",
                zorder=3)
    ax.axhline(0, color="0.4", linewidth=0.8, zorder=1)
    ys = [100 * r.ppl_change for r in rows]
    low, high = min(ys + [0.0]), max(ys + [0.0])
    ax.set_yscale("symlog", linthresh=LINEAR_PCT, linscale=3)
    ax.set_ylim(min(low * 1.5, -0.3), max(high * 1.6, LINEAR_PCT * 1.5))  # room for a labelled negative tick
    lo, hi = ax.get_ylim()
    ticks = [t for t in TICKS_PCT if lo <= t <= hi]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_yticklabels([f"{t:+g}%" if t else "0%" for t in ticks])
    ax.set_xlabel("bits per element, every container byte counted  (fewer is better \u2190)")
    ax.set_ylabel("perplexity change against the stored cache\n(less is better \u2193; linear within \u00b11%)")
    ax.set_title((title + "\n" if title else "") + "lower left is better", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    _label_points(fig, ax, [(r.bits_per_element, 100 * r.ppl_change, r.codec.partition(":")[2] or r.codec)
                            for r in rows])
    fig.savefig(path)
    plt.close(fig)


def _label_points(fig: Any, ax: Any, points: Sequence[tuple[float, float, str]]) -> None:
    """Label each point at the first offset where the label overlaps no other label or marker and stays inside
    the axes, or else where it overlaps the fewest; a label away from its point is joined to it by a thin line."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    radius = 4  # pixels: about a marker's size
    markers = [Bbox.from_extents(mx - radius, my - radius, mx + radius, my + radius)
               for mx, my in (ax.transData.transform((x, y)) for x, y, _ in points)]
    taken: list[Any] = []

    def label(x: float, y: float, text: str, dx: float, dy: float, leader: bool) -> Any:
        return ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=6, va="bottom",
                           ha="left" if dx > 0 else "right" if dx < 0 else "center",
                           arrowprops=dict(arrowstyle="-", color="0.35", linewidth=0.5, shrinkA=0, shrinkB=3)
                           if leader else None)

    for x, y, text in sorted(points, key=lambda p: (p[0], p[1])):
        best = None
        for dx, dy in LABEL_OFFSETS:
            trial = label(x, y, text, dx, dy, leader=False)  # measured without its line, which may cross things
            box = trial.get_window_extent(renderer).expanded(1.05, 1.15)
            trial.remove()
            inside = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1)
            cost = sum(box.overlaps(b) for b in taken + markers) + (0 if inside else 100)
            if best is None or cost < best[0]:
                best = (cost, dx, dy, box)
            if cost == 0:
                break
        _, dx, dy, box = best
        label(x, y, text, dx, dy, leader=abs(dx) + abs(dy) > 16)
        taken.append(box)
