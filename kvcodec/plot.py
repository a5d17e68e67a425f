"""Rate-distortion plots (needs matplotlib: the ``plot`` extra)."""

from __future__ import annotations

from typing import Collection, Sequence

from kvcodec.errors import InvalidInputError


def rate_distortion_plot(rows: Sequence, path: str, title: str = "", separate: Collection[str] = ()) -> None:
    """Bits per element against perplexity change: each codec's configs joined by a line, except the rows
    named in ``separate`` (ablations), drawn as lone crosses."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InvalidInputError("plotting needs matplotlib: pip install 'kvcodec[plot]'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    families: dict[str, list] = {}
    for r in rows:
        if r.codec not in separate:
            families.setdefault(r.codec.split(":")[0], []).append(r)
    for name, rs in families.items():
        rs = sorted(rs, key=lambda r: r.bits_per_element)
        ax.plot([r.bits_per_element for r in rs], [100 * r.ppl_change for r in rs], "o-", label=name)
    lone = [r for r in rows if r.codec in separate]
    if lone:
        ax.plot([r.bits_per_element for r in lone], [100 * r.ppl_change for r in lone], "kx", label="ablations")
    for r in rows:
        ax.annotate(r.codec.partition(":")[2] or r.codec, (r.bits_per_element, 100 * r.ppl_change),
                    fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("symlog", linthresh=0.1)
    ax.set_xlabel("bits per element (every container byte)")
    ax.set_ylabel("perplexity change (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
