"""A standalone group machinery, test and benchmark material: N rank processes joined by
torch.distributed (gloo), over state an owner process keeps, greedy only. The groups the
sidecar serves are kvhold.executor.tensor_parallel.ranks (docs/ARCHITECTURE.md,
"Tensor-parallel groups"); this one is kept for tools/bench_recovery_tp.py without
`--sidecar` and tests/process/test_tensor_parallel_takeover.py.

The owner (`GroupOwner`, the sidecar's part) writes into its state directory (on /dev/shm):
  rank{r}.safetensors   rank r's weight shard (`TpPlan.shard`)
  kv{r}.bin             rank r's KV region: its own KV heads' pages
  tables.bin            int64 [world, seqs, 1 + max_len]: per rank and sequence, the count of
                        tokens whose pages that rank has published (col 0) and the tokens
  lease.bin             int64 [1]: the group epoch that may publish; float64 beats [world]
A rank publishes a step in this order: its KV pages (written during the forward pass),
the new token, then its count. The group commit rule: a sequence's first
C = min over ranks of count tokens are committed; the pages of positions < C - 1 are
published on every rank. A rank checks the lease before it publishes: a rank of an older
epoch (a fenced group) exits without writing.

Takeover: when any rank of the active group exits or stops beating (a SIGSTOP, a peer
stuck in a collective), the owner SIGKILLs every rank of that group, raises the epoch and
tells the hot-standby group (ranks started, shard loaded, communicator initialised and
exercised by one all-reduce) to go. Its ranks validate (every rank's tokens agree over the
committed prefix, which starts with the prompt), agree on C by an all-reduce(MIN), and
continue each sequence from token C - 1 over their own KV pages. Nothing committed is
recomputed and nothing is lost; greedy decoding on fp32 CPU continues token for token.

    python -m kvhold.testing.tensor_parallel_group --state DIR --rank R --epoch E
"""
from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np

PAGE_TOKENS = 16
FENCED_EXIT = 3


@dataclass
class Meta:
    model: str
    world: int
    prompts: list[list[int]]
    max_new: int
    step_delay_s: float = 0.0

    @property
    def max_len(self) -> int:
        return max(len(p) for p in self.prompts) + self.max_new

    @property
    def pages_per_seq(self) -> int:
        return math.ceil(self.max_len / PAGE_TOKENS)


def _tables(state: Path, meta: Meta, mode: str = "r+"):
    shape = (meta.world, len(meta.prompts), 1 + meta.max_len)
    return np.memmap(state / "tables.bin", dtype=np.int64, mode=mode, shape=shape)


def _lease(state: Path, mode: str = "r+"):
    return np.memmap(state / "lease.bin", dtype=np.int64, mode=mode, shape=(1,))


def _beats(state: Path, meta: Meta, mode: str = "r+"):
    return np.memmap(state / "beats.bin", dtype=np.float64, mode=mode, shape=(meta.world,))


def committed(tables: np.ndarray) -> np.ndarray:
    """The group commit rule: per sequence, the tokens every rank has published."""
    return tables[:, :, 0].min(axis=0)


# ---------------------------------------------------------------- the rank process

def _rank_main(state: Path, rank: int, epoch: int) -> int:
    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    from kvhold.executor.kv_cache import TORCH_DTYPES, KvCache
    from kvhold.executor.llama import SeqSlice, StepInput
    from kvhold.executor.tensor_parallel.model import TensorParallelLlama
    from kvhold.executor.tensor_parallel.plan import TpPlan
    from kvhold.protocol.model_spec import ModelSpec

    torch.set_num_threads(1)
    meta = Meta(**json.loads((state / "meta.json").read_text()))
    dist.init_process_group("gloo", init_method=f"file://{state}/store-{epoch}", rank=rank,
                            world_size=meta.world, timeout=timedelta(seconds=3600))
    spec = ModelSpec.from_dir(meta.model)
    plan = TpPlan(spec, meta.world)
    model = TensorParallelLlama(plan, load_file(str(state / f"rank{rank}.safetensors")),
                                TORCH_DTYPES[spec.dtype], meta.max_len)
    geometry = plan.kv_geometry(spec.dtype, PAGE_TOKENS)
    num_pages = len(meta.prompts) * meta.pages_per_seq
    region = np.memmap(state / f"kv{rank}.bin", dtype=np.dtype(spec.dtype), mode="r+",
                       shape=(num_pages, *geometry.page_shape))
    kv = KvCache(torch.from_numpy(region), geometry)
    tables, lease, beats = _tables(state, meta), _lease(state), _beats(state, meta)
    warm = torch.ones(1)
    dist.all_reduce(warm)                      # the communicator is up and exercised
    print(f"ready {rank}", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 0
    if lease[0] != epoch:
        return FENCED_EXIT
    beats[rank] = time.time()

    # validate and agree on where to resume
    counts = committed(tables).copy()
    for s, prompt in enumerate(meta.prompts):
        c = int(counts[s])
        if c and (c <= len(prompt) or any(list(tables[r, s, 1:1 + len(prompt)]) != prompt
                                         for r in range(meta.world))):
            c = 0                              # not a valid prefix: start the sequence over
        for r in range(meta.world):
            if c and not np.array_equal(tables[r, s, 1:1 + c], tables[0, s, 1:1 + c]):
                c = 0
        counts[s] = c
    agreed = torch.from_numpy(counts.copy())
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    counts = agreed.numpy().copy()
    mine = tables[rank]
    tokens = []
    for s, prompt in enumerate(meta.prompts):
        c = int(counts[s])
        tokens.append(list(prompt) + [int(t) for t in mine[s, 1 + len(prompt):1 + c]] if c else list(prompt))
        mine[s, 0] = c
    pages = [torch.arange(s * meta.pages_per_seq, (s + 1) * meta.pages_per_seq) for s in range(len(meta.prompts))]

    while True:
        todo = [s for s, p in enumerate(meta.prompts) if len(tokens[s]) < len(p) + meta.max_new]
        if not todo:
            break
        ids, pos, seqs, fed = [], [], [], []
        for s in todo:
            c = int(mine[s, 0])
            new = tokens[s] if c == 0 else [tokens[s][-1]]
            first = 0 if c == 0 else len(tokens[s]) - 1
            seqs.append(SeqSlice(start=len(ids), n=len(new), context=first + len(new), pages=pages[s]))
            ids += new
            pos += range(first, first + len(new))
            fed.append(s)
        positions = torch.tensor(pos)
        page_of = torch.cat([pages[s][torch.arange(sl.context - sl.n, sl.context) // PAGE_TOKENS]
                             for s, sl in zip(fed, seqs)])
        step = StepInput(token_ids=torch.tensor(ids), positions=positions, write_pages=page_of,
                         write_slots=positions % PAGE_TOKENS, seqs=seqs,
                         logits_rows=torch.tensor([sl.start + sl.n - 1 for sl in seqs]))
        logits = model.forward(step, kv)
        nxt = logits.argmax(dim=-1).tolist()
        if lease[0] != epoch:
            return FENCED_EXIT
        for s, t in zip(fed, nxt):
            tokens[s].append(t)
            mine[s, len(tokens[s])] = t        # the token, then the count: publish
            mine[s, 0] = len(tokens[s])
        beats[rank] = time.time()
        if meta.step_delay_s:
            time.sleep(meta.step_delay_s)
    beats[rank] = time.time()
    return 0                                   # no closing collective: the owner ends the group


# ---------------------------------------------------------------- the owner

@dataclass
class Group:
    epoch: int
    procs: list[subprocess.Popen]
    ready: bool = False
    _seen: int = 0           # ranks whose "ready" line was read


@dataclass
class Takeover:
    detected_s: float        # fault -> detection (from `fault_at`, the caller's clock)
    resumed_s: float | None  # fault -> first token committed by the standby group
    reason: str


@dataclass
class GroupOwner:
    """Owns a group's state and runs groups over it: an active one and a hot standby."""
    state: Path
    meta: Meta
    hang_s: float = 5.0
    standby: bool = True
    groups: list[Group] = field(default_factory=list)
    takeovers: list[Takeover] = field(default_factory=list)

    @classmethod
    def create(cls, state: Path, model_dir: Path, world: int, prompts: list[list[int]], max_new: int,
               **kw) -> "GroupOwner":
        from safetensors.torch import load_file, save_file

        from kvhold.executor.tensor_parallel.plan import TpPlan
        from kvhold.protocol.model_spec import ModelSpec

        state.mkdir(parents=True, exist_ok=True)
        step_delay_s = kw.pop("step_delay_s", 0.0)
        meta = Meta(model=str(model_dir), world=world, prompts=[list(p) for p in prompts], max_new=max_new,
                    step_delay_s=step_delay_s)
        (state / "meta.json").write_text(json.dumps(meta.__dict__))
        spec = ModelSpec.from_dir(model_dir)
        plan = TpPlan(spec, world)
        weights = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            weights.update(load_file(str(f)))
        geometry = plan.kv_geometry(spec.dtype, PAGE_TOKENS)
        num_pages = len(prompts) * meta.pages_per_seq
        for r in range(world):
            save_file(plan.shard(weights, r), str(state / f"rank{r}.safetensors"))
            np.memmap(state / f"kv{r}.bin", dtype=np.dtype(spec.dtype), mode="w+",
                      shape=(num_pages, *geometry.page_shape)).flush()
        tables = _tables(state, meta, "w+")
        for r in range(world):
            for s, p in enumerate(meta.prompts):
                tables[r, s, 1:1 + len(p)] = p     # count 0: nothing published yet
        tables.flush()
        _lease(state, "w+").flush()
        _beats(state, meta, "w+").flush()
        return cls(state=state, meta=meta, **kw)

    def _spawn(self, epoch: int) -> Group:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable, "-m", "kvhold.testing.tensor_parallel_group",
                                   "--state", str(self.state), "--rank", str(r), "--epoch", str(epoch)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
                 for r in range(self.meta.world)]
        g = Group(epoch, procs)
        self.groups.append(g)
        return g

    @staticmethod
    def _wait_ready(g: Group, timeout: float = 300.0) -> None:
        if g.ready:
            return
        deadline = time.monotonic() + timeout
        for p in g.procs[g._seen:]:
            line = ""
            while not line.startswith("ready"):
                if time.monotonic() > deadline or p.poll() is not None:
                    raise RuntimeError(f"rank of group {g.epoch} did not get ready (exit {p.poll()})")
                r, _, _ = select.select([p.stdout], [], [], 0.1)
                if r:
                    line = p.stdout.readline()
        g.ready = True

    def standby_ready(self) -> bool:
        """Whether a standby group is kept and every rank of it is ready (does not block)."""
        g = getattr(self, "spare", None)
        if g is None:
            return False
        if not g.ready:
            for i, p in enumerate(g.procs):
                if i < g._seen:
                    continue
                r, _, _ = select.select([p.stdout], [], [], 0)
                if not r or not p.stdout.readline().startswith("ready"):
                    return False
                g._seen = i + 1
            g.ready = True
        return True

    def _activate(self, g: Group) -> None:
        self._wait_ready(g)
        lease = _lease(self.state)
        lease[0] = g.epoch                     # every older group is fenced from here on
        beats = _beats(self.state, self.meta)
        beats[:] = time.time()
        for p in g.procs:
            p.stdin.write("go\n")
            p.stdin.flush()

    @staticmethod
    def kill(g: Group) -> None:
        for p in g.procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
        for p in g.procs:
            p.wait()

    def committed(self) -> np.ndarray:
        return committed(_tables(self.state, self.meta, "r"))

    def run(self, on_tick=None, timeout_s: float = 300.0, standby_first: bool = False) -> list[list[int]]:
        """Run to completion through any faults; `on_tick(owner, active_group)` is called every
        poll (a test's or benchmark's fault injector). With `standby_first`, the first group starts
        once the standby group is ready too, so that a fault from the first token on finds a hot
        standby however long the ranks take to start. Returns each sequence's output tokens."""
        epoch = int(_lease(self.state)[0]) + 1
        active = self._spawn(epoch)
        self.spare = spare = self._spawn(epoch + 1) if self.standby else None
        if standby_first and spare is not None:
            self._wait_ready(spare)
        self._activate(active)
        beats = _beats(self.state, self.meta, "r")
        target = np.array([len(p) + self.meta.max_new for p in self.meta.prompts])
        deadline = time.monotonic() + timeout_s
        self.fault_at: float | None = None
        pending: tuple[float, float, str, np.ndarray] | None = None
        try:
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError("the tensor-parallel group did not finish")
                if on_tick is not None:
                    on_tick(self, active)
                codes = [p.poll() for p in active.procs]
                if all(c == 0 for c in codes) or (self.committed() >= target).all():
                    break                      # every token committed: the group's work is done
                now = time.time()
                why = None
                if any(c is not None and c != 0 for c in codes):
                    why = f"rank exit {codes}"
                elif (now - beats.min()) > self.hang_s and None in codes:
                    why = f"rank silent {now - beats.min():.2f}s"
                if pending is not None and (self.committed() > pending[3]).any():
                    fault, detected, reason, _ = pending
                    self.takeovers.append(Takeover(detected - fault, time.time() - fault, reason))
                    pending = None
                    if self.standby and spare is None:   # the next standby, once the group resumed
                        self.spare = spare = self._spawn(active.epoch + 1)
                if why is None:
                    time.sleep(0.002)
                    continue
                detected = time.time()
                self.kill(active)              # the whole group: peers stuck in a collective too
                if spare is None and not self.standby:
                    raise RuntimeError(f"group {active.epoch} failed ({why}) and no standby group is kept")
                if spare is None:                  # a fault before the standby was replaced: a cold one
                    spare = self._spawn(active.epoch + 1)
                before = self.committed().copy()
                if pending is not None:        # a fault before the previous takeover resumed
                    self.takeovers.append(Takeover(pending[1] - pending[0], None, pending[2]))
                fault = self.fault_at if self.fault_at is not None else detected
                self.fault_at = None
                active, spare = spare, None
                self.spare = None
                self._activate(active)
                pending = (fault, detected, why, before)
            if pending is not None:
                fault, detected, reason, _ = pending
                self.takeovers.append(Takeover(detected - fault, time.time() - fault, reason))
        finally:
            for g in self.groups:
                self.kill(g)
        tables = _tables(self.state, self.meta, "r")
        return [[int(t) for t in tables[0, s, 1 + len(p):1 + len(p) + self.meta.max_new]]
                for s, p in enumerate(self.meta.prompts)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="one rank of a tensor-parallel executor group")
    ap.add_argument("--state", type=Path, required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--epoch", type=int, required=True)
    a = ap.parse_args(argv)
    try:
        return _rank_main(a.state, a.rank, a.epoch)
    except RuntimeError as exc:                # a collective broken by a peer's death: the group is over
        print(f"rank {a.rank} of group {a.epoch}: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: gloo's threads, still connected to a peer that may be exiting at
    # the same moment, would abort the process (std::terminate) while it destroys them
    os._exit(code)
