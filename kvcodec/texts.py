"""Real text that every machine has: Python's own documentation and the licenses Debian ships."""

from __future__ import annotations

import os

from kvcodec.errors import InvalidInputError

LICENSE_DIR = "/usr/share/common-licenses"
# Three different registers of English (reference prose with code, and two licenses) for evaluation.
DEFAULT_EVAL_TEXTS = ("pydoc-topics", "license:GPL-3", "license:MPL-2.0")


def load_text(spec: str) -> str:
    """The text named by ``spec``: a file path, ``pydoc-topics`` (the topics of
    Python's ``help()``, joined in sorted order) or ``license:NAME`` (a file of
    /usr/share/common-licenses)."""
    if spec == "pydoc-topics":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[k] for k in sorted(topics))
    if spec.startswith("license:"):
        path = os.path.join(LICENSE_DIR, spec.split(":", 1)[1])
    else:
        path = spec
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidInputError(f"cannot read text {spec!r}: {e.strerror}") from None
