"""`kvhold pool-restart` end to end with real processes: a pool restart under load loses no
request and changes no output (SDK and HTTP streams just pause); a "reboot" after the drain
(everything SIGKILLed, a fresh sidecar on the same journal) brings the requests back; a
damaged journal record is reported failed with its reason, never dropped silently."""
import json
import os
import signal
import threading

import pytest

from kvhold.client.client import Client, wait_all
from kvhold.protocol.errors import NotFound
from kvhold.sidecar.durable_journal import DurableJournal, decode_record, encode_record
from kvhold.testing.sidecar_process import SidecarProcess, submit_requests
from kvhold.testing.serve_process import http_client
from tests.process.helpers import (POOL_RESTART_FLAGS as FLAGS, POOL_RESTART_REQUESTS as REQUESTS, Server,
                                   pool_restart_cli)

HTTP_REQUEST = {"prompt": "Never lose a stream", "max_tokens": 400, "temperature": 0.9, "seed": 5,
                "ignore_eos": True}


def submit(client, requests=REQUESTS):
    return submit_requests(client, requests)


def http_stream_text(base: str, body: dict, out: dict, answered: threading.Event | None = None) -> None:
    with http_client().stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=90) as r:
        out["status"] = r.status_code
        if answered is not None:
            answered.set()          # the status is known: the request was admitted (200) or refused
        raw = r.read().decode()
    # each event's data line (an event also carries its id line: kvhold.serving.stream_resume)
    # (an SSE comment, a keepalive while the pool restarts, is no event)
    events = [e.rpartition("\n")[2] for e in raw.split("\n\n") if not e.startswith(":")]
    out["done"] = events[-2] == "data: [DONE]"
    out["text"] = "".join(json.loads(e[len("data: "):])["choices"][0]["text"] for e in events[:-2])


def test_pool_restart_under_load_sdk_and_http(tiny_model, runtime_root, tmp_path):
    journal = tmp_path / "journal"
    server = Server(tiny_model, runtime_root, tmp_path / "serve.log", *FLAGS, "--journal-dir", str(journal))
    try:
        with Client.for_instance(server.instance, runtime_root, timeout=10) as client:
            reference = [r.token_ids for r in wait_all(submit(client))]
            http_reference = client.generate(**HTTP_REQUEST).result().text
            before = client.status()

            http = {}
            streams = submit(client)
            answered = threading.Event()
            http_thread = threading.Thread(target=http_stream_text, args=(server.base, HTTP_REQUEST, http, answered))
            http_thread.start()
            assert answered.wait(60)                # in flight before the drain starts, however fast it starts
            cli = pool_restart_cli(server.instance, runtime_root, "--continue", "--timeout", "60", "--json")
            results = wait_all(streams)
            http_thread.join(90)
            after = client.status()
    finally:
        server.stop()
    assert cli.returncode == 0, cli.stderr
    figures = json.loads(cli.stdout[cli.stdout.index("{"):])
    assert [r.token_ids for r in results] == reference                # zero lost, identical
    assert http == {"status": 200, "done": True, "text": http_reference}
    assert after["pid"] == before["pid"] and after["generation"] == before["generation"] + 1
    drain = after["pool_restart"]["previous_drain"]
    assert drain["in_flight"] == drain["requests_journaled"] == len(REQUESTS) + 1   # all mid-stream
    assert figures["requests_restored"] == len(REQUESTS) + 1 and not figures["failed"]
    assert figures["ms_from_drain_start"]["first_token"] > 0
    assert not list(journal.glob("req-*")) and not list(journal.glob("seg-*"))   # every record removed at the end


def test_reboot_after_drain_and_a_damaged_record(tiny_model, runtime_root, tmp_path):
    journal = tmp_path / "journal"
    # the client that goes away leaves its request to run to the end (never cancelled for it)
    flags = ["--model", str(tiny_model), *FLAGS, "--journal-dir", str(journal), "--unclaimed-cancel-s", "0"]
    sc = SidecarProcess(flags, runtime_root=runtime_root, log_path=tmp_path / "sidecar.log").start()
    fresh = None
    try:
        sc.wait_steady(standbys=0)
        a, b = sc.new_client(timeout=10), sc.new_client(timeout=10)
        reference = [r.token_ids for r in wait_all(submit(a, REQUESTS[:3]))]
        streams = submit(a, REQUESTS[:2])
        gone = submit(b, REQUESTS[2:3])[0].request_id
        for _ in range(3):                    # a few tokens reach the client before the drain
            next(streams[0])
        cli = pool_restart_cli(sc.instance, runtime_root, "--wait-for-operator", "--timeout", "60")
        assert cli.returncode == 0, cli.stderr
        assert "kvhold pool-restart --resume" in cli.stdout
        # the "reboot": every process dies, /run is emptied; only the journal on disk survives
        os.killpg(sc.proc.pid, signal.SIGKILL)
        sc.proc.wait()
        b.close()
        for name in ("pool-restart.hold", "generation"):
            (runtime_root / sc.instance / name).unlink(missing_ok=True)
        damaged = journal / f"req-{streams[1].request_id:016x}.json"
        data = bytearray(damaged.read_bytes())
        data[data.index(b'"seed"') + 8] ^= 0x01                     # one bit flipped on disk
        damaged.write_bytes(bytes(data))

        fresh = SidecarProcess(flags, instance=sc.instance, runtime_root=runtime_root,
                               log_path=tmp_path / "fresh.log").start()
        assert list(streams[0]) and streams[0].result().token_ids == reference[0]   # paused, then on
        with pytest.raises(NotFound, match="checksum mismatch"):
            streams[1].result()
        status = fresh.wait_for(lambda st: st["pool_restart"]["unclaimed"] and st, timeout=30)
        assert status["generation"] == 2                      # after the journal's generation 1
        assert [u["request_id"] for u in status["pool_restart"]["unclaimed"]] == [gone]
        failed = status["pool_restart"]["failed"]
        assert [f["request_id"] for f in failed] == [streams[1].request_id]
        assert "checksum mismatch" in failed[0]["reason"]
        assert (journal / "failed" / damaged.name).exists() and not damaged.exists()
        assert "cannot be restored: checksum mismatch" in (tmp_path / "fresh.log").read_text()
        a.close()
    finally:
        sc.stop(signal.SIGKILL)
        if fresh is not None:
            fresh.stop()


def test_record_format_rejects_damage_with_a_reason(tmp_path):
    body = {"request_id": 7, "generation": 1, "client": "7501", "prompt_ids": [1, 2], "generated": [3],
            "stop_ids": [], "max_tokens": 4, "seed": 9, "top_k": 0, "temperature": 0.5, "top_p": 1.0}
    data = encode_record(body)
    assert decode_record(data) == body
    cases = {b"garbage": "not valid JSON", data.replace(b'"seed": 9', b'"seed": 8'): "checksum mismatch",
             data.replace(b'"version": 1', b'"version": 9'): "record version 9",
             data[:len(data) // 2]: "not valid JSON"}
    for bad, reason in cases.items():
        with pytest.raises(ValueError, match=reason):
            decode_record(bad)
    dj = DurableJournal(tmp_path / "j")
    dj.write(body)
    dj.path_for(8).write_bytes(b"{}")
    good, failed = dj.load()
    assert good == [body]
    assert [(f.request_id, f.reason) for f in failed] == [(8, "not a kvhold-journal record")]
    assert (tmp_path / "j" / "failed" / dj.path_for(8).name).exists()
