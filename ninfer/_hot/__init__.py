"""Hot-path helpers: a compiled Cython module when it was built, else its pure-Python twin.

`IS_COMPILED` tells which one is in use; both satisfy the same contract (tests/test_hot.py).
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

__all__ = ["take_pages", "give_pages", "release_pages", "pack_batch", "pack_decode", "IS_COMPILED"]
