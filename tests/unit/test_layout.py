"""Package layering and generated code stay as documented."""

import ast
import filecmp
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = {
    "runtime": set(),
    "elastic": {"runtime"},
    "chaos": {"runtime", "elastic"},
    "integrations": {"elastic", "runtime"},
}


def imported_packages(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


# The command line is the top of the stack: `elastic chaos` drives the chaos package.
EXCEPTIONS = {("elastic/cli.py", "chaos")}


def test_imports_flow_one_way():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in (ROOT / pkg).rglob("*.py"):
            for mod in imported_packages(f):
                if (str(f.relative_to(ROOT)), mod) in EXCEPTIONS:
                    continue
                if mod in ALLOWED and mod != pkg and mod not in allowed:
                    bad.append(f"{f.relative_to(ROOT)} imports {mod}")
    assert not bad, bad


def test_generated_protos_match_the_proto_file(tmp_path):
    env_py = pathlib.Path(sys.executable).parent
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={"PATH": f"{env_py}:/usr/bin:/bin"})
    for name in ("elastic_pb2.py", "elastic_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / name, ROOT / "runtime/_proto" / name, shallow=False), (
            f"runtime/_proto/{name} is stale: run scripts/gen_protos.sh")


def test_report_counts_a_recommitted_step_as_lost():
    from elastic.report import build_report

    events = [{"t": 0.0, "kind": "step_committed", "step": 0, "loss": 2.0},
              {"t": 1.0, "kind": "step_committed", "step": 1, "loss": 1.5},
              {"t": 2.0, "kind": "step_committed", "step": 1, "loss": 1.5}]
    report = build_report(events)
    assert report["steps_completed"] == 2 and report["steps_lost"] == 1 and report["losses"] == [2.0, 1.5]
