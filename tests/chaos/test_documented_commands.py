"""Every ``elastic chaos`` command that README.md and docs/chaos-guide.md show does what they say it does.

The commands are read from the documents themselves (code blocks, and inline
code in running text; ``bash scripts/demo.sh`` is the command its script
runs), so a command added to or changed in the docs is tested as written.
Each runs for real (reference, faulted run on local workers, verdict) and
must pass, exit 0, or, where the docs show its output, print that output and
exit as a bad input does (2). A placeholder for your own code is this
suite's own (``mypkg.train:make_job``: ``tests/chaos/own_model.py``;
``CONFIG``: the bundled ``tiny``), and paths are the repository's, as the
docs run them from its root. Identical commands run once.

A documented scenario that another test already runs (:data:`RUN_ELSEWHERE`:
the same faults on the same config, with more assertions) is not run twice:
here it must parse and be accepted (config loaded, every fault reachable),
and the test named must exist and run those faults.
"""

import pathlib
import re
import shlex

import pytest

from tests.conftest import ROOT, run_cli

DOCS = ("README.md", "docs/chaos-guide.md", "docs/multi-host.md")
PLACEHOLDERS = {"mypkg.train:make_job": "tests.chaos.own_model:make_job", "CONFIG": "tiny"}

#: Documented command -> (the test that runs its scenario for real, the faults text that test runs).
RUN_ELSEWHERE = {
    "tiny steps=30 elastic_spares=1 elastic_shadow_spares=true --faults kill:all@step=12":
        ("tests/chaos/test_state_tiers.py::test_a_shadowing_spare_replaces_every_active_slice_with_no_step_lost",
         "kill:all@step=12"),
    "tiny steps=40 dcn_data_parallelism=2 elastic_snapshot_interval=4 --faults kill:all@snapshot=8":
        ("tests/chaos/test_state_tiers.py::"
         "test_losing_every_replica_restores_the_newest_in_memory_snapshot_bit_identically", "kill:all@snapshot=8"),
    "tiny steps=40 elastic_spares=1 enable_checkpointing=true checkpoint_period=4 --faults "
    "kill:everything@checkpoint=8":
        ("tests/chaos/test_state_tiers.py::"
         "test_losing_every_copy_in_memory_restores_the_newest_checkpoint_bit_identically", "kill:{target}@checkpoint"),
    "tiny steps=100000 --mtbf 20s --duration 5m --seed 7":
        ("tests/chaos/test_chaos_faults.py::test_soak_mode_draws_random_faults_and_stops_at_the_duration", "--mtbf"),
    "integrations/maxtext/configs/tiny.yml dcn_data_parallelism=2 elastic_spares=1 --faults kill@step=3":
        ("tests/maxtext/test_maxtext_chaos.py::"
         "test_gcs_arrayrecord_packed_worker_kills_a_spare_takes_one_place_then_the_survivor_takes_the_microbatches",
         "kill:slice=1@step=2"),
    "tiny --trainer tests.chaos.own_model:make_job --faults kill@step=3":
        ("tests/chaos/test_own_model.py::test_own_model_under_elastic_chaos_from_the_command_line",
         "tests.chaos.own_model:make_job"),
    "tiny steps=40 dcn_data_parallelism=2 ici_fsdp_parallelism=1 elastic_microbatches=2 --faults kill:client@step=20":
        ("tests/chaos/test_client_faults.py::test_a_killed_client_is_restarted_and_re_attaches_its_live_workers",
         "kill:client@step=20"),
    "tiny steps=10 enable_checkpointing=true checkpoint_period=2 --faults kill_save@checkpoint=4":
        ("tests/chaos/test_state_tiers.py::test_a_save_cut_off_by_its_writers_death_is_never_counted_and_is_removed",
         "kill_save@checkpoint"),
    "tiny steps=40 elastic_spares=1 --faults kill:slice=1@step=8,kill:role=source@transfer":
        ("tests/chaos/test_chaos_faults.py::test_the_source_killed_while_sending_state_leaves_another_replica",
         "kill:role=source@transfer"),
    "--scenario chaos/scenarios/kill-save.yml":
        ("tests/chaos/test_state_tiers.py::test_a_save_cut_off_by_its_writers_death_is_never_counted_and_is_removed",
         "kill_save@checkpoint"),
    "--scenario chaos/scenarios/partition.yml steps=60":
        ("tests/chaos/test_chaos_faults.py::"
         "test_a_hung_worker_resumed_later_and_a_partitioned_one_back_have_fenced_themselves_and_are_refused",
         "partition(for="),
    "tiny dcn_data_parallelism=2 elastic_hosts_per_slice=2 ici_fsdp_parallelism=4 elastic_spares=1 steps=40 "
    "--faults kill:slice=1,host=1@step=10":
        ("tests/chaos/test_multi_host.py::"
         "test_a_host_lost_loses_its_slice_which_a_spare_slice_replaces_then_the_run_shrinks", "kill:slice=1,host=1@"),
}


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


def test_a_documented_scenario_another_test_runs_is_accepted_and_that_test_runs_it():
    from chaos.cli import register
    from chaos.harness import fault_plan, plan
    from elastic.cli_support import OneLineParser, config_loader
    from elastic.config_loading import load_config

    shown = {c for _, c, _ in COMMANDS}
    assert set(RUN_ELSEWHERE) <= shown, set(RUN_ELSEWHERE) - shown   # a doc changed: update the table
    sub = OneLineParser(prog="elastic").add_subparsers()
    register(sub)
    for command, (test, faults) in RUN_ELSEWHERE.items():
        path, _, name = test.partition("::")
        source = (ROOT / path).read_text()
        start = source.index(f"def {name}(")
        end = source.find("\ndef ", start)
        body = source[start:end if end != -1 else None]
        assert faults in body, (command, test)   # that test runs the documented faults
        args, extra = sub.choices["chaos"].parse_known_args(shlex.split(command))
        if args.config and "=" in args.config:   # `--scenario F steps=9`: as the command takes it
            args.overrides.insert(0, args.config)
            args.config = None
        scenario = str(ROOT / args.scenario) if args.scenario else None
        found, overrides, options = plan(scenario=scenario, faults=args.faults, mtbf=args.mtbf,
                                         duration=args.duration, seed=args.seed)
        overrides += [*args.overrides, *extra] + ([f"elastic_trainer={args.trainer}"] if args.trainer else [])
        config = args.config or found.config
        config = str(ROOT / config) if "/" in config else config
        if config_loader(config, overrides) is None:   # jax-elastic's own configs: every fault can fire
            fault_plan(load_config(config, overrides), options)


@pytest.mark.parametrize("where,command,output", [c for c in COMMANDS if c[1] not in RUN_ELSEWHERE],
                         ids=[c for _, c, _ in COMMANDS if c not in RUN_ELSEWHERE])
def test_a_documented_chaos_command_passes_as_documented(where, command, output, base, request):
    words = shlex.split(command)
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
