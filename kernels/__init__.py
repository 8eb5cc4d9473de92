"""numba-cuda kernel sources. Each module holds factories that return a plain Python kernel function
with the model geometry baked in as compile-time constants; `ninfer.core.cuda.kernels` compiles them
ahead of time to PTX (C-like pointer signatures) and launches them itself. Nothing here runs at
import time beyond numba's decorators for device helpers.

Each module declares its kernels' signatures beside them: `SIGNATURES = {kernel: argument types}`,
the kernel's name being its factory's, the types those of `ninfer.core.cuda.kernels.ARG_TYPES`
(a kernel with an fp32-storage variant lists its bf16 types; `f32=True` turns "u16*" / "u32*" into
"f32*"). The table is a plain literal (a value may name a tuple literal assigned above it) because
ninfer/models/qwen3_5/cuda/kernel_set.py reads it from the source text: loading kernels from a warm
cache imports no numba."""
