"""kvhold's vLLM general plugin: pyproject declares it in the group vLLM's
`load_general_plugins` reads (`vllm.general_plugins`), and it resolves, the way vLLM resolves
it (`EntryPoint.load()`), to `kvhold.vllm_bridge.loader.register`, without importing vLLM or
torch: vLLM loads every plugin of the group in every process it starts. (That vLLM itself
calls it is checked where vLLM is installed: tests/vllm_bridge/test_vllm_plugin.py.)"""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GROUP, NAME, VALUE = "vllm.general_plugins", "kvhold", "kvhold.vllm_bridge.loader:register"


def test_pyproject_declares_the_vllm_general_plugin():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][GROUP] == {NAME: VALUE}


def test_the_entry_point_resolves_to_register_without_importing_vllm_or_torch():
    code = (
        "import sys, importlib.metadata as md\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('vllm', 'torch'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        f"ep = md.EntryPoint(name={NAME!r}, value={VALUE!r}, group={GROUP!r})\n"
        "func = ep.load()\n"
        "import kvhold.vllm_bridge.loader as loader\n"
        "assert func is loader.register and callable(func)\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch')]\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_an_installed_kvhold_that_declares_vllm_plugins_declares_this_one():
    """The installed metadata, where it lists any plugin of the group (an install made from a
    pyproject older than the entry point lists none; the built wheel's is checked in
    test_packaging)."""
    try:
        eps = importlib.metadata.distribution("kvhold").entry_points
    except importlib.metadata.PackageNotFoundError:
        return
    ours = [(ep.name, ep.value) for ep in eps if ep.group == GROUP]
    assert ours in ([], [(NAME, VALUE)])
