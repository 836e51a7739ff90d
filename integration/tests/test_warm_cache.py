"""`built_once`: a warm start is built once per key and code, by whichever process asks first."""

from __future__ import annotations

import json

from tidal.integration.sft import built_once


def _build(folder):
    folder.mkdir(parents=True)
    n = folder.parent / "builds"
    n.write_text(str(int(n.read_text()) + 1 if n.exists() else 1))
    (folder / "model.txt").write_text("weights")


def _other_build(folder):  # same job, other source: another cache entry
    folder.mkdir(parents=True)
    (folder / "model.txt").write_text("other weights")


def test_a_warm_start_is_built_once_per_key_and_source(tmp_path):
    a = built_once(tmp_path, {"steps": 10}, _build)
    assert built_once(tmp_path, {"steps": 10}, _build) == a and (tmp_path / "builds").read_text() == "1"
    assert json.loads((a / ".complete").read_text()) == {"steps": 10}
    b = built_once(tmp_path, {"steps": 11}, _build)
    assert b != a and (tmp_path / "builds").read_text() == "2"
    c = built_once(tmp_path, {"steps": 10}, _other_build)
    assert c not in (a, b) and (c / "model.txt").read_text() == "other weights"


def test_a_build_that_died_half_way_is_built_again(tmp_path):
    a = built_once(tmp_path, {"k": 1}, _build)
    (a / ".complete").unlink()  # as if the process building it had been killed before it finished
    assert built_once(tmp_path, {"k": 1}, _build) == a and (tmp_path / "builds").read_text() == "2"
