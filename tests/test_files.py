"""coe.files.write_json_atomic: the whole document or the old one, never a temp file left behind."""
from __future__ import annotations

import json

import pytest

from coe.files import write_json_atomic


def test_a_write_replaces_the_whole_document_and_leaves_no_temp_file(tmp_path):
    path = tmp_path / "sub" / "doc.json"
    write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2], "b": 1} and path.read_text().startswith('{\n "a"')
    write_json_atomic(path, {"c": 3})
    assert json.loads(path.read_text()) == {"c": 3} and [p.name for p in path.parent.iterdir()] == ["doc.json"]


def test_a_document_that_cannot_be_written_leaves_the_old_one(tmp_path):
    path = tmp_path / "doc.json"
    write_json_atomic(path, {"old": True})
    with pytest.raises(TypeError):
        write_json_atomic(path, {"bad": object()})
    assert json.loads(path.read_text()) == {"old": True} and [p.name for p in tmp_path.iterdir()] == ["doc.json"]
