"""numba-cuda kernel sources. Each module holds factories that return a plain Python kernel function
with the model geometry baked in as compile-time constants; `ninfer.core.cuda.kernels` compiles them
ahead of time to PTX (C-like pointer signatures) and launches them itself. Nothing here runs at
import time beyond numba's decorators for device helpers."""
