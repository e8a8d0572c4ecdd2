"""A standby promoted to a worker takes the worker's log name, never over the log of the worker it replaces (its
record of how it died)."""

from runtime.launch.launcher import _take_name


def test_a_promoted_standbys_log_never_replaces_the_dead_workers_log(tmp_path):
    first, second = tmp_path / "worker-standby-1.log", tmp_path / "worker-standby-2.log"
    first.write_text("standby 1\n")
    second.write_text("standby 2\n")
    _take_name(str(first), str(tmp_path / "worker-w3.log"))   # a new worker: the plain name
    assert (tmp_path / "worker-w3.log").read_text() == "standby 1\n" and not first.exists()
    _take_name(str(second), str(tmp_path / "worker-w3.log"))   # w3 died and is replaced: both kept
    assert (tmp_path / "worker-w3.log").read_text() == "standby 1\n"
    assert (tmp_path / "worker-w3.worker-standby-2.log").read_text() == "standby 2\n" and not second.exists()
