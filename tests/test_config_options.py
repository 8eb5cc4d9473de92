"""EngineOptions: every bad start-up option is a RequestError naming it, before anything loads
(a float max_context used to pass, and the Program's int() of it then failed the Engine)."""
import math

import pytest

from ninfer.errors import RequestError
from ninfer.options import EngineOptions


@pytest.mark.parametrize("field, value, words", [
    ("max_concurrency", 9, "must be in 1..8"),
    ("max_concurrency", "2", "max_concurrency='2'"),
    ("max_concurrency", True, "max_concurrency=True"),
    ("max_context", 1, "max_context=1"),
    ("max_context", 100.5, "max_context=100.5"),
    ("max_queue", -1, "max_queue=-1"),
    ("prefill_chunk", 0, "prefill_chunk=0"),
    ("page_size", 4.0, "page_size=4.0"),
    ("num_kv_pages", 0, "num_kv_pages=0"),
    ("num_kv_pages", 2.5, "num_kv_pages=2.5"),
    ("host_snapshot_bytes", -1, "host_snapshot_bytes=-1"),
    ("queue_timeout_s", 0, "queue_timeout_s=0"),
    ("queue_timeout_s", -1.0, "queue_timeout_s=-1.0"),
    ("queue_timeout_s", math.nan, "queue_timeout_s=nan"),
    ("queue_timeout_s", "5", "queue_timeout_s='5'"),
    ("device_id", -1, "device_id=-1"),
    ("backend", "tpu", "backend='tpu'"),
    ("purpose", "train", "purpose='train'"),
])
def test_bad_option_is_a_request_error_naming_it(field, value, words):
    with pytest.raises(RequestError, match=words.replace(".", r"\.")):
        EngineOptions.from_kwargs(**{field: value})


def test_good_options_pass():
    opts = EngineOptions.from_kwargs(max_concurrency=8, max_context=2, max_queue=0,
                                     num_kv_pages=1, host_snapshot_bytes=0, queue_timeout_s=0.5)
    assert opts.max_concurrency == 8 and opts.queue_timeout_s == 0.5


def test_prefix_cache_is_on_by_default_on_both_backends():
    """Checkpoints live on the device first (no copy per request), so the cache is on for both
    backends, with a 256 MiB host tier; explicit values win."""
    from ninfer.errors import RequestError
    from ninfer.options import EngineOptions
    assert EngineOptions.from_kwargs().prefix_cache_budget_bytes == 256 << 20
    assert EngineOptions.from_kwargs(backend="cuda").prefix_cache_budget_bytes == 256 << 20
    assert EngineOptions.from_kwargs(backend="cuda").prefix_cache_device_share == 0.5
    assert EngineOptions.from_kwargs(backend="cuda",
                                     prefix_cache_bytes=1 << 20).prefix_cache_budget_bytes == 1 << 20
    assert EngineOptions.from_kwargs(prefix_cache_bytes=0).prefix_cache_budget_bytes == 0
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(RequestError, match="prefix_cache_bytes"):
            EngineOptions.from_kwargs(prefix_cache_bytes=bad)


def test_context_cache_options():
    """prefix_cache / prefix_cache_device_fraction / prefix_cache_host_bytes (the serve flags
    --no-prefix-cache, --prefix-cache-device-fraction, --prefix-cache-host-bytes); the older
    prefix_cache_bytes names the same host budget."""
    from ninfer.errors import RequestError
    from ninfer.options import EngineOptions
    opts = EngineOptions.from_kwargs()
    assert opts.uses_prefix_cache and opts.prefix_cache_device_share == 0.5
    assert opts.checkpoint_interval == 2048
    assert EngineOptions.from_kwargs(prefix_cache_host_bytes=1 << 20).prefix_cache_budget_bytes \
        == 1 << 20
    assert EngineOptions.from_kwargs(prefix_cache_host_bytes=7,
                                     prefix_cache_bytes=7).prefix_cache_budget_bytes == 7
    off = EngineOptions.from_kwargs(prefix_cache=False, prefix_cache_host_bytes=1 << 20)
    assert off.prefix_cache_budget_bytes == 0 and off.prefix_cache_device_share == 0.0
    assert EngineOptions.from_kwargs(prefix_cache_device_fraction=0).prefix_cache_device_share == 0
    with pytest.raises(RequestError, match="older name"):
        EngineOptions.from_kwargs(prefix_cache_host_bytes=1, prefix_cache_bytes=2)
    for name, bad in (("prefix_cache_host_bytes", -1), ("prefix_cache_host_bytes", 1.5),
                      ("prefix_cache_device_fraction", 1.5), ("prefix_cache_device_fraction", -0.1),
                      ("prefix_cache_device_fraction", float("nan")),
                      ("prefix_cache_device_fraction", True), ("prefix_cache", 1),
                      ("checkpoint_interval", 0)):
        with pytest.raises(RequestError, match=name):
            EngineOptions.from_kwargs(**{name: bad})


def test_batch_invariant_turns_the_context_cache_off_and_refuses_it_on():
    """A cache hit changes where prefill chunks split, and whether a request hits depends on the
    others: batch_invariant's load independence holds only with the cache off."""
    assert EngineOptions.from_kwargs().uses_prefix_cache
    opts = EngineOptions.from_kwargs(batch_invariant=True)
    assert not opts.uses_prefix_cache and opts.prefix_cache_budget_bytes == 0 \
        and opts.prefix_cache_device_share == 0.0
    assert not EngineOptions.from_kwargs(batch_invariant=True, prefix_cache=False).uses_prefix_cache
    with pytest.raises(RequestError, match="batch_invariant"):
        EngineOptions.from_kwargs(batch_invariant=True, prefix_cache=True)
