"""The sidecar with its frontend in process (`kvhold sidecar` without --external-frontend): the
memory owner (kvhold.sidecar.daemon.Sidecar) with the client side mixed in: the client sockets
and their peers (kvhold.frontend.client_side), admission and streams (kvhold.frontend.frontend),
restored streams (kvhold.frontend.restore) and the pool restart's client half."""
from __future__ import annotations

from kvhold.frontend.client_side import ClientSide
from kvhold.frontend.frontend import Frontend, tokenizer_top_id
from kvhold.frontend.restore import Restore
from kvhold.protocol import messages as m
from kvhold.protocol.settings import UNSUPPORTED_SAMPLING
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.daemon import Sidecar
from kvhold.sidecar.pool_restart import PoolRestart


class InlineSidecar(ClientSide, Sidecar):
    def __init__(self, config: SidecarConfig):
        super().__init__(config, external_frontend=False)

    def prepare(self) -> None:
        """The owner's preparation, and the tokenizer (a spare does this ahead)."""
        super().prepare()
        if self.config.pool.model is not None:
            tokenizer_top_id(str(self.config.pool.model))      # loads the tokenizer and reads its vocabulary

    def _make_request_components(self, fingerprint: str) -> None:
        cfg = self.config
        self.frontend = Frontend(self.tables, self.spec, cfg.pool.model,
                                 runs_model=cfg.executors.workload in ("engine", "vllm"), durable=self.durable,
                                 fingerprint=fingerprint, timeline=self.timeline, host=self,
                                 max_prompt_bytes=cfg.pool.max_prompt_bytes,
                                 unsupported=UNSUPPORTED_SAMPLING.get(cfg.executors.workload, ()))
        self.pool_restart = PoolRestart(self.frontend, self.durable, self.paths,
                                        generation=self.tables.generation, send_client=self.send_client)
        self.restore = Restore(self.frontend, self.durable, fingerprint=fingerprint,
                               vocab_size=self.spec.vocab_size if self.spec else 0,
                               generation=self.tables.generation, started_ns=self.started_ns,
                               send_client=self.send_client,
                               unclaimed_cancel_s=cfg.journal.unclaimed_cancel_s)
        self.frontend.restored = self.restore
        self.frontend.add_handler(m.PoolRestart, self.pool_restart.on_request)
        self.frontend.add_handler(m.Resume, self.restore.on_resume)
