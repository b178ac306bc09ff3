"""The descriptor hand-back at re-adoption: a restarted sidecar takes its pool's regions back
from a live executor that kept their descriptors, refuses any other, and makes a fresh pool
when none comes in time. Real processes, real signals, real shared memory and descriptors."""
import os
import signal
import threading

import posix_ipc

from kvhold.protocol import fdpass
from kvhold.protocol.hand_back import HandBack
from kvhold.protocol.memory import SHM_DIR, RegionInfo
from kvhold.protocol.naming import InstancePaths
from kvhold.testing.sidecar_process import SidecarProcess
from tests.process.helpers import alive as _alive, roles as _roles, sidecar_log, wait_until

IDLE = ["--workload", "idle", "--lease-ms", "20000", "--log-level", "INFO"]


def _start(flags, root, log, instance=None, wait=True) -> SidecarProcess:
    sc = SidecarProcess(flags, instance=instance, runtime_root=root, log_path=log)
    return sc.start() if wait else sc


def _start_waiting(flags, root, log, instance) -> tuple[SidecarProcess, threading.Thread, list]:
    """A sidecar that adopts answers only once it has the regions: started on a thread."""
    sc = SidecarProcess(flags, instance=instance, runtime_root=root, log_path=log)
    errors: list = []

    def run():
        try:
            sc.start(timeout=60)
        except Exception as exc:   # reported by the test, which joins the thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return sc, thread, errors


def _hand_back(paths: InstancePaths, claimed_pid: int, slot: int, epoch: int, fd: int, size: int) -> dict:
    msg = HandBack(token=paths.token_file.read_text().strip(), pid=claimed_pid, slot=slot, epoch=epoch,
                   regions=(RegionInfo("kv", size, "host", False),))
    sock = fdpass.connect(str(paths.fd_socket))
    try:
        fdpass.send(sock, msg.to_wire(), [fd])
        reply, stray = fdpass.recv(sock)
    finally:
        sock.close()
    for x in stray:
        os.close(x)
    return reply


def test_a_foreign_descriptor_is_refused_and_the_executors_own_are_taken_back(runtime_root, tmp_path):
    flags = IDLE + ["--journal-dir", str(tmp_path / "j")]
    first = _start(flags, runtime_root, tmp_path / "a.log")
    second, foreign = None, None
    try:
        first.wait_steady()
        st = first.status()
        before = _roles(st)
        active = next(p for p, r in before.items() if r == "active")
        lease = next(e for e in st["executors"] if e["pid"] == active)
        paths = InstancePaths.for_instance(first.instance, runtime_root)
        kv_size = os.stat(os.path.join(SHM_DIR, paths.shm_name("kv").lstrip("/"))).st_size
        for pid in before:                    # so that this test's hand-backs come first
            os.kill(pid, signal.SIGSTOP)
        try:
            os.kill(first.proc.pid, signal.SIGKILL)      # the sidecar alone
            first.proc.wait()
            second, starter, start_errors = _start_waiting(flags, runtime_root, tmp_path / "b.log",
                                                           first.instance)
            wait_until(lambda: "waiting up to" in sidecar_log(second), timeout_s=30,
                       what="the new sidecar to wait for the descriptors")
            foreign = posix_ipc.SharedMemory(None, flags=posix_ipc.O_CREX, mode=0o600, size=kv_size)
            # a process that claims the active executor's pid: SO_PEERCRED says otherwise
            reply = _hand_back(paths, active, lease["slot"], lease["epoch"], foreign.fd, kv_size)
            assert not reply["ok"] and f"names pid {active}, the connection is pid {os.getpid()}" in reply["error"]
            # a process that holds no lease of the pool
            reply = _hand_back(paths, os.getpid(), lease["slot"], lease["epoch"], foreign.fd, kv_size)
            assert not reply["ok"] and "holds no live lease" in reply["error"]
        finally:
            for pid in before:
                os.kill(pid, signal.SIGCONT)
        starter.join(60)
        assert not start_errors, start_errors
        wait_until(lambda: set(before) <= {e["pid"] for e in second.events("attach")}, timeout_s=30,
                   what="both executors to attach again")
        st = second.status()
        assert _roles(st) == before
        record = st["adoption"]["hand_back"]
        assert record["pid"] in before and record["backend"] == "host"
        assert record["regions"]["kv"]["check"] == f"the same object as {paths.shm_name('kv')}"
        assert [r["pid"] for r in record["refused"]] == [os.getpid(), os.getpid()]
        log = sidecar_log(second)
        assert "refused the descriptors handed back by pid" in log and "took the regions back" in log
        # the executor that came second was told the regions are back already, and attached
        assert "this sidecar holds the regions already" in sidecar_log(first)    # executors' output
    finally:
        if foreign is not None:
            foreign.close_fd()
            foreign.unlink()
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


def test_with_no_descriptors_handed_back_in_time_the_pool_is_replaced(runtime_root, tmp_path):
    flags = IDLE + ["--journal-dir", str(tmp_path / "j"), "--sidecar-wait-ms", "1500"]
    first = _start(flags, runtime_root, tmp_path / "a.log")
    second = None
    try:
        first.wait_steady()
        old, generation = list(_roles(first.status())), first.status()["generation"]
        for pid in old:                       # alive, holding their leases, but silent
            os.kill(pid, signal.SIGSTOP)
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        second = _start(flags, runtime_root, tmp_path / "b.log", instance=first.instance)
        assert not any(_alive(p) for p in old)          # killed before the fresh pool was made
        second.wait_steady()
        st = second.status()
        assert st["adoption"] is None and st["generation"] == generation + 1
        assert not set(_roles(st)) & set(old)
        log = sidecar_log(second)
        assert "no executor handed back the regions' descriptors within 1.5 s" in log
        assert "not adopting the pool of sidecar pid" in log
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)


def test_descriptors_that_are_not_the_named_regions_are_refused_and_the_pool_replaced(runtime_root, tmp_path):
    """The kv object under its name is replaced while no sidecar runs: the executors' kept
    descriptors are the old object, not the one the name opens. Both are refused, their pool
    is not adopted, and a fresh one is made."""
    flags = IDLE + ["--journal-dir", str(tmp_path / "j")]
    first = _start(flags, runtime_root, tmp_path / "a.log")
    second = None
    try:
        first.wait_steady()
        old, generation = list(_roles(first.status())), first.status()["generation"]
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait()
        paths = InstancePaths.for_instance(first.instance, runtime_root)
        name = paths.shm_name("kv")
        size = os.stat(os.path.join(SHM_DIR, name.lstrip("/"))).st_size
        posix_ipc.unlink_shared_memory(name)
        posix_ipc.SharedMemory(name, flags=posix_ipc.O_CREX, mode=0o600, size=size).close_fd()
        second = _start(flags, runtime_root, tmp_path / "b.log", instance=first.instance)
        second.wait_steady()
        st = second.status()
        assert st["adoption"] is None and st["generation"] == generation + 1
        assert not any(_alive(p) for p in old) and not set(_roles(st)) & set(old)
        log = sidecar_log(second)
        refusals = [line for line in log.splitlines() if "refused the descriptors handed back by pid" in line]
        assert {int(line.split("by pid ")[1].split(":")[0]) for line in refusals} == set(old)
        assert all(f"region kv: the descriptor is not {name}" in line for line in refusals)
        assert "every live executor was refused or died" in log
    finally:
        if second is not None:
            second.stop()
        first.stop(signal.SIGKILL)
