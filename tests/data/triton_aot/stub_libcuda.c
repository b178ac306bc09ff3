/* libcuda.so.1 with no GPU behind it. Until stub_set_ready(1) (a forked child "creating its
   context") every call fails as if cuInit never ran; then calls succeed with plausible values
   and cuLaunchKernelEx records its configuration and the raw bytes of each parameter. */
#include <stdint.h>
#include <string.h>
#include "cuda.h"
#define FAIL_UNLESS_READY if (!ready) return CUDA_ERROR_NOT_INITIALIZED
static int ready, fail_load, launches, expected;
static CUlaunchConfig config;
static CUfunction launched;
static uint64_t params[64];
void stub_set_ready(int r) { ready = r; }
void stub_fail_load(int f) { fail_load = f; }
void stub_expect_params(int n) { expected = n < 64 ? n : 64; }
int stub_launches(void) { return launches; }
void stub_last_launch(unsigned dims[7], uint64_t *stream, uint64_t *function, uint64_t out[64]) {
  dims[0] = config.gridDimX; dims[1] = config.gridDimY; dims[2] = config.gridDimZ;
  dims[3] = config.blockDimX; dims[4] = config.blockDimY; dims[5] = config.blockDimZ;
  dims[6] = config.sharedMemBytes; *stream = (uint64_t)config.hStream; *function = (uint64_t)launched;
  memcpy(out, params, sizeof params);
}
CUresult cuGetErrorString(CUresult e, const char **s) { *s = "stub libcuda"; return CUDA_SUCCESS; }
CUresult cuCtxGetCurrent(CUcontext *c) { FAIL_UNLESS_READY; *c = (CUcontext)0x1; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { FAIL_UNLESS_READY; return CUDA_SUCCESS; }
CUresult cuCtxGetLimit(size_t *v, CUlimit l) { FAIL_UNLESS_READY; *v = 0; return CUDA_SUCCESS; }
CUresult cuCtxSetLimit(CUlimit l, size_t v) { FAIL_UNLESS_READY; return CUDA_SUCCESS; }
CUresult cuDeviceGet(CUdevice *d, int i) { FAIL_UNLESS_READY; *d = i; return CUDA_SUCCESS; }
CUresult cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice d) { FAIL_UNLESS_READY; *v = 1 << 16; return CUDA_SUCCESS; }
CUresult cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice d) { FAIL_UNLESS_READY; *c = (CUcontext)0x1; return CUDA_SUCCESS; }
CUresult cuFuncGetAttribute(int *v, CUfunction_attribute a, CUfunction f) { FAIL_UNLESS_READY; *v = 1024; return CUDA_SUCCESS; }
CUresult cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) { FAIL_UNLESS_READY; return CUDA_SUCCESS; }
CUresult cuFuncSetCacheConfig(CUfunction f, CUfunc_cache c) { FAIL_UNLESS_READY; return CUDA_SUCCESS; }
CUresult cuModuleLoadData(CUmodule *m, const void *image) {
  FAIL_UNLESS_READY;
  if (fail_load || memcmp(image, "\x7f" "ELF", 4)) return CUDA_ERROR_NO_BINARY_FOR_GPU;
  *m = (CUmodule)0x2; return CUDA_SUCCESS;
}
CUresult cuModuleGetFunction(CUfunction *f, CUmodule m, const char *name) { FAIL_UNLESS_READY; *f = (CUfunction)0xf00; return CUDA_SUCCESS; }
CUresult cuPointerGetAttribute(void *data, CUpointer_attribute a, CUdeviceptr p) { FAIL_UNLESS_READY; *(CUdeviceptr *)data = p; return CUDA_SUCCESS; }
CUresult cuOccupancyMaxActiveClusters(int *n, CUfunction f, const CUlaunchConfig *c) { FAIL_UNLESS_READY; *n = 1; return CUDA_SUCCESS; }
CUresult cuTensorMapEncodeTiled(CUtensorMap *m, CUtensorMapDataType t, cuuint32_t r, void *g, const cuuint64_t *d,
                                const cuuint64_t *s, const cuuint32_t *b, const cuuint32_t *e, CUtensorMapInterleave i,
                                CUtensorMapSwizzle w, CUtensorMapL2promotion l, CUtensorMapFloatOOBfill f) { return CUDA_ERROR_NOT_SUPPORTED; }
CUresult cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **kernel_params, void **extra) {
  FAIL_UNLESS_READY;
  config = *c; launched = f; launches++;
  for (int i = 0; i < expected; i++) memcpy(&params[i], kernel_params[i], 8);   /* 8 bytes: mask by type */
  return CUDA_SUCCESS;
}
