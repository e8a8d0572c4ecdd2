"""Bad input to the CLI gives one clear line and exit status 2."""

import pytest


@pytest.mark.parametrize("args, needle", [
    (["run", "tiny", "stpes=3"], "unknown config key 'stpes'"),
    (["run", "tiny", "steps=abc"], "'steps' must be an integer"),
    (["run", "tiny", "steps"], "steps"),
    (["run", "no-such-config.yml"], "no-such-config"),
    (["run", "tiny", "elastic_microbatches=3"], "elastic_microbatches"),
    (["run", "tiny", "dcn_data_parallelism=8"], "elastic_microbatches"),
    (["frobnicate"], "invalid choice"),
])
def test_bad_input_is_one_line_naming_the_problem(cli, args, needle):
    proc, _ = cli(*args, check=False)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("elastic: error:") and needle in lines[0], lines[0]


def test_chaos_is_a_plugged_in_command(cli):
    """`elastic` finds `chaos` through the `elastic.commands` entry points; elastic never imports chaos."""
    from importlib.metadata import entry_points

    assert [ep.value for ep in entry_points(group="elastic.commands") if ep.name == "chaos"] == ["chaos.cli:register"]
    proc, _ = cli("--help")
    assert proc.returncode == 0 and "chaos" in proc.stdout and "run a config under injected faults" in proc.stdout
    proc, _ = cli("chaos", "tiny", "--faults", "kill:slise=1@step=3", check=False)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "elastic: error: fault 1 'kill:slise=1@step=3': unknown target 'slise' "
        "(expected slice, stage, worker, role, random, all, everything, client)"]


def test_a_broken_plugin_is_one_warning_and_the_builtin_commands_still_work(monkeypatch, capsys):
    from importlib.metadata import EntryPoint

    import elastic.cli

    broken = [EntryPoint(name="broken", value="no_such_module_for_elastic:register", group="elastic.commands"),
              EntryPoint(name="chaos", value="chaos.cli:register", group="elastic.commands")]
    monkeypatch.setattr(elastic.cli, "entry_points", lambda group: broken if group == "elastic.commands" else [])
    assert elastic.cli.main(["run", "tiny", "stpes=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("elastic: warning: command 'broken'") and "ModuleNotFoundError" in err[0]
    assert err[1].startswith("elastic: error: unknown config key 'stpes'")
    with pytest.raises(SystemExit):
        elastic.cli.main(["--help"])
    out = capsys.readouterr().out
    assert "chaos" in out and "broken" not in out


def test_library_output_is_kept_off_the_terminal_and_shown_only_when_something_crashes(capsys):
    import logging
    import sys

    from elastic.cli_support import kept_library_output
    from elastic.config import ConfigError

    with kept_library_output() as kept:
        print("[NO-OP] a stub")
        handler = logging.StreamHandler()   # bound to the stream of its time, as libraries do at import
        print("a warning", file=sys.stderr)
    assert "".join(kept) == "[NO-OP] a stub\na warning\n"
    handler.stream.write("later\n")   # a handler made while kept reaches the terminal afterwards
    assert capsys.readouterr() == ("", "later\n")
    with pytest.raises(ConfigError), kept_library_output():
        print("noise")
        raise ConfigError("bad input")   # one line says what is wrong: the noise stays kept
    assert capsys.readouterr() == ("", "")
    with pytest.raises(RuntimeError), kept_library_output():
        print("what led to it")
        raise RuntimeError("crash")
    assert capsys.readouterr() == ("", "what led to it\n")


@pytest.mark.parametrize("where, needle", [("nothing", "does not exist"), ("empty", "holds no complete checkpoint"),
                                           ("file", "cannot be read")])
def test_a_bad_load_full_state_path_is_refused_before_any_worker_starts(cli, tmp_path, where, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("not a checkpoint")
    proc, _ = cli("run", "tiny", "run_name=bad", f"load_full_state_path={tmp_path / where}", check=False)
    assert proc.returncode == 2, proc.stderr
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith("elastic: error: config key load_full_state_path") and needle in line, line
    written = [p.name for p in (tmp_path / "bad").rglob("*")]
    assert written in ([], [".lock"]), f"no worker started, no event written: {written}"
