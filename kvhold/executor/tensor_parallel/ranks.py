"""Tensor parallelism under the sidecar: an executor is the leader (rank 0) of a group of N
rank processes (docs/ARCHITECTURE.md, "Tensor-parallel groups", "Served by the sidecar").

The leader is an ordinary executor (attach, lease, engine, scheduler, sampler, commit
protocol, takeover); only its model differs: `LeaderModel` sends each step's input to the
followers (ranks 1..N-1) over a pipe and runs rank 0's shard, the all-reduces after
o_proj and down_proj joining the ranks (gloo). The followers are the leader's children:
`start_followers` fetches the region descriptors from the sidecar again and hands each
follower the KV pool's and the weights' (inherited fds), so every rank maps the sidecar's
own memory. The ranks meet through a FileStore in the instance's runtime directory and
connect gloo's pairs on the loopback interface. A follower runs its shard's layers over its KV heads and computes no logits.

KV layout: the pool keeps the N = 1 layout `[page][layer][k/v][token][kv_head][head_dim]`;
rank r reads and writes only its heads `[r*H/N, (r+1)*H/N)` of every page (`rank_kv`).
A page therefore holds every rank's KV for its tokens, its checksum (computed by the
leader over the whole page) covers every rank's bytes, and a takeover validates and
repairs (copies tail pages) every rank's KV with the N = 1 code.

Commit across the group: each layer writes its KV before its o_proj all-reduce, so once
the leader has the step's logits (after the last layer's down_proj all-reduce) every rank
has written that step's KV; the leader's commit protocol publishes pages, then tokens,
exactly as at N = 1.

Failure: a follower sets PR_SET_PDEATHSIG (SIGKILL), so the group dies with its leader
(the supervisor SIGKILLs a fenced or hung leader; a follower stopped with SIGSTOP or stuck
in a collective dies too). The leader watches its followers' pidfds from a thread and
exits at once when one dies, before it could publish anything of a step that rank did not
finish: SIGKILLed itself if the rank was killed from outside (SIGKILL, SIGTERM), with code
FOLLOWER_DIED_EXIT otherwise (a crash: it counts against the requests of the step, section 8). The leader reports its followers' pids in `Ready` and the
supervisor watches and kills them as well (kvhold.sidecar.supervisor: a rank's death fences
the group; a fence that kills or loses the leader SIGKILLs every rank). The supervisor then
promotes the standby, itself a leader whose followers are started and mapped, and whose
communicator is initialised and exercised by the warm-up.

    python -m kvhold.executor.tensor_parallel.ranks   (a follower: its config on stdin)
"""
from __future__ import annotations

import ctypes
import logging
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
from datetime import timedelta

import numpy as np
import torch

from kvhold.executor import host_compute
from kvhold.executor.kv_cache import TORCH_DTYPES, KvCache
from kvhold.executor.llama import SeqSlice, StepInput
from kvhold.executor.tensor_parallel.model import TensorParallelLlama
from kvhold.executor.tensor_parallel.plan import TpPlan
from kvhold.protocol.tensor_parallel import FOLLOWER_MODULE, follower_pids

log = logging.getLogger(__name__)
FOLLOWER_DIED_EXIT = 71


def group_pids(leader: int) -> list[int]:
    """The leader (rank 0) and its follower ranks (its children running this module), in rank
    order, as /proc shows them: for tests and tools, independently of what the sidecar reports."""
    return [leader, *follower_pids(leader)]


GLOO_TIMEOUT = timedelta(seconds=600)   # a rank stuck longer is a hang: the supervisor kills first
_HEADER = struct.Struct("<I")


def rank_kv(kv: KvCache, plan: TpPlan, rank: int) -> KvCache:
    """Rank `rank`'s view of a pool in the whole model's layout: its KV heads of every page."""
    per = plan.spec.num_kv_heads // plan.size
    geometry = plan.kv_geometry(kv.geometry.dtype, kv.geometry.page_tokens)
    return KvCache(kv.pool[:, :, :, :, rank * per:(rank + 1) * per, :], geometry)


def _step_message(step: StepInput, scratch: bool) -> bytes:
    body = pickle.dumps((scratch, step.token_ids.numpy(), step.positions.numpy(), step.write_pages.numpy(),
                         step.write_slots.numpy(),
                         [(s.start, s.n, s.context, s.pages.numpy()) for s in step.seqs]),
                        protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(body)) + body


def _read_exact(f, n: int) -> bytes | None:
    data = f.read(n)
    return data if data is not None and len(data) == n else None


class LeaderModel(TensorParallelLlama):
    """Rank 0's model: each forward first sends the step to the followers, then runs rank 0's
    shard; logits are computed here only. `kv` is the whole pool (the engine's), or a private
    warm-up pool (the followers then use a private one of theirs)."""

    def __init__(self, plan: TpPlan, shard, compute_dtype, max_positions: int, group: "FollowerGroup",
                 shared_pool: torch.Tensor):
        super().__init__(plan, shard, compute_dtype, max_positions)
        self.ranks = group             # (LlamaModel's `group` is the query heads per KV head)
        self.shared_pool = shared_pool

    store_path = None

    def forward(self, step: StepInput, kv: KvCache) -> torch.Tensor:
        self.ranks.send(_step_message(step, scratch=kv.pool.data_ptr() != self.shared_pool.data_ptr()))
        logits = super().forward(step, rank_kv(kv, self.plan, 0))
        if self.store_path is not None:       # every rank has joined and run a step: the rendezvous is over
            self.store_path.unlink(missing_ok=True)
            self.store_path = None
        return logits


class FollowerGroup:
    """The leader's side of its followers: their processes, pipes and the pidfd watch."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs = procs
        self.pidfds = [os.pidfd_open(p.pid) for p in procs]
        threading.Thread(target=self._watch, name="tp-ranks", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def send(self, message: bytes) -> None:
        for p in self.procs:
            p.stdin.write(message)
            p.stdin.flush()

    def _watch(self) -> None:
        ready, _, _ = select.select(self.pidfds, [], [])
        rank = 1 + self.pidfds.index(ready[0])
        # how it died, left unreaped (WNOWAIT): the sidecar reads the same status from its zombie
        info = os.waitid(os.P_PIDFD, ready[0], os.WEXITED | os.WNOWAIT)
        outside = info.si_code == os.CLD_KILLED and info.si_status in (signal.SIGKILL, signal.SIGTERM)
        # the group is over: exit before anything of a step this rank did not finish is published
        log.error("rank %d of the tensor-parallel group (pid %d) died (%s %d); the group's leader exits",
                  rank, self.procs[rank - 1].pid, "signal" if info.si_code != os.CLD_EXITED else "code",
                  info.si_status)
        logging.shutdown()
        if outside:     # killed from outside: so is the group, which is how the sidecar counts the death
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(FOLLOWER_DIED_EXIT)


def start_group(ctx, spec, weights: dict[str, torch.Tensor], compute_dtype: str, kv: KvCache,
                max_positions: int) -> LeaderModel:
    """Start ranks 1..N-1 over the sidecar's regions, join them as rank 0, and return rank 0's model."""
    import torch.distributed as dist

    from kvhold.protocol.memory import RegionInfo

    s = ctx.settings
    world = s.tensor_parallel_size
    plan = TpPlan(spec, world)
    # --cpu-threads per rank; by default the N ranks share half the cores, as one executor does
    threads = s.cpu_threads or max(1, (os.cpu_count() or 2) // (2 * world))
    host_compute.setup(threads)
    # the rendezvous: a file in the instance's 0700 runtime directory (a TCPStore would listen on
    # every interface), removed once the warm-up step has run through every rank; gloo's pairs
    # on the loopback interface only, not the address the host name resolves to
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store_path = ctx.channel.paths.runtime_dir / f"tp-{os.getpid()}-{ctx.epoch}.store"
    store_path.unlink(missing_ok=True)
    fds = ctx.channel.fetch_fds(ctx.attached)
    infos = {d["name"]: RegionInfo.from_wire(d) for d in ctx.attached.regions}
    procs = []
    try:
        for rank in range(1, world):
            config = dict(rank=rank, world=world, store=str(store_path), leader_pid=os.getpid(), model=s.model,
                          compute_dtype=compute_dtype, kv_geometry=kv.geometry, num_pages=kv.num_pages,
                          max_positions=max_positions, cpu_threads=threads,
                          kv_fd=fds["kv"], kv_info=infos["kv"],
                          weights_fd=fds["weights"], weights_info=infos["weights"].with_access(True),
                          manifest=ctx.attached.weights["manifest"])
            env = dict(os.environ, OMP_NUM_THREADS=str(threads))
            p = subprocess.Popen([sys.executable, "-m", FOLLOWER_MODULE],
                                 stdin=subprocess.PIPE, pass_fds=(fds["kv"], fds["weights"]), env=env)
            body = pickle.dumps(config, protocol=pickle.HIGHEST_PROTOCOL)
            p.stdin.write(_HEADER.pack(len(body)) + body)
            p.stdin.flush()
            procs.append(p)
    finally:
        for fd in fds.values():
            os.close(fd)
    dist.init_process_group("gloo", store=dist.FileStore(str(store_path), world), rank=0, world_size=world,
                            timeout=GLOO_TIMEOUT)
    group = FollowerGroup(procs)
    log.info("tensor-parallel group of %d ranks: followers %s", world, group.pids)
    model = LeaderModel(plan, plan.shard(weights, 0), TORCH_DTYPES[compute_dtype], max_positions, group, kv.pool)
    model.store_path = store_path
    return model


# ---------------------------------------------------------------- the follower process

def _follower(f) -> int:
    import torch.distributed as dist

    from kvhold.executor.weights import WeightsRegion
    from kvhold.protocol.checkpoint import Manifest
    from kvhold.protocol.memory import map_region
    from kvhold.protocol.model_spec import ModelSpec

    header = _read_exact(f, _HEADER.size)
    if header is None:
        return 0
    c = pickle.loads(_read_exact(f, _HEADER.unpack(header)[0]))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)             # PR_SET_PDEATHSIG: the group dies with its leader
    if os.getppid() != c["leader_pid"]:
        return 1                              # the leader died before the prctl
    host_compute.setup(c["cpu_threads"])
    rank, world = c["rank"], c["world"]
    spec = ModelSpec.from_dir(c["model"])
    plan = TpPlan(spec, world)
    weights = WeightsRegion(map_region(c["weights_fd"], c["weights_info"]), Manifest.from_wire(c["manifest"]),
                            c["model"]).tensors()
    dtype = TORCH_DTYPES[c["compute_dtype"]]
    model = TensorParallelLlama(plan, plan.shard(weights, rank), dtype, c["max_positions"])
    del weights
    geometry = c["kv_geometry"]
    shared = KvCache.from_mapping(map_region(c["kv_fd"], c["kv_info"]), geometry, c["num_pages"])
    os.close(c["kv_fd"])
    os.close(c["weights_fd"])
    mine, scratch = rank_kv(shared, plan, rank), rank_kv(KvCache.private(geometry, 1), plan, rank)
    dist.init_process_group("gloo", store=dist.FileStore(c["store"], world), rank=rank, world_size=world,
                            timeout=GLOO_TIMEOUT)
    while (header := _read_exact(f, _HEADER.size)) is not None:
        is_scratch, ids, positions, pages, slots, seqs = pickle.loads(_read_exact(f, _HEADER.unpack(header)[0]))
        kv = scratch if is_scratch else mine
        step = StepInput(token_ids=torch.from_numpy(ids), positions=torch.from_numpy(positions),
                         write_pages=torch.from_numpy(pages), write_slots=torch.from_numpy(slots),
                         seqs=[SeqSlice(a, n, ctx_len, torch.from_numpy(np.asarray(p))) for a, n, ctx_len, p in seqs],
                         logits_rows=torch.zeros(0, dtype=torch.long))
        with torch.inference_mode():          # the layers only: logits are the leader's
            model.layers(step.token_ids, step.positions, step.write_pages, step.write_slots, kv,
                         lambda layer, q, step=step, kv=kv: model._attention(layer, q, step, kv))
    return 0                                   # the leader closed the pipe


def main() -> int:
    try:
        return _follower(sys.stdin.buffer)
    except RuntimeError as exc:                # a collective broken by a peer's death: the group is over
        print(f"tensor-parallel follower: {str(exc).splitlines()[0][:300]}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
