"""The zygote's Triton AOT path against a stub libcuda (stub_libcuda.c), on a machine
without a GPU: run by tests/process/test_executor_triton_aot.py, prints one JSON line.

The parent preloads like the zygote (stub: CUDA never initialised), checks a launch of an
unprepared specialization goes to the JIT, forks children that play an executor with a
context (stub: calls succeed) and records what the prepared launcher hands the driver,
and checks that a warm-up reaching a plain JIT kernel cannot initialise CUDA."""
import ctypes, json, os, struct, sys
stub = ctypes.CDLL(os.path.join(os.environ["TRITON_LIBCUDA_PATH"], "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
import torch, triton, triton.language as tl
from kvhold.executor.cuda.kernel_shapes import KernelShapes
from kvhold.executor.zygote import preload
from kvhold.executor.cuda import triton_aot
from kvhold.executor.cuda.attention import _paged_decode_kernel, paged_decode_attention
from kvhold.executor.cuda.checksum import TritonChecksum

shapes = KernelShapes(**json.loads(sys.argv[1]))
preload("cuda:0", shapes)                       # the zygote's path: compile, build launchers, arm
out = {"stats": triton_aot.stats(), "torch_cuda_initialised": torch.cuda.is_initialized(),
       "driver_initialised": triton_aot.cuda_driver_initialised()}
m = triton_aot.meta
try:                                            # another geometry: not prepared, the JIT's
    one = m((1,), torch.int64)
    TritonChecksum(m((4, 1, 2, 32, 4, 64), shapes.dtype)).ranges(one, one, one)
except Exception as exc:
    out["miss_raised"] = type(exc).__name__
out["miss"] = triton_aot.stats()["kvhold.executor.cuda.checksum._range_hash_kernel"]


def forked(child) -> dict:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            result = child()
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(result).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 1 << 16):
        data += chunk
    os.waitpid(pid, 0)
    return json.loads(data)


def as_a_child_with_a_context(fail_load=False):
    """What a forked executor does: its context exists (the stub says so), torch's device is 0."""
    stub.stub_set_ready(1)
    stub.stub_fail_load(int(fail_load))
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: (9, 0)
    _paged_decode_kernel._tri.stream = lambda device: 0x5157
    stub.stub_expect_params(18)             # 5 pointers, 10 ints, 1 float, 2 scratch pointers


def launch():
    as_a_child_with_a_context()
    q = torch.randn(shapes.max_batch, shapes.num_heads, shapes.head_dim).to(torch.bfloat16)
    pool = torch.zeros(shapes.kv_pool_shape, dtype=torch.bfloat16)
    table = torch.zeros(shapes.max_batch, shapes.max_pages_per_seq, dtype=torch.int32)
    ctx = torch.ones(shapes.max_batch, dtype=torch.int32)
    res = paged_decode_attention(q, pool, 2, table, ctx, 0.125)
    dims, stream, function = (ctypes.c_uint * 7)(), ctypes.c_uint64(), ctypes.c_uint64()
    params = (ctypes.c_uint64 * 64)()
    stub.stub_last_launch(dims, ctypes.byref(stream), ctypes.byref(function), params)
    entry = next(iter(_paged_decode_kernel.prepared.values()))
    sp = pool.stride()
    return {"stub_launches": stub.stub_launches(), "aot_launches": _paged_decode_kernel.launches,
            "dims": list(dims), "stream": stream.value, "function": function.value,
            "want_dims": [shapes.max_batch, shapes.num_kv_heads, 1, 32 * entry.compiled.metadata.num_warps, 1, 1,
                          entry.compiled.metadata.shared],
            "pointers": list(params[:5]),
            "want_pointers": [t.data_ptr() for t in (q, pool, table, ctx, res)],
            "ints": [p & 0xFFFFFFFF for p in params[5:15]],
            "want_ints": [q.stride(0), q.stride(1), res.stride(0), res.stride(1), sp[0], sp[2], sp[3], sp[4],
                          table.stride(0), 2 * sp[1]],
            "scale": struct.unpack("<f", struct.pack("<I", params[15] & 0xFFFFFFFF))[0],
            "scratch": list(params[16:18])}


def failed_load():
    as_a_child_with_a_context(fail_load=True)
    try:
        paged_decode_attention(m((shapes.max_batch, shapes.num_heads, shapes.head_dim), shapes.dtype),
                               m(shapes.kv_pool_shape, shapes.dtype), 0,
                               m((shapes.max_batch, shapes.max_pages_per_seq), torch.int32),
                               m((shapes.max_batch,), torch.int32), 0.125)
    except Exception as exc:                 # the JIT, on a machine with no GPU
        return {"raised": type(exc).__name__, "broken": _paged_decode_kernel.broken}
    return {"broken": _paged_decode_kernel.broken}


out["child"] = forked(launch)
out["child_failed_load"] = forked(failed_load)


@triton.jit
def plain(p):
    tl.store(p, 1)


triton_aot.warm_up(lambda s: plain[(1,)](m((1,), torch.int32)))
out["second_prepare"] = triton_aot.prepare(shapes)
out["torch_cuda_initialised_at_end"] = torch.cuda.is_initialized()
print(json.dumps(out))
