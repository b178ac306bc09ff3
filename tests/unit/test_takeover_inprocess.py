"""Takeovers driven in one process: two engines share one tables segment and one KV pool,
the first is abandoned at a chosen point (as if SIGKILLed: nothing more of it runs), its
lease is fenced, the second takes over with the first's epoch still pending (its exit not
yet confirmed, so tails must not be written in place) and finishes every request. Outputs
must equal an uninterrupted run's. Exact states, no timing: complements the real-process
tests in test_recovery_e2e."""
from __future__ import annotations

import pytest

from kvhold.executor import faults
from kvhold.executor.commit import CommitProtocol, NativePages
from kvhold.protocol.layout import ExecState
from tests.unit.helpers import EnginePool, decode_until, float64_model, run_to_end
from tools.bench_engine_setup import admit

PAGE_TOKENS = 16
MAX_SEQ = 128


@pytest.fixture(scope="module")
def model(tiny_model):
    return float64_model(tiny_model, MAX_SEQ)


class Pool(EnginePool):
    def started(self, **kw):
        return super().started(REQUESTS, **kw)


REQUESTS = [dict(prompt_ids=[3 + (7 * i + j) % 500 for j in range(20 + 3 * i)], max_tokens=24,
                 temperature=(0.0, 0.8, 1.0)[i % 3], top_p=0.9, seed=11 + i) for i in range(3)]


@pytest.fixture(scope="module")
def reference(model):
    pool = Pool(model, 64)
    try:
        engine, ids = pool.started()
        run_to_end(engine)
        return pool.outputs(ids)
    finally:
        pool.close()


def test_takeover_with_a_full_pool_drops_tails_instead_of_failing(model, reference):
    """Every page is in use when the executor dies and its exit is not confirmed yet: no free
    page to copy a partially filled tail into. The takeover used to die with OutOfPages (and
    the half-repaired tables then went to a cold executor); it must recompute those tails."""
    # 3 requests of 20, 23 and 26 prompt tokens: after prefill and a few decode steps each
    # holds 2 pages, the second partially filled. The pool: null page + exactly those 6.
    pool = Pool(model, 1 + 6)
    try:
        dead, ids = pool.started()
        decode_until(dead, 3)
        assert dead.blocks.allocator.num_free == 0
        assert all(s.num_computed % PAGE_TOKENS for s in dead.seqs.values())   # partial tails
        epoch = pool.fence(dead)
        survivor = pool.engine()
        report = survivor.take_over([epoch], 0).to_dict()
        assert report["tails_dropped"] == 3 and report["pages_copied"] == 0
        assert report["requests_lost"] == report["requests_damaged"] == 0
        assert report["tokens_recomputed"] > 0
        # the tails are quarantined until the dead writer's exit is confirmed (sidecar: Reaped)
        assert len(survivor.quarantined) == 3
        survivor.step()
        assert survivor.release_quarantined([epoch]) == 3
        run_to_end(survivor)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_takeover_with_a_pool_full_of_idle_cached_pages_copies_tails(model, reference):
    """A busy prefix cache keeps the pool full of idle cached pages. Tails that must be copied
    (the dead writer's exit not confirmed) take idle cached pages for their copies, and nothing
    the dead executor committed is recomputed."""
    pool = Pool(model, 1 + 6 + 4)
    try:
        dead = pool.engine(prefix_salt=b"full-pool")
        dead.take_over([], 0)
        admit(pool.tables, [dict(prompt_ids=[400 + j for j in range(64)], max_tokens=1, temperature=0.0)])
        run_to_end(dead)                   # its 4 full pages stay in the cache, referenced by nobody
        assert dead.blocks.prefix.num_cached == 4
        ids = admit(pool.tables, REQUESTS)
        decode_until(dead, 3)
        assert dead.blocks.allocator.num_free == 0
        assert all(s.num_computed % PAGE_TOKENS for s in dead.seqs.values())   # partial tails
        epoch = pool.fence(dead)
        survivor = pool.engine(prefix_salt=b"full-pool")
        report = survivor.take_over([epoch], 0).to_dict()
        assert report["pages_copied"] == 3 and report["tails_dropped"] == 0
        assert report["tokens_recomputed"] == 0 and report["requests_lost"] == 0
        assert len(survivor.blocks.prefix.unverified) == 1       # 3 of the 4 idle pages given up
        run_to_end(survivor)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_a_death_inside_a_pages_entry_into_the_prefix_cache_loses_nothing(model, reference):
    """The executor dies inside `mark_cached` after the page's owner became its cache key and
    before the CACHED flag was set (version odd). The page's rows are whole: the takeover keeps
    it as its request's page (owner restored), nothing is bad, lost or recomputed."""
    from kvhold.protocol.layout import PageFlag

    pool = Pool(model, 64)
    try:
        dead, ids = pool.started(prefix_salt=b"interrupted")
        decode_until(dead, 3)
        seq = next(iter(dead.seqs.values()))
        page = seq.pages[0]
        pages = pool.tables.pages
        assert pages["flags"][page] & PageFlag.CACHED and pages["owner"][page] != seq.request_id
        pages["flags"][page] &= ~pages.dtype["flags"].type(PageFlag.CACHED)    # the flag not set yet
        pages["version"][page] += 1                                            # inside the seqlock
        epoch = pool.fence(dead)
        survivor = pool.engine(prefix_salt=b"interrupted")
        report = survivor.take_over([epoch], 0).to_dict()
        assert report["pages_interrupted"] == 1 and report["pages_bad"] == 0
        assert report["requests_lost"] == report["requests_damaged"] == 0 and report["tokens_recomputed"] == 0
        assert pages["owner"][page] == seq.request_id and pages["version"][page] % 2 == 0
        run_to_end(survivor)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_takeover_copies_tails_when_pages_are_free(model, reference):
    pool = Pool(model, 64)
    try:
        dead, ids = pool.started()
        decode_until(dead, 3)
        epoch = pool.fence(dead)
        survivor = pool.engine()
        report = survivor.take_over([epoch], 0).to_dict()
        assert report["pages_copied"] == 3 and report["tails_dropped"] == 0
        assert report["tokens_recomputed"] == 0
        run_to_end(survivor)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


class _Killed(BaseException):
    """Stands for SIGKILL: raised at a fault point, nothing of the engine runs after it."""


COMMIT_POINTS = ("commit_begin", "commit_pages", "commit_journal", "commit_finish")


@pytest.mark.parametrize("point", COMMIT_POINTS)
def test_death_at_every_commit_stage_of_every_step(model, reference, monkeypatch, point):
    """The executor dies at `point` of step k, for every k until the requests are done; the
    survivor (its predecessor's exit unconfirmed) must finish every request as the reference
    did. Covers deaths during prefill, between prefill and the first token, and at the end."""
    steps = 0
    probe = Pool(model, 64)
    try:
        e = probe.engine()
        e.take_over([], 0)
        admit(probe.tables, REQUESTS)
        while e.has_work:
            e.step()
            steps += 1
    finally:
        probe.close()
    for k in range(1, steps + 1):
        pool = Pool(model, 64)
        try:
            dead = pool.engine()
            dead.take_over([], 0)
            ids = admit(pool.tables, REQUESTS)
            hits = [0]

            def point_hit(name, k=k, hits=hits):
                if name == point:
                    hits[0] += 1
                    if hits[0] == k:
                        raise _Killed()

            monkeypatch.setattr(faults, "point", point_hit)
            try:
                run_to_end(dead)
            except _Killed:
                pass
            finally:
                monkeypatch.undo()
            if not hits[0] >= k:
                continue                        # fewer commits than steps: nothing to kill
            epoch = pool.fence(dead)
            survivor = pool.engine()
            report = survivor.take_over([epoch], 0).to_dict()
            assert report["requests_lost"] == report["requests_damaged"] == 0, (point, k)
            survivor.step()
            survivor.release_quarantined([epoch])
            run_to_end(survivor)
            assert pool.outputs(ids) == reference, (point, k)
        finally:
            pool.close()


def test_death_between_a_prompts_pages_and_its_first_token_recomputes_the_last_chunk(
        model, reference, monkeypatch):
    """Killed right after publishing the KV pages of a step that completes a prompt, before its
    first token reached the journal: the survivor must recompute that prompt's last prefill
    chunk as a chunk, not the prompt's last position alone as a one-token (decode-shaped) row,
    which on CUDA runs different kernels than the chunk did (bits of the KV and the first
    token's logits could differ from the uninterrupted run's)."""
    pool = Pool(model, 64)
    try:
        dead = pool.engine()
        dead.take_over([], 0)
        ids = admit(pool.tables, REQUESTS)
        publish = NativePages.publish
        completing = []

        def publish_then_die(self, plan, slot_hashes):
            publish(self, plan, slot_hashes)
            done = [p.seq.slot for p in plan if p.samples and p.seq.num_generated == 0]
            if done:
                completing.extend(done)
                raise _Killed()

        monkeypatch.setattr(NativePages, "publish", publish_then_die)
        with pytest.raises(_Killed):
            run_to_end(dead)
        monkeypatch.undo()
        epoch = pool.fence(dead)
        survivor = pool.engine()
        report = survivor.take_over([epoch], 0).to_dict()
        assert report["prompts_realigned"] == len(completing) > 0
        chunk = survivor.scheduler.prefill_chunk
        rows: dict[int, list[int]] = {}
        run = survivor.runner.run_and_sample

        def record(plan, sampling, **kwargs):
            for p in plan:
                rows.setdefault(p.seq.slot, []).append(p.n)
            return run(plan, sampling, **kwargs)

        monkeypatch.setattr(survivor.runner, "run_and_sample", record)
        run_to_end(survivor)
        for slot in completing:
            seq_len = len(REQUESTS[ids.index(int(pool.tables.requests["request_id"][slot]))]["prompt_ids"])
            last_chunk = seq_len - (seq_len - 1) // chunk * chunk
            assert rows[slot][0] == last_chunk, (slot, rows[slot][:3])
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_a_decode_commit_is_published_while_the_next_step_runs(model, reference):
    """kvhold.executor.commit: a decode step's tokens and KV counts reach the tables when the
    next step's forward is queued (or on flush), in the commit's order, and never later."""
    pool = Pool(model, 64)
    try:
        engine, ids = pool.started()
        decode_until(engine, 2)
        req, pages = pool.tables.requests, engine.page_table.pages

        def published(seq):
            tail = seq.pages[(seq.num_computed - 1) // PAGE_TOKENS]
            return int(req["num_generated"][seq.slot]), int(pages["num_tokens"][tail])

        def kept(seq):
            tail = seq.pages[(seq.num_computed - 1) // PAGE_TOKENS]
            return seq.num_generated, engine.blocks.counts[tail]

        engine.step()                                   # a decode step: its commit is left pending
        assert engine.commits.pending is not None and engine.has_work
        for seq in engine.seqs.values():                # one token and one KV slot behind
            (tokens, slots), (want_tokens, want_slots) = published(seq), kept(seq)
            assert tokens == want_tokens - 1 and slots == want_slots - 1
        before = {seq.slot: kept(seq) for seq in engine.seqs.values()}
        changed = engine.step()                         # publishes the previous step's commit
        assert sorted(changed) == sorted(before)
        for seq in engine.seqs.values():
            assert published(seq) == before[seq.slot]
        assert sorted(engine.flush()) == sorted(before) and engine.commits.pending is None
        for seq in engine.seqs.values():
            assert published(seq) == kept(seq)
        run_to_end(engine)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_a_preemption_publishes_the_pending_commit_before_it_frees_pages(model, reference):
    """Too few pages for the three requests: running sequences are preempted (their pages
    freed and reused) while a decode commit may be pending; outputs must not change."""
    pool = Pool(model, 1 + 6)
    try:
        engine, ids = pool.started()
        publish, published = engine.commits.publish_pending, [0]

        def checked():          # every page a pending commit names is still its sequence's, as kept
            pending = engine.commits.pending
            if pending is not None and pending.pages is not None:     # a deferred decode commit
                for page, count in zip(pending.pages.tolist(), pending.counts.tolist()):
                    assert engine.blocks.counts.get(page) == count, f"page {page} changed hands"
                published[0] += 1
            publish()

        engine.commits.publish_pending = engine.scheduler.on_preempt = checked
        run_to_end(engine, limit=2000)
        assert engine.scheduler.num_preemptions > 0 and published[0] > 0
        assert pool.outputs(ids) == reference
    finally:
        pool.close()


def test_a_cancellation_publishes_the_pending_commit_before_finishing(model):
    from kvhold.protocol.layout import AdmitState, FinishReason

    pool = Pool(model, 64)
    try:
        engine, ids = pool.started()
        decode_until(engine, 2)
        engine.step()
        assert engine.commits.pending is not None
        req = pool.tables.requests
        slot = int((req["request_id"] == ids[0]).nonzero()[0][0])
        generated = engine.seqs[slot].num_generated
        req["admit_state"][slot] = AdmitState.CANCELLED
        engine.step()
        assert int(req["exec_state"][slot]) == ExecState.FINISHED
        assert int(req["finish_reason"][slot]) == FinishReason.CANCELLED
        assert int(req["num_generated"][slot]) == generated      # its pending token was published first
        assert slot not in engine.seqs
        run_to_end(engine)
    finally:
        pool.close()


def test_pipelined_commits_preempt_no_more_than_immediate_ones(model, monkeypatch):
    """A request finishing in a decode step frees its pages before the next schedule, as an
    immediate commit would: the pipeline must not make the scheduler preempt (recompute)."""
    reqs = [dict(prompt_ids=[3 + i for i in range(16)], max_tokens=18, seed=1),
            dict(prompt_ids=[7 + i for i in range(15)], max_tokens=17, seed=2)]
    preempted = {}
    for defer in (True, False):
        monkeypatch.setattr(CommitProtocol, "pipelined", defer)
        pool = Pool(model, 5)
        try:
            engine = pool.engine(max_batch=4, max_batch_tokens=40, prefill_chunk=32)
            engine.take_over([], 0)
            admit(pool.tables, reqs)
            run_to_end(engine, 3000)
            preempted[defer] = engine.scheduler.num_preemptions
        finally:
            pool.close()
    assert preempted[True] == preempted[False]


def test_a_fenced_executor_writes_no_journal_entry_of_its_pending_commit(model, monkeypatch):
    """Fenced between publishing the pages and the journal (stopped there, a successor took
    over): the rest of the pending commit must not reach the journal."""
    from kvhold.protocol.leases import Fenced

    pool = Pool(model, 64)
    try:
        engine, ids = pool.started()
        decode_until(engine, 2)
        engine.step()
        assert engine.commits.pending is not None
        before = pool.tables.requests["num_generated"].copy()

        def point(name):
            if name == "commit_pages":
                pool.fence(engine)

        monkeypatch.setattr(faults, "point", point)
        with pytest.raises(Fenced):
            engine.step()
        assert (pool.tables.requests["num_generated"] == before).all()
    finally:
        pool.close()


class _CountedChecksum:
    """The engine's checksum, counting the pages each `pages` pass hashes."""

    def __init__(self, inner):
        self.inner, self.passes = inner, []

    def pages(self, page_ids, num_tokens):
        self.passes.append(len(page_ids))
        return self.inner.pages(page_ids, num_tokens)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_validation_hashes_every_listed_page_once_and_a_standby_read_ahead_gives_the_same_tokens(
        model, reference):
    """The checksum pass starts before the requests are rebuilt (NativeTakeover.prefetch) and
    validation takes its result: one pass over the listed pages, then one over the copied tails.
    A survivor that read the tokens ahead (a hot standby idling) continues to the same outputs."""
    pool = Pool(model, 64)
    try:
        dead, ids = pool.started()
        decode_until(dead, 3)
        epoch = pool.fence(dead)
        survivor = pool.engine()
        survivor.tokens_ahead.refresh()
        listed = int(survivor.journal.req["num_pages"][survivor.journal.live_slots()].sum())
        survivor.checksum = counted = _CountedChecksum(survivor.checksum)
        report = survivor.take_over([epoch], 0).to_dict()
        assert counted.passes == [listed, report["pages_copied"]] and report["pages_checked"] == listed
        assert survivor.tokens_ahead is None           # active: it reads ahead no more
        run_to_end(survivor)
        assert pool.outputs(ids) == reference
    finally:
        pool.close()
