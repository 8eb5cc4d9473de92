"""Stress: a few hundred requests, random lengths, random cancels and abandons, a tiny KV pool.
Every handle resolves exactly once, finished requests match their uninterrupted run, and nothing
is left in the Program."""
import gc
import random
import threading
import time

import pytest

from ninfer.api import SamplingParams
from runtime_helpers import drain, make_core, prompt, reference_tokens

pytestmark = pytest.mark.timeout(120)

NUM_REQUESTS = 300
MAX_CONTEXT = 32


@pytest.mark.parametrize("seed", [2024, 7])
def test_stress_random_cancels_abandons_tiny_pool(seed):
    core, model = make_core(max_concurrency=4, max_context=MAX_CONTEXT, page_size=4,
                            num_kv_pages=10, prefill_chunk=5, max_queue=400,
                            host_snapshot_bytes=3000)
    rng = random.Random(seed)
    plans = []
    for i in range(NUM_REQUESTS):
        sampling = rng.choice([dict(), dict(temperature=1.0, top_k=20, seed=rng.randrange(1 << 30))])
        # prompt + max_tokens may pass the 32-token context: clamped, the output ends there
        params = SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.7,
                                clamp_max_tokens=True, **sampling)
        fate = rng.choices(["keep", "cancel", "cancel_later", "abandon"], [6, 1, 1, 1])[0]
        plans.append((prompt(1000 + i, rng.randint(1, 20)), params, fate, rng.random() * 0.02))

    outcomes, errors = {}, []

    def client(indices):
        try:
            for i in indices:
                p, params, fate, delay = plans[i]
                h = core.submit(p, params, request_id=f"s{i}")
                if fate == "cancel":
                    h.cancel()
                elif fate == "cancel_later":
                    threading.Timer(delay, h.cancel).start()
                elif fate == "abandon":
                    channel = h._channel
                    del h                              # dropped: cancel + consumer release
                    outcomes[i] = ("abandoned", channel)
                    continue
                outcomes[i] = ("kept", h)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(range(k, NUM_REQUESTS, 4),)) for k in range(4)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    gc.collect()

    checked = 0
    for i, (kind, obj) in sorted(outcomes.items()):
        p, params, fate, _ = plans[i]
        if kind == "abandoned":
            result = obj.wait_result(60)
            assert result.finish_reason in ("cancelled", "length", "stop")
            continue
        _, result = drain(obj, timeout=60)
        want = reference_tokens(p, params, MAX_CONTEXT)
        if fate == "keep":
            assert result.finish_reason in ("length", "stop"), (i, result)
            assert result.token_ids == want, i
            checked += 1
        else:
            assert result.finish_reason in ("cancelled", "length", "stop"), (i, result)
            assert result.token_ids == want[:len(result.token_ids)], i
    assert checked > NUM_REQUESTS // 2
    stats = core.stats()
    assert stats["pauses"] > 0 and stats["requests_finished"] == NUM_REQUESTS
    assert stats["snapshot_resumes"] > 0 and stats["replay_resumes"] > 0
    deadline = time.monotonic() + 10
    while core.stats()["outstanding"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.stats()["outstanding"] == 0
    assert core.health == "ready"
    core.shutdown()
    core.program.assert_all_free()
    assert time.monotonic() - start < 60
