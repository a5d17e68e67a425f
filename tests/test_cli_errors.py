"""Bad input to every subcommand: a clear message, the documented exit code, no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from kvcodec.cli import EXIT_FAILED, EXIT_INVALID, EXIT_IO, EXIT_UNSUPPORTED, EXIT_USAGE, build_parser, main

COMMANDS = sorted(next(a.choices for a in build_parser()._actions if hasattr(a, "choices") and a.choices))


def run(capsys, *argv):
    capsys.readouterr()
    code = main(list(argv))  # an exception escaping here is a traceback the user would see
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


@pytest.fixture(scope="module")
def files(real_dump, tmp_path_factory):
    import kvcodec

    d = tmp_path_factory.mktemp("bad")
    dump = real_dump("pydoc-topics", 300)
    kvc = d / "kv.kvc"
    kvcodec.save(kvc, kvcodec.KVCache.load_safetensors(dump), "kivi")
    (d / "text.txt").write_text("not a container, not a dump\n" * 20)
    truncated = d / "truncated.kvc"
    truncated.write_bytes(kvc.read_bytes()[: kvc.stat().st_size // 2])
    return {"dump": str(dump), "kvc": str(kvc), "text": str(d / "text.txt"), "truncated": str(truncated),
            "missing": str(d / "missing.kvc"), "dir": d}


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_flag_prints_the_subcommands_usage(capsys, command):
    # (a command with required arguments names those first; the cases below give them and a bad flag)
    code, out, err = run(capsys, command, "--no-such-flag")
    assert code == EXIT_USAGE and err.startswith(f"usage: kvcodec {command}") and out == ""
    code, out, err = run(capsys, command, "--no-such-flag", "--json")
    report = json.loads(out)
    assert code == EXIT_USAGE and report == {"ok": False, "command": command, "error": report["error"],
                                             "exit_code": EXIT_USAGE}


def _cases(f):
    """(argv, exit code, words the message must hold) for each subcommand."""
    out = str(f["dir"] / "out.x")
    return [
        (["dump", "--text", "license:NOPE", "-o", out], EXIT_USAGE, ["NOPE", "GPL-3", "MPL-2.0"]),
        (["dump", "--tokens", "0", "-o", out], EXIT_USAGE, ["--tokens", "positive"]),
        (["dump", "--model", "no-such-model", "--text", f["text"], "-o", out], EXIT_INVALID, ["no-such-model"]),
        (["encode", f["missing"], "-o", out], EXIT_IO, [f["missing"]]),
        (["encode", f["text"], "-o", out], EXIT_FAILED, [f["text"]]),
        (["encode", f["dump"], "-o", "/nonexistent-dir/x.kvc"], EXIT_IO, ["/nonexistent-dir/x.kvc"]),
        (["encode", f["dump"], "-o", out, "--codec", "kivi:bits=4", "--set", "bits=2"], EXIT_USAGE,
         ["bits", "twice", "--codec kivi:bits=4", "--set bits=2"]),
        (["encode", f["dump"], "-o", out, "--codec", "kivi:bits"], EXIT_USAGE, ["key=value"]),
        (["encode", f["dump"], "-o", out, "--codec", "kivi:bits=3"], EXIT_INVALID, ["bits"]),
        (["encode", f["dump"], "-o", out, "--chunk-tokens", "-4"], EXIT_USAGE, ["--chunk-tokens"]),
        (["encode", f["dump"], "-o", out, "--threads", "zero"], EXIT_USAGE, ["--threads"]),
        (["decode", f["kvc"], "-o", out, "--device", "foo"], EXIT_USAGE, ["--device", "foo"]),
        (["decode", f["kvc"], "-o", out, "--device", "meta"], EXIT_UNSUPPORTED, ["meta"]),
        (["decode", f["kvc"], "-o", out, "--layers", "40"], EXIT_USAGE, ["--layers 40", "30 layers", "0-29"]),
        (["decode", f["kvc"], "-o", out, "--layers", "abc"], EXIT_USAGE, ["--layers", "abc"]),
        (["decode", f["kvc"], "-o", out, "--chunks", "7"], EXIT_USAGE, ["--chunks", "2 chunks"]),
        (["decode", f["truncated"], "-o", out], EXIT_FAILED, [f["truncated"]]),
        (["decode", f["kvc"], "-o", out, "--against", f["missing"]], EXIT_IO, [f["missing"]]),
        (["info", f["kvc"], "--no-such-flag"], EXIT_USAGE, ["unrecognized arguments: --no-such-flag"]),
        (["info", f["missing"]], EXIT_IO, [f["missing"]]),
        (["info", f["text"]], EXIT_FAILED, [f["text"], "not a kvcodec container"]),
        (["info", f["truncated"]], EXIT_FAILED, [f["truncated"]]),
        (["verify", f["text"]], EXIT_FAILED, [f["text"]]),
        (["verify", f["kvc"], "--against", f["text"]], EXIT_FAILED, [f["text"]]),
        (["eval", "--text", "license:NOPE"], EXIT_USAGE, ["NOPE", "GPL-3"]),
        (["eval", "--codec", "nosuch"], EXIT_UNSUPPORTED, ["nosuch"]),
        (["bench", f["dump"], "--repeat", "0"], EXIT_USAGE, ["--repeat"]),
        (["bench", f["kvc"]], EXIT_FAILED, [f["kvc"]]),
        (["profile", "--text", "license:NOPE", "-o", out], EXIT_USAGE, ["NOPE"]),
        (["codecs", "extra"], EXIT_USAGE, ["extra"]),
    ]


def test_every_subcommand_rejects_bad_input_with_a_message(capsys, files):
    cases = _cases(files)
    assert {argv[0] for argv, _, _ in cases} >= {"dump", "encode", "decode", "info", "verify", "eval", "bench",
                                                 "profile", "codecs"}
    for argv, expected, words in cases:
        code, out, err = run(capsys, *argv)
        assert code == expected, (argv, code, err)
        assert all(w in out + err for w in words), (argv, out, err)  # verify reports its FAILED on stdout
        if expected == EXIT_USAGE:
            assert f"usage: kvcodec {argv[0]}" in err, (argv, err)
        code, out, err = run(capsys, *argv, "--json")
        report = json.loads(out)
        assert code == expected and report["ok"] is False and report["exit_code"] == expected, (argv, out)
    assert not (files["dir"] / "out.x").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without CUDA")
def test_a_missing_device_is_an_environment_error_not_corrupt_data(capsys, files):
    import kvcodec
    from kvcodec.errors import CorruptDataError, DeviceUnavailableError, UnsupportedError

    blob = open(files["kvc"], "rb").read()
    for call in (lambda: kvcodec.decode(blob, device="cuda"), lambda: kvcodec.decode(iter([blob]), device="cuda"),
                 lambda: kvcodec.open(blob).read_chunk(0, device="cuda")):
        with pytest.raises(DeviceUnavailableError, match="cuda") as e:
            call()
        assert isinstance(e.value, UnsupportedError) and not isinstance(e.value, CorruptDataError)
    code, _, err = run(capsys, "decode", files["kvc"], "-o", str(files["dir"] / "o.st"), "--device", "cuda")
    assert code == EXIT_UNSUPPORTED and "cuda" in err


def test_the_console_script_shows_no_traceback(files):
    exe = shutil.which("kvcodec") or pytest.fail("the kvcodec console script is not installed")
    for argv in (["info", files["text"]], ["decode", files["kvc"], "-o", "x", "--device", "meta"]):
        res = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode in (EXIT_FAILED, EXIT_UNSUPPORTED) and "Traceback" not in res.stderr
        assert res.stderr.startswith(f"kvcodec {argv[0]}: error: ")
