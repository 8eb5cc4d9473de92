import pathlib

import pytest

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    return FIXTURES


@pytest.fixture(autouse=True)
def _no_kernel_pack(monkeypatch):
    """Tests see no kernel pack unless they make one (tests/test_kernel_pack_nogpu.py): a checkout
    where one was built (NINFER_KERNEL_PACK, kernels/prebuilt) must not change what the kernel
    cache tests observe."""
    from ninfer.core.cuda import kernels
    monkeypatch.setattr(kernels, "pack_dir", lambda: FIXTURES / "no-kernel-pack")
