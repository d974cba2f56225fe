"""tokenloom.fsio: temporary files of dead writers, and one-line messages for OS errors."""

from __future__ import annotations

import errno
import os
import subprocess
import sys

import pytest

from tokenloom.fsio import atomic_writer, naming, os_error_message, remove_dead_temps, temp_name


def _dead_pid() -> int:
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout)


def test_remove_dead_temps_removes_files_and_folders_of_dead_pids_only(tmp_path):
    final = tmp_path / "out.bin"
    dead = _dead_pid()
    stale_file, stale_dir = tmp_path / f"out.bin.tmp-{dead}-aaaa0000", tmp_path / f"out.bin.tmp-{dead}-bbbb1111"
    stale_file.write_bytes(b"x")
    (stale_dir / "inner").mkdir(parents=True)
    live = tmp_path / os.path.basename(temp_name(final))  # this process: alive
    live.write_bytes(b"x")
    odd = tmp_path / "out.bin.tmp-notapid"
    odd.write_bytes(b"x")
    other = tmp_path / f"out.binary.tmp-{dead}-cccc2222"  # another output's name
    other.write_bytes(b"x")
    assert sorted(remove_dead_temps(final)) == sorted([str(stale_file), str(stale_dir)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, odd.name, other.name])


@pytest.mark.parametrize("err, start", [(errno.ENOSPC, "no space left on device writing /d/{x}.bin: free space on that disk"),
                                        (errno.EMFILE, "too many open files at /d/{x}.bin: raise the open-file limit"),
                                        (errno.EIO, "I/O error on /d/{x}.bin"),
                                        (errno.EROFS, "read-only file system at /d/{x}.bin"),
                                        (errno.ENAMETOOLONG, "File name too long on /d/{x}.bin")])
def test_os_error_message_names_the_path_and_what_to_do(err, start):
    message = os_error_message(OSError(err, os.strerror(err)), "/d/{x}.bin")  # braces stay literal
    assert message.startswith(start) and "\n" not in message
    assert os_error_message(OSError(err, os.strerror(err), "/d/{x}.bin")).startswith(start)  # the error's own name


def test_naming_gives_a_nameless_error_the_path_and_keeps_its_kind(tmp_path):
    with pytest.raises(PermissionError) as info, naming(tmp_path / "f"):
        raise OSError(errno.EACCES, "denied")
    assert info.value.filename == str(tmp_path / "f")
    with pytest.raises(OSError) as info, naming(tmp_path / "f"):
        raise OSError(errno.EIO, "io", "/named/already")
    assert info.value.filename == "/named/already"


def test_atomic_writer_names_its_target_and_leaves_no_temporary(tmp_path):
    with pytest.raises(OSError) as info, atomic_writer(tmp_path / "m.json", "w") as f:
        f.write("x")
        raise OSError(errno.ENOSPC, "full")
    assert info.value.filename == str(tmp_path / "m.json")
    assert list(tmp_path.iterdir()) == []
