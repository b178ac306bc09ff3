"""A vLLM engine as a kvhold executor: `kvhold sidecar --workload vllm --kv-mode foreign`.

The sidecar spawns executors as usual (`python -m kvhold.executor`, with the sidecar's own
Python: run the sidecar from the environment vLLM is installed in); each runs this workload,
which holds one vLLM `LLMEngine` whose engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, uni-process executor). SIGKILL of the executor is
SIGKILL of vLLM's engine core; the hot standby is a second executor with its own vLLM
engine, built and warmed, that has written nothing.

prepare (standby-to-be): the weights region is loaded and sealed by the designated
executor (kvhold.executor.engine_workload), then vLLM is built with `load_format="kvhold"`
(kvhold.vllm_bridge.loader: weights from the region, no disk read) and the kvhold KV
connector (kvhold.vllm_bridge.connector), blocks of kvhold's `page_tokens`, as many
blocks as kvhold has pages, vLLM's prefix caching as `--enable-prefix-caching` says (on by
default: its cached blocks are kvhold's shared cached pages, keyed as kvhold's engine keys them,
kvhold.executor.prefix_cache with the same salt; the connector and KvMirror.settle_full share
them), synchronous scheduling, eager mode; then one warm-up request that no page records.
promote: `KvMirror.plan_restore` validates every page the dead executor mirrored for a
live journal request (quarantining what a writer not yet reaped may still write), and
each live request is resubmitted to vLLM as prompt + the tokens the journal holds, for
its remaining tokens. The connector reports the intact prefix past vLLM's own cache hit as
matched tokens and loads it before the first forward; vLLM computes the rest (and caches what was
loaded: a second request with the same prefix starts on the first one's loaded blocks). The
takeover also keeps the dead engine's idle cached pages (unchecked, checked between steps or when
a new request would be offered them): a new request with a prefix they hold loads them as an
external hit instead of computing it (the connector's `_offer`). The `Recovered` report is sent once
every resubmitted request has been computed up to its next token, with the tokens that
were actually loaded and computed (the connector counts both), never a plan.
step: admit the journal's new requests, cancel, run one vLLM step (the connector mirrors
its KV inside it), then journal each new token with its log-probs when asked for (pages
first, tokens second), list the request's mirrored pages and finish it by kvhold's own rule
(stop ids, EOS unless ignore_eos, max_tokens, max_seq_len), as the native engine does; a
request's first output journals vLLM's prefix-cache hit as its cached tokens (usage's
cached_tokens: vLLM's num_cached_tokens, its local hit and the connector's external one).
maintain (each turn of the active loop): POST /reset_prefix_cache, carried out
in vLLM (once no request runs) and then on kvhold's idle cached pages.

Log-probs (`logprobs=k`, `prompt_logprobs=k`) are vLLM's raw ones (kvhold.vllm_bridge.logprobs),
journaled with their tokens: a generated token's before the count that covers it, a known
token's (the prompt's, asked for with prompt_logprobs) before the first generated token. vLLM
gives a known token's log-probs only for positions it computes, and mirrors their KV before the
step's output reaches the workload, so the pages come first here: a successor that finds a
request whose known tokens' log-probs are not all journaled (`known_logprobs`) loads none of its
KV and has vLLM compute its whole prompt again, with prompt_logprobs. Every other resubmission
asks only for the log-probs of the tokens it generates: what the journal holds is never
computed or written again.

Continuations after a takeover equal an uninterrupted run (the KV of the intact prefix is
the same bytes; only what follows it is computed, in one prefill), sampled ones too:
vLLM's own sampler draws from one generator per request, seeded once, which a resubmitted
request would restart, so the bridge installs `KeyedSampling` (kvhold.vllm_bridge.sampling),
which keys every draw by (seed, position) as kvhold's own engine does.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

from kvhold.executor import faults
from kvhold.executor.engine import finish_reason
from kvhold.executor.engine_bridge import BridgeWorkload
from kvhold.executor.kv_cache import KvCache
from kvhold.executor.prefix_cache import PrefixCache
from kvhold.protocol import messages as m
from kvhold.protocol.journal import Journal
from kvhold.protocol.layout import FinishReason, PageFlag
from kvhold.protocol.leases import now_ns
from kvhold.protocol.model_spec import ModelSpec
from kvhold.protocol.recovery_report import RecoveryReport, RequestRecovery
from kvhold.protocol.settings import UNSUPPORTED_SAMPLING
from kvhold.vllm_bridge import check_vllm_version, connector, loader
from kvhold.vllm_bridge.logprobs import known_logprobs, known_rows
from kvhold.vllm_bridge.logprobs import rows as logprob_rows
from kvhold.vllm_bridge.sampling import KeyedSampling, extra_args

log = logging.getLogger(__name__)
CONNECTOR = {"kv_connector": "KvholdConnector", "kv_connector_module_path": "kvhold.vllm_bridge.connector",
             "kv_role": "kv_both"}
WARM_UP_ID = "warmup"
MAX_REPORTED = 64
VERIFY_BATCH = 64             # idle cached pages checked per turn of the loop after a takeover


@dataclass
class _Live:
    request_id: int
    external: str             # the vLLM request id (before vLLM's random suffix)
    known: tuple[int, int, int] | None = None   # positions [start, end) whose log-probs its
    # prompt_logprobs give (k of them), until journaled (`known_logprobs`)
    fresh: bool = True        # its first submission (not a takeover's resubmission)
    tokens: tuple[int, ...] = ()   # what was submitted (request-conditioned fault points)


def engine_kwargs(settings, geometry) -> dict:
    """vllm.LLM keywords: what the bridge needs of vLLM (module docstring)."""
    kv = geometry.kv
    return dict(model=settings.model, load_format=loader.LOAD_FORMAT, dtype=kv.dtype,
                block_size=kv.page_tokens, num_gpu_blocks_override=geometry.num_pages,
                max_model_len=geometry.max_seq_len, max_num_seqs=settings.max_batch,
                max_num_batched_tokens=settings.max_batch_tokens,
                enable_prefix_caching=settings.prefix_caching,
                async_scheduling=False, enforce_eager=True, disable_log_stats=True, seed=0,
                kv_transfer_config=dict(CONNECTOR), logits_processors=[KeyedSampling],
                max_logprobs=geometry.max_logprobs, logprobs_mode="raw_logprobs")


def sampling_params(entry, num_generated: int, prompt_logprobs: int | None = None):
    """vLLM SamplingParams for a journal entry with `num_generated` tokens already journaled.
    Stops are kvhold's (the workload finishes requests): vLLM ignores EOS and runs to the
    remaining max_tokens unless aborted. min_tokens is refused (`VllmWorkload.unsupported`):
    kvhold's stops are not vLLM's, so vLLM's own min_tokens would mask nothing here. Log-probs
    of the generated tokens as the request asks; `prompt_logprobs`: of the submitted tokens
    too (`known_logprobs`); flat (kvhold.vllm_bridge.logprobs reads FlatLogprobs)."""
    from vllm import SamplingParams

    p = entry.sampling
    keyed = extra_args(p.seed, num_generated) if p.temperature > 0 else None
    return SamplingParams(max_tokens=max(1, p.max_tokens - num_generated), temperature=p.temperature,
                          top_p=p.top_p, top_k=p.top_k if p.top_k > 0 else 0,
                          seed=p.seed if p.temperature > 0 else None, ignore_eos=True,
                          detokenize=False, skip_special_tokens=False, extra_args=keyed,
                          logprobs=p.logprobs, prompt_logprobs=prompt_logprobs, flat_logprobs=True)


class VllmWorkload(BridgeWorkload):
    unsupported = UNSUPPORTED_SAMPLING["vllm"]

    def __init__(self, ctx):
        super().__init__(ctx)
        self.live: dict[int, _Live] = {}            # journal slot -> its vLLM request
        self.by_external: dict[str, int] = {}       # vLLM request id -> journal slot
        self.recovery: dict | None = None           # the takeover whose report is pending

    # ------------------------------------------------------------------ prepare
    def prepare(self) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"      # the engine core runs in this process
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        s, tables = self.ctx.settings, self.ctx.tables
        if s.kv_mode != "foreign" or s.device != "cpu":
            raise RuntimeError("the vllm workload runs on cpu with --kv-mode foreign")
        import vllm

        check_vllm_version(vllm.__version__, s.vllm_any_version)
        spec = ModelSpec.from_dir(s.model)
        weights = self._weights(spec)
        self._phase("weights")
        geometry = tables.geometry
        kv = KvCache.from_mapping(self.ctx.mappings["kv"], geometry.kv, geometry.num_pages)
        self.bridge = connector.Bridge(tables, kv.pool, self.ctx.lease)
        salt = self._prefix_salt()           # the native engine's keys (kvhold.executor.prefix_cache)
        if salt is not None:
            self.bridge.prefix = PrefixCache(salt, geometry.kv.page_tokens)
        connector.install(self.bridge)
        lo = min(t.data_ptr() for t in weights.values())
        hi = max(t.data_ptr() + t.numel() * t.element_size() for t in weights.values())
        loader.install(weights, (lo, hi))
        loader.register()
        from vllm import LLM

        self.llm = LLM(**engine_kwargs(s, geometry))
        self.engine = self.llm.llm_engine
        self._phase("vllm_engine")
        self.weights_report = dict(loader.last_report)
        self.journal = Journal(tables)
        self.eos = set(spec.eos_token_ids)
        self.max_seq_len = geometry.max_seq_len
        self.page_tokens = geometry.kv.page_tokens
        self._warm_up()
        self._phase("warm_up")

    def _warm_up(self) -> None:
        """One short request through every path a step takes (no page is written: not active),
        log-probs included where the journal keeps them (vLLM compiles their rank count on first
        use: tens of seconds here, not in a takeover's first step)."""
        from vllm import SamplingParams

        keeps = self.journal.tables.logprobs is not None
        lp = dict(logprobs=1, prompt_logprobs=1, flat_logprobs=True) if keeps else {}
        self.engine.add_request(WARM_UP_ID, {"prompt_token_ids": [1, 2, 3]},
                                SamplingParams(max_tokens=2, temperature=0.0, detokenize=False, **lp))
        while self.engine.has_unfinished_requests():
            self.engine.step()

    # ------------------------------------------------------------------ takeover
    def promote(self, msg: m.Promote) -> RecoveryReport | None:
        t0 = now_ns()
        b = self.bridge
        entries = self._live_entries()
        recorded = _recorded_tokens(self.bridge.mirror.page_table.snapshot(), self.journal, entries)
        plans = self._plan_restore(entries, msg.pending_epochs)
        t_validated = now_ns()
        counts = {rid: tuple(int(b.mirror.counts[p]) for p in plan.pages) for rid, plan in plans.items()}
        # a request whose known tokens' log-probs are not all journaled is computed whole: vLLM
        # gives prompt log-probs only for the positions it computes (module docstring)
        whole = {e.request_id for e in entries if known_logprobs(e) is not None}
        if whole:
            log.info("%d requests computed again from their first token for their log-probs", len(whole))
        b.restorable = {rid: (plan.pages, counts[rid]) for rid, plan in plans.items()
                        if plan.pages and rid not in whole}
        b.active = True
        rows = []
        for e in entries:
            b.watch[e.request_id] = e.num_tokens
            self._submit(e)
            self.live[e.slot].fresh = False
            r = plans[e.request_id].restored
            rows.append((e, r.first_bad, recorded.get(e.request_id, 0)))
        stats = b.mirror.last_restore
        report = RecoveryReport(detect_ns=msg.detect_ns, promoted_ns=t0, validated_ns=t_validated,
                                resumed_ns=now_ns(), pages_checked=stats["pages_checked"],
                                pages_bad=stats["pages_bad"], pages_quarantined=stats["pages_quarantined"],
                                kv_mode="foreign-vllm", fenced_epoch=msg.fenced_epoch)
        self.recovery = {"report": report, "rows": rows}
        if not entries:
            return self._finish_report()
        return None                  # sent from `step` once the loads and recomputation happened

    def _finish_report(self) -> RecoveryReport:
        """The takeover's report from what the connector loaded and vLLM computed."""
        rec, self.recovery = self.recovery, None
        b, report, per = self.bridge, rec["report"], []
        kept = recomputed = 0
        classes = {"resumable": 0, "damaged": 0, "lost": 0}
        for e, first_bad, recorded in rec["rows"]:
            rid, n = e.request_id, e.num_tokens
            loaded = b.loaded.pop(rid, 0) + b.cached.pop(rid, 0)     # copied in, or vLLM's cache hit
            computed = b.computed.pop(rid, 0)
            b.watch.pop(rid, None)
            # positions computed again that the dead executor had committed (the last journal
            # token is the next input: computed in an uninterrupted run too)
            again = max(0, min(loaded + computed, recorded, n - 1) - loaded)
            klass = "resumable" if first_bad is None else ("damaged" if loaded else "lost")
            classes[klass] += 1
            kept += loaded
            recomputed += again
            if again:
                self.journal.add_counter(e.slot, "num_recomputed", again)
            per.append(RequestRecovery(request_id=rid, klass=klass, first_bad_page=first_bad,
                                       kv_kept=loaded, tokens_recomputed=again))
        report = dataclasses.replace(report, tokens_kept=kept, tokens_recomputed=recomputed,
                                     requests_resumable=classes["resumable"],
                                     requests_damaged=classes["damaged"], requests_lost=classes["lost"],
                                     requests=per[:MAX_REPORTED])
        log.info("took over: %d resumable, %d damaged, %d lost; %d KV tokens loaded from kvhold pages "
                 "(%d pages), %d recomputed", classes["resumable"], classes["damaged"], classes["lost"],
                 kept, b.pages_loaded, recomputed)
        return report

    def _recovery_done(self) -> bool:
        """Every resubmitted request has been computed up to its next token (or has ended)."""
        b = self.bridge
        for e, _, _ in self.recovery["rows"]:
            done = (b.loaded.get(e.request_id, 0) + b.cached.get(e.request_id, 0)
                    + b.computed.get(e.request_id, 0) >= e.num_tokens)
            if not done and e.slot in self.live:
                return False
        return True

    # ------------------------------------------------------------------ serving
    def _submit(self, entry) -> None:
        tokens = self.journal.all_tokens(entry.slot, entry.num_tokens).tolist()
        ext = connector.external_id(entry.request_id, self.ctx.epoch)
        known = known_logprobs(entry) if self.journal.tables.logprobs is not None else None
        self.engine.add_request(ext, {"prompt_token_ids": tokens},
                                sampling_params(entry, entry.num_generated, known[2] if known else None))
        self._track(entry, _Live(entry.request_id, ext, known, tokens=tuple(tokens)))
        self.by_external[ext] = entry.slot

    def step(self) -> list[int]:
        self._admit()
        changed = self._cancel()
        if self.engine.has_unfinished_requests():
            faults.batch_point("step", [live.tokens for live in self.live.values()])   # before the forward
            for out in self.engine.step():
                slot = self.by_external.get(out.request_id)
                if slot is not None and self._commit(slot, out):
                    changed.append(slot)
        if self.recovery is not None and self._recovery_done():
            report = self._finish_report()
            self.ctx.channel.send(m.Recovered(slot=self.ctx.attached.slot, epoch=self.ctx.epoch, report=report))
        return changed

    def maintain(self) -> None:
        """At each turn of the active executor's loop: once a takeover's report is sent, a batch
        of the idle cached pages it kept is checked (KvMirror.verify_cached; a new request checks
        the ones it would be offered itself). POST /reset_prefix_cache (asked through
        the tables' header, as of the native engine): vLLM's cache is reset (vLLM 0.32 does it
        only with no request running: until then it is asked again at each turn), then kvhold's
        idle cached pages are freed, then the reset is recorded done."""
        mirror = self.bridge.mirror
        if self.recovery is None and mirror is not None and mirror.prefix is not None and mirror.prefix.unverified:
            mirror.verify_cached(limit=VERIFY_BATCH)      # the idle cached pages a takeover kept
        header = self.ctx.tables.header
        asked = int(header["prefix_reset_asked"])
        if self.bridge.prefix is None or asked == int(header["prefix_reset_done"]):
            return
        if not self.llm.reset_prefix_cache():
            return
        self.ctx.lease.check()
        freed = self.bridge.mirror.reset_prefix_cache() if self.bridge.mirror is not None else 0
        header["prefix_reset_done"] = asked
        log.info("prefix cache reset: %d idle cached pages freed", freed)

    def _cancel(self) -> list[int]:
        done = []
        for slot, live in list(self.live.items()):
            if self.journal.is_cancelled(slot):
                self._end(slot, FinishReason.CANCELLED, abort=True)
                done.append(slot)
        return done

    def _commit(self, slot: int, out) -> bool:
        """Journal the tokens this vLLM RequestOutput adds (its KV is mirrored already), each
        with its log-probs when asked for, the known tokens' log-probs first, then finish by
        kvhold's rule; the output is cumulative over this submission."""
        live = self.live.get(slot)
        if live is None:
            return False
        finished, completion = out.finished, out.outputs[0]
        e, new = self._new_tokens(slot, list(completion.token_ids))
        self._list_pages(slot, live.request_id)
        if new and live.fresh and e.num_generated == 0 and out.num_cached_tokens:
            # usage's cached_tokens: the prompt tokens vLLM's prefix cache served (its first start)
            self.journal.set_cached_tokens(slot, int(out.num_cached_tokens))
        if new:                                # the step's KV mirrored, nothing of it journaled (crash tests)
            faults.point("commit_pages")
            faults.batch_point("commit_pages", [live.tokens])
        if live.known is not None and new:     # vLLM returns them with the first generated token
            if out.prompt_logprobs is None or len(out.prompt_logprobs) < live.known[1]:
                raise RuntimeError(f"request {live.request_id}: vLLM gave a token before the log-probs "
                                   f"of positions {live.known[0]}..{live.known[1] - 1}")
            self._journal_known(slot, live, out.prompt_logprobs)
        first = e.num_generated - self.offsets[slot]          # new[0]'s index in this submission
        asked = e.sampling.logprobs if self.journal.tables.logprobs is not None else None
        reason = None
        for j, token in enumerate(new):
            lp = None if asked is None else logprob_rows(completion.logprobs, [first + j], [token], asked)
            e = self._append_token(slot, e, token, lp)
            reason = finish_reason(e, token, self.eos, self.max_seq_len)
            if reason is not None:
                break
        if reason is None and finished:
            reason = FinishReason.LENGTH if e.num_generated >= e.max_tokens else FinishReason.CONTEXT
        if reason is not None:
            self._end(slot, reason, abort=not finished)
        return bool(new) or reason is not None

    def _journal_known(self, slot: int, live: _Live, flat) -> None:
        """The log-probs of the submitted tokens `live.known` names, then their `lp_done`."""
        args = known_rows(self.journal, slot, live.known, flat)
        self.ctx.lease.check()
        self.journal.write_logprobs(*args)
        live.known = None

    def _end(self, slot: int, reason: FinishReason, abort: bool) -> None:
        live = self.live[slot]
        self.by_external.pop(live.external, None)
        if abort:
            self.engine.abort_request([live.external])
        self._end_request(slot, live.request_id, reason)


def _recorded_tokens(records, journal, entries) -> dict[int, int]:
    """KV tokens the dead executor had mirrored, per request: its own pages' and the shared
    (cached) pages its journal list names."""
    live = (records["owner"] != 0) & ((records["flags"] & PageFlag.QUARANTINED) == 0)
    out: dict[int, int] = {}
    for owner, count in zip(records["owner"][live].tolist(), records["num_tokens"][live].tolist()):
        out[int(owner)] = out.get(int(owner), 0) + int(count)
    shared = (records["flags"] & PageFlag.CACHED) != 0
    for e in entries:
        pages = journal.pages_of(e.slot, journal.num_pages(e.slot))
        pages = pages[(pages > 0) & (pages < len(records))]
        pages = pages[shared[pages]]
        out[e.request_id] = out.get(e.request_id, 0) + int(records["num_tokens"][pages].sum())
    return out


def main(argv=None) -> int:
    """The executor process (`python -m kvhold.vllm_bridge`): kvhold.executor.runtime with this workload."""
    import argparse
    from pathlib import Path

    from kvhold.executor.runtime import EXIT_OK, ExecutorConfig, ExecutorRuntime
    from kvhold.protocol.logs import setup_logging

    p = argparse.ArgumentParser(prog="python -m kvhold.vllm_bridge",
                                description="Run one vLLM executor under a kvhold sidecar.")
    p.add_argument("--instance", default=os.environ.get("KVHOLD_INSTANCE", "default"))
    p.add_argument("--runtime-root", type=Path, default=None)
    p.add_argument("--token-file", type=Path, default=None)
    p.add_argument("--log-level", default=os.environ.get("KVHOLD_LOG_LEVEL", "INFO"))
    p.add_argument("--urgent", action="store_true", help="accepted for the sidecar's spawn; no effect on vLLM")
    args = p.parse_args(argv)
    setup_logging(args.log_level, role="executor")

    def factory(name, ctx):
        if name != "vllm":
            raise ValueError(f"python -m kvhold.vllm_bridge runs the vllm workload, not {name!r}")
        return VllmWorkload(ctx)

    cfg = ExecutorConfig(instance=args.instance, runtime_root=args.runtime_root, token_file=args.token_file,
                         urgent=args.urgent, workload_factory=factory)
    try:
        return ExecutorRuntime(cfg).run()
    except KeyboardInterrupt:
        return EXIT_OK
