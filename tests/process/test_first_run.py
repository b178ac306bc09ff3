"""What a new user meets first: `kvhold serve` started, as the installed command, from a folder
that holds a directory named `kvhold` (a clone, seen from its parent folder). Its children
(`python -m kvhold ...`: the sidecar, the frontend, executors, the zygote) put the working
directory first on their import path and would import that directory instead of the package;
the command starts them so that they do not (kvhold.cli.main)."""
import shutil
import sys
from pathlib import Path

from kvhold.testing.serve_process import ServeProcess
from tests.process.helpers import SERVE_FLAGS, completion


def _console_script() -> str:
    """The `kvhold` command of the Python running the tests (pip's console script)."""
    beside = Path(sys.executable).with_name("kvhold")
    found = str(beside) if beside.exists() else shutil.which("kvhold")
    assert found, "the kvhold command is not installed (pip install -e .)"
    return found


def test_serve_from_a_folder_holding_a_kvhold_directory(tiny_model, tmp_path, runtime_root):
    (tmp_path / "kvhold").mkdir()                  # what a clone looks like from its parent
    (tmp_path / "kvhold" / "README.md").write_text("a clone\n")
    srv = ServeProcess([*SERVE_FLAGS, "--standbys", "0"], runtime_root, model=tiny_model,
                       log_path=tmp_path / "serve.log", cwd=tmp_path)
    srv.cmd[:3] = [_console_script()]              # as a user types it, not `python -m kvhold`
    srv.start(standbys=0)
    try:
        out = completion(srv, prompt="From the parent folder", max_tokens=4, temperature=0.0)
        assert out.usage.completion_tokens == 4
    finally:
        assert srv.stop() == 0, (tmp_path / "serve.log").read_text()[-3000:]
