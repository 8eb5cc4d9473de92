#!/usr/bin/env bash
# The GPU tests and the benchmarks in one command, on a machine with the GPU (docs/gpu.md):
#
#     bash bench/gpu_check.sh [tests] [gdn] [sample] [decode] [fp8] [moe] [cache] [tier] [mixed]
#                             [vision] [mtp] [spec] [table25] [profile] [prefill] [fused] [wide]
#                             [full]
#                       (default: all but fp8, moe, cache, tier, mixed, vision, mtp, spec,
#                        table25, profile, prefill, fused, wide, full)
#
# Logs go to $OUT (default ./gpu_out); a short summary of each part is printed last. "full" runs
# bench_decode over every shape, prefill size, context and batch of docs/performance.md; "decode"
# only the 27B and 35B-A3B rows the issue's milestones name.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.:bench${PYTHONPATH:+:$PYTHONPATH}
export NINFER_KERNEL_CACHE=${NINFER_KERNEL_CACHE:-$PWD/.kcache}
parts=${*:-tests gdn sample decode}
# The Cython hot loop (ninfer/_hot) is built for this machine's Python: an extension built elsewhere
# (another Python version) is not loaded, and the pure-Python twins would be measured instead.
python3 setup.py -q build_ext --inplace >"$OUT/hot_build.log" 2>&1
python3 -c "import ninfer._hot.pages as p; print('ninfer._hot:', p.__file__)" >>"$OUT/hot_build.log" 2>&1
summary=()
for part in $parts; do
    t0=$(date +%s)
    case $part in
        tests)
            # (the CPU simulator tests of the other tests/test_cuda_*_nogpu.py files run in CI)
            timeout 560 python3 -m pytest -q -rfE -p no:cacheprovider --durations=15 tests/gpu \
                tests/test_cuda_nogpu.py \
                >"$OUT/tests.log" 2>&1
            summary+=("tests: $(tail -1 "$OUT/tests.log")") ;;
        gdn)
            timeout 150 python3 bench/bench_gdn_chunk.py --tokens 4096 --sweep >"$OUT/gdn.log" 2>&1
            summary+=("gdn: rc=$? (see gdn.log)") ;;
        sample)
            timeout 120 python3 bench/bench_sample.py >"$OUT/sample.log" 2>&1
            summary+=("sample: rc=$? (see sample.log)") ;;
        decode)
            timeout 300 python3 bench/bench_decode.py --shapes 27b,35b-a3b --prefill 512,4096 \
                --contexts 2048 --batches 1 --profile --out "$OUT/decode.json" >"$OUT/decode.log" 2>&1
            summary+=("decode: rc=$? (see decode.log)") ;;
        fp8)
            # packed weights and the W8A8 prefill: their GPU tests, the GEMM options, and fp8
            # Engine rows of $FP8_SHAPES (default 35b-a3b; each converted from random weights
            # first, ~5 minutes: one shape per device call)
            timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_quant_gpu.py \
                tests/gpu/test_kv_quant_gpu.py tests/gpu/test_fp8_prefill_gpu.py >"$OUT/fp8_tests.log" 2>&1
            timeout 200 python3 bench/bench_fp8_gemm.py >"$OUT/fp8_gemm.log" 2>&1
            for shape in ${FP8_SHAPES:-35b-a3b}; do
                rm -rf /tmp/ninfer-bench
                timeout 560 python3 bench/bench_engine.py --shapes $shape --direct --quantize fp8 \
                    --prefill 512,4096 --batches 1,8 --modes greedy --steps 50 --profile-kernels \
                    >"$OUT/engine_${shape}_fp8.log" 2>&1
            done
            summary+=("fp8: $(tail -1 "$OUT/fp8_tests.log") (see fp8_*.log, engine_*_fp8.log)") ;;
        moe)
            # packed experts' MoE prefill: the grouped tensor-core GEMV's GPU tests, then a
            # 10-layer 35B-A3B in fp8 through the Engine with it and without it (--moe-dequant)
            timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_quant_gpu.py \
                -k "grouped or whole_model or expert" >"$OUT/moe_tests.log" 2>&1
            for flag in "" --moe-dequant; do
                timeout 240 python3 bench/bench_engine.py --shapes 35b-a3b@10 --direct --quantize fp8 \
                    --workdir /dev/shm/nb --prefill 512,4096 --batches 1 --modes greedy --steps 30 \
                    $flag --profile-kernels >"$OUT/engine_35b10_fp8${flag:+_dequant}.log" 2>&1
            done
            summary+=("moe: $(tail -1 "$OUT/moe_tests.log") (see engine_35b10_fp8*.log)") ;;
        cache)
            # the context cache: its GPU tests, then bench_context_cache (chat: 8 turns of 1,024
            # user + 256 answer tokens, with the cache's per-turn work; agent: 8 sessions on an
            # 8K system prompt) for each of $CACHE_SHAPES (default 9b; "9b 27b" for both)
            timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "cache" \
                >"$OUT/cache_tests.log" 2>&1
            for shape in ${CACHE_SHAPES:-9b}; do
                rm -rf /tmp/ninfer-bench     # (disk: a 27B artifact is 54 GB)
                timeout 500 python3 bench/bench_context_cache.py --backend cuda --shape $shape \
                    --direct --turns 8 --out "$OUT/cache_$shape.json" >"$OUT/cache_$shape.log" 2>&1
            done
            summary+=("cache: $(tail -1 "$OUT/cache_tests.log") (see cache_*.log)") ;;
        tier)
            # the context cache's host tier (cuda/host_tier.py): its GPU tests, then the 9B chat
            # with the device tier too small for a checkpoint (every one on the host) and with a
            # small one (checkpoints demoted), each with demotions on the copy stream
            # (--async-host-copies) and without
            timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu -k "cache" \
                >"$OUT/tier_tests.log" 2>&1
            for frac in 0.005 0.05; do
                for flag in "" --async-host-copies; do
                    timeout 200 python3 bench/bench_context_cache.py --backend cuda --shape 9b \
                        --direct --turns 8 --workloads chat --device-fraction $frac $flag \
                        >"$OUT/tier_9b_${frac}${flag:+_async}.log" 2>&1
                done
            done
            summary+=("tier: $(tail -1 "$OUT/tier_tests.log") (see tier_9b_*.log)") ;;
        mixed)
            # the host's work beside the GPU's: the GPU tests of the pipelined decode and of
            # mixed batches; 9B greedy decode through the Engine with steps launched ahead
            # (the default) and one by one (--no-chain); decode rows beside a prefill chunk, one forward
            # (CudaModel.mixed_batches) against two (7 decoders + a 4096-token prompt)
            timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_engine_gpu.py \
                -k "mixed or pipelined" >"$OUT/mixed_tests.log" 2>&1
            for flag in "" --no-chain; do
                timeout 200 python3 bench/bench_engine.py --shapes 9b --prefill 512 --batches 1,8 \
                    --modes greedy --steps 50 $flag \
                    >"$OUT/engine_9b${flag:+_serial}.log" 2>&1
            done
            timeout 300 python3 bench/bench_mixed.py --shape 9b --out "$OUT/mixed.json" \
                >"$OUT/mixed.log" 2>&1
            summary+=("mixed: $(tail -1 "$OUT/mixed_tests.log") (see engine_9b*.log, mixed.log)") ;;
        vision)
            # the device vision tower: its GPU tests, images/s of the 27B, 9B, 35B-A3B towers
            # (vis_flash_attention), the 27B tower with the GEMM attention (profiled), then TTFT of
            # image chats and decode beside the tower through the Engine (a random 9B + tower)
            timeout 150 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_vision_gpu.py \
                >"$OUT/vision_tests.log" 2>&1
            for geometry in 27b 9b 35b-a3b; do
                timeout 90 python3 bench/bench_vision.py --geometry $geometry \
                    --sizes 448,1024,2048 >"$OUT/vision_$geometry.log" 2>&1
            done
            timeout 90 python3 bench/bench_vision.py --geometry 27b --sizes 448,1024,2048 \
                --gemm-attention --profile >"$OUT/vision_27b_gemm.log" 2>&1
            timeout 300 python3 bench/bench_vision.py --engine 9b --sizes 1024,448 --tower-sms auto,0 \
                >"$OUT/vision_engine_9b.log" 2>&1
            summary+=("vision: $(tail -1 "$OUT/vision_tests.log") (see vision_*.log)") ;;
        mtp)
            # speculation with the MTP head on the device (issue 25): the GPU tests of its step,
            # its verify and the Engine's speculative units; one draft token, the drafter's
            # 64-position feed and a verify of 4 positions against a decode step at the 9B, 27B,
            # 35B-A3B shapes; the reference models end to end at their own and at set acceptances
            timeout 600 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_mtp_gpu.py \
                tests/gpu/test_speculative_gpu.py >"$OUT/mtp_tests.log" 2>&1
            timeout 300 python3 bench/bench_mtp.py --shapes 9b,27b,35b-a3b >"$OUT/mtp.log" 2>&1
            timeout 600 python3 bench/bench_speculative.py --backend cuda --ks 1,3 --adaptive 4 \
                --oracle 0.5,0.9 --json "$OUT/speculative_cuda.json" >"$OUT/speculative.log" 2>&1
            # the 9B shape (random weights + an MTP head) at B = 1 and 8: its own (rejected)
            # drafts and a set acceptance of 0.7 per position
            for b in 1 8; do
                timeout 400 python3 bench/bench_speculative.py --backend cuda --shapes 9b --batch $b \
                    --prompts 8 --ks 3 --adaptive 4 --oracle 0.7 \
                    --json "$OUT/speculative_9b_b$b.json" >"$OUT/speculative_9b_b$b.log" 2>&1
            done
            summary+=("mtp: $(tail -1 "$OUT/mtp_tests.log") (see mtp.log, speculative*.log)") ;;
        spec)
            # issue 25's floor (>= 0.97x plain decoding at any acceptance): the 9B's own head
            # (acceptance 0) at B = 8 and 4 (200 tokens) and B = 1 (64), adaptive k only; then where
            # the drafter's catch-up feeds go (bench_catch_up.py: each feed timed, run again at
            # its token count and at one fewer). H100 12-07 before cuBLASLt shared algorithms
            # past 8 rows: B = 8 0.93x, B = 1 0.96x; a feed of 337 positions 19.5 ms cold, 3.3 warm;
            # with them (exploration budget 5%): B = 8 0.94-0.95x, B = 1 0.97x, 336 after 337 warm
            # (those in one process, plain decoding first: ~2% in its favour, a process's first
            # Engine's; bench_speculative now runs each configuration in a process of its own)
            for b in 8 4 1; do
                timeout 200 python3 bench/bench_speculative.py --backend cuda --shapes 9b --batch $b \
                    --prompts 8 --ks "" --adaptive 4 --max-tokens $((b == 1 ? 64 : 200)) \
                    >"$OUT/spec_floor_b$b.log" 2>&1
            done
            timeout 200 python3 bench/bench_catch_up.py --backend cuda --shapes 9b --batch 8 \
                --prompts 8 --ks "" --adaptive 4 --max-tokens 200 >"$OUT/catch_up.log" 2>&1
            # the shared algorithms' cost to prefills of other lengths (--own-algos: each GEMM
            # on its own shape's algorithm beside)
            timeout 200 python3 bench/bench_decode.py --shapes 9b,35b-a3b --prefill 100,500,3000 \
                --contexts 2048 --batches 1 --steps 5 --own-algos >"$OUT/own_algos.log" 2>&1
            summary+=("spec: B=8 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/spec_floor_b8.log")," \
                      "B=4 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/spec_floor_b4.log")," \
                      "B=1 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/spec_floor_b1.log")" \
                      "(see spec_floor_*.log, catch_up.log, own_algos.log)") ;;
        table25)
            # issue 25's table in one call (docs/performance.md "Speculative decoding with the
            # MTP head", targets set for the H200): a verify of 4 positions and one draft token
            # against a decode step (9B, 27B, B = 1); the 9B at B = 1 with drafts replaced by the
            # target's own token at the dense reference model's measured acceptance by position
            # (0.76 / 0.40 / 0.25 at k = 3, 2.38 tokens a verify; 0.09 the fourth's), k = 3 and
            # adaptive; the floor (the 9B's own head, adaptive) at B = 8, 4, 1
            timeout 150 python3 bench/bench_mtp.py --shapes 9b,27b --batch 1 >"$OUT/t25_pieces.log" 2>&1
            timeout 200 python3 bench/bench_speculative.py --backend cuda --shapes 9b --batch 1 \
                --prompts 8 --ks 3 --adaptive 4 --oracle 0.76/0.40/0.25/0.09 \
                >"$OUT/t25_speedup.log" 2>&1
            for b in 8 4 1; do
                timeout 150 python3 bench/bench_speculative.py --backend cuda --shapes 9b --batch $b \
                    --prompts 8 --ks "" --adaptive 4 --max-tokens $((b == 1 ? 64 : 200)) \
                    >"$OUT/t25_floor_b$b.log" 2>&1
            done
            summary+=("table25: pieces $(grep -c verify_vs_decode "$OUT/t25_pieces.log") rows;" \
                      "floor B=8 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/t25_floor_b8.log")," \
                      "B=4 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/t25_floor_b4.log")," \
                      "B=1 $(awk -F'|' '/^\| adaptive/ {print $9}' "$OUT/t25_floor_b1.log")" \
                      "(see t25_*.log)") ;;
        fused)
            # the decode's fused launches (issue 26): the GPU tests of the norm in the GEMV's
            # prologue, the router in the gate|up GEMV, the fused MoE tail, PDL and the attention
            # on tensor cores; then the 35B-A3B and 2B decode with each norm in its product's
            # prologue (--fuse-norm 1) and as its own kernel (0), at the GEMV's default threshold
            # and one that takes the input projections too (64 MB), the router fused or not, PDL
            # on (the MoE model's default; forced for the 2B); the attention's two kernels
            timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_model_gpu.py \
                tests/gpu/test_pdl_gpu.py tests/gpu/test_ops_gpu.py \
                -k "moe or pdl or graph or tensor_cores or paged_attention_mma" \
                >"$OUT/fused_tests.log" 2>&1
            timeout 150 python3 bench/bench_decode.py --shapes 35b-a3b --prefill 64 --contexts 2048 \
                --batches 1,2,8 --steps 30 --fuse-norm 1,0 --gemv-max-mb 16,64 --fuse-router 1,0 \
                >"$OUT/fused_35b.log" 2>&1
            # the attention on tensor cores against the CUDA-core kernel at long contexts
            timeout 150 python3 bench/bench_decode.py --shapes 27b,9b --prefill 64 \
                --contexts 2048,32768 --batches 1,8 --steps 10 --attn-mma 1,0 \
                >"$OUT/fused_attn.log" 2>&1
            NINFER_PDL=1 timeout 150 python3 bench/bench_decode.py --shapes 2b --prefill 64 \
                --contexts 2048 --batches 1,8 --steps 30 --fuse-norm 1,0 --gemv-max-mb 16,64 \
                >"$OUT/fused_2b.log" 2>&1
            summary+=("fused: $(tail -1 "$OUT/fused_tests.log") (see fused_*.log)") ;;
        profile)
            # GPU time per kernel inside the captured decode graph (tools/profile_graph.py: CUPTI
            # through torch.profiler, the image's torch), B = 1 and 8 at context 2048, for each
            # of $PROFILE_SHAPES (default: the MoE and the dense release of the issue's table)
            for shape in ${PROFILE_SHAPES:-35b-a3b 27b 9b 2b}; do
                timeout 120 python3 tools/profile_graph.py --shape $shape --batches 1,8 --reps 10 \
                    >"$OUT/profile_$shape.log" 2>&1
            done
            summary+=("profile: $(grep -h "kernels sum" "$OUT"/profile_*.log | tr '\n' ';')") ;;
        prefill)
            # the prefill's pieces and rows (issue 26): the delta rule's kernels and the grouped
            # GEMMs on the GPU, one GDN layer's scan, our grouped GEMM beside the host path per
            # layer, then every shape's prefill with its per-kernel profile (the MoE prefill
            # routed on the device, the default, with the host route beside: ms_host_route)
            timeout 240 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_gdn_chunk_gpu.py \
                tests/gpu/test_ops_gpu.py -k "gdn or moe_route" >"$OUT/prefill_tests.log" 2>&1
            timeout 120 python3 bench/bench_gdn_chunk.py --tokens 4096 --nv 48 >"$OUT/gdn48.log" 2>&1
            timeout 90 python3 bench/bench_gdn_chunk.py --tokens 4096 --nv 32 >"$OUT/gdn32.log" 2>&1
            timeout 120 python3 bench/probe_grouped_gemm.py --tokens 64,512,4096 >"$OUT/probe.log" 2>&1
            timeout 240 python3 bench/bench_decode.py --shapes 35b-a3b,9b,2b,27b --prefill 512,4096 \
                --contexts 2048 --batches 1 --steps 5 --profile --out "$OUT/prefill.json" \
                >"$OUT/prefill.log" 2>&1
            summary+=("prefill: $(tail -1 "$OUT/prefill_tests.log") (see gdn*.log, probe.log, prefill.log)") ;;
        wide)
            # the prefill's elementwise kernels (issue 26, 12-07): the SwiGLU four columns a
            # thread (silu_mul4), the GDN gated norm a warp a head (gated_rmsnorm4), the
            # attention softmax with the row in registers (causal_softmax_reg), the conv 16
            # tokens a block (conv_silu_chunk): their op tests,
            # the whole-model tests, decode rows with the 4-wide kernels and without (--wide-kernels),
            # the 9B and 27B prefill profiles (before them, H100 9B 4096: silu_mul 8.86,
            # gated_rmsnorm 4.61, causal_softmax 6.04, conv_silu 5.55 ms; 27B: silu_mul 25.4,
            # causal_softmax 17.9)
            timeout 200 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_ops_gpu.py \
                -k "gated or silu or softmax or tensor_core or conv" >"$OUT/wide_tests.log" 2>&1
            timeout 300 python3 -m pytest -q -rfE -p no:cacheprovider tests/gpu/test_model_gpu.py \
                >>"$OUT/wide_tests.log" 2>&1
            timeout 120 python3 bench/bench_decode.py --shapes 2b,9b --prefill 64 --contexts 2048 \
                --batches 1,8 --steps 30 --wide-kernels 1,0,1,0 >"$OUT/wide_decode.log" 2>&1
            timeout 200 python3 bench/bench_decode.py --shapes 9b,27b --prefill 4096 --contexts 2048 \
                --batches 1 --steps 3 --profile >"$OUT/wide_prefill.log" 2>&1
            summary+=("wide: $(grep -E 'passed|failed' "$OUT/wide_tests.log" | tr '\n' ' ') (see wide_*.log)") ;;
        full)
            python3 bench/bench_decode.py --profile --steps 30 --out "$OUT/full.json" >"$OUT/full.log" 2>&1
            summary+=("full: rc=$? (see full.log)") ;;
        *) echo "unknown part $part"; exit 2 ;;
    esac
    summary[-1]="${summary[-1]} [$(( $(date +%s) - t0 )) s]"
done
for s in "${summary[@]}"; do echo "$s"; done
