"""A Triton kernel compiled inside a serving step, and the lease it needs meanwhile.

A standby's warm-up (and the zygote's ahead-of-time preparation) launches every kernel a step
can launch (kvhold.executor.cuda.runner, kvhold.executor.cuda.triton_aot). A kernel it missed
compiles in the step that first launches it: about a second (milliseconds if Triton's disk
cache has it), longer than an active executor's lease. The sidecar would fence the executor
as hung, and a hang counts against the requests in the step (kvhold.sidecar.request_deaths):
a request that reaches the same kernel alone in the successor, which compiles it again,
would be failed at its second death although nothing is wrong with it.

So while a kernel compiles in an active executor, `CompileWatch` takes its lease off the
steady rate (clears `LeaseFlag.WARM`: the sidecar then allows FIRST_STEP_GRACE leases, as
for a first step), beats before and after, and logs a warning naming the kernel, so that the
warm-up can be made to cover it. Triton calls `knobs.runtime.jit_cache_hook` before every
compile and `jit_post_compile_hook` after it; hooks set before are called too. Without
Triton (a CPU-only install) there is nothing to watch.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)


class CompileWatch:
    """Hooks Triton's compiles for an executor's `lease` (kvhold.protocol.leases.Lease)."""

    def __init__(self, lease):
        self.lease = lease
        self.compiles = 0                 # compiles seen while installed
        self._depth = 0
        self._rewarm = False              # the lease was warm when the outermost compile began
        self._started = 0.0
        self._knobs = self._before = None

    def install(self) -> bool:
        """Set the hooks (keeping any set before); False where Triton has none."""
        try:
            from triton import knobs
            runtime = knobs.runtime
            before = (runtime.jit_cache_hook, runtime.jit_post_compile_hook)
        except (ImportError, AttributeError):
            return False
        self._knobs, self._before = runtime, before
        runtime.jit_cache_hook = self._compile_starts
        runtime.jit_post_compile_hook = self._compile_done
        return True

    def uninstall(self) -> None:
        if self._knobs is not None:
            self._knobs.jit_cache_hook, self._knobs.jit_post_compile_hook = self._before
            self._knobs = None

    def _compile_starts(self, **kw):
        skip = self._before[0](**kw) if self._before and self._before[0] else None
        if skip:
            return skip                   # an earlier hook skips the compile: nothing compiles
        self.compiles += 1
        if self._depth == 0:
            self._started = time.monotonic()
            self._rewarm = self.lease.is_warm()
            if self._rewarm:
                self.lease.mark_cold()
            self.lease.beat()
            fn = kw.get("fn")
            log.warning("compiling Triton kernel %s in a step (no warm-up launched it): the lease allows a "
                        "first step's time meanwhile", getattr(fn, "name", None) or kw.get("repr", "?"))
        self._depth += 1
        return None

    def _compile_done(self, **kw):
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            self.lease.beat()
            if self._rewarm:
                self.lease.mark_warm()
                self._rewarm = False
            log.info("the kernel compiled in %.0f ms", (time.monotonic() - self._started) * 1e3)
        if self._before and self._before[1]:
            return self._before[1](**kw)
        return None
