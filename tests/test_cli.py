"""The ``kvcodec`` command line end to end on real KV."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from types import SimpleNamespace

import pytest
import torch

import kvcodec
from kvcodec.cli import EXIT_FAILED, EXIT_INVALID, EXIT_IO, EXIT_OK, EXIT_UNSUPPORTED, build_parser, main

SUBCOMMANDS = ["dump", "encode", "decode", "info", "verify", "eval", "bench", "codecs", "calibrate", "mooncake-segment"]


def run(capsys, *argv):
    capsys.readouterr()  # drop what fixtures printed
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("sub", [None, *SUBCOMMANDS])
def test_help_explains_itself(capsys, sub):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"] if sub is None else [sub, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and len(out) > 400
    if sub is None:
        assert all(s in out for s in SUBCOMMANDS)


@pytest.mark.parametrize("sub", ["dump", "eval", "calibrate"])
def test_text_help_names_every_form_load_text_takes(capsys, sub):
    """--text's help lists each kind of spec kvcodec.texts.load_text reads, not only files and licenses."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([sub, "--help"])
    from kvcodec.texts import SPECS

    out = " ".join(capsys.readouterr().out.split())
    for form in [spec for spec in SPECS if " " not in spec]:  # the forms with a syntax (not "a file path")
        assert form in out, form


def test_console_script_runs(kvcodec_script):
    res = subprocess.run([kvcodec_script, "codecs", "--json"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    ids = [c["id"] for c in json.loads(res.stdout)["codecs"]]
    assert "raw" in ids and "kivi" in ids


def test_dump_encode_decode_verify_round_trip(capsys, real_dump, tmp_path):
    dump = str(real_dump("pydoc-topics", 300))
    kvc, back = str(tmp_path / "kv.kvc"), str(tmp_path / "back.safetensors")
    code, out, _ = run(capsys, "encode", dump, "-o", kvc, "--codec", "raw", "--chunk-tokens", "64", "--json")
    assert code == EXIT_OK and json.loads(out)["ratio"] < 1.0
    assert run(capsys, "decode", kvc, "-o", back, "-q")[0] == EXIT_OK
    assert kvcodec.KVCache.load_safetensors(back).equal(kvcodec.KVCache.load_safetensors(dump))
    code, out, _ = run(capsys, "verify", kvc, "--against", dump)
    assert code == EXIT_OK and "keys   bit-exact" in out and "values bit-exact" in out
    code, out, _ = run(capsys, "info", kvc, "--json")
    info = json.loads(out)
    assert code == EXIT_OK and info["num_chunks"] == 5 and info["num_tokens"] == 300 and len(info["chunks"]) == 5
    code, out, _ = run(capsys, "info", kvc, "--chunks")
    assert "checksum" in out and "16.0" in out


def test_encode_with_options_and_partial_decode(capsys, real_dump, tmp_path):
    dump = str(real_dump("pydoc-topics", 300))
    kvc = str(tmp_path / "kv.kvc")
    code, out, _ = run(capsys, "encode", dump, "-o", kvc, "--codec", "kivi", "--set", "bits=2", "--json", "-q")
    assert code == EXIT_OK and json.loads(out)["config"] == {"bits": 2, "group": 128}
    part = str(tmp_path / "part.safetensors")
    assert run(capsys, "decode", kvc, "-o", part, "--layers", "0,5-6", "--chunks", "1", "-q")[0] == EXIT_OK
    kv = kvcodec.KVCache.load_safetensors(part)
    assert kv.num_layers == 3 and kv.num_tokens == 300 - 256


def test_verify_fails_on_corruption(capsys, real_dump, tmp_path):
    dump = str(real_dump("pydoc-topics", 300))
    kvc = tmp_path / "kv.kvc"
    assert run(capsys, "encode", dump, "-o", str(kvc), "-q")[0] == EXIT_OK
    data = bytearray(kvc.read_bytes())
    data[len(data) // 2] ^= 0x40
    kvc.write_bytes(bytes(data))
    code, out, _ = run(capsys, "verify", str(kvc))
    assert code == EXIT_FAILED and "FAILED" in out and "checksum" in out
    code, _, err = run(capsys, "decode", str(kvc), "-o", str(tmp_path / "x.safetensors"))
    assert code == EXIT_FAILED and "checksum" in err


def test_errors_map_to_documented_exit_codes(capsys, real_dump, tmp_path):
    dump = str(real_dump("pydoc-topics", 300))
    code, _, err = run(capsys, "encode", dump, "-o", str(tmp_path / "a.kvc"), "--codec", "nosuch")
    assert code == EXIT_UNSUPPORTED and "nosuch" in err
    code, _, err = run(capsys, "info", str(tmp_path / "missing.kvc"))
    assert code == EXIT_IO and "missing.kvc" in err
    code, _, err = run(capsys, "encode", dump, "-o", str(tmp_path / "a.kvc"), "--codec", "kivi:bits=3")
    assert code == EXIT_INVALID and "bits" in err
    code, _, err = run(capsys, "encode", dump, "-o", str(tmp_path / "a.kvc"), "--codec", "raw", "--backend", "triton")
    assert code == EXIT_UNSUPPORTED and "triton" in err
    if not torch.cuda.is_available():
        code, _, err = run(capsys, "encode", dump, "-o", str(tmp_path / "a.kvc"), "--device", "cuda")
        assert code == EXIT_UNSUPPORTED and "CUDA" in err
    assert not (tmp_path / "a.kvc").exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind by the failed encodes


def test_bench_prints_a_table(capsys, real_dump):
    dump = str(real_dump("pydoc-topics", 300))
    code, out, _ = run(capsys, "bench", dump, "--codec", "raw", "--codec", "kivi:bits=4", "--repeat", "1", "--json")
    rows = json.loads(out)["rows"]
    assert code == EXIT_OK and [r["codec"] for r in rows] == ["raw", "kivi:bits=4"]
    assert all(r["decode_Melem_s"] > 0 for r in rows)


def test_eval_measures_kivi_with_the_real_model(capsys, tmp_path):
    plot, report = tmp_path / "rd.png", tmp_path / "eval.json"
    code, out, err = run(capsys, "eval", "--text", "license:GPL-3", "--tokens", "384", "--continuation", "128",
                         "--codec", "raw", "--codec", "kivi:bits=2", "--codec", "kivi:bits=4", "--codec", "kivi:bits=8",
                         "--plot", str(plot), "--json-file", str(report))
    assert code == EXIT_OK
    assert "eval kivi:bits=4 on license:GPL-3" in err  # the progress bar names the run under way
    assert "Per cache (mean over the 1 text(s))" in out and "enc s/cache" in out and "dec MB/s" in out
    rows = {r["codec"]: r for r in json.loads(report.read_text())["rows"]}
    assert rows["raw"]["ppl_change"] == 0.0 and rows["raw"]["agreement"] == 1.0
    k2, k4, k8 = (rows[f"kivi:bits={b}"] for b in (2, 4, 8))
    assert k2["bits_per_element"] < k4["bits_per_element"] < k8["bits_per_element"] < 9
    assert abs(k8["ppl_change"]) < 0.01 and k8["agreement"] > 0.97
    assert k2["ppl_change"] > k4["ppl_change"] and k2["ppl_change"] > 0.05
    assert rows["raw"]["kl"] == 0.0 and k2["kl"] > k4["kl"] > k8["kl"] > 0
    assert k4["cases"] == 1 and k4["bytes_per_cache"] == k4["bytes"]
    assert k4["encode_MBps"] == pytest.approx(k4["raw_bytes"] / k4["encode_s"] / 1e6)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_quiet_silences_the_model_loading_bars(capsys, tmp_path):
    from kvcodec.models import _load_model

    _load_model.cache_clear()  # a model loaded earlier in this process would show no bar anyway
    code, out, err = run(capsys, "dump", "--text", "license:GPL-3", "--tokens", "16", "-o", str(tmp_path / "d.st"), "-q")
    assert code == EXIT_OK and err == "" and "wrote" in out


def test_backend_choices_are_the_codecs_backends():
    from kvcodec.codecs.base import BACKENDS

    commands = build_parser()._subparsers._group_actions[0].choices
    for name in ("encode", "decode"):
        action = next(a for a in commands[name]._actions if a.dest == "backend")
        assert tuple(action.choices) == BACKENDS


def test_calibrate_install_is_found_under_the_model_identity_hooks_use(capsys, real_dump, tmp_path, monkeypatch):
    """`kvcodec calibrate --install` on the real model (a small budget: one 2048-token segment, groups of 10 layers),
    quiet when asked: the calibration it writes codes a real cache of another text to within kvtc's error, and a
    hook serving the model's file finds it by the model identity its store carries, without loading the model (it
    was installed under the model's name, which no hook looks up)."""
    from kvcodec.codecs.kvtc import calibration_for_model
    from kvcodec.engines.auto_calibration import ensure_model_calibration, needs_first_calibration
    from kvcodec.models import model_path
    from kvcodec.store.identity import model_identity

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cal, kvc, back = (str(tmp_path / n) for n in ("smollm2.kvtc", "kv.kvc", "back.safetensors"))
    code, out, err = run(capsys, "calibrate", "--model", "smollm2", "--tokens", "2048", "--group-layers", "10",
                         "-o", cal, "-q", "--json", "--install")
    info = json.loads(out)
    assert code == EXIT_OK and err == "" and info["groups"] == 3 and info["tokens"] == 2047
    served = model_identity(model_path("smollm2"))  # as a hook serving the GGUF file computes it
    assert info["model_identity"] == served and info["installed"].endswith(info["sha256"] + ".kvtc")
    assert not needs_first_calibration("kvtc", None, served)
    assert ensure_model_calibration(served, lambda: pytest.fail("loaded the model"), print) == info["sha256"]
    assert calibration_for_model(served).model == "SmolLM2-135M-Instruct"  # the name, for humans
    dump = str(real_dump("pydoc-topics", 300))
    assert run(capsys, "encode", dump, "-o", kvc, "--codec", f"kvtc:level=4,calibration={cal}", "-q")[0] == EXIT_OK
    code, out, _ = run(capsys, "decode", kvc, "-o", back, "--against", dump, "--json", "-q")
    against = json.loads(out)["against"]
    # values are weighted by what their error does downstream, so their plain SNR is lower than the keys'
    assert code == EXIT_OK and 15 < against["keys"]["snr_db"] < 60 and 8 < against["values"]["snr_db"] < 60, against


# --- issue 35, item 5: the calibration a kvtc container was made with ------------------------------------------


@pytest.fixture()
def kvtc_files(real_dump, tmp_path, monkeypatch):
    """A fresh process's lookup state (nothing registered, an empty cache folder, no $KVCODEC_CALIBRATIONS), a
    calibration of SmolLM2's 30 layers fitted on the real GPL-3 cache (keys as stored: the lookup, not the fit, is
    under test) saved to a file, and the real pydoc-topics dump."""
    from kvcodec.codecs.kvtc import calibration as calmod
    from kvcodec.codecs.kvtc.calibration import LayerInfo
    from kvcodec.codecs.kvtc.fit import fit_calibration

    monkeypatch.setattr(calmod, "_registered", {})
    monkeypatch.setattr(calmod, "_pinned", set())
    monkeypatch.setattr(calmod, "_hashed", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(calmod.ENV_PATH, raising=False)
    src = kvcodec.KVCache.load_safetensors(real_dump("license:GPL-3", 512))
    h, t, d = src.layers[0].keys.shape
    rows = [x.float().permute(1, 0, 2).reshape(t, -1) for l in src.layers for x in (l.keys, l.values)]
    weights = [torch.full((h * d,), 10 / float(x.pow(2).mean().sqrt())) for x in rows]
    cal = fit_calibration(src.model, [LayerInfo(h, d, d, None)] * src.num_layers,
                          [list(range(i, i + 10)) for i in (0, 10, 20)], rows[0::2], rows[1::2], weights[0::2],
                          weights[1::2], (0.2, 0.6))
    path = tmp_path / "made-with.kvtc"
    cal.save(path)
    return SimpleNamespace(cal=cal, path=str(path), dump=str(real_dump("pydoc-topics", 300)), tmp=tmp_path,
                           forget=lambda: (calmod._registered.clear(), calmod._pinned.clear()))


def test_issue35_decode_and_verify_take_the_calibration_the_container_was_made_with(capsys, kvtc_files):
    f = kvtc_files
    kvc, back = str(f.tmp / "kv.kvc"), str(f.tmp / "back.safetensors")
    assert run(capsys, "encode", f.dump, "-o", kvc, "--codec", f"kvtc:calibration={f.path}", "-q")[0] == EXIT_OK
    f.forget()  # another process: the file is not installed anywhere
    code, _, err = run(capsys, "decode", kvc, "-o", back, "-q")
    assert code == EXIT_UNSUPPORTED and f.cal.digest in err and "--calibration FILE" in err
    code, out, _ = run(capsys, "verify", kvc, "--calibration", f.path, "--against", f.dump, "-q")
    assert code == EXIT_OK and "integrity checked" in out and "is lossy" in out, out
    f.forget()
    assert run(capsys, "decode", kvc, "-o", back, "--calibration", f.path, "-q")[0] == EXIT_OK
    assert kvcodec.KVCache.load_safetensors(back).num_tokens == 300
    code, _, err = run(capsys, "decode", kvc, "-o", back, "--calibration", f.dump)
    assert code == EXIT_FAILED and f"--calibration {f.dump}: not a kvtc calibration" in err
    # installed under the name it was made with, not its hash: found by its content
    f.forget()
    installed = f.tmp / "cals"
    installed.mkdir()
    shutil.copy(f.path, installed / "smollm2-mine.kvtc")
    os.environ[calibration_env()] = str(installed)  # (monkeypatch restores it: the fixture deleted it first)
    assert run(capsys, "verify", kvc, "-q")[0] == EXIT_OK


def calibration_env() -> str:
    from kvcodec.codecs.kvtc.calibration import ENV_PATH

    return ENV_PATH


def test_issue35_encode_finds_the_calibration_installed_for_the_model_a_dump_records(capsys, kvtc_files):
    """`kvcodec dump` records the model's identity, by which `calibrate --install` installs; a dump without one
    (another tool's) is refused in one line that says what to pass."""
    from kvcodec.codecs.kvtc import install
    from kvcodec.models import model_path
    from kvcodec.store.identity import model_identity

    f = kvtc_files
    identity = model_identity(model_path("smollm2"))
    install(f.cal.of_model(identity))
    f.forget()
    dump = str(f.tmp / "d.safetensors")
    code, out, _ = run(capsys, "dump", "--text", "license:GPL-3", "--tokens", "40", "-o", dump, "-q", "--json")
    assert code == EXIT_OK and json.loads(out)["model_identity"] == identity
    code, out, _ = run(capsys, "encode", dump, "-o", str(f.tmp / "a.kvc"), "--codec", "kvtc", "-q", "--json")
    assert code == EXIT_OK and json.loads(out)["config"]["calibration"] == f.cal.of_model(identity).digest
    foreign = str(f.tmp / "foreign.safetensors")
    kvcodec.KVCache.load_safetensors(dump).save_safetensors(foreign)  # the cache alone: no identity
    f.forget()  # (a calibration used in this process is found by the model's name too)
    code, _, err = run(capsys, "encode", foreign, "-o", str(f.tmp / "b.kvc"), "--codec", "kvtc")
    assert code == EXIT_INVALID and err.count("\n") == 1 and "records no model identity" in err
    assert "--codec kvtc:calibration=FILE" in err


# --- issue 35, item 7 -------------------------------------------------------------------------------------------


def test_issue35_codecs_is_plain_text_within_100_columns(capsys):
    code, out, _ = run(capsys, "codecs")
    assert code == EXIT_OK and max(map(len, out.splitlines())) <= 100
    assert "``" not in out and ":class:" not in out and ":func:" not in out
    summaries = {c["id"]: c["summary"] for c in json.loads(run(capsys, "codecs", "--json")[1])["codecs"]}
    # the whole first sentence, not its first line
    assert summaries["lmcache-cachegen"].endswith("arithmetic coding per (K/V, channel) lane of 256 tokens.")
    assert summaries["kivi"] == "KIVI quantization: bits in 2, 4, 8; group tokens share a key scale."


def test_issue35_verify_puts_the_distortion_beside_what_is_normal_for_the_codec(capsys, real_dump, tmp_path):
    dump = str(real_dump("pydoc-topics", 300))
    for spec, words in [("kivi:bits=2", ["kivi:bits=2 is lossy", "about 26% (keys) and 48% (values)"]),
                        ("kivi:bits=2,group=64", ["is lossy: its error is expected", "kvcodec eval"]),
                        ("zstd", ["zstd is lossless: a decode is bit-exact"])]:
        kvc = str(tmp_path / "kv.kvc")
        assert run(capsys, "encode", dump, "-o", kvc, "--codec", spec, "-q")[0] == EXIT_OK
        code, out, _ = run(capsys, "verify", kvc, "--against", dump, "-q")
        lines = out.splitlines()
        assert code == EXIT_OK and lines[0].startswith("OK: ") and "integrity checked" in lines[0]
        assert "error" not in lines[0] and lines[1].startswith("  distortion against")
        assert all(w in out for w in words), (spec, out)


@pytest.mark.parametrize("spec", ["kivi:bits=2", "kivi:bits=4", "kivi:bits=8", "fp8", "cachegen:level=4"])
def test_the_typical_errors_verify_shows_are_still_measured(real_dump, spec):
    from kvcodec.cli import TYPICAL_RELATIVE_ERROR, parse_codec
    from kvcodec.tools.distortion import distortion

    kv = kvcodec.KVCache.load_safetensors(real_dump("pydoc-topics", 300))
    d = distortion(kv, kvcodec.decode(kvcodec.encode(kv, parse_codec(spec))))
    for kind, typical in zip(("keys", "values"), TYPICAL_RELATIVE_ERROR[spec]):
        assert 100 * d[kind].relative_error == pytest.approx(typical, rel=0.15), (spec, kind)


def _documented_commands() -> list[tuple[str, int, str]]:
    from test_docs import PAGES, _blocks, _rel

    return [(_rel(page), line + i, text) for page in PAGES for line, lang, code, _ in _blocks(page)
            if lang in ("bash", "sh", "shell", "")
            for i, text in enumerate(code.splitlines()) if text.startswith("kvcodec ")]


def test_issue35_every_documented_command_line_parses():
    """The `kvcodec ...` lines of the docs' shell blocks are accepted by the parser as written (docs/cli.md showed
    `decode --chunks ... --against ...`, which decode refuses)."""
    import shlex

    commands = _documented_commands()
    assert any(page == "docs/cli.md" and "decode" in text for page, _, text in commands)
    for page, line, text in commands:
        argv = shlex.split(text, comments=True)[1:]
        if argv[-1:] == ["&"]:  # started in the background, as a long-lived process is
            argv.pop()
        try:
            build_parser().parse_args(argv)
        except Exception as e:  # noqa: BLE001 (the parser's UsageError, with the line that caused it)
            pytest.fail(f"{page}:{line}: {text!r}: {e}")
