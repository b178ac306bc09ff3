"""Executor tiers with real processes and SIGKILL: an executor forked from the zygote
takes over when no standby is ready; `--takeover wait-exit` promotes only after the
dead process has exited. Both continue every request exactly."""
import os
import signal

from kvhold.client.client import wait_all
from tests.process.helpers import FLAGS, ids, sidecar_log, submit


def _zygote_ready(st):
    return (st.get("zygote") or {}).get("ready")


def _kill_mid_stream(sc, client, after_tokens: int) -> tuple[list, int]:
    seen, victim = [0], {}

    def on_event(stream, event):
        seen[0] += 1
        if seen[0] == after_tokens:
            victim["pid"] = sc.wait_steady(standbys=0)["pid"]
            os.kill(victim["pid"], signal.SIGKILL)

    return ids(wait_all(submit(client), on_event)), victim["pid"]


def test_zygote_forks_the_replacement_when_no_standby_is_ready(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--zygote"])
    sc.wait_steady(standbys=0, timeout=120)
    sc.wait_for(_zygote_ready, timeout=120)
    with sc.new_client(timeout=60) as client:
        for trial in range(2):
            sc.wait_for(_zygote_ready, timeout=120)
            got, victim = _kill_mid_stream(sc, client, 20 + 25 * trial)
            assert got == reference, f"trial {trial}"
    # (the status once the last kill's takeover and exit are recorded: the streams may end first)
    st = sc.wait_for(lambda st: len(st["recoveries"]) == 2 and sc.executors(st, "active")
                     and any(e["kind"] == "exit" and e["pid"] == victim for e in st["events"]) and st, timeout=60)
    active = sc.executors(st, "active")[0]
    assert active["via"] == "zygote" and active["pid"] != victim
    assert st["zygote"]["forks"] >= 2
    spawns = [e for e in st["events"] if e["kind"] == "spawn"]
    assert [e["via"] for e in spawns][-2:] == ["zygote", "zygote"]
    assert len(st["recoveries"]) == 2 and all(r["requests_lost"] == 0 for r in st["recoveries"])
    # the zygote keeps its dead children zombies a while, so the sidecar reads how they died
    # (SIGKILL: 128 + 9), although their parent is the zygote
    exits = [e for e in st["events"] if e["kind"] == "exit" and e["pid"] == victim]
    assert [e["exit_code"] for e in exits] == [137]


def test_a_dead_zygote_is_restarted_and_executors_start_cold_meanwhile(tiny_model, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--zygote"])
    sc.wait_steady(standbys=0, timeout=120)
    first = sc.wait_for(lambda st: _zygote_ready(st) and st["zygote"]["pid"], timeout=120)
    os.kill(first, signal.SIGKILL)
    sc.wait_for(lambda st: st["zygote"]["pid"] != first, timeout=30)
    pid = sc.wait_steady(standbys=0)["pid"]
    os.kill(pid, signal.SIGKILL)        # the zygote is still importing torch: a cold start serves
    sc.wait_for(lambda st: any(e["role"] == "active" and e["pid"] != pid for e in st["executors"]),
                timeout=60)
    st = sc.wait_for(lambda st: st if _zygote_ready(st) else None, timeout=120)
    assert st["zygote"]["restarts"] == 1
    with sc.new_client(timeout=60) as client:
        assert len(wait_all(submit(client))) == 5


def test_wait_exit_promotes_only_after_the_dead_process_exited(tiny_model, reference, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--takeover", "wait-exit"])
    sc.wait_steady(timeout=120)
    with sc.new_client(timeout=60) as client:
        got, victim = _kill_mid_stream(sc, client, 30)
    assert got == reference

    def recovered(st):      # the kill's exit, fence, promotion and recovery record, once all are in
        fence = next((e for e in st["events"] if e["kind"] == "fence" and e["pid"] == victim), None)
        return (fence and st["recoveries"] and any(e["kind"] == "exit" and e["pid"] == victim for e in st["events"])
                and any(e["kind"] == "promote" and e["ns"] > fence["ns"] for e in st["events"]) and st)

    st = sc.wait_for(recovered, timeout=60)
    events = st["events"]
    exit_ns = next(e["ns"] for e in events if e["kind"] == "exit" and e["pid"] == victim)
    fence_ns = next(e["ns"] for e in events if e["kind"] == "fence" and e["pid"] == victim)
    promote_ns = next(e["ns"] for e in events if e["kind"] == "promote" and e["ns"] > fence_ns)
    assert promote_ns >= exit_ns
    rec = st["recoveries"][-1]
    assert rec["pages_copied"] == 0          # nothing pending: tails continue in place


def test_the_zygote_forks_single_threaded_and_its_executors_serve(tiny_model, start_sidecar):
    """A fork from a multi-threaded process can hand the child a lock that no thread will ever
    release. The zygote must be one thread when it forks: counted from outside (/proc) and as
    the zygote saw it at its forks, with Python's fork warning enabled and never emitted."""
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--zygote"],
                       env={"PYTHONWARNINGS": "always::DeprecationWarning"})
    sc.wait_steady(standbys=0, timeout=120)
    zygote = sc.wait_for(lambda st: st["zygote"] if _zygote_ready(st) else None, timeout=120)
    assert os.listdir(f"/proc/{zygote['pid']}/task") == [str(zygote["pid"])], "the zygote has threads"
    victim = sc.wait_steady(standbys=0)["pid"]
    os.kill(victim, signal.SIGKILL)
    active = sc.wait_for(lambda st: next((e for e in sc.executors(st, "active")
                                          if e["pid"] != victim and e["ready"]), None), timeout=60)
    assert active["via"] == "zygote"
    with sc.new_client(timeout=60) as client:
        result = client.generate("Forked from one thread", max_tokens=12, temperature=0.0,
                                 ignore_eos=True).result()
    assert len(result.token_ids) == 12
    st = sc.status()
    assert st["zygote"]["forks"] >= 1 and st["zygote"]["threads_at_fork"] == 1
    assert len(os.listdir(f"/proc/{zygote['pid']}/task")) == 1
    log = sidecar_log(sc)
    assert "preloaded torch and the engine" in log and "(1 thread)" in log
    assert "multi-threaded, use of fork()" not in log and "not forking" not in log


def _children(pid: int) -> set[int]:
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":   # a killed executor the zygote keeps a zombie
                out.add(int(entry))
    return out


def test_the_zygote_hands_the_request_to_a_spare_forked_ahead(tiny_model, reference, start_sidecar):
    """With a spare, the replacement is a child the zygote forked (and warmed) before the kill;
    the zygote forks the next spare after it, and each takeover continues every request."""
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--zygote",
                        "--zygote-spare", "on"])
    sc.wait_steady(standbys=0, timeout=120)
    zygote = sc.wait_for(lambda st: st["zygote"] if _zygote_ready(st) else None, timeout=120)
    assert zygote["spare"] is True
    with sc.new_client(timeout=60) as client:
        for trial in range(2):
            before = sc.wait_for(lambda st: _children(zygote["pid"]) - {e["pid"] for e in st["executors"]},
                                 timeout=60)      # a child of the zygote that is no executor yet: the spare
            taken = sc.status()["zygote"]["spare_forks"]   # the first executor may have had a spare too
            got, victim = _kill_mid_stream(sc, client, 20 + 25 * trial)
            assert got == reference, f"trial {trial}"
            st = sc.wait_for(lambda st: st if st["zygote"]["spare_forks"] == taken + 1 else None, timeout=30)
            active = sc.executors(st, "active")[0]
            assert active["via"] == "zygote" and active["pid"] in before
            assert st["zygote"]["last_spare"]["pid"] == active["pid"]
    assert len(sc.status()["recoveries"]) == 2
    assert all(r["requests_lost"] == 0 for r in sc.status()["recoveries"])
