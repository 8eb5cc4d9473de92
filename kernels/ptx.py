"""Single PTX instructions numba-cuda has no name for, as numba intrinsics (inline asm), each
with a twin for numba's CPU simulator that computes the same bits with numpy.

    prmt(a, b, sel)       prmt.b32: byte i of the result is byte sel[4i+3:4i] of the 8-byte b:a
    fma_bf16x2(a, b, c)   fma.rn.bf16x2 on two bf16 lanes (low half = element 0); sm_80+
    and_or(a, b, c)       lop3.b32 with lut 0xEA: (a & b) | c in one instruction (ptxas splits
                          the and and the or of two constants into two)
    cvt_bf16x2(hi, lo)    cvt.rn.bf16x2.f32: two floats -> bf16 pair (round to nearest even)
    ld_v4(p, i)           ld.global.nc.v4.u32 of p[i .. i + 4) (i a multiple of 4: 16 bytes);
                          ld_v2 (8 bytes), ld_1 (one word) likewise
    ld_v4_stream(p, i)    the same for bytes read once: not kept in L1, and L2 fetches the
                          whole 256-byte span from memory (the rest of it is read next);
                          ld_v2_stream, ld_stream likewise
    ld_v4_f32(p, i)       ld.global.nc.v4.f32 of a float32 pointer: four floats
    st_v4(p, i, a, b, c, d)
                          st.global.v4.u32 of four words at p[i .. i + 4) (i a multiple of 4)
    prefetch_l2(p, i)     prefetch.global.L2 of the 128-byte line holding p[i]: the load
                          starts, nothing waits for it (weights a kernel reads next)
    grid_wait()           where the kernel waits for the kernel before it under programmatic
                          dependent launch: a PTX comment, GRID_WAIT_MARK, that the kernel
                          loader (ninfer/core/cuda/kernels.py) turns into griddepcontrol.wait
                          when it launches the kernel that way (else it stays a comment); the
                          code before it may read only what no kernel writes (weights)
    mma_bf16(a0..a3, b0, b1, c0..c3)
                          mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32: a warp's
                          D[16, 8] = A[16, 16] B[16, 8] + C in fp32. Lane l (g = l / 4, t = l % 4)
                          holds A rows g and g + 8 at columns 2t, 2t + 1 (a0, a1) and 2t + 8,
                          2t + 9 (a2, a3), B rows 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1) of
                          column g, and D rows g (d0, d1), g + 8 (d2, d3) at columns 2t, 2t + 1.
                          sm_80+.
    tf32(x)               cvt.rna.tf32.f32: a float rounded to tf32 (10 mantissa bits, ties away
                          from zero), its bits as u32: what mma_tf32 multiplies
    mma_tf32(a0..a3, b0, b1, c0..c3)
                          mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32: a warp's
                          D[16, 8] = A[16, 8] B[8, 8] + C in fp32. Lane l (g = l / 4, t = l % 4)
                          holds A[g, t] (a0), A[g + 8, t] (a1), A[g, t + 4] (a2), A[g + 8, t + 4]
                          (a3), B[t, g] (b0), B[t + 4, g] (b1), and D rows g (d0, d1), g + 8
                          (d2, d3) at columns 2t, 2t + 1. sm_80+.

The mma twins makes the 32 lanes of a simulated warp (Python threads of one block) meet at a
barrier, as the real instruction needs the whole warp; every kernel here calls it with whole warps.
"""
import threading

import numpy as np
from numba import config

GRID_WAIT_MARK = "// ninfer: grid dependency wait"   # (kernels.py's, asserted equal in a test)

if config.ENABLE_CUDASIM:
    def _bf16(bits):
        return float(np.array([(int(bits) & 0xFFFF) << 16], np.uint32).view(np.float32)[0])

    def _to_bf16(v):
        import ml_dtypes
        return int(np.array([v], np.float64).astype(ml_dtypes.bfloat16).view(np.uint16)[0])

    def prmt(a, b, sel):
        src = (int(b) << 32) | int(a)
        out = 0
        for i in range(4):
            j = (int(sel) >> (4 * i)) & 7
            out |= ((src >> (8 * j)) & 0xFF) << (8 * i)
        return np.uint32(out)

    def fma_bf16x2(a, b, c):
        out = 0
        for h in range(2):
            s = 16 * h
            # bf16 products are exact in float64, and so is one add of a bf16 to them here
            v = _bf16(int(a) >> s) * _bf16(int(b) >> s) + _bf16(int(c) >> s)
            out |= _to_bf16(v) << s
        return np.uint32(out)

    def and_or(a, b, c):
        return np.uint32((int(a) & int(b)) | int(c))

    def cvt_bf16x2(hi, lo):
        return np.uint32((_to_bf16(np.float32(hi)) << 16) | _to_bf16(np.float32(lo)))

    def ld_1(p, i):
        return p[i]

    def ld_v2(p, i):
        return p[i], p[i + 1]

    def ld_v4(p, i):
        return p[i], p[i + 1], p[i + 2], p[i + 3]

    ld_stream, ld_v2_stream, ld_v4_stream = ld_1, ld_v2, ld_v4
    ld_v4_f32 = ld_v4

    def st_v4(p, i, a, b, c, d):
        p[i], p[i + 1], p[i + 2], p[i + 3] = a, b, c, d

    def prefetch_l2(p, i):
        p[i]            # (an address past the array fails here as the load would)

    def grid_wait():
        pass

    _WARPS, _LOCK = {}, threading.Lock()

    def _warp_fragments(regs):
        """Every lane's registers of one mma of this simulated warp (a copy), once all 32 lanes
        gave theirs; the caller reads them, then waits at the barrier again (no lane may write
        the next mma's registers before every lane has copied these)."""
        t = threading.current_thread()
        key = (id(t._manager), tuple(t.blockIdx), t.thread_id // 32)
        with _LOCK:
            bar, frags = _WARPS.setdefault(key, (threading.Barrier(32, timeout=300), [None] * 32))
        frags[t.thread_id % 32] = regs
        bar.wait()
        return bar, list(frags), t.thread_id % 32

    def mma_bf16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        bar, frags, lane = _warp_fragments((a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 16))
        B = np.zeros((16, 8))
        for ln, (f0, f1, f2, f3, g0, g1) in enumerate(frags):
            g, q = ln // 4, ln % 4
            for reg, r, c in ((f0, g, 2 * q), (f1, g + 8, 2 * q), (f2, g, 2 * q + 8),
                              (f3, g + 8, 2 * q + 8)):
                A[r, c], A[r, c + 1] = _bf16(reg), _bf16(int(reg) >> 16)
            for reg, k in ((g0, 2 * q), (g1, 2 * q + 8)):
                B[k, g], B[k + 1, g] = _bf16(reg), _bf16(int(reg) >> 16)
        bar.wait()
        D = A @ B
        g, q = lane // 4, lane % 4
        return (np.float32(D[g, 2 * q] + c0), np.float32(D[g, 2 * q + 1] + c1),
                np.float32(D[g + 8, 2 * q] + c2), np.float32(D[g + 8, 2 * q + 1] + c3))

    def tf32(x):
        u = int(np.array([x], np.float32).view(np.uint32)[0])
        return np.uint32(((u + 0x1000) & 0xFFFFE000) & 0xFFFFFFFF)     # magnitude: ties away

    def _f32(bits):
        return float(np.array([int(bits) & 0xFFFFFFFF], np.uint32).view(np.float32)[0])

    def mma_tf32(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        bar, frags, lane = _warp_fragments((a0, a1, a2, a3, b0, b1))
        A = np.zeros((16, 8))
        B = np.zeros((8, 8))
        for ln, (f0, f1, f2, f3, g0, g1) in enumerate(frags):
            g, q = ln // 4, ln % 4
            A[g, q], A[g + 8, q], A[g, q + 4], A[g + 8, q + 4] = (_f32(f) for f in (f0, f1, f2, f3))
            B[q, g], B[q + 4, g] = _f32(g0), _f32(g1)
        bar.wait()
        D = A @ B
        g, q = lane // 4, lane % 4
        return (np.float32(D[g, 2 * q] + c0), np.float32(D[g, 2 * q + 1] + c1),
                np.float32(D[g + 8, 2 * q] + c2), np.float32(D[g + 8, 2 * q + 1] + c3))
else:
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    _I32, _F32 = ir.IntType(32), ir.FloatType()

    def _asm(builder, ret, args, text, constraints):
        ftype = ir.FunctionType(ret, [a.type for a in args])
        return builder.asm(ftype, text, constraints, list(args), side_effect=False)

    @intrinsic
    def prmt(typingctx, a, b, sel):
        u = types.uint32
        sig = u(u, u, u)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, args, "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r")
        return sig, codegen

    @intrinsic
    def fma_bf16x2(typingctx, a, b, c):
        u = types.uint32
        sig = u(u, u, u)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, args, "fma.rn.bf16x2 $0, $1, $2, $3;", "=r,r,r,r")
        return sig, codegen

    @intrinsic
    def and_or(typingctx, a, b, c):
        u = types.uint32
        sig = u(u, u, u)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, args, "lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r")
        return sig, codegen

    @intrinsic
    def cvt_bf16x2(typingctx, hi, lo):
        f = types.float32
        sig = types.uint32(f, f)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, args, "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f")
        return sig, codegen

    def _ld(qualifiers, n):
        # ld.global.nc of n (1, 2, 4) consecutive u32 words at p[i]: a tuple of n
        vec = f".v{n}" if n > 1 else ""
        outs = ", ".join(f"${j}" for j in range(n))
        text = f"ld.global.nc{qualifiers}{vec}.u32 " + (f"{{{outs}}}" if n > 1 else outs) \
            + f", [${n}];"
        constraints = ",".join(["=r"] * n + ["l"])

        def ld(typingctx, p, i):
            sig = (types.UniTuple(types.uint32, n) if n > 1 else types.uint32)(p, types.int64)

            def codegen(context, builder, sig, args):
                addr = builder.gep(args[0], [args[1]])
                if n == 1:
                    return _asm(builder, _I32, [addr], text, constraints)
                res = _asm(builder, ir.LiteralStructType([_I32] * n), [addr], text, constraints)
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, j) for j in range(n)])
            return sig, codegen
        ld.__name__ = f"ld_{n}" + qualifiers.replace(".", "_").replace(":", "_")
        return intrinsic(ld)

    _STREAM = ".L1::no_allocate.L2::256B"
    ld_1, ld_v2, ld_v4 = _ld("", 1), _ld("", 2), _ld("", 4)
    ld_stream, ld_v2_stream, ld_v4_stream = _ld(_STREAM, 1), _ld(_STREAM, 2), _ld(_STREAM, 4)

    @intrinsic
    def ld_v4_f32(typingctx, p, i):
        # ld.global.nc.v4.f32 of p[i .. i + 4) (a float32 pointer; i a multiple of 4)
        f = types.float32
        sig = types.UniTuple(f, 4)(p, types.int64)

        def codegen(context, builder, sig, args):
            addr = builder.gep(args[0], [args[1]])
            res = _asm(builder, ir.LiteralStructType([_F32] * 4), [addr],
                       "ld.global.nc.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,l")
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(res, j) for j in range(4)])
        return sig, codegen

    @intrinsic
    def st_v4(typingctx, p, i, a, b, c, d):
        # st.global.v4.u32 [p + 4 i], {a, b, c, d} (i a multiple of 4: 16 bytes)
        u = types.uint32
        sig = types.void(p, types.int64, u, u, u, u)

        def codegen(context, builder, sig, args):
            addr = builder.gep(args[0], [args[1]])
            ftype = ir.FunctionType(ir.VoidType(), [addr.type] + [_I32] * 4)
            builder.asm(ftype, "st.global.v4.u32 [$0], {$1, $2, $3, $4};", "l,r,r,r,r",
                        [addr, *args[2:]], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def prefetch_l2(typingctx, p, i):
        sig = types.void(p, types.int64)

        def codegen(context, builder, sig, args):
            addr = builder.gep(args[0], [args[1]])
            builder.asm(ir.FunctionType(ir.VoidType(), [addr.type]), "prefetch.global.L2 [$0];",
                        "l", [addr], side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    @intrinsic
    def grid_wait(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            # side_effect: kept, and no load of the kernel's moves above it
            builder.asm(ir.FunctionType(ir.VoidType(), []), GRID_WAIT_MARK, "", [],
                        side_effect=True)
            return context.get_dummy_value()
        return sig, codegen

    def _mma(shape_types):
        """mma.sync.aligned.<shape_types> {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}: A and B as u32
        registers, C and D fp32 (the two shapes below share every operand count)."""
        def mma(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
            u, f = types.uint32, types.float32
            sig = types.UniTuple(f, 4)(u, u, u, u, u, u, f, f, f, f)

            def codegen(context, builder, sig, args):
                res = _asm(builder, ir.LiteralStructType([_F32] * 4), args,
                           f"mma.sync.aligned.{shape_types} {{$0, $1, $2, $3}}, "
                           "{$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                           "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
                return context.make_tuple(builder, sig.return_type,
                                          [builder.extract_value(res, j) for j in range(4)])
            return sig, codegen
        mma.__name__ = "mma_" + shape_types.split(".")[-2]
        return intrinsic(mma)

    mma_bf16 = _mma("m16n8k16.row.col.f32.bf16.bf16.f32")
    mma_tf32 = _mma("m16n8k8.row.col.f32.tf32.tf32.f32")

    @intrinsic
    def tf32(typingctx, x):
        sig = types.uint32(types.float32)

        def codegen(context, builder, sig, args):
            return _asm(builder, _I32, args, "cvt.rna.tf32.f32 $0, $1;", "=r,f")
        return sig, codegen
