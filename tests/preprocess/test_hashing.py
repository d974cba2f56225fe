"""The inputs' digests: BLAKE3 of a file (b3sum's), of a datasets directory, computed by a child process."""

from __future__ import annotations

import blake3
import pytest

from tokenloom.preprocess import hashing
from tokenloom.preprocess.hashing import InputHasher, digest


def test_a_file_digest_is_b3sum_s_and_a_directory_digest_covers_names_and_contents(tmp_path, monkeypatch):
    data = bytes(range(256)) * 40_000  # ~10 MB: several BLAKE3 chunks, hashed by more than one thread
    (tmp_path / "f.bin").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    monkeypatch.setattr(hashing, "THREADS", 4)
    assert digest(str(tmp_path / "f.bin")) == blake3.blake3(data).hexdigest()
    assert digest(str(tmp_path / "empty")) == blake3.blake3(b"").hexdigest()
    ds = tmp_path / "ds"
    (ds / "train").mkdir(parents=True)
    (ds / "train" / "a.arrow").write_bytes(b"a")
    (ds / "state.json").write_bytes(b"{}")
    before = digest(str(ds))
    (ds / "train" / "a.arrow").rename(ds / "train" / "b.arrow")
    renamed = digest(str(ds))
    (ds / "train" / "b.arrow").write_bytes(b"b")
    assert len({before, renamed, digest(str(ds))}) == 3


def test_the_hasher_child_returns_the_digests_or_raises_its_error(tmp_path):
    paths = []
    for i in range(6):  # more files than it hashes at once
        paths.append(str(tmp_path / f"{i}.jsonl"))
        (tmp_path / f"{i}.jsonl").write_bytes(b'{"text": "x"}\n' * (i + 1))
    assert InputHasher(paths).result() == {p: digest(p) for p in paths}
    hasher = InputHasher([*paths, str(tmp_path / "gone.jsonl")])
    with pytest.raises(FileNotFoundError):
        hasher.result()
    hasher.close()


def test_a_closed_hasher_leaves_no_process(tmp_path):
    import multiprocessing

    (tmp_path / "a").write_bytes(b"x" * 1000)
    hasher = InputHasher([str(tmp_path / "a")])
    hasher.close()
    assert multiprocessing.active_children() == []
