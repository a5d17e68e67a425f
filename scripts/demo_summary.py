"""The demo's last line, from the numbers ``kvcodec eval --json-file`` measured for the default cachegen:
how much smaller, how much perplexity it costs, how fast it decodes."""

from __future__ import annotations

import json
import sys


def main(path: str) -> None:
    report = json.load(open(path))
    row = next(r for r in report["rows"] if r["codec"] == "cachegen")
    texts = len(report["texts"])
    print(f"default cachegen: {row['raw_bytes'] / row['bytes']:.1f}x smaller than {report['kv_dtype']}, "
          f"{100 * row['ppl_change']:+.2f}% perplexity, decodes at {row['decode_MBps']:.0f} MB/s on "
          f"{report['threads']} thread(s) ({report['model']}, {report['prefix_tokens']}-token caches of {texts} "
          f"text{'s' if texts > 1 else ''})")


if __name__ == "__main__":
    main(sys.argv[1])
