"""A /dev/shm too small for the pool: the sidecar refuses at start with the size and the remedy,
and a pool that fits is backed at creation, so no executor dies of SIGBUS when the filesystem
fills up later. Each sidecar runs in its own mount namespace with a small tmpfs over /dev/shm
(as a container's is), which needs root or a user namespace of one's own: without either
these tests skip, saying why."""
import errno
import os
import shutil
import subprocess

import pytest

from kvhold.client.client import wait_all
from kvhold.testing.sidecar_process import SidecarProcess

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

SHM_MB = 20
FLAGS = ["--max-seq-len", "512", "--max-batch-tokens", "64", "--max-batch", "16", "--standbys", "0",
         "--log-level", "INFO"]


# A mount namespace needs CAP_SYS_ADMIN: root has it; anyone else gets it inside a user namespace
# of their own (where they are root) if the kernel allows unprivileged user namespaces.
NAMESPACES = (["--mount"], ["--user", "--map-root-user", "--mount"])


def _small_shm_prefix(namespaces: list[str], size_mb: int) -> list[str]:
    script = f'mount -t tmpfs -o size={size_mb}m,mode=1777 tmpfs /dev/shm && exec "$@"'
    return ["unshare", *namespaces, "--propagation", "private", "sh", "-c", script, "sh"]


@pytest.fixture(scope="module")
def small_shm():
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) to give the sidecar its own small /dev/shm")
    said = []
    for namespaces in NAMESPACES:
        probe = subprocess.run([*_small_shm_prefix(namespaces, 1), "true"], capture_output=True, text=True)
        if probe.returncode == 0:
            return _small_shm_prefix(namespaces, SHM_MB)
        said.append(f"unshare {' '.join(namespaces)}: {probe.stderr.strip()}")
    pytest.skip("needs a private mount namespace with a tmpfs over /dev/shm: root, CAP_SYS_ADMIN or "
                "unprivileged user namespaces (" + "; ".join(said) + ")")


def _sidecar(model, flags, prefix, runtime_root, tmp_path):
    return SidecarProcess(["--model", str(model), *FLAGS, *flags], runtime_root=runtime_root,
                          log_path=tmp_path / "sidecar.log", prefix=prefix)


def test_a_pool_larger_than_dev_shm_is_refused_with_the_size_and_the_remedy(
        tiny_model, small_shm, runtime_root, tmp_path):
    sc = _sidecar(tiny_model, ["--kv-pages", "512"], small_shm, runtime_root, tmp_path)  # 32 MiB of KV
    try:
        with pytest.raises(RuntimeError, match="exited with code 2"):
            sc.start(timeout=60)
    finally:
        sc.stop()
    log = (tmp_path / "sidecar.log").read_text()
    assert "not enough shared memory" in log
    assert "the pool needs" in log and f"of its {SHM_MB:.1f} MiB is free" in log
    assert "--shm-size=" in log and "emptyDir" in log and "--kv-pages" in log


def _fill(directory: str) -> int:
    """Take every free byte of the shm filesystem at `directory`; returns how many."""
    fd = os.open(os.path.join(directory, "filler"), os.O_CREAT | os.O_RDWR, 0o600)
    taken = 0
    try:
        for chunk in (1 << 20, 1 << 12):
            while True:
                try:
                    os.posix_fallocate(fd, taken, chunk)
                except OSError as exc:
                    assert exc.errno == errno.ENOSPC
                    break
                taken += chunk
    finally:
        os.close(fd)
    return taken


def test_a_pool_that_fits_is_backed_so_a_full_dev_shm_kills_no_executor(
        tiny_model, small_shm, runtime_root, tmp_path):
    # 8 MiB of KV; no log-prob area (at its default width it alone would take the tables past 20 MiB)
    # and no room for grammars (64 KiB per journal slot by default: 16 MiB more)
    with _sidecar(tiny_model, ["--kv-pages", "128", "--max-logprobs", "0", "--max-grammar-bytes", "0"], small_shm,
                  runtime_root, tmp_path) as sc:
        active = sc.wait_steady(standbys=0)
        shm_dir = f"/proc/{sc.proc.pid}/root/dev/shm"       # the sidecar's own /dev/shm
        assert os.statvfs(shm_dir).f_blocks * os.statvfs(shm_dir).f_frsize == SHM_MB << 20
        _fill(shm_dir)                                      # something else takes the rest
        assert os.statvfs(shm_dir).f_bavail == 0
        # requests over nearly the whole KV pool: pages no one had touched before the fill
        requests = [dict(prompt_ids=list(range(2 + i, 42 + i)), max_tokens=150, temperature=0.0, ignore_eos=True)
                    for i in range(8)]
        with sc.new_client(timeout=120) as client:
            results = wait_all([client.generate(**r) for r in requests])
        assert [len(r.token_ids) for r in results] == [150] * 8
        st = sc.status()
        assert [e["pid"] for e in st["executors"] if e["role"] == "active"] == [active["pid"]]
        assert not [e for e in st["events"] if e["kind"] == "exit"]
