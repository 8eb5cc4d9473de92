"""The CUDA device layer (cuda-python driver API): device/context/stream, arena, AOT kernel cache
and launcher, cuBLASLt, graphs. Importing this package does not import cuda-python; the first
driver call does, and raises ninfer.DeviceError when the [cuda] extra or a GPU is missing."""
