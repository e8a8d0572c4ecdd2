"""How an example's elastic version differs from its original loop (``examples/<name>/original.py`` and
``elastic_version.py``): the lines outside ``make_job``, the factory's own lines, and the diff examples/README.md
shows. Used by the examples' tests; ``python -m tests.examples.test_examples`` prints the README's diff blocks."""

import difflib

from tests.conftest import ROOT


def split_factory(path):
    """(the file's non-blank lines outside make_job and the __main__ block, make_job's non-blank lines)."""
    body, factory, part = [], [], None
    for line in path.read_text().splitlines():
        if line.startswith("def make_job"):
            part = factory
        elif line.startswith('if __name__ == "__main__"'):
            part = []
        elif line and not line[0].isspace():
            part = None
        if line.strip():
            (body if part is None else part).append(line)
    return body, factory


def changed_lines(a, b):
    """Lines added, removed or replaced to turn ``a`` into ``b`` (a replaced line counts once)."""
    ops = difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes()
    return sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def unified_diff(example):
    """The diff examples/README.md shows (one line of context)."""
    d = ROOT / "examples" / example
    a, b = (d / "original.py").read_text().splitlines(), (d / "elastic_version.py").read_text().splitlines()
    lines = difflib.unified_diff(a, b, f"{example}/original.py", f"{example}/elastic_version.py", n=1, lineterm="")
    return "\n".join(lines)
