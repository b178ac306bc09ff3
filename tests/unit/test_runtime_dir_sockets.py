"""An instance's unix sockets must fit in sun_path: a runtime directory too deep for them is
refused at start with the path and what to change, never met as a bind error later."""
from pathlib import Path

import pytest

from kvhold.protocol.naming import MAX_SOCKET_PATH, InstancePaths
from kvhold.sidecar.config import ExecutorsConfig, SettingError, SidecarConfig


IDLE = ExecutorsConfig(workload="idle")


def _root(total: int) -> Path:
    """A runtime root whose longest socket path ('<root>/i/frontend-link.sock') has `total` bytes."""
    return Path("/tmp/" + "r" * (total - len("/tmp/") - len("/i/frontend-link.sock")))


def test_the_longest_socket_path_that_fits_is_accepted_and_one_byte_more_is_not():
    assert InstancePaths.for_instance("i", _root(MAX_SOCKET_PATH)).socket_path_problem() is None
    problem = InstancePaths.for_instance("i", _root(MAX_SOCKET_PATH + 1)).socket_path_problem()
    assert "frontend-link.sock has 108 bytes" in problem and "--runtime-root" in problem


def test_a_sidecar_config_refuses_a_runtime_dir_too_deep_for_its_sockets():
    with pytest.raises(SettingError) as info:
        SidecarConfig(instance="i", runtime_root=_root(MAX_SOCKET_PATH + 10), executors=IDLE)
    assert info.value.settings == ("runtime_root",) and "too deep" in str(info.value)
    SidecarConfig(instance="i", runtime_root=_root(MAX_SOCKET_PATH), executors=IDLE)
