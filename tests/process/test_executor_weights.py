"""Weights are loaded once into the sidecar's region, then only mapped, read-only."""
import os
import signal

from tests.process.helpers import sidecar_log


def test_loaded_once_then_mapped_by_every_replacement(tiny_model, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), "--log-level", "INFO"])
    for _ in range(2):
        active = sc.wait_steady()
        os.kill(active["pid"], signal.SIGKILL)
        sc.wait_for(lambda st: all(e["pid"] != active["pid"] for e in st["executors"]), timeout=30)
    sc.wait_steady()
    log = sidecar_log(sc)
    assert log.count("loaded 39 tensors") == 1
    assert log.count("weights already sealed") >= 3
    assert sc.status()["weights"]["state"] == "sealed"


def test_a_loader_that_dies_is_replaced_before_sealing(tiny_model, start_sidecar, tmp_path):
    env = {"KVHOLD_FAULT": "weights_loaded:1:kill", "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), "--log-level", "INFO"], env=env)
    sc.wait_steady()
    assert (tmp_path / "fired").exists()
    log = sidecar_log(sc)
    assert log.count("loads the weights") == 2       # the first loader died; another took over
    with sc.new_client() as client:
        assert client.generate("after a loader death", max_tokens=4).result().completion_tokens == 4
