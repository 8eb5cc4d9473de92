"""GPU tests: skipped as a folder unless the [cuda] extra imports and a CUDA device answers."""
import pytest


def _gpu_reason():
    try:
        from ninfer.core.cuda import driver as d
        dev = d.Device(0)
        dev.close()
    except Exception as exc:   # noqa: BLE001 - any failure means "no usable GPU here"
        return f"no usable CUDA GPU: {exc}"
    return None


REASON = _gpu_reason()


def pytest_collection_modifyitems(config, items):
    if REASON is None:
        return
    skip = pytest.mark.skip(reason=REASON)
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def gpu():
    from gpu_harness import Harness
    h = Harness()
    yield h
    h.close()
