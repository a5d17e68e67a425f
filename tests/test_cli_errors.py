"""Bad input to every subcommand: a clear message, the documented exit code, no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvcodec.cli import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_INVALID, EXIT_IO, EXIT_STDOUT_CLOSED, EXIT_UNSUPPORTED,
                         EXIT_USAGE, build_parser, main)

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


def test_the_console_script_shows_no_traceback(files, kvcodec_script):
    for argv in (["info", files["text"]], ["decode", files["kvc"], "-o", "x", "--device", "meta"]):
        res = subprocess.run([kvcodec_script, *argv], capture_output=True, text=True, timeout=120)
        assert res.returncode in (EXIT_FAILED, EXIT_UNSUPPORTED) and "Traceback" not in res.stderr
        assert res.stderr.startswith(f"kvcodec {argv[0]}: error: ")


# --- issue 35, item 7 -------------------------------------------------------------------------------------------


def _interrupt_default():
    """Children get Python's own Ctrl-C handling even when this process was started with SIGINT ignored (a
    background job)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_issue35_a_closed_stdout_ends_quietly(files):
    """`kvcodec info x.kvc --json | head -c 100`: the reader goes away; no BrokenPipeError traceback, exit 141."""
    for argv in (["info", files["kvc"], "--json"], ["info", files["missing"], "--json"], ["codecs"]):
        p = subprocess.Popen([sys.executable, "-m", "kvcodec", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        p.stdout.close()  # before the child writes: its first write finds no reader
        err = p.stderr.read().decode()
        assert p.wait(timeout=120) == EXIT_STDOUT_CLOSED and err == "", (argv, err)


def test_issue35_ctrl_c_prints_one_line(files, tmp_path):
    """Ctrl-C while the model loads: "interrupted", exit 130, no traceback and nothing from atexit callbacks."""
    p = subprocess.Popen([sys.executable, "-m", "kvcodec", "dump", "--tokens", "16", "-o", str(tmp_path / "d.st")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_interrupt_default)
    first = os.read(p.stderr.fileno(), 200)  # the model's loading bar: the command is running
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    err = (first + err).decode()
    assert p.returncode == EXIT_INTERRUPTED and err.endswith("interrupted\n") and "Traceback" not in err, err
    assert "Exception ignored" not in err and not (tmp_path / "d.st").exists()


def test_issue35_ctrl_c_while_torch_imports_prints_one_line(tmp_path):
    """Ctrl-C during start-up, while torch imports: it was a KeyboardInterrupt traceback from inside torch, because
    ``import kvcodec`` imported torch before the command's handler existed."""
    p = subprocess.Popen([sys.executable, "-m", "kvcodec", "dump", "--tokens", "16", "-o", str(tmp_path / "d.st")],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_interrupt_default)
    maps, deadline = f"/proc/{p.pid}/maps", time.monotonic() + 60
    while "libtorch" not in open(maps).read():  # torch's libraries are mapped at the start of its import
        assert p.poll() is None and time.monotonic() < deadline
        time.sleep(0.005)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == EXIT_INTERRUPTED and err.decode() == "interrupted\n", err.decode()


def test_issue35_an_output_folder_is_refused_before_any_work(capsys, files, tmp_path):
    for argv in (["encode", files["dump"]], ["decode", files["kvc"]], ["dump"], ["calibrate"]):
        code, _, err = run(capsys, *argv, "-o", str(tmp_path))
        assert code == EXIT_USAGE and "is a folder" in err and f"-o {tmp_path}/" in err, (argv, err)
    assert list(tmp_path.iterdir()) == []


def test_issue35_a_file_that_is_not_a_kv_dump_says_what_a_dump_holds(capsys, files, tmp_path):
    """Every file that is not a dump is the same kind of error (exit 1, it was 1 or 5), and says what a dump holds;
    a container given as a dump says to use decode or info."""
    from safetensors.torch import save_file

    bad = {"foreign": {"bias": torch.zeros(3)},
           "shapes": {"layers.0.keys": torch.zeros(2, 10, 8, dtype=torch.float16),
                      "layers.0.values": torch.zeros(2, 9, 8, dtype=torch.float16)},
           "dtype": {"layers.0.keys": torch.zeros(2, 10, 8, dtype=torch.float64),
                     "layers.0.values": torch.zeros(2, 10, 8, dtype=torch.float64)},
           "novalues": {"layers.0.keys": torch.zeros(2, 10, 8, dtype=torch.float16)}}
    out = str(tmp_path / "out.kvc")
    for name, tensors in bad.items():
        path = str(tmp_path / f"{name}.safetensors")
        save_file(tensors, path)
        for argv in (["encode", path, "-o", out], ["bench", path], ["decode", files["kvc"], "-o", out, "--against", path]):
            code, _, err = run(capsys, *argv)
            assert code == EXIT_FAILED and path in err and "layers.{i}.keys and layers.{i}.values" in err, (argv, err)
            assert "[heads, tokens, head_dim]" in err
    for argv in (["encode", files["kvc"], "-o", out], ["bench", files["kvc"]]):
        code, _, err = run(capsys, *argv)
        assert code == EXIT_FAILED and f"{files['kvc']} is a kvcodec container" in err and "kvcodec decode" in err
        assert "header too large" not in err


def test_issue35_python_dash_m_kvcodec_runs(files):
    res = subprocess.run([sys.executable, "-m", "kvcodec", "info", files["text"]], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == EXIT_FAILED and res.stderr.startswith("kvcodec info: error: ")
