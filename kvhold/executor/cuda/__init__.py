"""The executor's CUDA path: Triton kernels (attention, GEMM, checksum, per-row kernels), the
fused layers and the graph-captured runner built on them, their ahead-of-time compile and the
shapes it compiles for, the compile watch, and the CUDA fault points.

Importing the package imports none of its modules (none of them torch or Triton on the CPU path)."""
