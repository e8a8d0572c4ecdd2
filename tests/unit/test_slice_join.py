"""Joining a run as one host of a slice of several by hand (``elastic worker --slice-hosts H --slice-host K
--slice-coordinator HOST0:PORT``): the command the client prints, the flags' checks, the slice's id its hosts
agree on, and the registry's refusal of a host of another slice shape. Pure, or in-process."""

import pytest

from elastic import cli
from elastic.config_loading import load_config
from elastic.options import SECRET_ENV, controller_options
from runtime import ElasticError, slice_flags_problem
from runtime._proto import elastic_pb2 as pb
from runtime.control.registry import Registry
from runtime.control.worker_group import join_command
from runtime.core.events import EventLog
from runtime.worker.worker_process import slice_id


def test_the_printed_command_names_a_hosts_share_of_the_devices_and_the_slice_flags(tmp_path, monkeypatch):
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    cfg = load_config("tiny", ["elastic_hosts_per_slice=2", "ici_fsdp_parallelism=4", "elastic_launcher=none",
                               "elastic_controller_address=127.0.0.1:5000", "elastic_run_id=r1"])
    command = join_command("127.0.0.1:5000", "r1", controller_options(cfg, tmp_path))
    assert command == ("elastic worker --controller 127.0.0.1:5000 --run-id r1 --devices 2 --slice-hosts 2 "
                       "--slice-host K --slice-coordinator HOST0:PORT")
    # Filled in, it is a command `elastic worker` takes.
    args = cli.parser().parse_args(command.replace("K", "1").replace("HOST0:PORT", "10.0.0.5:8476").split()[1:])
    assert (args.slice_hosts, args.slice_host, args.slice_coordinator, args.devices) == (2, 1, "10.0.0.5:8476", 2)
    assert not slice_flags_problem(args.slice_hosts, args.slice_host, args.slice_coordinator)


@pytest.mark.parametrize("hosts, host, coordinator, says", [
    (2, 0, "", "--slice-hosts 2 needs --slice-coordinator HOST0:PORT"),
    (2, 2, "h0:8476", "--slice-host 2 is not a host of a slice of --slice-hosts 2 (0..1)"),
    (0, 0, "", "--slice-hosts must be >= 1, got 0"),
    (1, 0, "h0:8476", "--slice-coordinator needs --slice-hosts > 1"),
    (2, 1, "h0", "--slice-coordinator must be HOST0:PORT with a port 1..65535, got 'h0'"),
    (2, 1, "h0:0", "--slice-coordinator must be HOST0:PORT"),
])
def test_flags_that_make_no_host_of_a_slice_are_one_usage_line_before_jax_starts(hosts, host, coordinator, says,
                                                                                  capsys):
    assert says in slice_flags_problem(hosts, host, coordinator)
    argv = ["worker", "--controller", "127.0.0.1:1", "--run-id", "r", "--slice-hosts", str(hosts),
            "--slice-host", str(host)] + (["--slice-coordinator", coordinator] if coordinator else [])
    assert cli.main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("elastic: error: ") and says in line


def test_a_slice_is_named_by_its_host_0_and_a_host_given_another_name_is_refused():
    assert slice_id("", 1, "pod-a-3f2e1c") == "pod-a-3f2e1c"   # a restarted slice's hosts agree on a fresh id
    assert slice_id("s0", 1, "s0") == "s0" and slice_id("s0", 0, "s0") == "s0"
    with pytest.raises(ElasticError) as e:
        slice_id("s1", 1, "s0")
    assert str(e.value) == ("--worker-id 's1' is not its slice's: host 0 of this slice joined as 's0' (give every "
                            "host of a slice the same --worker-id, or none but host 0)")


def test_a_host_of_another_slice_shape_is_refused_saying_the_flags_that_fit(tmp_path):
    events = EventLog(tmp_path / "events.jsonl")
    registry = Registry("run", events, refuse=lambda w: "", hosts_per_slice=2)
    request = pb.RegisterRequest(run_id="run", worker_id="pod-a", address="127.0.0.1:100", num_devices=2,
                                 platform="cpu", pid=1000)
    reply = registry.Register(request, context=None)
    assert not reply.accepted and reply.reason == (
        "this run's slices have 2 host(s) (elastic_hosts_per_slice=2), this worker's 1: start each host of a slice "
        "with --slice-hosts 2 --slice-host K --slice-coordinator HOST0:PORT")
    events.close()
