"""Every ```python block of docs/python-api.md runs, in order, in one namespace."""
import pathlib
import re

DOC = pathlib.Path(__file__).parent.parent / "docs" / "python-api.md"


def test_python_api_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 5
    namespace = {}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC.name}[block {i}]", "exec"), namespace)
