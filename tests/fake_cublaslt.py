"""A CublasLt whose library records every call instead of reaching cuBLASLt (CPU tests of plan
choices: float32 compute, batch-invariant pins). Heuristics always return one algorithm."""


def fake_cublaslt(*, f32: bool = False, invariant: bool = False, sm_count: int = 0):
    """(lt, calls): `calls` lists (function name, args) in call order."""
    from ninfer.core.cuda import cublaslt as C
    calls = []

    class Lib:
        def __getattr__(self, name):
            def call(*args):
                calls.append((name, args))
                if name.endswith("Create"):
                    args[0]._obj.value = 0x1000 + len(calls)
                if name == "cublasLtMatmulAlgoGetHeuristic":
                    args[-1]._obj.value = 1
                return 0
            return call
    lt = C.CublasLt.__new__(C.CublasLt)
    lt.lib, lt.handle, lt.workspace_bytes, lt._prefs, lt._plans = Lib(), "handle", 1 << 20, {}, {}
    lt._shared_algos = {}
    lt.f32, lt.invariant, lt.sm_count = f32, invariant, sm_count
    lt.ab_type = C.CUDA_R_32F if f32 else C.CUDA_R_16BF
    return lt, calls
