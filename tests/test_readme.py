"""The README's usage snippet runs as written."""

import pathlib
import re


def test_readme_usage_snippet_runs(capsys):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {})
    assert "load_factor" in capsys.readouterr().out
