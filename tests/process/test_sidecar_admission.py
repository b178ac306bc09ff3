"""Admission never holds up the sidecar's event loop, with real processes: a text prompt of the
largest accepted size is tokenized while the loop goes on (no turn over 10 ms, pings and a
stream answered); a prompt over the limit is refused as too large (HTTP 413) at once; a burst
of durable admissions is written in a few batches, each acknowledged only once on disk, with
no long turn; a full disk refuses admissions and leaves no temporary file."""
import asyncio
import subprocess
import threading
import time

import pytest

from kvhold.client.aclient import AsyncClient
from kvhold.protocol.errors import ProtocolError, PromptTooLarge, PromptTooLong
from kvhold.protocol.naming import InstancePaths
from tests.process.helpers import FLAGS, wait_until

pytestmark = pytest.mark.slow     # real restarts and timeouts: `pytest -m slow` (CI runs it)

SLOW_MS = 10
MAX_PROMPT = 1 << 20          # the default --max-prompt-bytes


def loop_window(before: dict, after: dict) -> dict:
    """What the loop did between two status reads: turns, those over 10 ms (less the time the
    loop's thread waited for a CPU: `stalled`; in all: `over_10ms`), the slow ones."""
    return {"turns": after["turns"] - before["turns"],
            "stalled": after["stalls_over_ms"]["10"] - before["stalls_over_ms"]["10"],
            "over_10ms": after["turns_over_ms"]["10"] - before["turns_over_ms"]["10"],
            "slow": [t for t in after["slow"] if t not in before["slow"]]}


class Pinger(threading.Thread):
    """Pings the sidecar back to back from another client: the stall a client sees."""

    def __init__(self, sc):
        super().__init__(daemon=True)
        self.client = sc.new_client(timeout=30)
        self.rtts: list[float] = []
        self.stop = threading.Event()

    def run(self):
        while not self.stop.is_set():
            t0 = time.perf_counter()
            self.client.ping()
            self.rtts.append(time.perf_counter() - t0)
            time.sleep(0.002)

    def finish(self) -> float:
        self.stop.set()
        self.join(30)
        self.client.close()
        return max(self.rtts)


def test_a_maximum_size_prompt_is_tokenized_off_the_loop(tiny_model, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0"])
    sc.wait_steady(standbys=0)
    client = sc.new_client(timeout=60)
    streamer = sc.new_client(timeout=60)      # a Client is one socket: the reader thread has its own
    stream = streamer.generate("Once upon a time", max_tokens=490, ignore_eos=True, seed=1)
    arrivals: list[float] = []
    reader = threading.Thread(target=lambda: arrivals.extend(time.monotonic() for _ in stream), daemon=True)
    reader.start()
    while not arrivals:
        time.sleep(0.01)
    prompt = ("The quick brown fox jumps over the lazy dog. " * 30000)[:MAX_PROMPT]
    pinger = Pinger(sc)
    pinger.start()
    before = client.status()
    t0 = time.monotonic()
    with pytest.raises(PromptTooLong, match="does not fit the context"):   # every byte tokenized
        client.generate(prompt, max_tokens=4)
    tokenize_s = time.monotonic() - t0
    client.status()
    after = client.status()           # a status is built within a turn: the one before has ended
    worst_ping = pinger.finish()
    window = loop_window(before["loop"], after["loop"])
    reader.join(60)
    during = [t for t in arrivals if t0 <= t <= t0 + tokenize_s]
    gaps = [b - a for a, b in zip(during, during[1:])]
    print(f"tokenized {len(prompt)} bytes in {tokenize_s:.2f} s: {window}; worst ping "
          f"{worst_ping * 1e3:.1f} ms over {len(pinger.rtts)} pings; {len(during)} tokens streamed "
          f"meanwhile, longest gap {max(gaps, default=0) * 1e3:.1f} ms")
    assert tokenize_s > 0.2 and window["turns"] > 50         # the loop kept turning meanwhile
    # The goal is no stall over 10 ms; on a shared 2-core machine one turn in a few hundred reaches
    # 10-12 ms of its own work (CPU wait excluded), so one such turn is tolerated and none may reach 25 ms.
    assert window["stalled"] <= 1 and all(t["ms"] - t["cpu_wait_ms"] < 25 for t in window["slow"]), window["slow"]
    # A ping that waited out the tokenization would take as long as it; one that only waited for
    # a CPU (the tokenizer's threads and, under a parallel test run, another worker's processes
    # saturate both cores: 0.55 s was seen beside a 1.13 s tokenization) takes a fraction of it.
    # The loop's own turns, CPU wait excluded, are held to 10-25 ms above.
    assert worst_ping < max(0.25, 0.6 * tokenize_s) and len(pinger.rtts) > 20, (worst_ping, tokenize_s)
    # the stream went on: tokens kept arriving in separate deliveries, not one burst once the loop
    # was free (how many is the executor's pace, on CPUs it shares with the tokenizer and this test)
    assert len(during) >= 4 and sum(g > 0.002 for g in gaps) >= 1, (len(during), gaps)
    assert len(stream.result().token_ids) == 490
    streamer.close()
    client.close()


def test_a_prompt_over_the_limit_is_refused_as_too_large(tiny_model, start_sidecar):
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--max-prompt-bytes", "64KiB"])
    sc.wait_steady(standbys=0)
    limit = 64 << 10
    with sc.new_client(timeout=10) as client:
        with pytest.raises(PromptTooLarge, match=f"limit of {limit} bytes"):
            client.generate("x" * (limit + 1), max_tokens=4)             # by its length in characters
        with pytest.raises(PromptTooLarge, match="bytes of UTF-8"):
            client.generate("é" * (limit // 2 + 1), max_tokens=4)       # by its UTF-8 size
        with pytest.raises(PromptTooLarge, match="exceeds this sidecar's limit"):
            client.generate("x" * (4 << 20), max_tokens=4)              # refused before decoding
        with pytest.raises(ProtocolError, match="too long"):
            client.generate(prompt_ids=[5] * 100_000, max_tokens=4)     # refused before decoding
        with pytest.raises(PromptTooLong):
            client.generate("x" * limit, max_tokens=4)                  # at the limit: tokenized
        assert client.generate("Once upon a time", max_tokens=3, ignore_eos=True).result().completion_tokens == 3


def test_http_answers_413_for_a_prompt_too_large(tiny_model, runtime_root, tmp_path):
    from tests.process.helpers import Server

    server = Server(tiny_model, runtime_root, tmp_path / "serve.log", "--standbys", "0",
                    "--max-prompt-bytes", "64KiB")
    try:
        r = server.post("/v1/completions", {"prompt": "x" * (65 << 10), "max_tokens": 4})
        ok = server.post("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 2})
    finally:
        server.proc.terminate()
        server.proc.wait(30)
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "prompt_too_large" and "64 KiB" not in r.json()["error"]["message"]
    assert ok.status_code == 200


async def _burst(endpoint: str, n: int, **params) -> list:
    async with AsyncClient(endpoint, timeout=60) as client:
        return await asyncio.gather(*(client.generate(prompt_ids=[5, 6, 7 + i % 100], **params)
                                      for i in range(n)), return_exceptions=True)


def test_a_burst_of_durable_admissions_is_group_committed(tiny_model, start_sidecar, tmp_path):
    journal = tmp_path / "journal"
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--journal-dir", str(journal)])
    sc.wait_steady(standbys=0)
    before = sc.status()
    streams = asyncio.run(_burst(InstancePaths.for_instance(sc.instance, sc.runtime_root).client_endpoint,
                                 64, max_tokens=2))
    sc.status()
    after = sc.status()
    assert all(not isinstance(s, Exception) for s in streams), streams
    window = loop_window(before["loop"], after["loop"])
    print(f"64 admissions: {after['admissions'].get('durable')}; loop {window}")
    assert window["stalled"] == 0, window["slow"]               # no fsync on the loop
    durable = after["admissions"]["durable"]
    # every admission written durably, in batches (one fsync pair each); how many records a batch
    # takes depends on how fast they arrive against the disk, so that count is pinned by
    # tests/unit/test_sidecar_durable_journal.py with a held disk, not here
    assert durable["batched_records"] == 64 and 1 <= durable["batches"] <= 64
    sc.wait_for(lambda st: st["requests"]["in_flight"] == 0, timeout=60)
    # the ends' marks and unlinks run on the group commit's thread after the requests finish
    # (a segment's file, then its .ended): the journal empties soon after, not at once
    wait_until(lambda: not [p.name for p in journal.iterdir() if p.name.startswith(("seg-", "req-"))], 10,
               what="every segment and request file of the ended requests to be removed")


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs: a journal directory that runs out of space (needs mount rights)."""
    path = tmp_path / "disk"
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield path
    subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_full_disk_refuses_admissions_and_leaves_no_temporary_file(tiny_model, start_sidecar, tiny_disk):
    journal = tiny_disk / "journal"
    sc = start_sidecar(["--model", str(tiny_model), *FLAGS, "--standbys", "0", "--journal-dir", str(journal)])
    sc.wait_steady(standbys=0)
    prompt = list(range(2, 480))       # ~2 KiB records: the disk holds about a hundred
    with sc.new_client(timeout=30) as client:
        accepted, refused = [], []
        for _ in range(300):
            try:
                accepted.append(client.generate(prompt_ids=prompt, max_tokens=1))
            except Exception as exc:
                refused.append(exc)
                if len(refused) >= 5:
                    break
        assert accepted and refused
        assert all("cannot journal the request durably" in str(e) and "No space left" in str(e)
                   for e in refused), refused
        assert not [p.name for p in journal.iterdir() if p.name.endswith(".tmp")]
        for s in accepted:
            s.result()
        sc.wait_for(lambda st: st["requests"]["in_flight"] == 0, timeout=60)
        assert client.generate(prompt_ids=prompt, max_tokens=1).result().completion_tokens == 1
    assert not [p.name for p in journal.iterdir() if p.suffix == ".tmp"]
