"""Hot-path helpers: compiled Cython modules when they were built, else their pure-Python twins.

`IS_COMPILED` tells which one is in use for the page tables and batch packing (pages.pyx),
`ROUTES_COMPILED` for the MoE prefill's row layout (routes.pyx); each pair satisfies the same
contract (tests/test_hot.py).
"""
try:
    from . import pages as _impl          # built by setup.py from pages.pyx
    IS_COMPILED = True
except ImportError:                       # no compiler / NINFER_NO_CYTHON: same results, slower
    from . import pages_py as _impl
    IS_COMPILED = False

take_pages = _impl.take_pages
give_pages = _impl.give_pages
release_pages = _impl.release_pages
pack_batch = _impl.pack_batch
pack_decode = _impl.pack_decode

try:
    from . import routes as _routes       # built by setup.py from routes.pyx
    ROUTES_COMPILED = True
except ImportError:
    from . import routes_py as _routes
    ROUTES_COMPILED = False

expert_rows_fill = _routes.expert_rows_fill

__all__ = ["take_pages", "give_pages", "release_pages", "pack_batch", "pack_decode",
           "expert_rows_fill", "IS_COMPILED", "ROUTES_COMPILED"]
