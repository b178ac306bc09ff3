"""A sidecar started over damaged state files (kvhold.protocol.state_files) serves: each bad file
is set aside as `<name>.bad` and the good ones are used. Real files, a real sidecar process."""
import time

import msgpack

from tests.process.helpers import FLAGS, GOOD

GENERATION = 1 << 40          # request ids of pool generation 1


def _kept(rid: int, **changes) -> bytes:
    doc = {"request_id": rid, "identity": b"u\x00\x01", "ids": [5, 6], "texts": ["a", "b"],
           "done": {"request_id": rid, "finish_reason": "length", "prompt_tokens": 3, "completion_tokens": 2,
                    "text": "ab"},
           "finished_ns": time.monotonic_ns(), "logprobs": {}}
    doc.update(changes)
    return msgpack.packb(doc, use_bin_type=True)


def test_a_sidecar_over_damaged_state_files_sets_them_aside_and_serves(tiny_model, start_sidecar, tmp_path):
    journal = tmp_path / "journal"
    results = journal / "results"
    results.mkdir(parents=True)
    (journal / "request_deaths.json").write_text("null")
    (journal / "generation").write_text("1e400\n")
    good = GENERATION | 1
    damaged = {GENERATION | 2: _kept(GENERATION | 2, ids="56"),
               GENERATION | 3: _kept(GENERATION | 3, ids=[2**63, 6]),
               GENERATION | 4: _kept(GENERATION | 4, ids=[-5, 6]),
               GENERATION | 5: _kept(GENERATION | 5, texts=["a"]),
               GENERATION | 6: b"\xc1 not msgpack"}
    (results / f"{good:016x}.kept").write_bytes(_kept(good))
    for rid, data in damaged.items():
        (results / f"{rid:016x}.kept").write_bytes(data)

    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--journal-dir", str(journal)])
    sc.wait_steady(standbys=0, timeout=120)
    with sc.new_client(timeout=60) as client:
        assert len(client.generate(**dict(GOOD, ignore_eos=True)).result().token_ids) == GOOD["max_tokens"]
    st = sc.status()
    assert [u["request_id"] for u in st["pool_restart"]["unclaimed"]] == [good]
    for rid in damaged:
        assert (results / f"{rid:016x}.kept.bad").exists() and not (results / f"{rid:016x}.kept").exists()
    assert (journal / "request_deaths.json.bad").read_text() == "null"
    assert (journal / "generation.bad").exists() and int((journal / "generation").read_text()) >= 1
    assert sc.proc.poll() is None
