"""Files kvcodec writes: whole or not at all, with the mode a plain open() gives under the umask."""

from __future__ import annotations

import os
import stat

import pytest
import torch

import kvcodec
from kvcodec.cli import main
from kvcodec.files import atomic_writer
from kvcodec.store import DiskTier


def small_cache() -> kvcodec.KVCache:
    g = torch.Generator().manual_seed(7)
    return kvcodec.KVCache([(torch.randn(2, 40, 8, generator=g).half(), torch.randn(2, 40, 8, generator=g).half())])


@pytest.fixture(params=[0o022, 0o077, 0o002])
def umask(request):
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_every_file_gets_the_umask_mode(tmp_path, umask, capsys):
    expected = 0o666 & ~umask
    kv = small_cache()
    kvcodec.save(tmp_path / "api.kvc", kv, "kivi")
    kv.save_safetensors(tmp_path / "dump.safetensors")
    assert main(["encode", str(tmp_path / "dump.safetensors"), "-o", str(tmp_path / "cli.kvc"), "-q"]) == 0
    assert main(["decode", str(tmp_path / "cli.kvc"), "-o", str(tmp_path / "back.safetensors"), "-q"]) == 0
    tier = DiskTier(tmp_path / "tier", shared=True)  # a private tier makes its files 0600 (tests/test_disk_safety.py)
    assert tier.put("model@0@0@abc@float16", kvcodec.encode(kv))
    written = ["api.kvc", "dump.safetensors", "cli.kvc", "back.safetensors"]
    written += [os.path.join("tier", n) for n in os.listdir(tmp_path / "tier")]
    assert len(written) == 5 and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    assert {n: oct(mode(tmp_path / n)) for n in written} == {n: oct(expected) for n in written}


def test_atomic_writer_keeps_the_old_file_on_failure_and_names_the_target(tmp_path):
    target = tmp_path / "x.bin"
    target.write_bytes(b"old")
    with pytest.raises(RuntimeError):
        with atomic_writer(target) as f:
            f.write(b"new, half written")
            raise RuntimeError("killed")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["x.bin"]
    with pytest.raises(FileNotFoundError) as e:
        with atomic_writer(tmp_path / "no-dir" / "y.bin"):
            pass
    assert e.value.filename == str(tmp_path / "no-dir" / "y.bin")
