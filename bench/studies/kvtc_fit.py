"""kvtc calibration cost against KV width: streamed moments and the fit, measured per layer group on synthetic
features of each model's shape, beside the model sizes they are for.

    python bench/studies/kvtc_fit.py [--kept 0.6 0.1] [--tokens 14468] [--device cpu]

The default grouping rule (``default_groups``: the fewest groups of consecutive layers of one kind with at most
``MAX_GROUP_FEATURES`` features) splits each shape into groups; every group of one width costs the same, so each
distinct width is measured once, in a process of its own (its peak resident memory is the group's), and a
shape's totals are that cost times its groups, for keys and values.  Features are synthetic: Gaussian rows with
a power-law spectrum whose floor (the truncation) keeps the fraction ``--kept`` of the components (SmolLM2's
real calibration keeps 0.5-0.65 of each group; 0.1 shows the randomized solver).  The moments are
measured on 4096 rows and scaled to ``--tokens`` (SmolLM2's default calibration text is 14,468 tokens).  The
70B-class row (80 layers of 8 × 128) is extrapolated from the 8B-class groups, which have the same widths.
Each measurement is also appended to bench/studies/results/kvtc_fit.jsonl; ``--reuse`` takes those already there (same
width, kept fraction and device) instead of measuring them again, so a run cut short on a busy machine can be
resumed.  Writes bench/studies/results/kvtc_fit.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

from kvcodec.codecs.kvtc.calibration import LayerInfo
from kvcodec.codecs.kvtc.fit import MAX_GROUP_FEATURES, default_groups
from kvcodec.codecs.kvtc.eigen import leading_eigenpairs
from kvcodec.codecs.kvtc.moments import Moments

RESULTS = Path(__file__).resolve().parent / "results"
MEASURED_ROWS = 4096
# name: layers, KV heads, head dim, fp16 weights in GB (parameters × 2), sliding-window layers
SHAPES = {
    "SmolLM2-135M": (30, 3, 64, 0.27, ()),
    "Qwen2.5-0.5B-class": (24, 2, 64, 0.99, ()),
    "Gemma 3 270M": (18, 1, 256, 0.54, tuple(i for i in range(18) if (i + 1) % 6)),
    "Llama-3-8B (synthetic)": (32, 8, 128, 16.06, ()),
    "70B-class (extrapolated)": (80, 8, 128, 141.1, ()),
}


def one_group(width: int, kept: float, device: str) -> dict:
    """Moments of MEASURED_ROWS synthetic rows and the fit of one group of ``width`` features, timed."""
    g = torch.Generator().manual_seed(width)
    # a random orthonormal mixing of a power-law spectrum: the covariance's eigenvectors are not the axes
    mix = torch.linalg.qr(torch.randn(width, width, dtype=torch.float64, generator=g)).Q
    std = torch.arange(1, width + 1, dtype=torch.float64) ** -1.0
    rows = (torch.randn(MEASURED_ROWS, width, dtype=torch.float64, generator=g) * std) @ mix.T
    rows = rows.float()
    floor = float(std[max(0, int(kept * width) - 1)] ** 2) * 0.999
    del mix
    base_rss = _rss_mb()
    cpu0, t0 = time.process_time(), time.perf_counter()
    m = Moments(width)
    for start in range(0, MEASURED_ROWS, 2048):
        m.add(rows[start:start + 2048])
    moments_s, moments_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    cpu0, t0 = time.process_time(), time.perf_counter()
    cov = m.covariance(torch.ones(width))
    if device != "cpu":
        cov = cov.to(device)
    var, vec, method = leading_eigenpairs(cov, floor) if device == "cpu" else _device_fit(cov, floor)
    fit_s, fit_cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {"width": width, "kept": int(var.numel()), "method": method, "moments_s_per_row": moments_s / MEASURED_ROWS,
            "moments_cpu_per_row": moments_cpu / MEASURED_ROWS, "fit_s": fit_s, "fit_cpu": fit_cpu,
            "peak_mb": _rss_mb(), "base_mb": base_rss}


def _device_fit(cov: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor, str]:
    """On an accelerator the full eigendecomposition is fast enough at these widths: no shortcut."""
    var, vec = torch.linalg.eigh(cov)
    torch.cuda.synchronize()
    keep = max(1, int((var >= floor).sum()))
    return var.flip(0)[:keep], vec.flip(1)[:, :keep], "exact (device)"


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def shape_groups(layers: int, heads: int, dim: int, windowed: tuple[int, ...]) -> list[list[int]]:
    infos = [LayerInfo(heads, dim, dim, None) for _ in range(layers)]
    return default_groups(infos, None, [i in windowed for i in range(layers)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kept", type=float, nargs="+", default=[0.6, 0.1],
                   help="fractions of each group's components kept (the second and later: 8B-class width only)")
    p.add_argument("--tokens", type=int, default=14468, help="calibration tokens the moments are scaled to")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reuse", action="store_true", help="take measurements already in kvtc_fit.jsonl")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process: measure one width
    args = p.parse_args()
    if args.one:
        print(json.dumps(one_group(args.one, args.kept[0], args.device)))
        return
    load = os.getloadavg()[0]
    shapes = {name: (spec, shape_groups(*spec[:3], spec[4])) for name, spec in SHAPES.items()}
    widths = sorted({len(members) * spec[1] * spec[2] for spec, groups in shapes.values() for members in groups})
    wide = sorted({len(members) * 8 * 128 for members in shapes["Llama-3-8B (synthetic)"][1]})
    runs = [(w, args.kept[0]) for w in widths] + [(w, k) for k in args.kept[1:] for w in wide]
    log = RESULTS / "kvtc_fit.jsonl"
    measured = {}
    if args.reuse and log.exists():
        for line in log.read_text().splitlines():
            r = json.loads(line)
            if r.get("device", "cpu") == args.device:
                measured[r["width"], r["kept_asked"]] = r
    RESULTS.mkdir(exist_ok=True)
    for width, kept in runs:
        if (width, kept) in measured:
            continue
        out = subprocess.run([sys.executable, __file__, "--one", str(width), "--kept", str(kept), "--device", args.device],
                             check=True, capture_output=True, text=True).stdout
        measured[width, kept] = json.loads(out.strip().splitlines()[-1]) | {"kept_asked": kept, "device": args.device}
        with log.open("a") as f:
            f.write(json.dumps(measured[width, kept]) + "\n")
        print(measured[width, kept], flush=True)
    lines = [f"# kvtc calibration cost against KV width ({args.device})", "",
             f"Default grouping: the fewest groups of consecutive layers of one kind with at most {MAX_GROUP_FEATURES} "
             f"features. Moments scaled to {args.tokens} calibration tokens; time and CPU time are for keys and values "
             "of every group (one group of each width measured, in its own process); peak RSS is that process's "
             "(the torch runtime included), moments MB what all groups' float64 moments hold while the model runs. "
             "Calibration MB: the fp16 bases of the components kept (the sample spectrum keeps a little less than "
             "asked; means, weights, variances add under 0.1%).", "",
             "| model shape | K+V width / token | groups (width) | kept (asked) | solver | moments s (CPU s) | fit s (CPU s) "
             "| peak RSS MB (one group) | moments MB (all groups) | calibration MB | % of fp16 model |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for kept in args.kept:
        for name, ((layers, heads, dim, model_gb, _), groups) in shapes.items():
            if kept != args.kept[0] and not (heads, dim) == (8, 128):
                continue
            gw = [len(members) * heads * dim for members in groups]
            rows = [measured[w, kept] for w in gw]
            moments_s = 2 * sum(r["moments_s_per_row"] for r in rows) * args.tokens
            moments_cpu = 2 * sum(r["moments_cpu_per_row"] for r in rows) * args.tokens
            fit_s, fit_cpu = 2 * sum(r["fit_s"] for r in rows), 2 * sum(r["fit_cpu"] for r in rows)
            cal_mb = sum(2 * w * r["kept"] * 2 for w, r in zip(gw, rows)) / 1e6
            moments_mb = sum(2 * 8 * (w * w + 2 * w) for w in gw) / 1e6
            widths = ", ".join(f"{gw.count(w)} × {w}" for w in sorted(set(gw), reverse=True))
            lines.append(f"| {name} | {layers * heads * dim * 2} | {widths} | {kept:.0%} | "
                         f"{'/'.join(sorted({r['method'] for r in rows}))} | {moments_s:.0f} ({moments_cpu:.0f}) | "
                         f"{fit_s:.0f} ({fit_cpu:.0f}) | {max(r['peak_mb'] for r in rows):.0f} | {moments_mb:.0f} | "
                         f"{cal_mb:.0f} | {100 * cal_mb / (model_gb * 1e3):.1f}% |")
    lines += ["", f"Made by `python bench/studies/kvtc_fit.py` on a shared 2-core machine (load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after); torch {torch.__version__}, {torch.get_num_threads()} threads."]
    RESULTS.mkdir(exist_ok=True)
    name = "kvtc_fit.md" if args.device == "cpu" else f"kvtc_fit-{args.device.split(':')[0]}.md"
    (RESULTS / name).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
