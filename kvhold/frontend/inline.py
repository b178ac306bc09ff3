"""The sidecar with its frontend in process (`kvhold sidecar` without --external-frontend): the
memory owner (kvhold.sidecar.daemon.Sidecar) and the same frontend a frontend process runs
(kvhold.frontend.process.FrontendProcess), over an in-process link (vLLM's in-process client
pattern): the owner's end is kvhold.sidecar.frontend_link.InprocFrontendLink, the frontend's an
`InprocPort`; the typed link messages pass by direct calls, never encoded. One process, one
poll loop, one thread: the frontend's client sockets are on the owner's loop, and each loop
turn runs the owner's work, then the frontend's. The owner has one code path for both modes.

The frontend shares the owner's tables, durable journal, recovery timeline and checkpoint
description (`OwnerShared`); it re-admits the durable journal's requests itself, before any
executor runs (with a re-adopted pool, those not in its journal), and the tokenizer is loaded
in `prepare` (ahead, in a spare)."""
from __future__ import annotations

from kvhold.frontend.frontend import tokenizer_top_id
from kvhold.frontend.process import FrontendProcess, InprocPort, OwnerShared
from kvhold.sidecar.config import SidecarConfig
from kvhold.sidecar.daemon import Sidecar
from kvhold.sidecar.frontend_link import FrontendEnd, InprocFrontendLink


class InlineSidecar(Sidecar):
    link_class = InprocFrontendLink

    def __init__(self, config: SidecarConfig):
        super().__init__(config)
        self.frontend_process: FrontendProcess | None = None

    def prepare(self) -> None:
        """The owner's preparation, and the tokenizer (a spare does this ahead)."""
        super().prepare()
        if self.config.pool.model is not None:
            tokenizer_top_id(str(self.config.pool.model))      # loads the tokenizer and reads its vocabulary

    def _make_link(self) -> FrontendEnd:
        link = InprocFrontendLink(self.tables, wake=self.wake_executor, status=self.status)
        shared = OwnerShared(loop=self.loop, tables=self.tables, durable=self.durable, timeline=self.timeline,
                             spec=self.spec, started_ns=self.started_ns,
                             fingerprint=self.manifest.fingerprint if self.manifest is not None else "")
        self.frontend_process = link.peer = FrontendProcess(self.config, owner=InprocPort(link), shared=shared)
        return link
