"""DiskTier's safe defaults: a private folder (refused when another user owns it or others may write it), 0600 files,
no symlink followed on read or write, and no file read whole past ``max_value_bytes``."""

from __future__ import annotations

import os
import stat

import pytest

from kvcodec.errors import InvalidInputError, LimitExceededError
from kvcodec.store import DiskTier


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture()
def umask():
    old = os.umask(0)  # the most permissive: whatever is private here is private by choice, not by umask
    yield
    os.umask(old)


def test_private_folder_and_files(tmp_path, umask):
    tier = DiskTier(tmp_path / "new" / "kv")
    assert mode(tmp_path / "new" / "kv") == 0o700
    assert tier.put("k", b"token ids inside")
    (name,) = os.listdir(tmp_path / "new" / "kv")
    assert mode(tmp_path / "new" / "kv" / name) == 0o600
    shared = DiskTier(tmp_path / "shared", shared=True)  # deliberately shared: the umask decides
    assert shared.put("k", b"v") and mode(tmp_path / "shared") == 0o777
    assert {mode(p) for p in (tmp_path / "shared").iterdir()} == {0o666}


@pytest.mark.parametrize("bits", [0o770, 0o707, 0o1777])
def test_a_folder_others_may_write_is_refused(tmp_path, bits):
    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(bits)
    with pytest.raises(InvalidInputError, match="writable by its group or by others.*chmod 700.*shared=True"):
        DiskTier(folder)
    assert DiskTier(folder, shared=True).put("k", b"v")
    folder.chmod(0o700)
    assert DiskTier(folder).get("k") == b"v"


def _foreign_uid() -> int:
    return 65534 if os.geteuid() != 65534 else 65533


def test_a_folder_of_another_user_is_refused(tmp_path):
    if os.geteuid() == 0:
        folder = tmp_path / "kv"  # what another user made first, e.g. /tmp/kvcodec-vllm
        folder.mkdir(mode=0o755)
        os.chown(folder, _foreign_uid(), -1)
    else:
        folder = tmp_path.anchor  # "/": root's
    with pytest.raises(InvalidInputError, match="belongs to user .* not to this process's user.*shared=True"):
        DiskTier(folder)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a symlink owned by another user needs root")
def test_a_symlinked_folder_of_another_user_is_refused(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "planted"
    link.symlink_to(mine)
    os.lchown(link, _foreign_uid(), -1)
    with pytest.raises(InvalidInputError, match="symlink owned by user"):
        DiskTier(link)
    own = tmp_path / "own-link"
    own.symlink_to(mine)
    assert DiskTier(own).put("k", b"v")  # one's own symlink to one's own folder is fine


def test_symlinks_are_not_followed(tmp_path):
    tier = DiskTier(tmp_path / "kv")
    outside = tmp_path / "secret.txt"
    outside.write_bytes(b"not a kv value")
    path = os.path.join(tier.path, tier._file("k"))
    os.symlink(outside, path)
    assert tier.get("k") is None and not tier.contains("k")  # read: O_NOFOLLOW
    assert tier.size() == 0
    assert tier.put("k", b"value")  # write: the rename replaces the link, never writes through it
    assert outside.read_bytes() == b"not a kv value"
    assert not os.path.islink(path) and tier.get("k") == b"value"
    os.unlink(path)
    os.symlink(outside, path)
    assert DiskTier(tmp_path / "kv")._index == {} and tier.size() == 0  # not counted against the capacity


def test_a_file_past_max_value_bytes_is_refused_unread(tmp_path):
    tier = DiskTier(tmp_path / "kv", max_value_bytes=1000)
    assert tier.put("small", b"s" * 1000) and tier.get("small") == b"s" * 1000
    with open(os.path.join(tier.path, tier._file("big")), "wb") as f:  # what another writer left; the size check
        f.truncate(1 << 40)  # a sparse terabyte                            comes before any read
    with pytest.raises(LimitExceededError, match="more than the 1000"):
        tier.get("big")
    with pytest.raises(LimitExceededError, match="more than the 10 "):  # and the reader's own bound
        tier.get("small", 10)
    assert DiskTier(tmp_path / "kv").get("small") == b"s" * 1000  # the default limit (1 GiB)


def test_a_folder_swapped_under_a_running_disk_tier_is_never_read(tmp_path):
    """The folder was checked once, by path: whoever owns its parent could rename it away and put a folder of forged
    values at the path, which the running tier then served.  The tier holds the folder it checked."""
    path = tmp_path / "kv"
    tier = DiskTier(path)
    assert tier.put("k", b"good")
    os.rename(path, tmp_path / "moved")
    forged = DiskTier(path)  # a private folder of the same user's making at the same path
    assert forged.put("k", b"forged") and forged.put("other", b"forged")
    assert tier.get("k") == b"good" and tier.keys() == ["k"] and tier.value_sizes(["k", "other"]) == [4, None]
    assert tier.put("new", b"value") and not forged.contains("new")
    assert tier.delete("k") and forged.get("k") == b"forged"
