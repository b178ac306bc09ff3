"""A pure-Python stand-in for the parts of TensorRT-LLM 1.2 that call kvhold's glue.

TensorRT-LLM cannot be installed on the machines this is tested on, so the glue
(kvhold.trtllm_bridge) is driven by this harness, which reproduces what TensorRT-LLM's own
code does around it: the modules it imports, the signatures it calls, and the order of the
calls in one executor iteration. Each behaviour names the upstream file and the commit of
NVIDIA/TensorRT-LLM it was read at (b35ac1b6 is the tree whose tensorrt_llm/version.py says
1.2.0rc2); nothing else of TensorRT-LLM is modelled.

* `fake_tensorrt_llm(layout)`: a `tensorrt_llm` package in `sys.modules` with the connector
  ABCs at the 1.2 path (tensorrt_llm/_torch/pyexecutor/kv_cache_connector.py, 00fdcbff) or the
  newer one (tensorrt_llm/_torch/pyexecutor/connectors/kv_cache_connector.py, 035ab91c), and the
  checkpoint loader bases (tensorrt_llm/_torch/models/checkpoints/, b35ac1b6).
* `call_load_weights`: `ModelLoader._call_load_weights` (model_loader.py, 004b733e): keywords
  passed only where `inspect.getfullargspec(load_method).args` names them.
* `ConnectorEngine`: one request's life through the KV cache manager and the executor loop.
  - connector construction as py_executor_creator.py does it (commit 000429d5: import
    `connector_module`, getattr the two class names, build each with `llm_args`; refuse any
    capacity scheduler but GUARANTEED_NO_EVICT), then `register_kv_caches(primary pool)`;
  - `addSequence` (cpp/tensorrt_llm/batch_manager/kvCacheManager.cpp, b35ac1b6): with block
    reuse, a radix-tree match of the prompt's full blocks (the last prompt token is never
    matched), then `get_num_new_matched_tokens(request, matched)`, then
    `setPrepopulatedPromptLen(matched + connector)` which requires it below the prompt length;
    without reuse the connector is not asked at all;
  - the scheduler output (kv_cache_connector.py, 00fdcbff: `KvCacheConnectorSchedulerOutputManager`):
    a context request's `computed_position` is its context position minus the tokens the
    connector matched this step, a generation request's `len(get_tokens(0)) - 1` with one
    scheduled token; `KvCacheConnectorManager.get_num_new_matched_tokens` raises when 0 tokens
    come back with async=True;
  - one iteration: `build_connector_meta`, `bind_connector_meta`, `start_load_kv`, per decoder
    layer `wait_for_layer_load` / `save_kv_layer` (the layer hooks of py_executor.py), then
    `wait_for_save`, `get_finished`, and `request_finished(request, block_ids)` at the end;
  - the overlap scheduler (on by default): the token sampled in one iteration reaches
    `get_tokens` only after the next iteration was scheduled, so `computed_position` lags
    one row behind the row that iteration writes.
  The engine's attention checks, before each layer runs, that every KV row a request depends
  on holds the right values, so a wrong load or a row claimed too early fails the test.
"""
from __future__ import annotations

import abc
import contextlib
import importlib
import inspect
import sys
import types
from dataclasses import dataclass, field

import torch

CONNECTOR_PATHS = {"1.2": "tensorrt_llm._torch.pyexecutor.kv_cache_connector",
                   "connectors": "tensorrt_llm._torch.pyexecutor.connectors.kv_cache_connector"}
GLUE = ("kvhold.trtllm_bridge.trtllm_connector", "kvhold.trtllm_bridge.trtllm_weights")


# ------------------------------------------------------------------ the modules the glue imports
class KvCacheConnectorWorker(abc.ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args
        self._metadata = None
        super().__init__()

    def bind_connector_meta(self, metadata):
        self._metadata = metadata

    def get_connector_meta(self):
        return self._metadata

    @abc.abstractmethod
    def register_kv_caches(self, kv_cache_tensor): ...

    @abc.abstractmethod
    def start_load_kv(self, stream): ...

    @abc.abstractmethod
    def wait_for_layer_load(self, layer_idx, stream): ...

    @abc.abstractmethod
    def save_kv_layer(self, layer_idx, stream): ...

    @abc.abstractmethod
    def wait_for_save(self, stream): ...

    @abc.abstractmethod
    def get_finished(self, finished_gen_req_ids, started_loading_req_ids): ...


class KvCacheConnectorScheduler(abc.ABC):
    def __init__(self, llm_args):
        self._llm_args = llm_args
        super().__init__()

    @abc.abstractmethod
    def build_connector_meta(self, scheduler_output): ...

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, request, num_computed_tokens): ...

    @abc.abstractmethod
    def request_finished(self, request, cache_block_ids): ...

    @abc.abstractmethod
    def update_state_after_alloc(self, request, block_ids): ...


class BaseWeightLoader(abc.ABC):
    @abc.abstractmethod
    def load_weights(self, checkpoint_dir, **kwargs): ...


class WeightMapper:
    def init_model_and_config(self, model, config):
        self.model, self.config = model, config


class HfCheckpointLoader:
    def __init__(self, *, weight_loader=None, weight_mapper=None, config_loader=None):
        self.weight_loader, self.weight_mapper, self.config_loader = weight_loader, weight_mapper, config_loader

    def load_weights(self, checkpoint_dir, **kwargs):
        return self.weight_loader.load_weights(checkpoint_dir, **kwargs)

    def get_initialized_weight_mapper(self, model, config):
        mapper = self.weight_mapper or WeightMapper()
        mapper.init_model_and_config(model, config)
        return mapper


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    m.__path__ = []                          # a package, so submodules resolve
    return m


@contextlib.contextmanager
def fake_tensorrt_llm(layout: str | None = "1.2"):
    """`tensorrt_llm` in sys.modules with the connector ABCs at `CONNECTOR_PATHS[layout]` (None:
    at neither), the glue modules reloaded against it; everything restored afterwards."""
    names = ["tensorrt_llm", "tensorrt_llm._torch", "tensorrt_llm._torch.pyexecutor",
             "tensorrt_llm._torch.pyexecutor.connectors", "tensorrt_llm._torch.models",
             "tensorrt_llm._torch.models.checkpoints", "tensorrt_llm._torch.models.checkpoints.hf"]
    mods = {n: _module(n) for n in names}
    mods["tensorrt_llm._torch.models.checkpoints.base_weight_loader"] = _module(
        "tensorrt_llm._torch.models.checkpoints.base_weight_loader", BaseWeightLoader=BaseWeightLoader)
    mods["tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader"] = _module(
        "tensorrt_llm._torch.models.checkpoints.hf.checkpoint_loader", HfCheckpointLoader=HfCheckpointLoader)
    if layout is not None:
        path = CONNECTOR_PATHS[layout]
        mods[path] = _module(path, KvCacheConnectorScheduler=KvCacheConnectorScheduler,
                             KvCacheConnectorWorker=KvCacheConnectorWorker)
    saved = {n: sys.modules.get(n) for n in [*mods, *CONNECTOR_PATHS.values(), *GLUE]}
    for n in CONNECTOR_PATHS.values():
        sys.modules.pop(n, None)
    sys.modules.update(mods)
    try:
        for g in GLUE:
            sys.modules.pop(g, None)
        yield {g: importlib.import_module(g) for g in GLUE}
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m
        for g in GLUE:                       # back to the modules as they import here
            sys.modules.pop(g, None)
            importlib.import_module(g)


def call_load_weights(load_method, weights, weight_mapper, allow_partial_loading: bool = False):
    """ModelLoader._call_load_weights (model_loader.py, 004b733e), as TensorRT-LLM does it."""
    args = inspect.getfullargspec(load_method).args
    kargs = {}
    if "weight_mapper" in args:
        kargs["weight_mapper"] = weight_mapper
    if "allow_partial_loading" in args:
        kargs["allow_partial_loading"] = allow_partial_loading
    else:
        assert allow_partial_loading is False, "allow_partial_loading is not supported for this model"
    load_method(weights, **kargs)


# ------------------------------------------------------------------ the executor around the connector
@dataclass
class RequestData:                           # kv_cache_connector.py, 00fdcbff
    request_id: int
    new_tokens: list
    new_block_ids: list
    computed_position: int
    num_scheduled_tokens: int


@dataclass
class SchedulerOutput:
    new_requests: list = field(default_factory=list)
    cached_requests: list = field(default_factory=list)


class Stream:
    def synchronize(self) -> None:           # the harness computes synchronously
        pass


@dataclass
class Request:
    request_id: int
    tokens: list                             # every token the request has (the device's view)
    prompt_len: int
    max_new: int
    py_client_id: int | None = None
    blocks: list = field(default_factory=list)
    context_position: int = 0
    visible: int = 0                         # tokens get_tokens(0) shows (lags under overlap)
    generated: int = 0
    sent_blocks: int = 0
    sent_tokens: int = 0
    new: bool = True

    def get_tokens(self, beam: int) -> list:
        return self.tokens[:self.visible]

    @property
    def in_context(self) -> bool:
        return self.context_position < self.prompt_len


def kv_row(tokens, pos: int, layers: int, heads: int, dim: int) -> torch.Tensor:
    """What attention writes for position `pos`: a function of the tokens up to it."""
    gen = torch.Generator().manual_seed(hash(tuple(tokens[:pos + 1])) & 0x7FFFFFFF)
    return torch.randn(layers, 2, heads, dim, generator=gen)


def next_token(tokens) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 997 + 1


class ConnectorEngine:
    """One TensorRT-LLM engine (PyTorch backend, TP=1) as the connector sees it."""

    def __init__(self, llm_kwargs: dict, *, num_layers: int, num_kv_heads: int, head_dim: int,
                 num_blocks: int = 64, overlap: bool = True, head_major: bool = True):
        kv = llm_kwargs["kv_cache_config"]
        self.block_tokens, self.reuse = kv["tokens_per_block"], bool(kv.get("enable_block_reuse", True))
        self.layers, self.heads, self.dim, self.overlap = num_layers, num_kv_heads, head_dim, overlap
        self.head_major = head_major
        self.pool = torch.zeros(num_blocks, num_layers, 2, self.block_tokens * num_kv_heads * head_dim)
        self.free = list(range(num_blocks))
        self.radix: dict[tuple, int] = {}    # token prefix of full blocks -> cached block
        self.requests: dict[int, Request] = {}
        self.waiting: list[Request] = []
        self.finished: dict[int, list] = {}
        self.external_loads: dict[int, int] = {}
        self.connector_asked = 0
        self.stream = Stream()
        policy = llm_kwargs.get("scheduler_config", {}).get("capacity_scheduler_policy", "GUARANTEED_NO_EVICT")
        if str(policy).rsplit(".", 1)[-1] != "GUARANTEED_NO_EVICT":   # py_executor_creator.py
            raise NotImplementedError("KV connector is only supported with guaranteed no evict scheduler policy.")
        cfg = llm_kwargs["kv_connector_config"]
        module = importlib.import_module(cfg["connector_module"])
        worker_cls = getattr(module, cfg["connector_worker_class"])
        scheduler_cls = getattr(module, cfg["connector_scheduler_class"])
        llm_args = types.SimpleNamespace(kv_cache_config=types.SimpleNamespace(**kv))
        self.worker, self.scheduler = worker_cls(llm_args), scheduler_cls(llm_args)
        self.worker.register_kv_caches(self.pool)

    # ---------------------------------------------------------------- device memory
    def _view(self):
        n, t, h, d = self.pool.shape[0], self.block_tokens, self.heads, self.dim
        inner = (h, t, d) if self.head_major else (t, h, d)
        return self.pool.view(n, self.layers, 2, *inner)

    def _write(self, req: Request, pos: int) -> None:
        row = kv_row(req.tokens, pos, self.layers, self.heads, self.dim)
        block, slot = req.blocks[pos // self.block_tokens], pos % self.block_tokens
        if self.head_major:
            self._view()[block, :, :, :, slot] = row
        else:
            self._view()[block, :, :, slot] = row

    def _read(self, req: Request, pos: int) -> torch.Tensor:
        block, slot = req.blocks[pos // self.block_tokens], pos % self.block_tokens
        v = self._view()[block]
        return v[:, :, :, slot] if self.head_major else v[:, :, slot]

    def _check_rows(self, req: Request, upto: int) -> None:
        """Attention reads rows [0, upto): each must hold what computing it would give."""
        for pos in range(upto):
            if not torch.equal(self._read(req, pos), kv_row(req.tokens, pos, self.layers, self.heads, self.dim)):
                raise AssertionError(f"request {req.request_id}: KV row {pos} is wrong when attention reads it")

    # ---------------------------------------------------------------- KV cache manager
    def add_request(self, request_id: int, tokens, max_new: int, client_id: int | None = None) -> None:
        self.waiting.append(Request(request_id, list(tokens), len(tokens), max_new, client_id,
                                    visible=len(tokens)))

    def _block(self) -> int:
        return self.free.pop(0)

    def _add_sequence(self, req: Request) -> None:
        bt = self.block_tokens
        num_blocks = -(-req.prompt_len // bt)
        matched = 0
        if self.reuse:                       # the block-reuse overload of addSequence
            usable = (req.prompt_len - 1) // bt          # the last prompt token is never matched
            for i in range(usable):
                hit = self.radix.get(tuple(req.tokens[:(i + 1) * bt]))
                if hit is None:
                    break
                req.blocks.append(hit)
                matched += bt
            req.blocks += [self._block() for _ in range(num_blocks - len(req.blocks))]
            self.connector_asked += 1
            num, load_async = self.scheduler.get_num_new_matched_tokens(req, matched)
            if num == 0 and load_async:
                raise RuntimeError("load_kv_async must be False when num_tokens is 0!")
            if load_async:
                raise NotImplementedError("the harness models synchronous loads only")
            self.external_loads[req.request_id] = num
            if not matched + num < req.prompt_len:       # setPrepopulatedPromptLen's TLLM_CHECK
                raise RuntimeError(f"prepopulatedPromptLen {matched + num} >= promptLen {req.prompt_len}")
            req.context_position = matched + num
        else:                                # the other overload: the connector is ignored
            req.blocks = [self._block() for _ in range(num_blocks)]
        self.scheduler.update_state_after_alloc(req, list(req.blocks))

    def _store_context_blocks(self, req: Request) -> None:
        bt = self.block_tokens
        for i in range((req.prompt_len - 1) // bt):
            self.radix.setdefault(tuple(req.tokens[:(i + 1) * bt]), req.blocks[i])

    # ---------------------------------------------------------------- one executor iteration
    def step(self) -> None:
        for req in self.waiting:
            self._add_sequence(req)
            self.requests[req.request_id] = req
        self.waiting = []
        if not self.requests:
            return
        out, work = SchedulerOutput(), []
        for req in self.requests.values():
            new_blocks = req.blocks[req.sent_blocks:]
            req.sent_blocks = len(req.blocks)
            if req.in_context:
                n = req.prompt_len - req.context_position          # no chunking
                data = RequestData(req.request_id, [], new_blocks,
                                   req.context_position - self.external_loads.pop(req.request_id, 0), n)
                work.append((req, range(req.context_position, req.prompt_len)))
            else:
                data = RequestData(req.request_id, [], new_blocks, req.visible - 1, 1)
                work.append((req, range(len(req.tokens) - 1, len(req.tokens))))
            (out.new_requests if req.new else out.cached_requests).append(data)
            req.new = False
        self.external_loads = {}
        self.worker.bind_connector_meta(self.scheduler.build_connector_meta(out))
        self.worker.start_load_kv(self.stream)
        for layer in range(self.layers):
            self.worker.wait_for_layer_load(layer, self.stream)
            if layer == 0:
                for req, rows in work:
                    self._check_rows(req, rows.start)
                    for pos in rows:
                        self._write(req, pos)
            self.worker.save_kv_layer(layer, self.stream)
        self.worker.wait_for_save(self.stream)
        self.worker.get_finished([], [])
        for req, rows in work:
            if req.in_context:
                req.context_position = req.prompt_len
                if self.reuse:
                    self._store_context_blocks(req)
            self._sample(req)

    def _sample(self, req: Request) -> None:
        req.tokens.append(next_token(req.tokens))
        req.generated += 1
        if (len(req.tokens) - 1) % self.block_tokens == 0:
            req.blocks.append(self._block())
        # the token reaches get_tokens now, or (overlap) after the next iteration is scheduled
        req.visible = len(req.tokens) - (1 if self.overlap else 0)
        if req.generated >= req.max_new:
            self.scheduler.request_finished(req, list(req.blocks))
            del self.requests[req.request_id]
            self.finished[req.request_id] = req.tokens[req.prompt_len:]

    def run(self, max_steps: int = 1000) -> dict:
        for _ in range(max_steps):
            if not self.requests and not self.waiting:
                break
            self.step()
        return self.finished
