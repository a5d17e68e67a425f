"""Real text that every machine has: Python's own sources and documentation, the licenses Debian ships, and files
that the project's installed packages bundle.

A text is named by a spec (see :func:`load_text`), so calibrations and benchmarks name the same text everywhere.
"""

from __future__ import annotations

import importlib.util
import os
import sysconfig

from kvcodec.errors import InvalidInputError

LICENSE_DIR = "/usr/share/common-licenses"
# Three different registers of English (reference prose with code, and two licenses) for evaluation.
DEFAULT_EVAL_TEXTS = ("pydoc-topics", "license:GPL-3", "license:MPL-2.0")
# Kinds of text that no calibration default and no evaluation default is of: an essay on a library's design in
# reStructuredText, a commented configuration file, and a table of data (HTML's character entities, a Python
# dict literal).  kvtc's out-of-domain checks (bench/rate_distortion.py --texts heldout,
# bench/studies/kvtc_heldout_levers.py) measure on them.
HELDOUT_TEXTS = ("stdlib:email/architecture.rst", "package:matplotlib/mpl-data/matplotlibrc", "stdlib:html/entities.py")
# The held-out kinds and two more that kvtc's defaults are checked on (bench/kvtc_defaults.py): Python source unlike
# the calibration's two modules (a heap algorithm's, mostly docstrings and comments), and prose unlike its licenses
# and pydoc pages (IDLE's old release notes).
OUT_OF_DOMAIN_TEXTS = HELDOUT_TEXTS + ("stdlib:heapq.py", "stdlib:idlelib/NEWS2x.txt")
# kvtc's calibration texts (kvcodec.codecs.kvtc.fit): legal prose, Python source and documentation pages,
# at most DEFAULT_TEXT_TOKENS of each; none is an evaluation text or a held-out kind, or a version of one.  Measured
# on SmolLM2 at level 2 (bench/studies/results/kvtc_heldout-levers.md), this mix's basis left 37% less KL divergence on
# the held-out kinds than four licenses of about as many tokens (0.0140 against 0.0223 nats per token, at 6% fewer
# bits) and 5% more on the evaluation texts, two of which are licenses; all of each text (28,063 tokens) was no
# better and took calibration past three minutes.
DEFAULT_CALIBRATION_TEXTS = ("license:Apache-2.0", "license:LGPL-2.1", "stdlib:textwrap.py", "stdlib:csv.py",
                             "pydoc:json", "pydoc:itertools")
DEFAULT_TEXT_TOKENS = 2560
SPECS = ("a file path", "pydoc-topics", "pydoc:MODULE", "license:NAME", "stdlib:PATH", "package:PACKAGE/PATH")


def load_text(spec: str) -> str:
    """The text named by ``spec``:

    * ``pydoc-topics``: the topics of Python's ``help()``, joined in sorted order;
    * ``pydoc:MODULE``: the plain-text ``help()`` page of an importable module (documentation);
    * ``license:NAME``: a file of /usr/share/common-licenses;
    * ``stdlib:PATH``: a file of Python's standard library, by its path there (``stdlib:argparse.py``: code);
    * ``package:PACKAGE/PATH``: a file that an installed package bundles (``package:matplotlib/mpl-data/matplotlibrc``);
    * anything else: a file path.
    """
    if spec == "pydoc-topics":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[k] for k in sorted(topics))
    kind, _, name = spec.partition(":")
    if kind == "pydoc" and name:
        return _pydoc(spec, name)
    if kind == "license" and name:
        names = license_names()
        if name not in names:
            raise InvalidInputError(f"text {spec!r}: no license {name!r} in {LICENSE_DIR}; "
                                    f"the names there: {', '.join(names) or 'none'}")
        return _read(spec, os.path.join(LICENSE_DIR, name))
    if kind == "stdlib" and name:
        return _read(spec, _inside(spec, sysconfig.get_paths()["stdlib"], name))
    if kind == "package" and name:
        package, _, rel = name.partition("/")
        found = importlib.util.find_spec(package) if package.isidentifier() else None
        if found is None or not found.submodule_search_locations:
            raise InvalidInputError(f"text {spec!r}: no installed package {package!r} (the form is "
                                    "package:PACKAGE/PATH, PACKAGE an importable package)")
        return _read(spec, _inside(spec, list(found.submodule_search_locations)[0], rel))
    if kind in ("pydoc", "license", "stdlib", "package"):
        raise InvalidInputError(f"text {spec!r} names nothing after {kind + ':'!r}")
    return _read(spec, spec)


def _pydoc(spec: str, module: str) -> str:
    import pydoc

    if not all(part.isidentifier() for part in module.split(".")):
        raise InvalidInputError(f"text {spec!r}: {module!r} is not a module name")
    try:
        obj = pydoc.locate(module)
    except pydoc.ErrorDuringImport as e:
        raise InvalidInputError(f"text {spec!r}: importing {module!r} failed: {e.value}") from None
    if obj is None:
        raise InvalidInputError(f"text {spec!r}: no module {module!r} to document")
    page = pydoc.plain(pydoc.render_doc(obj, renderer=pydoc.plaintext))
    # the last section is the module's file path, which differs between machines
    head, sep, tail = page.rpartition("\nFILE\n")
    return head + "\n" if sep and tail.count("\n") <= 2 else page


def _inside(spec: str, root: str, rel: str) -> str:
    """``root/rel``, refused unless it stays inside ``root`` (a spec names a file of one tree, not any file)."""
    path = os.path.realpath(os.path.join(root, rel))
    if not rel or os.path.isabs(rel) or os.path.commonpath([path, os.path.realpath(root)]) != os.path.realpath(root):
        raise InvalidInputError(f"text {spec!r}: {rel!r} is not a relative path inside {root}")
    return path


def _read(spec: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise InvalidInputError(f"cannot read text {spec!r}: {e.strerror} (a text is one of: "
                                f"{', '.join(SPECS)})") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"text {spec!r} is not UTF-8 text") from None


def license_names() -> list[str]:
    """The names ``license:NAME`` takes: the files of /usr/share/common-licenses."""
    try:
        return sorted(e.name for e in os.scandir(LICENSE_DIR) if e.is_file())
    except OSError:
        return []
