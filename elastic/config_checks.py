"""The checks of a complete set of config values: each key's range and form, and keys that contradict.

:func:`config_problem` looks at every value of a config at once (coerced to its key's type, defaults filled
in) and says what is wrong with the first bad one, as the one-line message :class:`elastic.config.ConfigError`
carries, naming the key, its value and where it was set. It is pure (it reads no environment; only the TLS
files are looked for on disk) and knows the schema only through the fields it is given, so the schema
(:mod:`elastic.config`), which raises the error, sits above it. The recovery role's contradictions
(``elastic_enabled=false`` with a key that steers recovery) are the schema's, checked there after these.
"""

from __future__ import annotations

import dataclasses
import operator
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from runtime import checkpoint_directory_problem

__all__ = ["HARDWARE", "config_problem", "key_at"]

#: Values of the key ``hardware`` besides "" (MaxText's names; elastic.options maps them to JAX's platforms).
HARDWARE = ("cpu", "gpu", "tpu")

_FACTORY = re.compile(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*")

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def key_at(key: str, values: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """``'key' (value, in source)`` for a message; the source only where ``sources`` names one."""
    return f"{key!r} ({values[key]!r}{', in ' + sources[key] if key in sources else ''})"


def config_problem(values: Mapping[str, Any], sources: Mapping[str, str],
                   fields: Mapping[str, dataclasses.Field]) -> str:
    """Range and cross-key checks over a complete set of coerced values: the first problem, "" if none.

    ``sources`` names where each key was set (a file, ``overrides``); ``fields`` are the schema's fields by
    name, whose metadata (``ge``, ``gt``, ``le``, ``unit``, ``choices``) bound each key's value.
    """

    def at(key: str) -> str:
        return key_at(key, values, sources)

    problem = _run_name_problem(values["run_name"])
    if problem:
        return (f"config key {at('run_name')} {problem}; a run name is a directory inside "
                "base_output_directory (e.g. 'exp1', or 'sweep/lr3' to nest)")
    trainer = values["elastic_trainer"]
    if trainer and not _FACTORY.fullmatch(trainer):
        return (f"config key {at('elastic_trainer')} must name a factory as 'module:function' "
                "(e.g. 'mypkg.train:make_job', with make_job(config) -> elastic.Trainer or elastic.wrap "
                "job), or be empty for the bundled model")
    hardware = values["hardware"]
    if hardware and hardware not in HARDWARE:
        why = ("; MaxText's gpu_multiprocess (one JAX process per GPU, joined by jax.distributed) is not taken "
               "(a slice of several processes is elastic_hosts_per_slice, docs/multi-host.md), so use gpu"
               if hardware == "gpu_multiprocess" else "")
        return (f"config key {at('hardware')} must be cpu, gpu or tpu, or empty for the platform the "
                f"workers get from the environment{why}")
    for name, f in fields.items():
        value = values[name]
        bounds = [(op, f.metadata[k]) for op, k in ((">=", "ge"), (">", "gt"), ("<=", "le"))
                  if f.metadata[k] is not None]
        if not all(_COMPARE[op](value, limit) for op, limit in bounds):
            limits = " and ".join(f"{op} {limit}{f.metadata['unit']}" for op, limit in bounds)
            where = f" (in {sources[name]})" if name in sources else ""
            return f"config key {name!r} must be {limits}, got {value!r}{where}"
        if f.metadata["choices"] and value not in f.metadata["choices"]:
            where = f" (in {sources[name]})" if name in sources else ""
            return f"config key {name!r} must be one of {', '.join(f.metadata['choices'])}, got {value!r}{where}"
    if values["base_emb_dim"] % values["base_num_query_heads"]:
        return (f"config keys {at('base_emb_dim')} and {at('base_num_query_heads')} contradict: "
                "base_emb_dim must be divisible by base_num_query_heads")
    m, slices = values["elastic_microbatches"], values["dcn_data_parallelism"]
    if m and m & (m - 1):
        return f"config key {at('elastic_microbatches')} must be a power of two (or 0 for auto)"
    if m and m < slices:
        return (f"config key {at('elastic_microbatches')} must be >= {at('dcn_data_parallelism')}: "
                "every slice needs at least one microbatch per step")
    for key in ("elastic_checkpoint_directory", "load_full_state_path", "load_parameters_path"):
        if values[key] and (problem := checkpoint_directory_problem(values[key])):
            return f"config key {at(key)} {problem}"
    if values["load_full_state_path"] and values["load_parameters_path"]:
        return (f"config keys {at('load_full_state_path')} and {at('load_parameters_path')} contradict: set one "
                "(a full state already holds its parameters)")
    if values["elastic_controller_address"] and (problem := _address_problem(values["elastic_controller_address"])):
        return f"config key {at('elastic_controller_address')} {problem}"
    if values["elastic_run_id"] and not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", values["elastic_run_id"]):
        return f"config key {at('elastic_run_id')} must be 1 to 64 letters, digits, '.', '_' or '-'"
    if values["ray_address"] and values["elastic_launcher"] != "ray":
        return (f"config keys {at('ray_address')} and {at('elastic_launcher')} contradict: "
                "a Ray cluster serves only elastic_launcher=ray")
    if values["elastic_pool"]:
        if problem := _address_problem(values["elastic_pool"]):
            return f"config key {at('elastic_pool')} {problem}"
        if values["elastic_launcher"] != "local":
            return (f"config keys {at('elastic_pool')} and {at('elastic_launcher')} contradict: a pool's hosts "
                    "run the workers (leave elastic_launcher at local)")
        if values["elastic_hosts_per_slice"] > 1:
            return (f"config keys {at('elastic_pool')} and {at('elastic_hosts_per_slice')} contradict: a pool "
                    "leases slices of one host (slices of several hosts from a pool are not built)")
        if values["rl_samplers"] and values["rl_sampler_devices"] != values["ici_fsdp_parallelism"]:
            return (f"config keys {at('elastic_pool')} and {at('rl_sampler_devices')} contradict: a pool's hosts "
                    f"have one device count, and an RL run's samplers ({values['rl_sampler_devices']} devices) "
                    f"lease hosts like its trainers ({values['ici_fsdp_parallelism']}): make them equal")
        if values["elastic_tls_cert_file"]:
            return (f"config keys {at('elastic_pool')} and {at('elastic_tls_cert_file')} contradict: a pool's hosts "
                    "start workers without the run's TLS files (TLS on a pool is not built)")
    if values["elastic_launcher"] == "none":
        if not values["elastic_controller_address"].rpartition(":")[2].strip("0"):
            return (f"config keys {at('elastic_launcher')} and {at('elastic_controller_address')} "
                    "contradict: workers started by someone else must know where the controller listens "
                    "(set elastic_controller_address=HOST:PORT with a port other than 0)")
        if not values["elastic_run_id"]:
            return (f"config keys {at('elastic_launcher')} and {at('elastic_run_id')} contradict: "
                    "workers started by someone else name the run when they join (set elastic_run_id)")
    if values["elastic_snapshot_interval"] and values["elastic_backup_kind"] != "snapshot":
        return (f"config keys {at('elastic_snapshot_interval')} and {at('elastic_backup_kind')} "
                "contradict: snapshots are taken only with elastic_backup_kind=snapshot")
    if values["elastic_snapshot_directory"] and not values["elastic_snapshot_directory"].startswith("/"):
        return (f"config key {at('elastic_snapshot_directory')} must be an absolute path (it names a "
                "directory on every worker's host)")
    tls = [k for k in ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file") if values[k]]
    if tls and len(tls) != 3:
        missing = [k for k in ("elastic_tls_cert_file", "elastic_tls_key_file", "elastic_tls_ca_file") if k not in tls]
        return (f"config key {at(tls[0])} needs {', '.join(repr(k) for k in missing)} too: "
                "TLS takes a certificate, its key and a CA file")
    for key in tls:
        if not pathlib.Path(values[key]).is_file():
            return f"config key {at(key)}: no such file"
    hosts = values["elastic_hosts_per_slice"]
    if values["ici_fsdp_parallelism"] % hosts:
        return (f"config keys {at('elastic_hosts_per_slice')} and {at('ici_fsdp_parallelism')} contradict: a "
                "slice's devices are spread over its hosts, the same number on each")
    if hosts > 1:   # what slices of several hosts do not do yet: one line each, naming the key to change
        for key, bad, why in (
                ("dcn_pipeline_parallelism", values["dcn_pipeline_parallelism"] > 1, "pipeline stages run on "
                 "slices of one host"),):
            if bad:
                return (f"config keys {at('elastic_hosts_per_slice')} and {at(key)} contradict: {why} for "
                        "now (docs/multi-host.md)")
    if values["eval_steps"] == 0:
        return (f"config key {at('eval_steps')} must be > 0 (eval steps per eval), or -1 for the whole eval "
                "source")
    if values["eval_interval"] > 0 and values["dcn_pipeline_parallelism"] > 1:
        return (f"config keys {at('eval_interval')} and {at('dcn_pipeline_parallelism')} contradict: eval is not "
                "computed by a pipelined run yet (set eval_interval=0, or dcn_pipeline_parallelism=1)")
    if values["elastic_min_slice_count"] > slices:
        return (f"config keys {at('elastic_min_slice_count')} and {at('dcn_data_parallelism')} contradict: "
                "the minimum slice count cannot exceed the slice count")
    return ""


def _address_problem(address: str) -> str:
    """Why ``address`` is not ``HOST:PORT`` ("" if it is); a pure check of the text."""
    host, colon, port = address.rpartition(":")
    if not colon or not host:
        return f"must be HOST:PORT, got {address!r}"
    if not port.isdigit() or int(port) > 65535:
        return f"must end with a port 0..65535, got {address!r}"
    return ""


def _run_name_problem(name: str) -> str:
    """Why ``name`` cannot be a run directory under base_output_directory ("" if it can; "" is "unnamed").

    '/' nests a run (the chaos harness keeps its references in 'references/<digest>'), but no part
    may climb out ('..'), be empty or '.', and the name may not be absolute: the run directory is
    always inside base_output_directory.
    """
    if not name:
        return ""
    if not name.strip():
        return "is blank"
    if "\x00" in name:
        return "contains a NUL character"
    if "\\" in name:
        return "contains a backslash"
    if name.startswith("/"):
        return "is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "contains '..' and would escape base_output_directory"
    if "" in parts or "." in parts:
        return "has an empty or '.' path component"
    return ""
