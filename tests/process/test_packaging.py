"""The package as users install it: one top-level name, no cycles between its parts, an SDK
that imports without the engine or the HTTP stack, and an index for every benchmark result."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "kvhold"


def _imports(path: Path) -> set[str]:
    """Every kvhold module a file imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.startswith("kvhold"):
                found.add(node.module)
                found.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("kvhold"))
    return found


def _part(module: str) -> str | None:
    """kvhold.<part>.… -> part; top-level modules of the package have none."""
    bits = module.split(".")
    return bits[1] if len(bits) > 2 or (len(bits) == 2 and (PACKAGE / bits[1]).is_dir()) else None


def _part_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for py in PACKAGE.rglob("*.py"):
        rel = py.relative_to(ROOT).with_suffix("")
        here = _part(".".join(rel.parts))
        if here is None:
            continue
        for mod in _imports(py):
            there = _part(mod)
            if there is not None and there != here:
                graph.setdefault(here, set()).add(there)
    return graph


def test_no_import_cycle_between_the_packages_parts():
    graph = _part_graph()
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not graph.get("protocol"), "the shared protocol imports no other part"


CLIENT_FACING = ("kvhold.frontend", "kvhold.serving", "kvhold.client", "tokenizers", "fastapi", "uvicorn",
                 "starlette", "jinja2", "transformers")


def _all_imports(path: Path) -> set[str]:
    """Every module a file imports, kvhold's and others', at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_memory_owner_holds_no_client_code():
    """kvhold.sidecar is the memory owner: no module of it imports client-facing code (the
    frontend, the HTTP API, the SDK, a tokenizer or chat templates), anywhere in its code; the
    client side lives in kvhold.frontend, which may import the owner's parts, never the reverse."""
    offenders = sorted(f"{py.relative_to(ROOT)}: {mod}" for py in (PACKAGE / "sidecar").rglob("*.py")
                       for mod in _all_imports(py)
                       if any(mod == bad or mod.startswith(bad + ".") for bad in CLIENT_FACING))
    assert not offenders
    code = ("import pkgutil, importlib, sys, kvhold.sidecar\n"
            "for mod in pkgutil.iter_modules(kvhold.sidecar.__path__, 'kvhold.sidecar.'):\n"
            "    importlib.import_module(mod.name)\n"
            f"bad = {CLIENT_FACING!r}\n"
            "print(sorted(n for n in sys.modules if n.startswith(bad)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr)


def test_product_code_never_imports_tools():
    offenders = [str(py.relative_to(ROOT)) for py in PACKAGE.rglob("*.py")
                 if re.search(r"^\s*(from|import) tools\b", py.read_text(), re.M)]
    assert not offenders


BLOCKED = ("torch", "fastapi", "uvicorn", "starlette", "prometheus_client", "tokenizers", "safetensors",
           "etcd3gw", "transformers", "triton")


def test_the_client_sdk_imports_without_the_engine_or_the_http_stack():
    code = (
        "import sys\n"
        f"blocked = {BLOCKED!r}\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in blocked:\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import kvhold.client.client, kvhold.client.aclient, kvhold.protocol.errors\n"
        "from kvhold.client.client import Client\n"
        "import kvhold.cli.main\n"   # the command line itself starts without them too
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_python_m_kvhold_and_version():
    from kvhold import __version__

    version = subprocess.run([sys.executable, "-m", "kvhold", "--version"], capture_output=True, text=True,
                             cwd=ROOT, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"kvhold {__version__}"
    bare = subprocess.run([sys.executable, "-m", "kvhold"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert bare.returncode == 0 and "usage: kvhold" in bare.stdout and "serve" in bare.stdout


def test_a_built_wheel_installs_only_kvhold(tmp_path):
    pytest.importorskip("build")
    src = tmp_path / "src"       # a copy of the tracked files, as a fresh clone has them
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    out = subprocess.run([sys.executable, "-m", "build", "--wheel", "--outdir", str(tmp_path / "dist"), str(src)],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PIP_NO_INPUT": "1"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("kvhold-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"kvhold"}, top
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Author" in metadata
    assert "Requires-Dist: torch" in metadata and "extra == \"engine\"" in metadata
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("/entry_points.txt"))).decode()
    assert "[vllm.general_plugins]\nkvhold = kvhold.vllm_bridge.loader:register" in entry_points


def test_every_benchmark_result_is_in_the_index():
    results = ROOT / "bench" / "results"
    index = (results / "README.md").read_text()
    missing = [p.name for p in results.iterdir() if p.name != "README.md" and p.name not in index
               and p.name.split(".")[0] + ".json" not in index]
    assert not missing, f"bench/results files not described in bench/results/README.md: {missing}"


def test_no_undefined_names_in_code_this_machine_cannot_run():
    """pyflakes' undefined-name and syntax checks (through ruff) over the package and tools: the
    CUDA paths never run in a CPU test suite, and a misspelt name there stops every executor on
    a GPU at its first use."""
    ruff = pytest.importorskip("ruff")
    from ruff.__main__ import find_ruff_bin

    del ruff
    proc = subprocess.run([find_ruff_bin(), "check", "--no-cache", "--select", "E9,F63,F7,F82",
                           "--output-format", "concise", "kvhold", "tools", "tests"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-1000:]


def test_test_modules_have_distinct_basenames():
    """pytest imports test modules by basename (the test folders are no packages): two of one
    name in different folders fail the collection of the whole suite."""
    seen: dict[str, Path] = {}
    clashes = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            clashes.append((str(seen[path.name].relative_to(ROOT)), str(path.relative_to(ROOT))))
        seen.setdefault(path.name, path)
    assert clashes == []
