"""Bad requests against a real `kvhold serve`: every one is refused with a 4xx before anything
is journaled, the keep-alive connection it came on keeps serving, and a restart after any of
them comes up; the HTTP API fuzzed from its own OpenAPI schema never answers 5xx."""
import http.client
import json
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

# a test extra (`pip install -e ".[test]"`, as CI does); a machine without it (the GPU one) skips this module
schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402

from kvhold.protocol.checkpoint import build_manifest  # noqa: E402
from kvhold.protocol.model_spec import ModelSpec
from kvhold.testing.sidecar_process import SidecarProcess
from kvhold.testing.serve_process import http_client
from tests.process.helpers import FLAGS, KEY, Server
from tests.unit.helpers import POISON, records, valid_record, write_record

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

# (body, status, code, param): each of these once reached the sidecar or the SDK unchecked
BAD = [
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2**31}, 400, "invalid_value", "top_k"),
    ({"prompt": "hi", "max_tokens": 2, "top_k": 2**64}, 400, "invalid_value", "top_k"),
    ({"prompt": [5, 2**64], "max_tokens": 2}, 400, "invalid_value", "prompt"),
    ({"prompt": [5, 2**31], "max_tokens": 2}, 400, "invalid_value", "prompt"),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [2**64]}, 400, "invalid_value", "stop_token_ids.0"),
    ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": list(range(9))}, 400, "invalid_value", "stop_token_ids"),
    (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', 400, "invalid_value", "prompt"),
    (b'{"prompt": "hi", "user": "\\udfff"}', 400, "invalid_value", "user"),
    (b'{"prompt": "hi", "stream_options": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "invalid_json", None),
    (b'{"prompt": "hi", "logit_bias": ' + b'{"a":' * 200 + b"1" + b"}" * 200 + b"}", 400, "invalid_json", None),
]


def _send(conn: http.client.HTTPConnection, path: str, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read()), r.getheader("connection")


@pytest.fixture
def journaled_server(tiny_model, runtime_root, tmp_path):
    journal = tmp_path / "journal"
    started = []

    def start():
        srv = Server(tiny_model, runtime_root, tmp_path / f"serve-{len(started)}.log", "--standbys", "0",
                     "--journal-dir", str(journal))
        started.append(srv)
        return srv
    yield start, journal
    for srv in started:
        srv.stop()


def test_bad_values_get_4xx_on_one_kept_alive_connection_and_a_restart_comes_up(journaled_server):
    start, journal = journaled_server
    srv = start()
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        for body, status, code, param in BAD:
            got, answer, connection = _send(conn, "/v1/completions", body)
            err = answer["error"]
            assert (got, err["code"], err["param"]) == (status, code, param), (str(body)[:80], err)
            assert err["message"] and connection != "close"
            # the same connection serves the next request
            got, answer, _ = _send(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
            assert got == 200 and answer["usage"]["completion_tokens"] == 2
        huge = {"prompt": "x" * (10 << 20), "max_tokens": 2}
        got, answer, connection = _send(conn, "/v1/completions", huge)
        assert (got, answer["error"]["code"]) == (413, "request_too_large") and connection != "close"
        got, _, _ = _send(conn, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert got == 200
    finally:
        conn.close()
    assert not list(journal.glob("req-*.json"))        # nothing refused was journaled
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(60) == 0
    again = start()                                     # waits until healthy
    assert again.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


@settings(max_examples=4, deadline=None, derandomize=True, phases=[Phase.generate],
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_a_sidecar_restart_comes_up_whatever_its_journal_holds(tiny_model, data):
    """Real restarts over durable records with random values in any field (valid checksums),
    and the known poison ones: each start comes up, fails the bad records with their reason,
    restores the others and runs them to the end."""
    fingerprint = build_manifest(tiny_model, ModelSpec.from_dir(tiny_model)).fingerprint
    root = Path(tempfile.mkdtemp(prefix="kvh-", dir="/tmp"))
    journal = root / "journal"
    journal.mkdir(mode=0o700)
    (journal / "generation").write_text("2\n")        # the records come from generation 2
    randoms = [(2 << 40) | i for i in range(1, 6)]
    for rid in randoms:
        write_record(journal, rid, data.draw(records(rid, fingerprint)))
    bad = [(field, value) for field, value, _ in POISON if field != "request_id"]   # (its id: unit test)
    poison = [(2 << 40) | (100 + i) for i in range(len(bad))]
    for rid, (field, value) in zip(poison, bad):
        write_record(journal, rid, dict(valid_record(rid, fingerprint), **{field: value}))
    ids = randoms + poison + [(2 << 40) | 200]
    write_record(journal, ids[-1], valid_record(ids[-1], fingerprint))
    sc = SidecarProcess(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--journal-dir", str(journal),
                         "--unclaimed-cancel-s", "0"],      # restored with no client: run to the end
                        runtime_root=root, log_path=root / "sidecar.log")
    try:
        status = sc.start().status()
        report = status["pool_restart"]
        failed = {f["request_id"]: f["reason"] for f in report["failed"]}
        assert ids[-1] not in failed and set(poison) <= set(failed) and all(failed.values())
        assert report["restore"]["requests_restored"] + len(failed) == len(ids)
        for rid in failed:
            assert (journal / "failed" / f"req-{rid:016x}.reason").is_file()
        # every restored request runs to its end (no client resumes it: kept for pickup)
        sc.wait_for(lambda st: len(st["pool_restart"]["unclaimed"]) == len(ids) - len(failed), timeout=90)
        assert sc.stop() == 0
    finally:
        sc.stop()
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- fuzzing from /openapi.json
@pytest.fixture(scope="module")
def fuzz_server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    # a short context keeps every valid request cheap on a CPU
    srv = Server(tiny_model, root, root / "serve.log", "--standbys", "0", "--max-seq-len", "48", api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    doc = http_client().get(fuzz_server.base + "/openapi.json", headers=fuzz_server.headers, timeout=10).json()
    assert {"CompletionRequest", "ChatRequest"} <= set(doc["components"]["schemas"])
    schema = schemathesis.openapi.from_dict(doc)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])

    return schema


api = schemathesis.pytest.from_fixture("api_schema")


def _cap_tokens(body) -> None:
    """At most 2 tokens per valid request, so that the fuzz stays fast on a CPU (a value of the
    wrong type or range is left as generated)."""
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            v = body.get(key) if body.get(key) is not None else 2
            if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
                body[key] = min(v, 2)


@api.parametrize()
@settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_the_api_fuzzed_from_its_schema_never_answers_5xx(case, fuzz_server):
    _cap_tokens(case.body)
    r = case.call(base_url=fuzz_server.base, headers=fuzz_server.headers, timeout=30)
    assert r.status_code < 500, (case.method, case.path, case.body, r.text[:300])
    if r.status_code >= 400 and case.path.startswith("/v1"):
        assert r.json()["error"]["message"]


def test_the_server_serves_after_the_fuzz(fuzz_server):
    assert fuzz_server.health().status_code == 200 and fuzz_server.proc.poll() is None
    r = fuzz_server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
