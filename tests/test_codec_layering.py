"""The codecs' layering, read statically from the source: the entropy coding cachegen and kvtc share is a package
of its own, no codec reaches into another codec or into another module's private names, positions are nobody's
codec, and decoded rows have one vocabulary (``kvcodec.layouts.sinks``)."""

from __future__ import annotations

import ast

from test_structure import IMPORTS, MODULES, _where, _within

CODECS = "kvcodec.codecs"
# the codec packages (a package under kvcodec.codecs that registers a codec), not the parts they share
CODEC_PACKAGES = sorted({".".join(m.split(".")[:3]) for m in MODULES
                         if m.startswith(CODECS + ".") and MODULES[m].name == "__init__.py"} - {CODECS + ".entropy"})


def _codec_of(module: str) -> str | None:
    return next((p for p in CODEC_PACKAGES if _within(module, p)), None)


def test_the_codec_packages_are_found():
    assert {"kvcodec.codecs.cachegen", "kvcodec.codecs.kvtc", "kvcodec.codecs.kvfetcher"} <= set(CODEC_PACKAGES)


def test_no_codec_imports_another_codec():
    """kvtc once imported cachegen's lanes, tables and section reader, kvfetcher cachegen's step grid."""
    bad = [f"{_where(name, line)} imports {target}" for name, imports in IMPORTS.items() if _codec_of(name)
           for target, line, _ in imports if _codec_of(target) not in (None, _codec_of(name))]
    assert not bad, "codecs import other codecs:\n" + "\n".join(bad)


def test_chunking_and_positions_import_no_codec():
    """chunking once imported kvtc's reposition: moving keys to new positions is not one codec's knowledge."""
    bad = [f"{_where(name, line)} imports {target}" for name in ("kvcodec.chunking", "kvcodec.positions")
           for target, line, _ in IMPORTS.get(name, []) if _codec_of(target)]
    assert not bad, "\n".join(bad)


def test_no_module_imports_a_private_name_of_another():
    """kvtc's device decoder once imported cachegen's _coding_tables, _kernels, _lane_block, _put and _steps."""
    bad = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcodec"):
                bad += [f"{_where(name, node.lineno)} imports {node.module}.{a.name}" for a in node.names
                        if a.name.startswith("_") and not a.name.startswith("__")]
    assert not bad, "\n".join(bad)


def test_no_codec_calls_a_private_method_of_a_codec_it_is_handed():
    """kvtc's device decoder once called KVTC._rotated and KVTC._sinks on the codec it was handed."""
    bad = []
    for name, path in MODULES.items():
        if not _codec_of(name):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id == "codec"):
                bad.append(f"{_where(name, node.lineno)}: {ast.unparse(node)}")
    assert not bad, "\n".join(bad)


def test_decoded_rows_have_one_vocabulary():
    """Where decoded rows go was once four classes besides layouts.sinks': kvtc's ContiguousSink and PagedSink,
    cachegen's Target, and the store's own DenseSink and PagedSink."""
    bad = []
    for name, path in MODULES.items():
        if name == "kvcodec.layouts.sinks":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and (node.name.endswith("Sink") or node.name == "Target"):
                bad.append(f"{_where(name, node.lineno)} defines {node.name}")
    assert not bad, "targets of decoded rows outside kvcodec.layouts.sinks:\n" + "\n".join(bad)
