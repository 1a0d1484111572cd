"""megatron_mugrpo.durable: atomic writes that leave nothing half-written, checksums that name their algorithm."""

from __future__ import annotations

import ast
import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest

from megatron_mugrpo import durable
from megatron_mugrpo.durable import Checksum, ChecksumError


def test_atomic_write_leaves_only_the_file(tmp_path: Path) -> None:
    path = tmp_path / "record.bin"
    durable.atomic_write_bytes(path, b"first")
    durable.atomic_write_bytes(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["record.bin"]


def test_json_round_trip(tmp_path: Path) -> None:
    value = {"b": [1, 2.5, None], "a": {"nested": "ü"}}
    path = tmp_path / "value.json"
    durable.atomic_write_json(path, value, sort_keys=True)
    assert json.loads(path.read_text()) == value
    assert path.read_text().endswith("}\n") and path.read_text().index('"a"') < path.read_text().index('"b"')


def test_a_failed_rename_keeps_the_old_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "pointer"
    durable.atomic_write_text(path, "old\n")

    def fail(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        durable.atomic_write_text(path, "new\n")
    assert path.read_text() == "old\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pointer"]  # the temporary is removed


def test_a_failure_while_writing_keeps_the_old_content(tmp_path: Path) -> None:
    path = tmp_path / "shard.arrow"
    durable.atomic_write_bytes(path, b"complete shard")
    with pytest.raises(RuntimeError, match="killed"), durable.atomic_path(path) as tmp:
        tmp.write_bytes(b"half a sh")
        raise RuntimeError("killed mid-write")
    assert path.read_bytes() == b"complete shard"
    assert not durable.temporary_path(path).exists()


def test_atomic_path_fsyncs_the_file_then_the_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(durable, "fsync_file", lambda p: calls.append(f"file {Path(p).name}"))
    monkeypatch.setattr(durable, "fsync_dir", lambda p: calls.append(f"dir {Path(p).name}"))
    with durable.atomic_path(tmp_path / "data") as tmp:
        tmp.write_bytes(b"x")
    assert calls == ["file data.tmp", f"dir {tmp_path.name}"]


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
def test_checksums_of_both_algorithms_verify(tmp_path: Path, algorithm: str) -> None:
    path = tmp_path / "data"
    data = os.urandom(3 * durable.HASH_CHUNK_BYTES + 17)  # several chunks and a remainder
    path.write_bytes(data)
    checksum = Checksum.of_file(path, algorithm)
    assert checksum == Checksum.of_bytes(data, algorithm)
    assert Checksum.from_json(asdict(checksum)) == checksum
    checksum.verify_file(path)
    assert durable.file_checksum(path, algorithm) == (checksum, len(data))


def test_new_checksums_are_xxh3_and_sha256_records_still_verify(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(b"groups")
    assert Checksum.of_file(path).algorithm == "xxh3_128"
    legacy = {"index": 0, "sha256": hashlib.sha256(b"groups").hexdigest()}  # a record of an earlier version
    checksum, rest = Checksum.split_record(legacy)
    assert checksum.algorithm == "sha256" and rest == {"index": 0}
    checksum.verify_file(path)


def test_a_mismatched_checksum_names_file_and_algorithm(tmp_path: Path) -> None:
    path = tmp_path / "shard"
    path.write_bytes(b"groups")
    checksum = Checksum.of_file(path)
    path.write_bytes(b"grOups")
    with pytest.raises(ChecksumError, match=r"shard .*shard does not match its recorded xxh3_128 checksum"):
        checksum.verify_file(path, "shard")


def test_an_unknown_algorithm_is_refused() -> None:
    with pytest.raises(ChecksumError, match="'md5' is not one of"):
        Checksum("md5", "00")
    with pytest.raises(ChecksumError, match="not a checksum record"):
        Checksum.from_json({"hexdigest": "00"})


# ------------------------------------------------------------------------------- directories


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def test_atomic_dir_appears_whole_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "out" / "model"
    with durable.atomic_dir(target, fsync=True) as build:
        assert build.parent == target.parent and build.is_dir() and not target.exists()
        (build / "sub").mkdir()
        (build / "sub" / "w.bin").write_text("weights")
        (build / "config.json").write_text("{}")
    assert _tree(target) == {"config.json": "{}", "sub/w.bin": "weights"}
    assert sorted(p.name for p in target.parent.iterdir()) == ["model"]


def test_a_failed_build_leaves_the_old_directory(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(RuntimeError, match="export failed"), durable.atomic_dir(target, replace_existing=True) as build:
        (build / "new.txt").write_text("half")
        raise RuntimeError("export failed")
    assert _tree(target) == {"old.txt": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_replace_existing_swaps_the_whole_directory(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with durable.atomic_dir(target, replace_existing=True) as build:
        (build / "new.txt").write_text("new")
    assert _tree(target) == {"new.txt": "new"}  # nothing of the old one survives beside the new files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # the old one, moved aside, is gone


def test_a_full_directory_is_not_replaced_unless_asked(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "keep.txt").write_text("keep")
    with pytest.raises(FileExistsError), durable.atomic_dir(target):
        pytest.fail("the block must not run")
    (tmp_path / "empty").mkdir()
    with durable.atomic_dir(tmp_path / "empty") as build:  # an empty directory is no loss
        (build / "a").write_text("a")
    assert _tree(tmp_path / "empty") == {"a": "a"} and _tree(target) == {"keep.txt": "keep"}


def test_a_file_written_with_a_mode_never_has_another(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    durable.temporary_path(path).write_text("stale temporary, world-readable")
    os.chmod(durable.temporary_path(path), 0o644)
    durable.atomic_write_bytes(path, b"token", mode=0o600)
    assert path.read_bytes() == b"token" and (path.stat().st_mode & 0o777) == 0o600


def test_read_json_is_none_before_the_first_write(tmp_path: Path) -> None:
    assert durable.read_json(tmp_path / "latest") is None
    durable.atomic_write_json(tmp_path / "latest", {"name": "v1"})
    assert durable.read_json(tmp_path / "latest") == {"name": "v1"}


# ---------------------------------------------------------------------- one durability path

ROOT = Path(__file__).resolve().parents[1]
RENAMES = {("os", "replace"), ("os", "rename"), ("shutil", "move")}


def hand_written_renames(source: str) -> list[int]:
    """Lines of ``source`` that rename a file or directory: ``os.replace`` / ``os.rename`` /
    ``shutil.move``, any ``.rename(...)``, and ``pathlib``'s ``.replace(target)`` (one positional
    argument; ``str.replace`` takes two)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call) and _renames(node))


def _renames(call: ast.Call) -> bool:
    if not isinstance(call.func, ast.Attribute):
        return False
    attr, owner = call.func.attr, call.func.value
    if isinstance(owner, ast.Name) and (owner.id, attr) in RENAMES:
        return True
    return attr == "rename" or (attr == "replace" and len(call.args) == 1 and not call.keywords)


def test_the_rename_finder_sees_every_spelling() -> None:
    source = "os.replace(a, b)\nos.rename(a, b)\ntmp.rename(out)\ntmp.replace(out)\nshutil.move(a, b)\n"
    assert hand_written_renames(source) == [1, 2, 3, 4, 5]
    assert hand_written_renames("name.replace('.', '/')\ndataclasses.replace(cfg, seed=1)\n") == []


def test_only_durable_renames() -> None:
    """Every atomic write goes through ``durable`` (temporary name, fsync when asked, rename, fsync of the
    directory), so a rename anywhere else is a hand-written one that skips some of those steps."""
    found = []
    for directory in (ROOT / "megatron_mugrpo", ROOT / "conversion"):
        for path in sorted(directory.rglob("*.py")):
            if path == ROOT / "megatron_mugrpo" / "durable.py":
                continue
            found += [f"{path.relative_to(ROOT)}:{line}" for line in hand_written_renames(path.read_text())]
    assert not found, f"renames outside durable.py (use durable.atomic_write_* / atomic_path / atomic_dir): {found}"


def test_a_manifest_entry_takes_the_algorithm_its_manifest_names() -> None:
    """A checkpoint manifest names the algorithm once; each entry holds a bare digest (pre-release: keyed by
    the algorithm's name). Both read through the one pre-release reader."""
    entry = {"checksum": "ab", "bytes": 3}
    assert Checksum.split_record(entry, "xxh3_128") == (Checksum("xxh3_128", "ab"), {"bytes": 3})
    assert Checksum.split_record({"sha256": "cd", "bytes": 4}, "sha256") == (Checksum("sha256", "cd"), {"bytes": 4})
    with pytest.raises(ChecksumError, match="holds no checksum"):
        Checksum.split_record({"bytes": 4}, "xxh3_128")
