"""tests/stored.py: stored reference numbers are refused once what produced them changed."""

import pytest

import stored


def test_a_stored_reference_is_read_back_while_its_sources_are_unchanged(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "REPO", tmp_path)
    case = tmp_path / "case.py"
    case.write_text("x = 1\n")
    stored.save(tmp_path / "expected" / "case.json", stored.digest([case]), {"loss": 0.25})
    assert stored.load(tmp_path / "expected" / "case.json", stored.digest([case])) == {"loss": 0.25}


def test_a_changed_case_or_a_missing_file_names_make_oracle(tmp_path, monkeypatch):
    monkeypatch.setattr(stored, "REPO", tmp_path)
    case = tmp_path / "case.py"
    case.write_text("x = 1\n")
    path = tmp_path / "expected" / "case.json"
    stored.save(path, stored.digest([case]), {"loss": 0.25})
    case.write_text("x = 2\n")
    with pytest.raises(stored.StaleReference, match="was stored from other sources.*run `make oracle`"):
        stored.load(path, stored.digest([case]))
    assert stored.digest([case]) != stored.digest([case], extra="another case")
    with pytest.raises(stored.StaleReference, match="no stored reference at expected/other.json: run `make oracle`"):
        stored.load(tmp_path / "expected" / "other.json", stored.digest([case]))
