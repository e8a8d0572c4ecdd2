"""Every ``elastic chaos`` command that README.md and docs/chaos-guide.md show does what they say it does.

The commands are read from the documents themselves (code blocks, and inline
code in running text; ``bash scripts/demo.sh`` is the command its script
runs), so a command added to or changed in the docs is tested as written.
Each runs for real (reference, faulted run on local workers, verdict) and
must pass, exit 0, or, where the docs show its output, print that output and
exit as a bad input does (2). Shortened only where it would take minutes:
a soak's ``--duration`` (5 minutes: 10 s here, at the documented MTBF). A
placeholder for your own code is this suite's own (``mypkg.train:make_job``:
``tests/chaos/own_model.py``; ``CONFIG``: the bundled ``tiny``), and paths
are the repository's, as the docs run them from its root. Identical
commands run once.
"""

import pathlib
import re
import shlex

import pytest

from tests.conftest import ROOT, run_cli

DOCS = ("README.md", "docs/chaos-guide.md")
PLACEHOLDERS = {"mypkg.train:make_job": "tests.chaos.own_model:make_job", "CONFIG": "tiny"}
SOAK = {"--duration": "10s"}   # 5 minutes of random faults, shortened to 10 s (at the documented MTBF)


def _demo_command() -> str:
    line = next(x for x in (ROOT / "scripts" / "demo.sh").read_text().splitlines() if x.startswith("exec "))
    return line.removeprefix("exec ").replace('"$@"', "").strip()


def _documented() -> list[tuple[str, str, str | None]]:
    """``(where, command, the output the docs show for it or None)`` for each distinct ``elastic chaos`` command."""
    found, seen = [], set()
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        commands = []
        for block in blocks:
            lines = block.replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                line = line.strip()
                if line.startswith("bash scripts/demo.sh"):
                    commands.append((_demo_command(), None))
                shown = line.removeprefix("$ ")
                if re.match(r"(\.venv/bin/)?elastic chaos ", shown):
                    after = lines[i + 1].strip() if line.startswith("$ ") and i + 1 < len(lines) else None
                    commands.append((shown, after))
        commands += [(c, None) for c in re.findall(r"`((?:\.venv/bin/)?elastic chaos [^`]+)`", prose)]
        for command, output in commands:
            words = shlex.split(command, comments=True)[2:]   # after "elastic chaos"
            words = [PLACEHOLDERS.get(w, w) for w in words]
            key = tuple(words)
            if key not in seen:
                seen.add(key)
                found.append((doc, shlex.join(words), output))
    return found


COMMANDS = _documented()


def test_the_docs_show_the_commands_this_test_runs():
    """The extraction finds what the docs show (if this fails, the docs' layout changed: fix _documented)."""
    shown = {c for _, c, _ in COMMANDS}
    assert "--scenario chaos/scenarios/kill-three.yml" in shown   # bash scripts/demo.sh
    assert "tiny steps=40 dcn_data_parallelism=2 elastic_snapshot_interval=4 --faults kill:all@snapshot=8" in shown
    assert any("--trainer tests.chaos.own_model:make_job" in c for c in shown)
    assert any(out and out.startswith("elastic: error:") for _, _, out in COMMANDS)
    assert len(COMMANDS) >= 15, COMMANDS


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """One output directory for the module's runs (each its own run_name), so runs of the same math share a
    reference (one per pytest-xdist worker: the factory's directories are)."""
    return tmp_path_factory.mktemp("documented")


@pytest.mark.parametrize("where,command,output", COMMANDS, ids=[c for _, c, _ in COMMANDS])
def test_a_documented_chaos_command_passes_as_documented(where, command, output, base, request):
    words = shlex.split(command)
    for flag, short in SOAK.items():
        if flag in words:
            words[words.index(flag) + 1] = short
    words = [str(ROOT / w) if "/" in w and (ROOT / w).exists() else w for w in words]   # run from the root
    run_name = f"doc{COMMANDS.index((where, command, output))}"
    proc, report = run_cli(["chaos", *words, f"run_name={run_name}"], base, check=False)
    if output is not None:   # the docs show what it prints: bad input, refused before anything starts
        assert proc.returncode == 2 and proc.stderr.strip() == output, (proc.returncode, proc.stderr)
        return
    run_dir = pathlib.Path(base) / run_name
    assert proc.returncode == 0, f"{where}: elastic chaos {command}\n{proc.stdout}\n{proc.stderr}"
    assert report["verdict"] == "pass" and report["run_id"], report["verdict_reasons"]
    assert proc.stdout.strip().splitlines()[-1] == f"report: {(run_dir / 'report.html').resolve().as_uri()}"
    if "kill-three.yml" in command:   # the README demo: replaced, shrunk, and grown back to 4 of 4
        paths = [f["path"] for f in report["failures"]]
        assert "replace" in paths and "shrink" in paths, paths
        assert report["slices_at_end"] == 4, (report["slices_at_end"], "the relaunched workers did not rejoin")
