"""Text specs: every default names a real text on this machine, the sets stay apart, and bad specs get clear errors."""

from __future__ import annotations

import pytest

from kvcodec.errors import InvalidInputError
from kvcodec.codecs.kvtc.fit import DEFAULT_CALIBRATION_TEXTS
from kvcodec.texts import DEFAULT_EVAL_TEXTS, HELDOUT_TEXTS, load_text


@pytest.mark.parametrize("spec", DEFAULT_CALIBRATION_TEXTS + DEFAULT_EVAL_TEXTS + HELDOUT_TEXTS)
def test_default_texts_load(spec):
    """Each default text exists; an evaluation text is long enough for the 1536 + 512-token protocol (about 4
    characters a token)."""
    assert len(load_text(spec)) > (8000 if spec not in DEFAULT_CALIBRATION_TEXTS else 1000)


def test_calibration_evaluation_and_heldout_texts_are_apart():
    """No text is in two sets, and no text of one set is contained in a text of another (a version of it)."""
    sets = [DEFAULT_CALIBRATION_TEXTS, DEFAULT_EVAL_TEXTS, HELDOUT_TEXTS]
    for i, a in enumerate(sets):
        for b in sets[i + 1:]:
            assert not set(a) & set(b)
            for x in a:
                for y in b:
                    tx, ty = load_text(x), load_text(y)
                    assert tx[1000:3000] not in ty and ty[1000:3000] not in tx, (x, y)


def test_specs_name_the_right_text():
    import csv
    import inspect

    assert load_text("stdlib:csv.py") == inspect.getsource(csv)
    page = load_text("pydoc:json")
    assert page.startswith("Python Library Documentation: package json") and "JSONDecoder" in page
    assert "\nFILE\n" not in page  # the machine's own path is left out
    assert "backend" in load_text("package:matplotlib/mpl-data/matplotlibrc")


@pytest.mark.parametrize("spec, words", [
    ("pydoc:", ["names nothing"]),
    ("pydoc:no_such_module_here", ["no module"]),
    ("pydoc:os;rm", ["not a module name"]),
    ("stdlib:../../../etc/passwd", ["not a relative path inside"]),
    ("stdlib:/etc/passwd", ["not a relative path inside"]),
    ("stdlib:no_such_file.py", ["cannot read", "stdlib:PATH"]),
    ("stdlib:email", ["cannot read"]),  # a folder
    ("package:no_such_package/x", ["no installed package"]),
    ("package:matplotlib/../../../etc/passwd", ["not a relative path inside"]),
    ("package:matplotlib", ["not a relative path inside"]),
    ("license:NOPE", ["no license", "GPL-3"]),
    ("/no/such/file.txt", ["cannot read"]),
])
def test_bad_specs_get_clear_errors(spec, words):
    with pytest.raises(InvalidInputError) as e:
        load_text(spec)
    for w in words:
        assert w in str(e.value)
