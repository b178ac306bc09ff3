"""Triton kernels compiled before fork, so a zygote-forked executor's first launch is cheap.

A kernel module opts in with two things (kvhold.executor.cuda.checksum shows both):

    @triton_aot.aot                  # launch syntax is unchanged: kernel[grid](*args, **constexprs)
    @triton.jit
    def _my_kernel(...): ...

    @triton_aot.warm_up              # calls the module's public functions with meta tensors
    def _aot_shapes(shapes: KernelShapes) -> None:
        my_public_op(triton_aot.meta((shapes.max_batch, shapes.hidden_size), shapes.dtype))

A warm-up runs in the zygote: meta tensors only, no CUDA call (a plain JIT launch it
reaches fails instead of initialising CUDA). It may also launch a kernel directly,
`_my_kernel[(1,)](meta(...), n, BLOCK=1024)`. Its arguments should specialise like the
executor's (dtype, 16-byte alignment, ints that are 16-divisible or equal to 1, i32 or
i64): a launch that does not goes to the JIT, logged once with its key.

`prepare(shapes)` runs in the zygote, before fork and without a CUDA context. Every launch
made by a warm-up is recorded, not run: Triton's own binder turns its arguments into the
specialization key the JIT would use (types, 16-divisibility, ints equal to 1), that key
is compiled for the GPU architecture read from NVML (or KVHOLD_TRITON_AOT_ARCH), and
Triton's own launcher stub for it is built and imported. The Triton driver object is
built and installed too, without the CUDA probe that `triton.runtime.driver.active` makes.

In a forked child, a launch whose arguments bind to a prepared key loads the cubin into
the current context on first use (Triton's loader: cuModuleLoadData) and goes through the
prebuilt stub on torch's current stream, so CUDA graph capture sees an ordinary launch.
Any other launch goes to the JIT, which compiles the same source with the same options;
a failure disables the fast path for that kernel (logged once). Correctness never
depends on this module. KVHOLD_TRITON_AOT=0 turns it off.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)
TESTED_TRITON = ("3.6.",)       # the internals used below were read in these releases
_KERNELS: list["AotKernel"] = []
_WARM_UPS: list = []
_recording = None      # the _Triton recording warm-ups' launches, inside prepare
_jit_only = False


def aot(fn) -> "AotKernel":
    """Wrap a @triton.jit function; its launches may skip the JIT once `prepare` has run."""
    kernel = AotKernel(fn)
    _KERNELS.append(kernel)
    return kernel


def warm_up(fn):
    """Register `fn(shapes)`: it launches the module's kernels at `shapes` with meta tensors."""
    _WARM_UPS.append(fn)
    return fn


@contextlib.contextmanager
def jit_only():
    """Launches made inside take the JIT (comparisons, debugging)."""
    global _jit_only
    saved, _jit_only = _jit_only, True
    try:
        yield
    finally:
        _jit_only = saved


def meta(shape, dtype) -> torch.Tensor:
    """A tensor with a shape, a dtype and contiguous strides, and no storage (address 0)."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


@dataclass(slots=True)
class _Prepared:
    """One compiled specialization: cubin, metadata, launcher stub; functions per device."""
    compiled: object                # triton.compiler.CompiledKernel
    launcher: object                # triton.backends.nvidia.driver.CudaLauncher (None: compile_only)
    arch: int
    functions: dict[int, int] = field(default_factory=dict)

    def function(self, device: int, utils) -> int:
        handle = self.functions.get(device)
        if handle is None:
            major, minor = torch.cuda.get_device_capability(device)
            if major * 10 + minor != self.arch:
                raise RuntimeError(f"compiled for sm_{self.arch}, device {device} is sm_{major}{minor}")
            md = self.compiled.metadata
            max_shared = utils.get_device_properties(device)["max_shared_mem"]
            if md.shared > max_shared:
                raise RuntimeError(f"needs {md.shared} B of shared memory, the device has {max_shared}")
            _, handle, _, _, max_threads = utils.load_binary(self.compiled.name, self.compiled.kernel,
                                                             md.shared, device)
            if md.num_warps * 32 > max_threads:
                raise RuntimeError(f"{md.num_warps} warps exceed {max_threads} threads")
            self.functions[device] = handle
        return handle


class AotKernel:
    """A @triton.jit function plus the specializations `prepare` compiled for it."""

    def __init__(self, fn):
        self.fn = fn
        self.name = f"{fn.fn.__module__}.{fn.fn.__qualname__}"
        self.prepared: dict[str, _Prepared] = {}
        self.pending: dict[str, tuple] = {}
        self.launches = self.fallbacks = 0
        self.broken: str | None = None
        self._tri: _Triton | None = None      # set once `prepare` armed this kernel
        self._missed: set[str] = set()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(grid, args, kwargs)

    def run(self, grid, args, kwargs):
        if _recording is not None:
            return self._record(_recording, args, kwargs)
        tri = self._tri
        if tri is None or _jit_only or not self.prepared or self.broken is not None or tri.hooked():
            return self.fn[grid](*args, **kwargs)
        _, bound, _, _, key = tri.bind(self, args, kwargs)
        entry = self.prepared.get(key)
        if entry is None:
            self._miss(key)
            return self.fn[grid](*args, **kwargs)
        try:
            device = torch.cuda.current_device()
            function = entry.function(device, tri.utils)
            g = grid(bound) if callable(grid) else grid
            # CudaLauncher(gridX, gridY, gridZ, stream, function, kernel metadata, launch
            # metadata, enter hook, exit hook, *every bound argument): constexprs are dropped
            # and the scratch pointers added by the stub itself, as on a JIT launch
            entry.launcher(g[0], g[1] if len(g) > 1 else 1, g[2] if len(g) > 2 else 1,
                           tri.stream(device), function, entry.compiled.packed_metadata,
                           None, None, None, *bound.values())
        except Exception as exc:   # not launched; the JIT raises the real error, if there is one
            self.broken = f"{type(exc).__name__}: {exc}"
            log.warning("Triton AOT launch of %s failed (%s); this kernel takes the JIT from now on",
                        self.name, self.broken)
        else:
            self.launches += 1
            return entry.compiled
        return self.fn[grid](*args, **kwargs)

    def _record(self, tri: "_Triton", args, kwargs) -> None:
        kwargs, bound, spec, options, key = tri.bind(self, args, kwargs)
        if key not in self.prepared:
            self.pending[key] = (kwargs, bound, spec, options)

    def _miss(self, key: str) -> None:
        self.fallbacks += 1
        if key not in self._missed and len(self._missed) < 8:
            self._missed.add(key)
            log.info("Triton AOT: %s launched with an unprepared specialization (JIT): %s",
                     self.name, key[:300])

    def stats(self) -> dict:
        return {"prepared": len(self.prepared), "aot_launches": self.launches,
                "jit_fallbacks": self.fallbacks, "broken": self.broken,
                "loaded_devices": sorted({d for p in self.prepared.values() for d in p.functions})}


class _Triton:
    """What this module takes from Triton's internals, in one place (read in Triton 3.6:
    runtime/jit.py JITFunction.run/_pack_args, compiler/compiler.py, backends/nvidia/driver.py)."""

    def __init__(self, arch: int):
        import triton
        from triton import knobs
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import compute_cache_key, create_function_from_signature

        self.triton, self.knobs, self.arch = triton, knobs, arch
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.ASTSource = ASTSource
        self.compute_cache_key = compute_cache_key
        self.create_binder = create_function_from_signature
        self.binders: dict[AotKernel, tuple] = {}     # kernel -> (binder, its key cache)
        self.driver = self.utils = self.stream = None

    def attach_driver(self) -> None:
        """CudaDriver() builds its utils module (load_binary & co.) and touches no CUDA API:
        it is `driver.active`'s is_active() probe and get_current_target() that initialise CUDA."""
        from triton.backends.nvidia.driver import CudaDriver

        runtime_driver = self.triton.runtime.driver
        if getattr(runtime_driver, "_active", None) is None:
            runtime_driver.set_active(CudaDriver())
        self.driver = runtime_driver.active
        self.utils = self.driver.utils
        self.stream = self.driver.get_current_stream

    @contextlib.contextmanager
    def no_cuda(self):
        """While warm-ups record: a JIT launch they reach (a kernel not wrapped by `aot`)
        fails instead of initialising CUDA through torch.cuda.current_device()."""
        def refuse(*_):
            raise RuntimeError("a warm-up reached a JIT launch (wrap the kernel with triton_aot.aot)")

        saved = self.driver.get_current_device
        self.driver.get_current_device = refuse
        try:
            yield
        finally:
            self.driver.get_current_device = saved

    def hooked(self) -> bool:
        """Launch hooks (profilers) are set: leave the launch to the JIT, which feeds them.
        Triton 3.6 keeps them as HookChains, empty when unused; older ones as None."""
        rt = self.knobs.runtime
        return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook,
                                                                         rt.launch_exit_hook))

    def bind(self, kernel: AotKernel, args, kwargs):
        """JITFunction.run's first steps: the same kwargs, binder and cache key."""
        binder, keys = self.binders.get(kernel) or self.binders.setdefault(
            kernel, (self.create_binder(kernel.fn.signature, kernel.fn.params, self.backend), {}))
        kwargs = dict(kwargs)
        kwargs["debug"] = kwargs.get("debug", kernel.fn.debug) or self.knobs.runtime.debug
        kwargs["instrumentation_mode"] = self.knobs.compilation.instrumentation_mode
        bound, spec, options = binder(*args, **kwargs)
        return kwargs, bound, spec, options, self.compute_cache_key(keys, spec, options)

    def compile(self, kernel: AotKernel, kwargs, bound, spec, options):
        """JITFunction._do_compile's compile: the same source, signature, attributes, options."""
        opts, signature, constexprs, attrs = kernel.fn._pack_args(self.backend, kwargs, bound, spec, options)
        src = self.ASTSource(kernel.fn, signature, constexprs, attrs)
        return self.triton.compile(src, target=self.target, options=opts.__dict__)

    def launcher(self, compiled):
        """The stub CompiledKernel._init_handles would build (a C module, gcc'd once, cached
        on disk): it marshals the arguments exactly as a JIT launch does."""
        return self.driver.launcher_cls(compiled.src, compiled.metadata)


def gpu_arch() -> int | None:
    """The target's compute capability as an int (90 for sm_90) from KVHOLD_TRITON_AOT_ARCH
    or NVML (no CUDA context). None when unknown or when the GPUs differ."""
    env = os.environ.get("KVHOLD_TRITON_AOT_ARCH", "").lower().replace("sm_", "").replace(".", "")
    if env:
        return int(env)
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        caps = {tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())}
    finally:
        pynvml.nvmlShutdown()
    if len(caps) != 1:
        log.warning("Triton AOT: GPUs of %d compute capabilities %s; set KVHOLD_TRITON_AOT_ARCH",
                    len(caps), sorted(caps))
        return None
    major, minor = caps.pop()
    return major * 10 + minor


def cuda_driver_initialised() -> bool | None:
    """Whether cuInit has run in this process (None without libcuda). Loading the
    library and asking does not initialise anything."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    ctx = ctypes.c_void_p()
    return lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 3      # CUDA_ERROR_NOT_INITIALIZED


def prepare(shapes, arch: int | None = None) -> dict:
    """Compile every warm-up's launches for `arch` (default `gpu_arch()`), build their
    launchers and arm the kernels. For the zygote, before fork. Never raises: the report
    says what happened."""
    report: dict = {"enabled": False}
    if os.environ.get("KVHOLD_TRITON_AOT", "1") == "0":
        report["reason"] = "KVHOLD_TRITON_AOT=0"
        return report
    t0 = time.monotonic()
    try:
        import triton
        report["triton"] = triton.__version__
        if not triton.__version__.startswith(TESTED_TRITON) and os.environ.get("KVHOLD_TRITON_AOT") != "1":
            raise RuntimeError(f"Triton {triton.__version__} is not one of {TESTED_TRITON} "
                               "(KVHOLD_TRITON_AOT=1 tries anyway)")
        arch = arch or gpu_arch()
        if arch is None:
            raise RuntimeError("GPU architecture unknown (no NVML, or mixed GPUs)")
        report["arch"] = arch
        tri = _Triton(arch)
        tri.attach_driver()
        report["driver_ms"] = round((time.monotonic() - t0) * 1e3, 1)
        with tri.no_cuda():
            report["warm_up_errors"] = _record_all(tri, shapes)
        compiled, report["compile_errors"] = _compile_all(tri, launchers=True)
    except Exception as exc:
        report["reason"] = f"{type(exc).__name__}: {exc}"
        log.warning("Triton AOT unavailable, kernels take the JIT: %s", report["reason"])
        return report
    for kernel in _KERNELS:
        kernel.prepared.update(compiled[kernel])
        kernel._tri, kernel.broken = tri, None
    report.update(enabled=True, ms=round((time.monotonic() - t0) * 1e3, 1),
                  kernels={k.name: len(k.prepared) for k in _KERNELS})
    log.info("Triton AOT: %d specializations of %d kernels ready for sm_%d in %.0f ms",
             sum(report["kernels"].values()), len(_KERNELS), arch, report["ms"])
    return report


def compile_only(shapes, arch: int) -> dict[str, list]:
    """What `prepare` would compile, compiled, with no driver and no launcher (so no libcuda
    and no GPU needed): {kernel name: [CompiledKernel]}. Arms nothing."""
    tri = _Triton(arch)
    errors = _record_all(tri, shapes)
    compiled, more = _compile_all(tri, launchers=False)
    if errors + more:
        raise RuntimeError("; ".join(errors + more))
    return {k.name: [p.compiled for p in compiled[k].values()] for k in _KERNELS}


def _record_all(tri: _Triton, shapes) -> list[str]:
    global _recording
    errors = []
    _recording = tri
    try:
        for fn in _WARM_UPS:
            try:
                fn(shapes)
            except Exception as exc:
                errors.append(f"{fn.__module__}.{fn.__qualname__}: {type(exc).__name__}: {exc}")
                log.warning("Triton AOT warm-up failed: %s", errors[-1])
    finally:
        _recording = None
    return errors


def _compile_all(tri: _Triton, launchers: bool) -> tuple[dict, list[str]]:
    """Compile what the warm-ups recorded: ({kernel: {key: _Prepared}}, errors)."""
    out, errors = {}, []
    for kernel in _KERNELS:
        pending, kernel.pending = kernel.pending, {}
        out[kernel] = {}
        for key, (kwargs, bound, spec, options) in pending.items():
            try:
                compiled = tri.compile(kernel, kwargs, bound, spec, options)
                launcher = tri.launcher(compiled) if launchers else None
                out[kernel][key] = _Prepared(compiled, launcher, tri.arch)
            except Exception as exc:
                errors.append(f"{kernel.name}: {type(exc).__name__}: {exc}")
                log.warning("Triton AOT compile of %s failed: %s", kernel.name, errors[-1])
    return out, errors


def stats() -> dict:
    """Per kernel: specializations prepared, AOT launches, JIT fallbacks, failure if any."""
    return {k.name: k.stats() for k in _KERNELS}


def load_all(device: int) -> int:
    """Load every prepared specialization's cubin into the current context of `device` now
    (what each one's first launch would do); returns how many. A zygote's spare child does
    this before it is handed a request (kvhold.executor.zygote). A cubin that cannot load
    there is left to its first launch, which reports it."""
    loaded = 0
    for kernel in _KERNELS:
        tri = kernel._tri
        if tri is None or kernel.broken is not None:
            continue
        for entry in kernel.prepared.values():
            try:
                entry.function(device, tri.utils)
                loaded += 1
            except Exception as exc:  # the launch path decides: JIT fallback, logged there
                log.info("Triton AOT: %s not preloaded: %s", kernel.name, exc)
    return loaded
