"""The test-checkpoint commands as a user runs them: `make_model --out` into folders that do not
exist yet (made first, not found missing at the end), with progress on stderr; `families`
without arguments explains itself and fails, with them writes the family's checkpoint."""
import json

import pytest

from kvhold.testing import families, make_model


def test_make_model_makes_the_parent_folders_and_says_what_it_does(tmp_path, capsys):
    out = tmp_path / "not" / "there" / "tiny"
    assert make_model.main(["--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    err = capsys.readouterr().err
    assert "training the BPE tokenizer" in err and "drawing random weights" in err
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]          # no temp folder left


def test_families_needs_a_family_and_writes_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        families.main([])
    assert exc.value.code == 2 and "family" in capsys.readouterr().err
    assert families.main(["qwen2", "--out", str(tmp_path / "q")]) == 0
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "qwen2"
