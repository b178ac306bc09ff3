"""tools/bench_recovery reads each takeover's host timing marks from the sidecar's log."""
from tools.bench_recovery import host_marks, summarize

LOG = """\
20:34:16.003 I [sidecar pid=568 e=0] kvhold.sidecar.supervisor: promoted executor pid 1044 (lease 0, epoch 12) to active
20:34:16.010 I [active pid=10440 e=12] kvhold.executor.engine_workload: takeover host marks (ms from its start): prefetched 9.00, plans 9.50
20:34:16.018 I [active pid=1044 e=12] kvhold.executor.engine_workload: takeover host marks (ms from its start): prefetched 0.31, plans 1.20, records 1.31, sums_prefetched 1.40, sums 3.02, verdicts 3.40
"""


def test_the_promoted_executors_marks_are_read_by_its_pid(tmp_path):
    log = tmp_path / "run.standby.log"
    log.write_text(LOG)
    assert host_marks(log, 1044) == {"prefetched": 0.31, "plans": 1.2, "records": 1.31, "sums_prefetched": 1.4,
                                     "sums": 3.02, "verdicts": 3.4}
    assert host_marks(log, 999) is None and host_marks(tmp_path / "none.log", 1044) is None


def test_the_summary_gives_each_marks_median_over_the_kills_that_logged_it():
    base = {f"{p}_ms": 1.0 for p in ("detect", "fenced", "promoted", "takeover_start", "validated", "resumed",
                                     "first_token", "exit_confirmed")}
    base.update(tokens_recomputed=0, requests_failed=0, requests_lost=0, requests_damaged=0, pages_bad=0,
                kv_mode="native", outputs_identical=True)
    samples = [dict(base, host_marks_ms={"plans": 1.0, "sums": 2.0}), dict(base, host_marks_ms={"plans": 3.0}),
               dict(base, host_marks_ms=None)]
    assert summarize(samples)["host_marks_p50_ms"] == {"plans": 2.0, "sums": 2.0}
    assert "host_marks_p50_ms" not in summarize([base])
