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
        name = spec.split(":", 1)[1]
        names = license_names()
        if name not in names:
            raise InvalidInputError(f"text {spec!r}: no license {name!r} in {LICENSE_DIR}; "
                                    f"the names there: {', '.join(names) or 'none'}")
        path = os.path.join(LICENSE_DIR, name)
    else:
        path = spec
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidInputError(f"cannot read text {spec!r}: {e.strerror} (a text is a file, 'pydoc-topics' "
                                "or 'license:NAME')") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"text {spec!r} is not UTF-8 text") from None


def license_names() -> list[str]:
    """The names ``license:NAME`` takes: the files of /usr/share/common-licenses."""
    try:
        return sorted(e.name for e in os.scandir(LICENSE_DIR) if e.is_file())
    except OSError:
        return []
