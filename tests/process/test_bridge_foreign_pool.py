"""Foreign-pool mode end to end: the reference engine keeps its own private KV
pool and is protected only by the KV mirror. Real sidecar, real executors, real SIGKILLs; the
continuation must equal an uninterrupted run of the native engine."""
import os
import signal

import numpy as np
import pytest
import torch

from kvhold.client.client import wait_all
from kvhold.protocol.tables import Tables
from kvhold.testing.sidecar_process import submit_requests
from tests.process.helpers import attach_pool as _attach, ids, run_with_fault, unique_prompt_token, wait_stopped

FLAGS = ["--kv-pages", "128", "--max-seq-len", "256", "--max-batch-tokens", "64", "--max-batch", "16",
         "--log-level", "INFO"]
FOREIGN = [*FLAGS, "--kv-mode", "foreign"]
REQUESTS = [
    dict(prompt="The sidecar keeps the memory", max_tokens=36, temperature=0.0),
    dict(prompt="Once upon a time", max_tokens=36, temperature=0.8, seed=7),
    dict(prompt_ids=list(range(2, 102)), max_tokens=24, temperature=1.0, top_p=0.9, seed=3),
    dict(prompt="Never lose a stream", max_tokens=32, temperature=1.1, seed=5),
]


def submit(client, requests=REQUESTS):
    return submit_requests(client, requests)


@pytest.fixture(scope="module")
def workload():
    """The native engine's reference (conftest's `reference`) runs these."""
    return FLAGS, REQUESTS


def test_sigkill_mid_stream_continues_identically(tiny_model, reference, start_sidecar, tmp_path):
    # Two kills of the active executor: the first one's, then its successor's. Each is aimed from
    # inside the executor: it stops itself before the forward of the n-th step that holds the
    # 100-token prompt (request 2: 24 tokens to generate, so at least 24 such steps), and this
    # test SIGKILLs it there, mid-stream by construction (request 2 has tokens to come, its
    # prompt's pages are committed) however far the engine runs ahead of this test's client.
    # The fault counts those steps only while `armed` exists and fires once per `fired`
    # (KVHOLD_FAULT_IF, KVHOLD_FAULT_ONCE): it is disarmed before each kill, so a successor does
    # not count the steps of the requests it takes over, and re-armed for the next round. In the
    # first round a probe holding the same token, alone, takes `probe` of the first executor's
    # `at` steps first (one step per token): the first kill comes at request 2's step
    # `at - probe` (about a third of its output), the second at its step `at` (about two thirds).
    armed, fired = tmp_path / "armed", tmp_path / "fired"
    token = unique_prompt_token(tiny_model, REQUESTS, 2)
    at, probe = 16, 8
    env = {"KVHOLD_FAULT": f"step:token={token}@{at}:stop", "KVHOLD_FAULT_IF": str(armed),
           "KVHOLD_FAULT_ONCE": str(fired)}
    # a lease that outlasts the stop: the stopped executor is not fenced as hung before its kill
    sc = start_sidecar(["--model", str(tiny_model), *FOREIGN, "--lease-ms", "10000"], env=env)
    with sc.new_client(timeout=60) as client:
        sc.wait_steady()
        assert ids(wait_all(submit(client))) == reference          # uninterrupted, foreign mode
        for first in (True, False):
            pid = sc.wait_steady()["pid"]
            fired.unlink(missing_ok=True)
            armed.touch()
            if first:      # one step per token, alone: `probe` steps counted, none of them the n-th
                result = client.generate(prompt_ids=[token], max_tokens=probe, temperature=0.0,
                                         ignore_eos=True).result()
                assert result.completion_tokens == probe and not fired.exists()
            streams = submit(client)
            wait_stopped(pid, 60)
            assert int(fired.read_text().split()[0]) == pid
            armed.unlink()                         # the successor runs clean
            os.kill(pid, signal.SIGKILL)
            os.kill(pid, signal.SIGCONT)
            assert ids(wait_all(streams)) == reference, first
    sc.wait_steady()             # a standby still starting up would slow the sidecar's stop
    recoveries = sc.status()["recoveries"]
    assert len(recoveries) == 2
    for rec in recoveries:
        assert rec["kv_mode"] == "foreign"
        assert rec["requests_lost"] + rec["requests_damaged"] == 0
        assert rec["tokens_recomputed"] == 0 and rec["tokens_kept"] > 0 and rec["pages_bad"] == 0


def test_damaged_mirror_page_recomputes_from_the_first_bad_block(tiny_model, reference, start_sidecar, tmp_path):
    # The active executor stops itself at the 4th step that holds the 100-token prompt, before
    # its forward: that request's prompt is computed then (at most 2 chunks of 64-token steps)
    # and its pages published, with 20 of its 24 tokens still to come, however late it arrived
    # and however far the engine is ahead of this test's client. The replacement runs clean.
    env = {"KVHOLD_FAULT": f"step:token={unique_prompt_token(tiny_model, REQUESTS, 2)}@4:stop",
           "KVHOLD_FAULT_ONCE": str(tmp_path / "fired")}
    sc = start_sidecar(["--model", str(tiny_model), *FOREIGN, "--lease-ms", "5000"], env=env)
    pid = sc.wait_steady()["pid"]
    tables, words = _attach(sc)
    flipped = {}
    with sc.new_client(timeout=60) as client:
        streams = submit(client)
        wait_stopped(pid, 60)                     # the tables hold still while we aim
        rids = tables.requests["request_id"]
        running = [s for s in streams if (rids == s.request_id).any()]
        target = streams[2]                       # the 100-token prompt: blocks 0..5 are sealed
        assert target in running
        for s in running:
            slot = int(np.nonzero(rids == s.request_id)[0][0])
            n = int(tables.requests["num_pages"][slot])
            pages = tables.page_lists[slot, :n]
            # the journal lists kvhold pages that the mirror assigned to this request, in order
            assert (tables.pages["owner"][pages] == s.request_id).all()
            assert (tables.pages["logical"][pages] == np.arange(n)).all()
        slot = int(np.nonzero(rids == target.request_id)[0][0])
        page = int(tables.page_lists[slot, 2])
        assert tables.pages["num_tokens"][page] == 16
        words[page, 1, 1, 4, 3] ^= np.uint32(1 << 9)        # layer 1, values, token 4
        flipped[target.request_id] = 2
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        results = wait_all(streams)
    assert ids(results) == reference
    sc.wait_steady()
    rec = sc.status()["recoveries"][-1]
    assert rec["kv_mode"] == "foreign" and rec["pages_bad"] == 1
    assert rec["requests_damaged"] == 1 and rec["requests_lost"] == 0
    by_id = {r["request_id"]: r for r in rec["requests"]}
    # the requests in the journal at the kill were taken over (those that ended before it, or
    # reached the executor after it, ran clean)
    assert {r.request_id for r in results if r.request_id in by_id} >= {s.request_id for s in running}
    for r in results:
        row = by_id.get(r.request_id)
        if r.request_id in flipped:
            assert row["class"] == "damaged" and row["first_bad_page"] == 2 and row["kv_kept"] == 32
            assert r.recomputed_tokens > 0
        else:
            assert row is None or row["class"] == "resumable"
            assert r.recomputed_tokens == 0


def test_native_mode_is_untouched(tiny_model):
    """Without --kv-mode foreign, executors run the native workload (settings say so)."""
    import argparse

    from kvhold.sidecar.flags import add_sidecar_args, sidecar_config_from_args

    parser = argparse.ArgumentParser()
    add_sidecar_args(parser)
    native = sidecar_config_from_args(parser.parse_args(["--model", str(tiny_model)])).executor_settings()
    assert native.kv_mode == "native"
    borrowed = parser.parse_args(["--model", str(tiny_model)])
    borrowed.kv_mode = "borrowed"           # past argparse's choices: the config's own check
    with pytest.raises(ValueError, match="--kv-mode"):
        sidecar_config_from_args(borrowed)


ON_GPU = [pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                          reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", ["cpu", *ON_GPU])
def test_mirror_of_a_bf16_engine_pool_on_its_device(device):
    """The mirror as foreign mode runs it on CUDA: bf16 pools on the device, the device's checksum,
    a prefill (hashed on kvhold's copy) then decode steps whose row hashes come from the engine's
    own pool (as the CUDA runner computes them), first through mirror_committed, then through
    the decode fast path (pinned staging, copy event); published checksums equal the CPU
    definition, and a restore gives back the engine's bytes."""
    from kvhold.executor.foreign_pool import engine_blocks
    from kvhold.executor.kv_cache import KvCache
    from kvhold.protocol.checksum import TorchChecksum, page_checksum_np, to_u64
    from kvhold.protocol.layout import KvGeometry, TableGeometry
    from kvhold.protocol.leases import Lease, LeaseTable
    from kvhold.executor.kv_mirror import Committed, KvMirror, device_checksum

    geom = TableGeometry(kv=KvGeometry(4, 2, 64, "bfloat16", 16), num_pages=32, num_slots=4, max_seq_len=256,
                         num_leases=2)
    tables = Tables.create(f"/kvhold-test-fmirror-{os.getpid()}", geom, 1)
    try:
        lease = Lease(tables, 0, LeaseTable(tables).grant(0, os.getpid()))
        shared = KvCache.private(geom.kv, geom.num_pages, device)
        private = KvCache.private(geom.kv, 24, device)
        private.pool.copy_(torch.randn(private.pool.shape, generator=torch.Generator().manual_seed(5)))
        mirror = KvMirror(tables, shared.pool, engine_blocks(private), lease)
        engine_sums = device_checksum(private.pool)
        assert type(mirror.checksum).__name__ == ("TritonChecksum" if device == "cuda" else "TorchChecksum")
        blocks = [7, 3, 11, 5]                                     # the engine's blocks for request 9
        mirror.mirror_committed([Committed(9, 0, 7, 16), Committed(9, 1, 3, 4)])       # a 20-token prefill
        for pos in range(20, 56):                                  # decode
            block, row = blocks[pos // 16], pos % 16
            h = int(to_u64(engine_sums.slots(torch.tensor([block], device=device),
                                             torch.tensor([row], device=device)))[0])
            if pos < 40:
                assert mirror.mirror_committed([Committed(9, pos // 16, block, row + 1)], {(block, row): h}) == 1
            else:                                                  # the decode fast path
                queued = mirror.queue_decode([9], [pos // 16], [block], [row])
                assert mirror.publish_decode(queued, [h] if pos % 2 else None) == 1
        pages = [mirror.page_of(9, i) for i in range(4)]
        words = shared.pool.cpu().view(torch.int64).reshape(geom.num_pages, 4, 2, 16, -1).numpy().view(np.uint64)
        for page, count in zip(pages, (16, 16, 16, 8)):
            assert int(tables.pages["num_tokens"][page]) == count
            assert int(tables.pages["checksum"][page]) == page_checksum_np(words[page], count)
        cpu_sums = to_u64(TorchChecksum(shared.pool.cpu()).pages(torch.tensor(pages), torch.tensor([16, 16, 16, 8])))
        assert (cpu_sums == tables.pages["checksum"][pages]).all()
        lease = Lease(tables, 1, LeaseTable(tables).grant(1, os.getpid()))
        fresh = KvCache.private(geom.kv, 24, device)
        restored = KvMirror(tables, shared.pool, engine_blocks(fresh), lease).restore(
            {9: [20, 21, 22, 23]}, engine_blocks(fresh))[9]
        assert (restored.blocks_restored, restored.tokens_restored, restored.first_bad) == (4, 56, None)
        assert torch.equal(fresh.pool[[20, 21, 22]], private.pool[[7, 3, 11]])
        assert torch.equal(fresh.pool[23, :, :, :8], private.pool[5, :, :, :8])
    finally:
        tables.unlink()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_foreign_mode_on_the_gpu_is_token_exact(tiny_model, tmp_path):
    """Foreign-pool mode on CUDA through a real sidecar: kills of the active executor, recovery
    through the mirror, every stream identical to the uninterrupted run."""
    from kvhold.testing.sidecar_process import SidecarProcess

    flags = ["--model", str(tiny_model), "--device", "cuda:0", "--backend", "cuda", "--kv-mode", "foreign",
             "--max-seq-len", "512", "--max-batch", "16", "--max-batch-tokens", "256", "--prefill-chunk", "64",
             "--log-level", "INFO", "--restart-backoff-ms", "0,0"]
    requests = [dict(prompt_ids=list(range(2, 2 + 20 * (i + 1))), max_tokens=48, temperature=0.8 if i % 2 else 0.0,
                     seed=i, ignore_eos=True) for i in range(6)]
    with SidecarProcess(flags, log_path=tmp_path / "sidecar.log") as sc:
        sc.wait_steady(timeout=600)
        with sc.new_client(timeout=120) as client:
            reference = ids(wait_all(submit_requests(client, requests)))
            for threshold in (30, 110):
                sc.wait_steady(timeout=600)
                seen = [0]

                def on_event(stream, event):
                    seen[0] += 1
                    if seen[0] == threshold:
                        os.kill(sc.wait_steady(standbys=0)["pid"], signal.SIGKILL)

                assert ids(wait_all(submit_requests(client, requests), on_event)) == reference, threshold
        sc.wait_steady(timeout=600)
        recs = sc.status()["recoveries"]
    assert len(recs) == 2
    for rec in recs:
        assert rec["kv_mode"] == "foreign" and rec["requests_lost"] + rec["requests_damaged"] == 0
        assert rec["tokens_recomputed"] == 0 and rec["tokens_kept"] > 0 and rec["pages_bad"] == 0


def test_decode_fast_path_commits_what_the_general_path_does(tiny_model):
    """Three foreign engines in lockstep on CPU: decode steps through the mirror's fast path with
    the copy queued by the runner hook `after_forward` (before the step's read-back, as on CUDA),
    the same with the hook dropped (the copy queued in the commit), and the general path.
    After every step their page tables, journal page lists, kvhold bytes and tokens agree."""
    from kvhold.executor.foreign_pool import foreign_engine_like
    from kvhold.executor.kv_cache import KvCache
    from tools.bench_engine_setup import admit, build_engine
    from tools.bench_mirror import check_mirror

    engines, all_tables = {}, []
    try:
        for variant in ("fast", "general", "hook"):
            native, tables = build_engine(tiny_model, "cpu", 64, 128, 8, 48, 16)
            all_tables.append(tables)
            g = native.kv.geometry
            engine = foreign_engine_like(native, KvCache.private(g, native.kv.num_pages, native.kv.pool.device))
            engines[variant] = (engine, tables)
        fast_steps = {v: 0 for v in engines}
        for variant, (engine, _) in engines.items():
            publish = engine.mirror.publish_decode

            def counted(*args, _publish=publish, _variant=variant):
                fast_steps[_variant] += 1
                return _publish(*args)

            engine.mirror.publish_decode = counted
        engines["general"][0].commits.pages._queue_decode = lambda plan: None
        unhooked, run_and_sample = engines["fast"][0], engines["fast"][0].runner.run_and_sample

        def without_hook(plan, sampling, beat=None, after_forward=None):   # the copy queued in the commit
            return run_and_sample(plan, sampling, beat=beat)

        unhooked.runner.run_and_sample = without_hook
        first = [dict(prompt_ids=list(range(3, 3 + n)), max_tokens=m) for n, m in ((5, 30), (21, 12), (40, 25))]
        late = [dict(prompt_ids=list(range(9, 9 + n)), max_tokens=m) for n, m in ((16, 20), (3, 9))]
        for step in range(80):
            if step in (0, 14):
                for _, tables in engines.values():
                    admit(tables, first if step == 0 else late)
            for engine, _ in engines.values():
                engine.step()
            ref = engines["fast"][1]
            for variant, (engine, tables) in engines.items():
                assert (tables.pages == ref.pages).all(), (variant, step)
                assert (tables.requests["num_pages"] == ref.requests["num_pages"]).all(), (variant, step)
                assert (tables.page_lists == ref.page_lists).all(), (variant, step)
                assert torch.equal(engine.mirror.pool, engines["fast"][0].mirror.pool), (variant, step)
                assert engine.mirror.holdings() == engines["fast"][0].mirror.holdings()
                assert {s: q.tokens for s, q in engine.seqs.items()} == \
                    {s: q.tokens for s, q in engines["fast"][0].seqs.items()}
            if step % 4 == 0:
                check = check_mirror(engines["hook"][0])       # mirror == engine blocks, checksums right
                assert check["bytes_match"] and check["checksums_match"], step
        assert not any(e.has_work for e, _ in engines.values())
        assert fast_steps["general"] == 0 and fast_steps["fast"] == fast_steps["hook"] >= 20
        assert all(not e.mirror.held for e, _ in engines.values())          # every request released
    finally:
        for tables in all_tables:
            tables.unlink()


@pytest.mark.parametrize("fault", ["publish_counts:2:kill", "publish_counts:7:kill"])
def test_death_inside_a_mirror_publish_keeps_the_rows_committed_before(tiny_model, reference, start_sidecar,
                                                                       tmp_path, fault):
    """The executor dies inside a mirror publish, its pages' new counts written and not yet their
    checksums: the successor keeps the rows each page had committed before (those its recorded
    checksum covers), as native mode does, so no request is damaged or lost."""
    got, rec = run_with_fault(start_sidecar, ["--model", str(tiny_model), *FOREIGN], tmp_path, fault, REQUESTS)
    assert got == reference
    assert len(rec) == 1 and rec[0]["kv_mode"] == "foreign", rec
    assert rec[0]["requests_lost"] == rec[0]["requests_damaged"] == 0 and rec[0]["pages_bad"] == 0, rec
