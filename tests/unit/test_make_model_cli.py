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


def test_make_model_spills_the_shards_that_do_not_fit_and_the_checkpoint_loads_as_one(tmp_path, monkeypatch,
                                                                                      capsys):
    """--spill-dir: once --out's file system has no room for the next shard, shards are written to
    the spill folder and linked from the checkpoint's folder, whose manifest and weights read as if
    every shard lay in it (a 70B checkpoint on a machine whose /dev/shm and disk are each too small)."""
    import shutil
    from collections import namedtuple

    import torch
    from safetensors.torch import load_file

    from kvhold.protocol.checkpoint import build_manifest
    from kvhold.protocol.model_spec import ModelSpec

    ref = make_model.build(tmp_path / "ref", "tiny", shard_bytes=200_000, progress=False)
    usage, real = namedtuple("usage", "total used free"), shutil.disk_usage
    room = {"left": 2}              # two shards fit beside --out, the rest do not

    def disk_usage(path):
        room["left"] -= 1
        return usage(1, 0, (1 << 40) if room["left"] >= 0 else 0) if str(path).startswith(
            str(tmp_path / "m")) else real(path)

    monkeypatch.setattr(make_model.shutil, "disk_usage", disk_usage)
    out, spill = tmp_path / "m" / "tiny", tmp_path / "spill"
    assert make_model.main(["--out", str(out), "--shard-gb", str(200_000 / 2**30), "--spill-dir", str(spill)]) == 0
    shards = sorted(out.glob("*.safetensors"))
    linked = [p for p in shards if p.is_symlink()]
    assert len(shards) == len(list(ref.glob("*.safetensors"))) > 3 and len(shards) - len(linked) == 2
    assert sorted(p.resolve() for p in linked) == sorted(spill.iterdir())
    assert "spilled to" in capsys.readouterr().err
    spec = ModelSpec.from_config(json.loads((out / "config.json").read_text()))
    assert build_manifest(out, spec).fingerprint == build_manifest(ref, spec).fingerprint
    for a, b in zip(shards, sorted(ref.glob("*.safetensors"))):
        want = load_file(b)
        assert all(torch.equal(t, want[name]) for name, t in load_file(a).items())
    # built again over itself: the old build's spilled shards go with it, none is left behind
    room["left"] = 2
    assert make_model.main(["--out", str(out), "--shard-gb", str(200_000 / 2**30), "--spill-dir", str(spill)]) == 0
    assert sorted(p.resolve() for p in out.glob("*.safetensors") if p.is_symlink()) == sorted(spill.iterdir())
