"""Helpers shared by the unit tests and the process tests that build on them: durable journal
records (valid, poisoned, or any JSON in any field), tiny checkpoints as transformers writes
them, and the sidecar's shared memory (tables and a KV region) made in process. torch and
transformers are imported only where they are used."""
from __future__ import annotations

import contextlib
import functools

from hypothesis import strategies as st

from kvhold.sidecar.durable_journal import encode_record

# ---------------------------------------------------------------- durable journal records
FINGERPRINT = "f" * 64
GENERATION = 3          # the new pool's; records come from generation 2

ints = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64]))


def valid_record(rid: int, fingerprint: str = FINGERPRINT) -> dict:
    return {"request_id": rid, "generation": rid >> 40, "client": (b"u" + bytes(16)).hex(),
            "prompt_ids": [1, 2, 3], "prefix": 0, "generated": [5, 6], "max_tokens": 8,
            "seed": 42, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop_ids": [3], "ignore_eos": False,
            "admitted_unix_ns": 1, "fingerprint": fingerprint, "cancelled": False, "state": "drained"}


json_values = st.recursive(
    st.none() | st.booleans() | ints | st.floats() | st.text(max_size=12) | st.sampled_from(["", "zz", "0a", "u"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12)
FIELDS = list(valid_record(1))


@st.composite
def records(draw, rid: int, fingerprint: str = FINGERPRINT) -> dict:
    """A record of request `rid` in which any fields hold any JSON value or are missing."""
    body = valid_record(rid, fingerprint)
    for key in draw(st.lists(st.sampled_from(FIELDS), min_size=1, max_size=4, unique=True)):
        if draw(st.booleans()):
            body.pop(key)
        else:
            body[key] = draw(json_values)
    return body


def write_record(directory, name_id: int, body: dict) -> None:
    (directory / f"req-{name_id:016x}.json").write_bytes(encode_record(body))


POISON = [   # (field, value, what the reason names): each once stopped every start
    ("top_k", 2**31, "top_k"), ("temperature", "hot", "temperature"), ("client", "not-hex", "client"),
    ("seed", -1, "seed"), ("max_tokens", -5, "max_tokens"), ("stop_ids", list(range(9)), "stop_token_ids"),
    ("prompt_ids", [1, 2**64], "token id"), ("generated", list(range(9)), "max_tokens"),
    ("request_id", (GENERATION << 40) | 1, "generation"),
]


# ---------------------------------------------------------------- transformers checkpoints
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
            rope_theta=10000.0)


def randomize(model, seed):
    """Weights large enough that the greedy tokens vary (transformers' init is nearly uniform);
    Gemma multiplies its embeddings by sqrt(hidden_size), so they are drawn that much smaller
    (else the tied head predicts the last token again and again)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    embed = model.config.hidden_size ** -0.5 if model.config.model_type.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif p.dim() == 1:
                p.copy_(0.2 * noise)
            else:
                p.copy_(noise * (embed if "embed" in name else p.shape[-1] ** -0.5 * 1.5))


def build_checkpoint(path, tokenizer, config_cls, model_cls, seed=0, shard=None, **cfg):
    """A tiny random model of `model_cls` saved by transformers in `path`; returned in float64."""
    import torch

    tok = tokenizer
    ids = dict(bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
               pad_token_id=None)
    config = config_cls(**{**TINY, "vocab_size": tok.get_vocab_size(), **ids, **cfg})
    torch.manual_seed(seed)
    model = model_cls(config)
    randomize(model, seed)
    model.save_pretrained(path, **({"max_shard_size": shard} if shard else {}))
    return model.double().eval()


def hf_greedy(model, prompt, n):
    import torch

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


CASES = {
    "llama": (lambda t: (t.LlamaConfig, t.LlamaForCausalLM), {}),
    "llama-tied-sharded": (lambda t: (t.LlamaConfig, t.LlamaForCausalLM),
                           dict(tie_word_embeddings=True, shard="60KB", seed=4)),  # seed: tokens vary
    "qwen2": (lambda t: (t.Qwen2Config, t.Qwen2ForCausalLM), {}),
    "qwen3": (lambda t: (t.Qwen3Config, t.Qwen3ForCausalLM), {}),
    "phi3": (lambda t: (t.Phi3Config, t.Phi3ForCausalLM), {}),
    # Gemma 2's defaults: attention scores capped at 50, logits at 30, sliding/global alternating
    "gemma2": (lambda t: (t.Gemma2Config, t.Gemma2ForCausalLM), dict(query_pre_attn_scalar=24)),
    # Gemma 3: q/k norms, one sliding then one global layer with their own RoPE bases, capped logits
    "gemma3_text": (lambda t: (t.Gemma3TextConfig, t.Gemma3ForCausalLM),
                    dict(layer_types=["sliding_attention", "full_attention"], final_logit_softcapping=8.0,
                         rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                          "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                             "rope_theta": 1_000_000.0}})),
}


# ---------------------------------------------------------------- the sidecar's shared memory
def mirror_geometry():
    """The pool of the KV mirror tests (kvhold.executor.kv_mirror and the vLLM connector)."""
    from kvhold.protocol.layout import KvGeometry, TableGeometry

    kv = KvGeometry(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", page_tokens=4)
    return TableGeometry(kv=kv, num_pages=256, num_slots=4, max_seq_len=64, num_leases=2)


class ShmPool:
    """Tables and a host KV region of `geometry`, named per test and created as the sidecar
    creates them; `kv` is the region as the engine's page pool, `words` as numpy words."""

    def __init__(self, geometry, generation: int = 1):
        import os
        import random

        from kvhold.protocol.memory import HostRegion
        from kvhold.protocol.tables import Tables

        tag = f"{os.getpid()}-{random.getrandbits(30)}"
        self.geometry = geometry
        self.tables_name = f"/kvhold-test-tables-{tag}"
        self.kv_name = f"/kvhold-test-kv-{tag}"
        self.tables = Tables.create(self.tables_name, geometry, generation)
        self.region = HostRegion(self.kv_name, "kv", geometry.kv_pool_bytes)
        self._mapping = self.region.map_local()

    @functools.cached_property
    def kv(self):
        from kvhold.executor.kv_cache import KvCache

        return KvCache.from_mapping(self._mapping, self.geometry.kv, self.geometry.num_pages).pool

    def words(self, dtype):
        """The region as [page, layer, K/V, token, word] of `dtype` words."""
        import numpy as np

        kv = self.geometry.kv
        size = np.dtype(dtype).itemsize
        return self._mapping.numpy(dtype, (self.geometry.num_pages, kv.num_layers, 2, kv.page_tokens,
                                           kv.row_bytes // size))

    def lease(self, slot: int):
        """Grant `slot` a fresh epoch (what the sidecar does on attach / promote)."""
        from kvhold.protocol.leases import Lease

        self.tables.leases["epoch"][slot] = self.tables.next_epoch()
        return Lease(self.tables, slot, int(self.tables.leases["epoch"][slot]))

    def close(self):
        self.tables.unlink()
        self.region.unlink()


# ---------------------------------------------------------------- engines in one process
ENGINE_PAGE_TOKENS = 16
ENGINE_MAX_SEQ = 128


def float64_model(checkpoint, max_seq: int = ENGINE_MAX_SEQ):
    """The checkpoint's model on CPU in float64, as an executor computes it there."""
    import torch
    from safetensors.torch import load_file

    from kvhold.executor.llama import LlamaModel
    from kvhold.protocol.model_spec import ModelSpec

    spec = ModelSpec.from_dir(checkpoint)
    weights = {}
    for f in sorted(checkpoint.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    weights = {k: v.to(torch.float64) for k, v in weights.items()}
    return LlamaModel(spec, weights, torch.float64, torch.device("cpu"), max_seq)


class EnginePool:
    """One tables segment and one KV pool, as a sidecar would own them, for engines run in this
    process: `engine()` leases the next slot (what attach does), `fence` replaces an epoch."""

    def __init__(self, model, num_pages: int, num_slots: int = 16, grammars=None):
        import os
        import time

        from kvhold.executor.kv_cache import KvCache
        from kvhold.protocol.layout import KvGeometry, TableGeometry
        from kvhold.protocol.leases import LeaseTable
        from kvhold.protocol.tables import Tables

        spec = model.spec
        geometry = TableGeometry(kv=KvGeometry(spec.num_layers, spec.num_kv_heads, spec.head_dim, "float64",
                                               ENGINE_PAGE_TOKENS),
                                 num_pages=num_pages, num_slots=num_slots, max_seq_len=ENGINE_MAX_SEQ,
                                 num_leases=4, max_extra_bytes=64 * 1024)
        self.tables = Tables.create(f"/kvhold-test-inproc-{os.getpid()}-{time.monotonic_ns()}", geometry, 1)
        self.kv = KvCache.private(geometry.kv, num_pages)
        self.leases = LeaseTable(self.tables)
        self.model = model
        self.grammars = grammars      # structured output (kvhold.executor.grammar.Grammars)
        self.slot = 0

    def engine(self, max_batch: int = 8, max_batch_tokens: int = 64, prefill_chunk: int = 32,
               prefix_salt: bytes | None = None):
        import os

        from kvhold.executor.engine import Engine
        from kvhold.protocol.leases import Lease

        slot, self.slot = self.slot, self.slot + 1
        lease = Lease(self.tables, slot, self.leases.grant(slot, os.getpid()))
        engine = Engine(self.model, self.kv, self.tables, lease, max_batch, max_batch_tokens,
                        prefill_chunk=prefill_chunk, prefix_salt=prefix_salt)
        engine.grammars = self.grammars
        return engine

    def started(self, requests, **kw):
        """A first engine on the pool (empty journal) and the requests admitted (their ids)."""
        from tools.bench_engine_setup import admit

        engine = self.engine(**kw)
        engine.take_over([], 0)
        return engine, admit(self.tables, requests)

    def fence(self, engine) -> int:
        return self.leases.fence(engine.lease.slot)

    def finish_after_takeover(self, dead, ids: list[int]) -> list[list[int]]:
        """`dead` abandoned (its lease fenced), a new engine takes over and runs the requests to
        their end: their tokens."""
        epoch = self.fence(dead)
        survivor = self.engine()
        survivor.take_over([epoch], 0)
        run_to_end(survivor)
        return self.outputs(ids)

    def outputs(self, ids: list[int]) -> list[list[int]]:
        from kvhold.protocol.journal import Journal
        from kvhold.protocol.layout import ExecState

        journal = Journal(self.tables)
        req = self.tables.requests
        out = []
        for rid in ids:
            slot = int((req["request_id"] == rid).nonzero()[0][0])
            e = journal.entry(slot)
            assert e.exec_state == ExecState.FINISHED
            out.append(journal.generated(slot, 0, e.num_generated))
        return out

    def close(self):
        self.tables.unlink()


def outputs_alone(model, requests, num_pages: int = 96, grammars=None) -> list[list[int]]:
    """The requests' tokens run to their end by one engine on a pool of their own."""
    pool = EnginePool(model, num_pages, grammars=grammars)
    try:
        engine, ids = pool.started(requests)
        run_to_end(engine)
        return pool.outputs(ids)
    finally:
        pool.close()


def decode_until(engine, generated: int) -> None:
    """Step until every request has decoded `generated` tokens."""
    while not engine.seqs or not all(s.num_generated >= generated for s in engine.seqs.values()):
        engine.step()


def run_to_end(engine, limit: int = 500) -> None:
    for _ in range(limit):
        if not engine.has_work:
            return
        engine.step()
    raise AssertionError("the engine did not finish its requests")


@contextlib.contextmanager
def uvicorn_in_a_thread(app, **options):
    """`app` served by a real uvicorn on a free loopback port, on a thread of this process:
    yields the port; stopped at the end."""
    import socket
    import threading
    import time

    import uvicorn

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", **options))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)
