"""The chunked gated delta rule (kernels/gdn_chunk.py) on the GPU: against a float64 sequential
oracle and against gdn_recurrent on the same inputs (outputs and final states), at the real head
geometries (27B: 16/48 heads of 128; 9B/35B-A3B: 16/32) and small odd ones, rows of 1 to 5000
tokens across chunk boundaries, fresh and continued states, NaN-poisoned outputs/workspace; the
fp32 kernels and, where the geometry takes them, the tensor-core (tf32) variants of a bf16 model."""
import numpy as np
import pytest

from gpu_harness import TOL_F32, TOL_TF32, rel_err
from oracles import gated_delta_rows, gdn_inputs
from ninfer.models.qwen3_5.cuda import gdn_chunk as gc
from ninfer.models.qwen3_5.cuda.kernel_set import gdn_chunk_specs

pytestmark = pytest.mark.gpu


@pytest.fixture
def g(gpu):
    yield gpu
    gpu.reset()


def run_case(g, dk, dv, nk, nv, lengths, ctxs, seed, strong_decay=False, tc=False):
    r = np.random.default_rng(seed)
    n, nb = sum(lengths), len(lengths)
    qs = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ctx = np.asarray(ctxs, np.int32)
    qkv, proj, P, a_off, b_off, A_log, dt_bias = gdn_inputs(r, dk, dv, nk, nv, n, strong_decay)
    slots = r.permutation(nb + 1)[:nb].astype(np.int32)
    state0 = (0.3 * r.standard_normal((nb + 1, nv, dk, dv))).astype(np.float32)
    d_qkv, d_proj, d_alog, d_dtb, d_qs, d_ctx, d_slots = (
        g.put(x) for x in (qkv, proj, A_log, dt_bias, qs, ctx, slots))
    specs = gdn_chunk_specs(dk, dv, nk, nv, tc=tc)
    cn = dict(specs["gdn_chunk_prep" + ("_tc" if tc else "")].params)["Cn"]
    tol = TOL_TF32 if tc else TOL_F32
    rows = [(int(qs[i]), lengths[i], int(ctx[i])) for i in range(nb)]

    def launch(name, grid, block, args):
        g.cache.get(specs[name]).launch(g.stream, grid, block, args)

    def chunked():
        st = g.put(state0)
        out = g.empty((n, nv * dv), np.float32)
        bufs = {k: g.empty(s, np.float32) for k, s in         # (NaN-poisoned)
                gc.buffer_shapes(n, nv, dk, cn, dv if tc else 0, nb).items()}
        gc.launch(launch, dk, dv, nv, cn, nb, gc.max_chunks(rows, n, nb, cn), core=out,
                  w=bufs["w"], p=bufs["p"], g=bufs["g"], qkv=d_qkv, proj=d_proj, proj_stride=P,
                  a_off=a_off, b_off=b_off, a_log=d_alog, dt_bias=d_dtb, state=st,
                  query_start=d_qs, context_lens=d_ctx, state_slots=d_slots, tc=tc,
                  s=bufs.get("s"))
        return out, st

    out_c, st_c = chunked()
    # recurrent, same inputs
    st_r = g.put(state0)
    out_r = g.empty((n, nv * dv), np.float32)
    g.run("gdn_recurrent", (nb, nv, (dv + 31) // 32), (128,),
          (out_r, d_qkv, d_proj, P, a_off, b_off, d_alog, d_dtb, st_r, d_qs, d_ctx, d_slots),
          dict(dk=dk, dv=dv, nk=nk, nv=nv))
    oc, sc = g.get(out_c).reshape(n, nv, dv), g.get(st_c)
    orr, sr = g.get(out_r).reshape(n, nv, dv), g.get(st_r)

    ref, ref_state = gated_delta_rows(qkv, proj, a_off, b_off, A_log, dt_bias, state0, slots, ctx,
                                      qs, nk, nv, dk, dv)
    assert rel_err(oc, ref) < tol
    assert rel_err(sc, ref_state) < tol
    assert rel_err(orr, ref) < TOL_F32 and rel_err(sr, ref_state) < TOL_F32
    assert rel_err(oc, orr) < tol
    assert rel_err(sc, sr) < tol
    spare = np.setdiff1d(np.arange(nb + 1), slots)
    assert np.array_equal(sc[spare], state0[spare])             # no other slot touched
    # per row too: a short row next to long ones is not hidden by the batch norm
    for row in range(nb):
        t0, t1 = qs[row], qs[row + 1]
        assert rel_err(oc[t0:t1], ref[t0:t1]) < tol, row
        assert rel_err(sc[slots[row]], ref_state[slots[row]]) < tol, row


GEOMETRIES = [(128, 128, 16, 48), (128, 128, 16, 32), (12, 20, 2, 6), (64, 40, 1, 2),
              (256, 128, 2, 4), (64, 64, 2, 2)]


@pytest.mark.parametrize("dk,dv,nk,nv,tc",
                         [(*geo, False) for geo in GEOMETRIES]
                         + [(*geo, True) for geo in GEOMETRIES if gc.tc_ok(geo[0], geo[1])])
def test_gdn_chunk_boundary_rows(g, dk, dv, nk, nv, tc):
    cn = gc.TC_CHUNK if tc else gc.chunk_size(dk)
    lengths = [1, cn - 1, cn, cn + 1, 3 * cn + 7, 2]
    ctxs = [0, 5, 0, 17, 3, 0]
    run_case(g, dk, dv, nk, nv, lengths, ctxs, seed=dk + dv + nv, tc=tc)


@pytest.mark.parametrize("tc", [False, True])
def test_gdn_chunk_strong_decay(g, tc):
    run_case(g, 128, 128, 16, 48, [200, 1, 65], [0, 4, 9], seed=7, strong_decay=True, tc=tc)


@pytest.mark.parametrize("tc", [False, True])
@pytest.mark.parametrize("lengths,ctxs", [([5000], [0]), ([1000, 1, 2049], [12, 0, 0])])
def test_gdn_chunk_long_rows_27b(g, lengths, ctxs, tc):
    run_case(g, 128, 128, 16, 48, lengths, ctxs, seed=sum(lengths), tc=tc)
