"""cuBLASLt through ctypes: bf16 x bf16 -> fp32 (fp32 compute), row-major `Y = X @ W^T (+ beta*Y)`.
With `f32=True` (dtype="float32") A and B are fp32 too, under the same strict CUBLAS_COMPUTE_32F:
IEEE fp32 products, never TF32 (that is CUBLAS_COMPUTE_32F_FAST_TF32, which is not used).

Row-major Y[M, N] = X[M, K] @ W[N, K]^T is, in cuBLAS's column-major view, the "TN" product
D(N x M) = op_T(A = W as K x N) * B (= X as K x M). Each distinct (M, N, K, beta) gets a plan: the
descriptors and the algorithm chosen once by the heuristic, against a fixed workspace. Plans are
made before graph capture (`plan()`), so replay never asks the heuristic.

`w_kn=True` takes the second operand as W[K, N] row-major (`Y = X @ W`), the "NN" product: prefill
attention's O = P @ V reads the gathered V rows as they are.

`batch=B, strides=(sw, sx, sy)` runs B such products in one strided-batched call, product i on
w + i*sw, x + i*sx, y + i*sy (strides in elements): the MoE prefill's experts, one launch per layer.

`fp8=True` (gemm_fp8): A = W and B = X are float8_e4m3 codes with block scales, the FP8 release
format (docs/artifact.md 3.2.1): W's one float32 per 128 x 128 block (BLK128x128_32F), X's one per
token and 128 columns (VEC128_32F), the prefill path of fp8 weights (W8A8, cuda/runner.py). The
layouts cuBLASLt reads, in row-major terms (measured on cuBLAS 13.1, bench/bench_fp8_gemm.py):
W's scales [ceil(N / 128), round_up(K / 128, 4)] (rows padded to 4 blocks), X's codes [M, K]
and scales [K / 128, M] (column blocks outer, tokens inner); M a multiple of 4 and K of 128
(the heuristic refuses other M; it also refuses some small shapes: fp8_plan_ok). Hopper's
cuBLASLt (12.9+) has these modes; `fp8_supported()` asks the heuristic once.

`invariant=True` (the Engine's batch_invariant option): no algorithm reduces split-K partials
with atomics (REDUCTION_SCHEME_INPLACE: their order varies run to run), so a plan always gives
the same bits. A row's result must also not depend on M (the decode batch size B): the heuristic
picks a kernel per M, for small M usually a split-K one whose split changes with M, so the
step runner runs every M < PIN_M as M = PIN_M (cuda/runner.py StepRunner.gemm): one plan, one
kernel and one grid for every decode batch. Larger M (prefill chunks) keep a plan per M: a chunk
of a given length always runs the same way, and the Program keeps a request's chunk boundaries.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import time

from ...errors import DeviceError

CUBLAS_COMPUTE_32F = 68          # strict fp32 (CUBLAS_COMPUTE_32F_FAST_TF32 = 77 is never used)
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUDA_R_8F_E4M3 = 28
DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER = 17, 18      # void* (device)
DESC_A_SCALE_MODE, DESC_B_SCALE_MODE = 31, 32            # int32 cublasLtMatmulMatrixScale_t
SCALE_VEC128_32F, SCALE_BLK128x128_32F = 4, 5
FP8_BLOCK = 128                  # the block of both scale modes
FP8_K_MULTIPLE = FP8_BLOCK       # K: whole blocks
PLAN_SCALE_PTR = 256             # a non-null address for planning (never dereferenced)
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
DESC_SM_COUNT_TARGET = 15             # int32: the SMs a GEMM's grid is sized for (0: all)
PREF_MAX_WORKSPACE_BYTES = 1
PREF_REDUCTION_SCHEME_MASK = 3        # uint32 mask of the allowed CUBLASLT_REDUCTION_SCHEME_*
REDUCTION_NONE, REDUCTION_INPLACE, REDUCTION_COMPUTE_TYPE, REDUCTION_OUTPUT_TYPE = 0, 1, 2, 4
# invariant mode: split-K partials only through a workspace, reduced in a fixed order
INVARIANT_REDUCTIONS = REDUCTION_COMPUTE_TYPE | REDUCTION_OUTPUT_TYPE
PIN_M = 8                             # invariant mode: decode GEMMs of M < PIN_M rows run as PIN_M
# a product of more rows than this runs the algorithm the heuristic picks for the next power of
# two (algo_rows), where it takes the exact shape (cublasLtMatmulAlgoCheck): the first launch of
# each new kernel costs milliseconds (H100, cuBLAS 13: an MTP catch-up feed of 336 rows after one
# of 337 took 9.3 ms against 3.3 warm, with or without CUDA_MODULE_LOADING=EAGER), and a drafter
# feed (at B = 1 often 30-100 positions) or a prompt's last chunk has a new length most times.
# Decode-sized products (the GEMVs of B <= 8 rows, PIN_M's) keep their own.
SHARED_ALGO_FROM = PIN_M
PREF_MIN_ALIGNMENT = (5, 6, 7, 8)     # A, B, C, D bytes (uint32, default 256)
LAYOUT_BATCH_COUNT, LAYOUT_STRIDED_BATCH_OFFSET = 5, 6     # int32 count, int64 element stride
# the grouped GEMM (cuBLAS 13's experimental CUBLASLT_BATCH_MODE_GROUPED): alpha and beta by
# device pointer, and the heuristic's hints for shapes it cannot read from the device
DESC_POINTER_MODE, POINTER_MODE_DEVICE = 2, 1
PREF_GROUPED_AVG_K, PREF_GROUPED_AVG_ROWS, PREF_GROUPED_AVG_COLS = 13, 14, 15

STATUS_NAMES = {0: "CUBLAS_STATUS_SUCCESS", 1: "CUBLAS_STATUS_NOT_INITIALIZED",
                3: "CUBLAS_STATUS_ALLOC_FAILED", 7: "CUBLAS_STATUS_INVALID_VALUE",
                8: "CUBLAS_STATUS_ARCH_MISMATCH", 11: "CUBLAS_STATUS_MAPPING_ERROR",
                13: "CUBLAS_STATUS_EXECUTION_FAILED", 14: "CUBLAS_STATUS_INTERNAL_ERROR",
                15: "CUBLAS_STATUS_NOT_SUPPORTED", 16: "CUBLAS_STATUS_LICENSE_ERROR"}


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t),
                ("state", ctypes.c_int), ("wavesCount", ctypes.c_float),
                ("reserved", ctypes.c_int * 4)]


def algo_rows(m: int) -> int:
    """The rows whose heuristic algorithm a product of m rows runs (SHARED_ALGO_FROM)."""
    return m if m <= SHARED_ALGO_FROM else 1 << (m - 1).bit_length()


def shared_algo_rows(n: int) -> list:
    """Row counts up to n whose products load every algorithm products of 9 .. n rows share:
    each power of two past SHARED_ALGO_FROM below 2n, n itself in place of the last where n is
    not one (CudaModel.warm_up runs them, so no call while serving pays a kernel's first
    launch)."""
    rows, b = [], 2 * SHARED_ALGO_FROM
    while b // 2 < n:
        rows.append(min(b, n))
        b *= 2
    return rows


def lt_check(status: int, what: str) -> None:
    if status != 0:
        raise DeviceError(f"{what} failed: {STATUS_NAMES.get(status, f'cublasStatus {status}')}")


def _candidates():
    names = ("libcublasLt.so.13", "libcublasLt.so.12")
    for base in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cu12/lib"):
            for n in names:
                yield from glob.glob(os.path.join(base, sub, n))
    yield from names
    yield "libcublasLt.so"


def load_library():
    errors = []
    for path in _candidates():
        try:
            return ctypes.CDLL(path)
        except OSError as exc:
            errors.append(f"{path}: {exc}")
    raise DeviceError("backend 'cuda': cuBLASLt not found (install nvidia-cublas, the [cuda] extra); "
                      + "; ".join(errors[-2:]))


def alignment(*ptrs) -> int:
    """Largest power of two (<= 256) dividing every address."""
    a = 256
    for p in ptrs:
        p = int(p)
        while a > 1 and p % a:
            a //= 2
    return a


_DESTROYERS = ("cublasLtDestroy", "cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy",
               "cublasLtMatmulPreferenceDestroy")


def fp8_scale_rows(m: int) -> int:
    """Leading dimension of X's VEC128_32F scales: tokens rounded up to 4."""
    return -(-int(m) // 4) * 4


def _destroy_partial(lib, layouts, desc, pref=None) -> None:
    """Destroy what a plan that failed half-way had made (best effort: the error being raised
    is the one to report)."""
    for layout in layouts:
        if layout.value:
            lib.cublasLtMatrixLayoutDestroy(layout)
    if desc.value:
        lib.cublasLtMatmulDescDestroy(desc)
    if pref is not None:
        lib.cublasLtMatmulPreferenceDestroy(pref)


class Plan:
    __slots__ = ("desc", "layouts", "algo", "m", "n", "k", "beta", "w_kn", "batch", "fp8")


class GroupedPlan:
    __slots__ = ("desc", "layouts", "algo", "n", "k", "groups")


class CublasLt:
    f32, ab_type, invariant = False, CUDA_R_16BF, False

    sm_count = 0
    plan_seconds = 0.0  # seconds spent making plans so far (one-off work: CudaModel.one_off_seconds)
    share_algos = True  # past SHARED_ALGO_FROM rows, the power of two's algorithm (False: bench A/B)

    def __init__(self, workspace_ptr: int, workspace_bytes: int, f32: bool = False,
                 invariant: bool = False, sm_count: int = 0):
        # f32: X and W are fp32 (dtype="float32"), else bf16; one type for every plan.
        # sm_count > 0: every GEMM's grid sized for that many SMs (work beside another stream's)
        self.f32 = bool(f32)
        self.sm_count = int(sm_count)
        self.invariant = bool(invariant)
        self.ab_type = CUDA_R_32F if self.f32 else CUDA_R_16BF
        lib = self.lib = load_library()
        vp, i32, u64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64
        lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
        lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, ctypes.c_size_t]
        lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, u64, u64, ctypes.c_int64]
        lib.cublasLtMatrixLayoutSetAttribute.argtypes = [vp, i32, vp, ctypes.c_size_t]
        lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
        lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, ctypes.c_size_t]
        lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32,
                                                       ctypes.POINTER(HeuristicResult),
                                                       ctypes.POINTER(i32)]
        lib.cublasLtMatmul.argtypes = [vp, vp, vp, u64, vp, u64, vp, vp, u64, vp, u64, vp, vp,
                                       u64, ctypes.c_size_t, vp]
        lib.cublasLtMatmulAlgoCheck.argtypes = [vp, vp, vp, vp, vp, vp, vp,
                                                ctypes.POINTER(HeuristicResult)]
        for f in _DESTROYERS:
            getattr(lib, f).argtypes = [vp]
        for f in ("cublasLtCreate", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                  "cublasLtMatrixLayoutCreate", "cublasLtMatrixLayoutSetAttribute",
                  "cublasLtMatmulPreferenceCreate",
                  "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic",
                  "cublasLtMatmulAlgoCheck", "cublasLtMatmul") + _DESTROYERS:
            getattr(lib, f).restype = i32
        self.handle = vp()
        lt_check(lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace_ptr, self.workspace_bytes = int(workspace_ptr), int(workspace_bytes)
        self._prefs = {}
        self._plans = {}
        self._shared_algos = {}       # plan key at algo_rows(M) -> its HeuristicResult, or None
        self._fp8_refused = set()
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self.calls = 0

    def close(self) -> None:
        """Destroy the plans' descriptors, the preferences and the handle (idempotent)."""
        lib = self.lib
        plans, prefs = list(self._plans.values()), list(self._prefs.values())
        self._plans, self._prefs = {}, {}
        for p in plans:
            for layout in p.layouts:
                lt_check(lib.cublasLtMatrixLayoutDestroy(layout), "cublasLtMatrixLayoutDestroy")
            lt_check(lib.cublasLtMatmulDescDestroy(p.desc), "cublasLtMatmulDescDestroy")
        for pref in prefs:
            lt_check(lib.cublasLtMatmulPreferenceDestroy(pref), "cublasLtMatmulPreferenceDestroy")
        if self.handle is not None:
            handle, self.handle = self.handle, None
            lt_check(lib.cublasLtDestroy(handle), "cublasLtDestroy")

    def _pref(self, align: int):
        """Heuristic preferences for buffers aligned to `align` bytes (sub-views of the grouped
        MoE path can be less aligned than cuBLASLt's default assumption of 256)."""
        pref = self._prefs.get(align)
        if pref is None:
            pref = self._prefs[align] = self._new_pref(
                {attr: align for attr in PREF_MIN_ALIGNMENT} if align < 256 else {})
        return pref

    def _new_pref(self, uint32_attrs: dict):
        """A preference: the workspace, the invariant mode's reductions, and `uint32_attrs`
        (attribute -> uint32 value: alignments, the grouped GEMM's shape hints)."""
        lib = self.lib
        pref = ctypes.c_void_p()
        lt_check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)),
                 "cublasLtMatmulPreferenceCreate")
        try:
            ws = ctypes.c_uint64(self.workspace_bytes)
            lt_check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES,
                                                              ctypes.byref(ws), 8),
                     "set MAX_WORKSPACE_BYTES")
            if self.invariant:
                uint32_attrs = {PREF_REDUCTION_SCHEME_MASK: INVARIANT_REDUCTIONS, **uint32_attrs}
            for attr, v in uint32_attrs.items():
                cv = ctypes.c_uint32(v)
                lt_check(lib.cublasLtMatmulPreferenceSetAttribute(pref, attr, ctypes.byref(cv), 4),
                         f"set preference {attr}")
        except BaseException:
            lib.cublasLtMatmulPreferenceDestroy(pref)
            raise
        return pref

    def batch_alignment(self, x_ptr, w_ptr, y_ptr, batch=1, strides=(0, 0, 0)) -> int:
        """alignment() of every product's operands: the first ones and, for a batch, the
        second ones (the strides keep the rest on the same alignment)."""
        if batch <= 1:
            return alignment(x_ptr, w_ptr, y_ptr)
        ab = 4 if self.f32 else 2
        sw, sx, sy = strides
        return alignment(x_ptr, w_ptr, y_ptr, x_ptr + ab * sx, w_ptr + ab * sw, y_ptr + 4 * sy)

    def plan(self, m: int, n: int, k: int, beta: float = 0.0, align: int = 256,
             w_kn: bool = False, batch: int = 1, strides: tuple = (0, 0, 0), ldc: int = 0,
             fp8: bool = False) -> Plan:
        strides = tuple(int(s) for s in strides) if batch > 1 else (0, 0, 0)
        ldc = int(ldc) or int(n)
        key = (int(m), int(n), int(k), float(beta), int(align), bool(w_kn), int(batch), strides,
               ldc, bool(fp8), bool(self.share_algos))
        p = self._plans.get(key)
        if p is not None:
            return p
        t0 = time.perf_counter()
        try:
            return self._new_plan(key, m, n, k, beta, align, w_kn, batch, strides, ldc, fp8)
        finally:
            self.plan_seconds += time.perf_counter() - t0

    def _new_plan(self, key, m, n, k, beta, align, w_kn, batch, strides, ldc, fp8) -> Plan:
        if min(m, n, k, batch) < 1:
            raise ValueError(f"gemm: empty shape M={m} N={n} K={k} batch={batch}")
        if fp8 and (self.f32 or w_kn or batch > 1 or k % FP8_K_MULTIPLE):
            raise ValueError(f"gemm_fp8: a bf16 handle, W[N, K], one product, K a multiple of "
                             f"{FP8_K_MULTIPLE} (M={m} N={n} K={k})")
        ab_type = CUDA_R_8F_E4M3 if fp8 else self.ab_type
        lib = self.lib
        desc = ctypes.c_void_p()
        a, b, c = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        try:
            lt_check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescCreate")
            opt, opn = ctypes.c_int32(CUBLAS_OP_T), ctypes.c_int32(CUBLAS_OP_N)
            lt_check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSA,
                                                        ctypes.byref(opn if w_kn else opt), 4),
                     "set TRANSA")
            lt_check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_TRANSB, ctypes.byref(opn), 4),
                     "set TRANSB")
            if self.sm_count > 0:
                sms = ctypes.c_int32(self.sm_count)
                lt_check(lib.cublasLtMatmulDescSetAttribute(desc, DESC_SM_COUNT_TARGET,
                                                            ctypes.byref(sms), 4),
                         "set SM_COUNT_TARGET")
            if fp8:
                for attr, mode in ((DESC_A_SCALE_MODE, SCALE_BLK128x128_32F),
                                   (DESC_B_SCALE_MODE, SCALE_VEC128_32F)):
                    v = ctypes.c_int32(mode)
                    lt_check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v), 4),
                             "set SCALE_MODE")
                # with block scale modes the heuristic refuses null scale pointers
                # (CUBLAS_STATUS_INVALID_VALUE, measured on cuBLAS 13.1) though it never reads
                # them: a stand-in until gemm_fp8 sets the call's own
                for attr in (DESC_A_SCALE_POINTER, DESC_B_SCALE_POINTER):
                    v = ctypes.c_void_p(PLAN_SCALE_PTR)
                    lt_check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(v),
                                                                ctypes.sizeof(v)),
                             "set SCALE_POINTER")
            # W[N, K] row-major is a K x N column-major matrix used transposed; W[K, N] row-major
            # is N x K column-major, used as it is
            rows_a, cols_a = (n, k) if w_kn else (k, n)
            lt_check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(a), ab_type, rows_a, cols_a,
                                                    rows_a), "layout A")
            lt_check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), ab_type, k, m, k),
                     "layout B")
            # (ldc > n: Y's columns [0, n) of wider rows, a segment of a fused output)
            lt_check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(c), CUDA_R_32F, n, m, ldc),
                     "layout C")
            if batch > 1:
                count_b = ctypes.c_int32(batch)
                for layout, stride in zip((a, b, c), strides):
                    st = ctypes.c_int64(stride)
                    lt_check(lib.cublasLtMatrixLayoutSetAttribute(
                        layout, LAYOUT_BATCH_COUNT, ctypes.byref(count_b), 4), "set BATCH_COUNT")
                    lt_check(lib.cublasLtMatrixLayoutSetAttribute(
                        layout, LAYOUT_STRIDED_BATCH_OFFSET, ctypes.byref(st), 8),
                        "set STRIDED_BATCH_OFFSET")
            algo = None
            if self.share_algos and batch == 1 and not fp8 and algo_rows(m) != m:
                algo = self._shared_algo((algo_rows(m),) + key[1:], desc, (a, b, c), n, k, ldc,
                                         ab_type, align)
            if algo is None:
                status, algo = self._heuristic(desc, a, b, c, align)
                lt_check(status, f"cublasLtMatmulAlgoGetHeuristic(M={m}, N={n}, K={k}, "
                                 f"batch={batch})")
                if algo is None:
                    what = "fp8 block-scaled" if fp8 else ("fp32" if self.f32 else "bf16")
                    raise DeviceError(f"cuBLASLt: no algorithm for {what} GEMM M={m} N={n} "
                                      f"K={k}")
        except BaseException:
            _destroy_partial(lib, (a, b, c), desc)
            raise
        p = Plan()
        p.desc, p.layouts, p.m, p.n, p.k, p.beta = desc, (a, b, c), m, n, k, float(beta)
        p.w_kn, p.batch, p.fp8, p.algo = bool(w_kn), int(batch), bool(fp8), algo
        self._plans[key] = p
        return p

    def _heuristic(self, desc, a, b, c, align: int) -> tuple:
        """(cublasStatus, the heuristic's best HeuristicResult for these layouts or None)."""
        res = (HeuristicResult * 1)()
        count = ctypes.c_int(0)
        status = self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c,
                                                         self._pref(align), 1, res,
                                                         ctypes.byref(count))
        return status, (res[0] if status == 0 and count.value >= 1 else None)

    def _shared_algo(self, shared_key, desc, layouts, n: int, k: int, ldc: int, ab_type,
                     align: int):
        """A copy of the HeuristicResult the heuristic picks for shared_key's rows (asked once
        per key, over layouts of that many rows), where it runs these layouts (the exact rows:
        cublasLtMatmulAlgoCheck, within the workspace); else None (the caller asks the heuristic
        for the exact shape)."""
        lib, mb = self.lib, shared_key[0]
        if shared_key not in self._shared_algos:
            found = None
            b, c = ctypes.c_void_p(), ctypes.c_void_p()
            try:
                if lib.cublasLtMatrixLayoutCreate(ctypes.byref(b), ab_type, k, mb, k) == 0 and \
                        lib.cublasLtMatrixLayoutCreate(ctypes.byref(c), CUDA_R_32F, n, mb,
                                                       ldc) == 0:
                    found = self._heuristic(desc, layouts[0], b, c, align)[1]
            finally:
                _destroy_partial(lib, (b, c), ctypes.c_void_p())
            self._shared_algos[shared_key] = found
        found = self._shared_algos[shared_key]
        if found is None:
            return None
        a, b, c = layouts
        checked = HeuristicResult()
        if lib.cublasLtMatmulAlgoCheck(self.handle, desc, a, b, c, c, ctypes.byref(found.algo),
                                       ctypes.byref(checked)) != 0 \
                or checked.state != 0 or checked.workspaceSize > self.workspace_bytes:
            return None
        return HeuristicResult.from_buffer_copy(found)

    def gemm(self, stream, x_ptr: int, w_ptr: int, y_ptr: int, m: int, n: int, k: int,
             beta: float = 0.0, w_kn: bool = False, batch: int = 1,
             strides: tuple = (0, 0, 0), ldc: int = 0) -> None:
        """y[m, n] (fp32) = x[m, k] (bf16) @ w[n, k]^T (bf16) + beta * y; with w_kn, w is [k, n]
        and y = x @ w + beta * y. (x, w fp32 when the handle was made with f32.) `batch` > 1:
        `batch` products, the i-th at element offsets i * strides (w, x, y). `ldc`: y's row
        stride in elements (default n)."""
        p = self.plan(m, n, k, beta, self.batch_alignment(x_ptr, w_ptr, y_ptr, batch, strides),
                      w_kn, batch, strides, ldc)
        self._matmul(stream, p, x_ptr, w_ptr, y_ptr, beta,
                     f"cublasLtMatmul(M={m}, N={n}, K={k}{', w_kn' if w_kn else ''})")

    def _matmul(self, stream, p: Plan, x_ptr, w_ptr, y_ptr, beta: float, what: str) -> None:
        a, b, c = p.layouts
        beta_c = self._zero if beta == 0.0 else (self._one if beta == 1.0 else ctypes.c_float(beta))
        self.calls += 1
        lt_check(self.lib.cublasLtMatmul(self.handle, p.desc, ctypes.byref(self._one),
                                         w_ptr, a, x_ptr, b, ctypes.byref(beta_c), y_ptr, c,
                                         y_ptr, c, ctypes.byref(p.algo.algo),
                                         self.workspace_ptr, self.workspace_bytes,
                                         ctypes.c_void_p(int(stream.handle))), what)

    def gemm_fp8(self, stream, x_ptr: int, x_scale_ptr: int, w_ptr: int, w_scale_ptr: int,
                 y_ptr: int, m: int, n: int, k: int, beta: float = 0.0, ldc: int = 0) -> None:
        """y[m, n] (fp32) = (x * x_scale)[m, k] @ (w * w_scale)[n, k]^T + beta * y on e4m3 codes
        (the module's docstring gives the scales' layouts). The scale pointers belong to the
        call, so they are set on the shared plan's descriptor right before it (host work only:
        a graph captures the values)."""
        p = self.plan(m, n, k, beta, alignment(x_ptr, w_ptr, y_ptr), ldc=ldc, fp8=True)
        for attr, ptr in ((DESC_A_SCALE_POINTER, w_scale_ptr), (DESC_B_SCALE_POINTER, x_scale_ptr)):
            v = ctypes.c_void_p(int(ptr))
            lt_check(self.lib.cublasLtMatmulDescSetAttribute(p.desc, attr, ctypes.byref(v),
                                                             ctypes.sizeof(v)), "set SCALE_POINTER")
        self._matmul(stream, p, x_ptr, w_ptr, y_ptr, beta, f"cublasLtMatmul fp8(M={m}, N={n}, K={k})")

    def fp8_plan_ok(self, m: int, n: int, k: int, beta: float, align: int, ldc: int) -> bool:
        """Whether gemm_fp8 has a plan for this shape (the heuristic refuses some: remembered)."""
        key = (int(m), int(n), int(k), float(beta), int(align), int(ldc))
        if key in self._fp8_refused:
            return False
        try:
            self.plan(m, n, k, beta, align, ldc=ldc, fp8=True)
        except DeviceError:
            self._fp8_refused.add(key)
            return False
        return True

    def fp8_supported(self) -> bool:
        """Whether this device's cuBLASLt has block-scaled e4m3 GEMMs with fp32 output (Hopper,
        cuBLAS 12.9+): the heuristic asked for one small shape."""
        if self.f32:
            return False
        try:
            self.plan(64, 256, 4 * FP8_BLOCK, 0.0, fp8=True)
        except DeviceError:
            return False
        return True

    # -- grouped GEMM: every group's rows and operand addresses read from device arrays --------

    def has_grouped_gemm(self) -> bool:
        """Whether this cuBLASLt has the experimental grouped GEMM (cuBLAS 13.10 has it, 13.1
        not) for this handle's type (bf16 only)."""
        return not self.f32 and hasattr(self.lib, "cublasLtGroupedMatrixLayoutCreate")

    def grouped_plan(self, n: int, k: int, groups: int, rows_dev: int, n_dev: int, k_dev: int,
                     avg_rows: int) -> GroupedPlan:
        """A plan for `groups` products y_g[m_g, n] (fp32) = x_g[m_g, k] @ w_g[n, k]^T (bf16)
        whose m_g the device writes at `rows_dev` (int32 [groups]) before each call: the MoE
        prefill's experts, routed on the device (no host round trip). n_dev / k_dev: int32
        [groups] arrays holding n and k (the layouts read every dimension from the device).
        `avg_rows` is the heuristic's hint for m_g. Raises DeviceError where this cuBLASLt has
        no grouped GEMM (the experimental CUBLASLT_BATCH_MODE_GROUPED: cuBLAS 13.10 has it,
        13.1 not) or no algorithm for it (moe_route.DeviceRoute.bind asks once)."""
        key = ("grouped", int(n), int(k), int(groups), int(rows_dev), int(n_dev), int(k_dev),
               int(avg_rows))
        p = self._plans.get(key)
        if p is not None:
            return p
        t0 = time.perf_counter()
        try:
            return self._new_grouped_plan(key, n, k, groups, rows_dev, n_dev, k_dev, avg_rows)
        finally:
            self.plan_seconds += time.perf_counter() - t0

    def _new_grouped_plan(self, key, n, k, groups, rows_dev, n_dev, k_dev,
                          avg_rows) -> GroupedPlan:
        if not self.has_grouped_gemm():
            raise DeviceError("cuBLASLt: no grouped GEMM here (needs cuBLAS 13's "
                              "cublasLtGroupedMatrixLayoutCreate; bf16 only)")
        lib = self.lib
        create = lib.cublasLtGroupedMatrixLayoutCreate
        vp = ctypes.c_void_p
        create.argtypes = [ctypes.POINTER(vp), ctypes.c_int, ctypes.c_int, vp, vp, vp]
        create.restype = ctypes.c_int
        desc, pref = vp(), None
        a, b, c = vp(), vp(), vp()
        try:
            lt_check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                     "cublasLtMatmulDescCreate")
            for attr, v in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N),
                            (DESC_POINTER_MODE, POINTER_MODE_DEVICE)):
                cv = ctypes.c_int32(v)
                lt_check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(cv), 4),
                         f"set matmul attribute {attr}")
            # column-major view as plan(): A = W_g as k x n (ld k), B = X_g as k x m_g (ld k),
            # D = Y_g as n x m_g (ld n)
            lt_check(create(ctypes.byref(a), self.ab_type, groups, vp(k_dev), vp(n_dev), vp(k_dev)),
                     "grouped layout A")
            lt_check(create(ctypes.byref(b), self.ab_type, groups, vp(k_dev), vp(rows_dev),
                            vp(k_dev)), "grouped layout B")
            lt_check(create(ctypes.byref(c), CUDA_R_32F, groups, vp(n_dev), vp(rows_dev),
                            vp(n_dev)), "grouped layout D")
            pref = self._new_pref({PREF_GROUPED_AVG_ROWS: n, PREF_GROUPED_AVG_COLS: max(1, avg_rows),
                                   PREF_GROUPED_AVG_K: k})
            res = (HeuristicResult * 1)()
            count = ctypes.c_int(0)
            lt_check(lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, a, b, c, c, pref, 1,
                                                        res, ctypes.byref(count)),
                     f"cublasLtMatmulAlgoGetHeuristic(grouped N={n}, K={k}, groups={groups})")
            if count.value < 1:
                raise DeviceError(f"cuBLASLt: no algorithm for the grouped GEMM N={n} K={k}")
        except BaseException:
            _destroy_partial(lib, (a, b, c), desc, pref)
            raise
        p = GroupedPlan()
        p.desc, p.layouts, p.n, p.k, p.groups = desc, (a, b, c), int(n), int(k), int(groups)
        p.algo = HeuristicResult()
        ctypes.memmove(ctypes.byref(p.algo), ctypes.byref(res[0]), ctypes.sizeof(HeuristicResult))
        # the preference is the plan's own (its hints are per plan): destroyed with it
        self._prefs[key] = pref
        self._plans[key] = p
        return p

    def grouped_gemm(self, stream, p: GroupedPlan, w_ptrs: int, x_ptrs: int, y_ptrs: int,
                     one_dev: int, zero_dev: int) -> None:
        """Run a grouped plan: w_ptrs / x_ptrs / y_ptrs are device arrays (uint64 [groups]) of
        each group's operand addresses; one_dev / zero_dev device float32 1.0 and 0.0 (alpha and
        beta: the grouped mode reads them by device pointer)."""
        a, b, c = p.layouts
        self.calls += 1
        lt_check(self.lib.cublasLtMatmul(self.handle, p.desc, ctypes.c_void_p(one_dev), w_ptrs, a,
                                         x_ptrs, b, ctypes.c_void_p(zero_dev), y_ptrs, c, y_ptrs,
                                         c, ctypes.byref(p.algo.algo), self.workspace_ptr,
                                         self.workspace_bytes,
                                         ctypes.c_void_p(int(stream.handle))),
                 f"cublasLtMatmul(grouped N={p.n}, K={p.k}, groups={p.groups})")
