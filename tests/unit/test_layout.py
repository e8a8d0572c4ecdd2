"""Package layering and generated code stay as documented (DESIGN.md, "Layout").

Imports flow one way, with no exceptions: ``runtime`` imports none of the
others; ``elastic -> runtime``; ``chaos -> elastic, runtime``;
``integrations -> elastic, runtime``; the report package ``elastic/report/``
sits below its users and imports only ``runtime`` and itself. Outside
``runtime/``, code uses ``runtime`` only through what its ``__init__`` exports
(``from runtime import X``), never ``runtime.<module>``; tests are exempt.
Every import counts, including the ones inside functions.
"""

import ast
import filecmp
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = {
    "runtime": set(),
    "elastic": {"runtime"},
    "chaos": {"runtime", "elastic"},
    "integrations": {"elastic", "runtime"},
}
REPORT = "elastic.report"
# Code outside runtime/ that must use only runtime's public surface (tests are exempt).
PUBLIC_USERS = ("elastic", "chaos", "integrations", "benchmarks", "scripts")
# Benchmarks of one runtime module in isolation, exempt like tests: the health monitor and the
# registry against thousands of simulated workers; the state digest and a state's assembly from its
# chunks against memcpy (runtime.state.state_copy); the GPU check reads its runs' final checkpoints
# with the runtime's own reader (runtime.state.checkpoint.CheckpointStore); the shared pool's service and ledger
# against thousands of hosts' polls.
MEASURES_INTERNALS = ("benchmarks/control_plane_scale.py", "benchmarks/digest.py", "benchmarks/pool_scale.py",
                      "scripts/gpu_check.py")


def package_of(path: pathlib.Path) -> str:
    """The package a file's relative imports start from."""
    parts = path.relative_to(ROOT).parts[:-1]
    return ".".join(parts)


def imports(source: str, package: str):
    """``(module, names)`` for every import in ``source`` (a file of ``package``): the absolute module
    imported and, for ``from M import a, b``, the names taken from it (None for ``import M``)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom):
            module = node.module
            if node.level:
                parts = package.split(".")
                module = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            yield module, tuple(a.name for a in node.names)


def file_imports(path: pathlib.Path):
    return imports(path.read_text(), package_of(path))


def py_files(*dirs):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def rel(f):
    return str(f.relative_to(ROOT))


def test_imports_flow_one_way():
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in py_files(pkg):
            for module, _ in file_imports(f):
                top = module.split(".")[0]
                if top in ALLOWED and top != pkg and top not in allowed:
                    bad.append(f"{rel(f)} imports {module}")
    assert not bad, bad


def test_the_report_package_imports_only_runtime_and_itself():
    bad = []
    for f in py_files("elastic/report"):
        for module, names in file_imports(f):
            if module.split(".")[0] not in ALLOWED:
                continue   # the standard library, third-party packages
            if module in ("runtime", REPORT) or module.startswith(REPORT + "."):
                continue
            if module == "elastic" and names is not None and set(names) <= {"report"}:
                continue
            bad.append(f"{rel(f)} imports {module}" + (f" ({', '.join(names)})" if names else ""))
    assert not bad, bad


def test_nothing_outside_runtime_reaches_into_its_modules():
    tree = ast.parse((ROOT / "runtime/__init__.py").read_text())
    [exported] = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)]
    bad = []
    for f in py_files(*PUBLIC_USERS):
        if rel(f) in MEASURES_INTERNALS:
            continue
        for module, names in file_imports(f):
            if module.startswith("runtime."):
                bad.append(f"{rel(f)} imports {module}")
            elif module == "runtime":
                bad += [f"{rel(f)} imports runtime.{n} (not in runtime.__all__)" for n in names or () if n not in exported]
        for node in ast.walk(ast.parse(f.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "runtime"
                    and node.attr not in exported):
                bad.append(f"{rel(f)} uses runtime.{node.attr} (not in runtime.__all__)")
    assert not bad, bad


def test_imports_are_resolved_wherever_they_are_written():
    src = ("import runtime.control.controller\nfrom runtime import worker\nfrom ..config import X\nfrom . import fold\n"
           "def f():\n    from chaos.spec import KINDS\n")
    assert list(imports(src, "elastic.report")) == [
        ("runtime.control.controller", None), ("runtime", ("worker",)), ("elastic.config", ("X",)),
        ("elastic.report", ("fold",)), ("chaos.spec", ("KINDS",))]


def test_generated_protos_match_the_proto_file(tmp_path):
    env_py = pathlib.Path(sys.executable).parent
    subprocess.run(["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)], check=True, cwd=ROOT,
                   env={"PATH": f"{env_py}:/usr/bin:/bin"})
    for name in ("elastic_pb2.py", "elastic_pb2_grpc.py"):
        assert filecmp.cmp(tmp_path / name, ROOT / "runtime/_proto" / name, shallow=False), (
            f"runtime/_proto/{name} is stale: run scripts/gen_protos.sh")


def test_every_name_runtime_exports_resolves():
    import runtime

    for name in runtime.__all__:   # the lazy table and __all__ must agree
        getattr(runtime, name)


# The surfaces of runtime and chaos hold what other packages import (found below) and the names a user writes that
# no package of ours imports; each of those is documented (README.md, docs/, examples/README.md). A name only tests
# need is not exported: tests import it from its module (tests are exempt from the layering).
SURFACE_USERS = ("elastic", "integrations", "chaos", "benchmarks", "examples", "scripts")
USER_NAMES = {
    # the errors a caller catches (docs/user-guide.md, "Errors")
    "runtime": {"ElasticError", "WorkerError", "WorkerLostError", "StepAbortedError", "ProtocolError",
                "StaleEpochError", "ProgramExportError", "RegistrationTimeoutError", "PlatformMismatchError",
                "ElasticTrainingFailedError", "CapacityExhaustedError", "StateLostError", "DeviceMismatchError",
                "ReplicaDivergenceError", "BadInputError"},
    # run_job and its result, the fault grammar, random schedules, scenario files (docs/chaos-guide.md)
    "chaos": {"run_job", "ChaosResult", "parse_faults", "validate", "Fault", "Target", "When", "FaultSpecError",
              "random_faults", "load_scenario", "Scenario"},
}


def names_taken_from(package: str, source: str, in_package: str):
    """The names ``source`` (a file of ``in_package``) takes from ``package``'s surface: ``from package import X``,
    ``package.X``, and lazy re-export tables (``{"X": "package"}``, ``{name: "package" for name in ("X", ...)}``)."""
    taken = {n for module, names in imports(source, in_package) if module == package for n in names or ()}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == package:
            taken.add(node.attr)
        elif isinstance(node, ast.Dict):
            taken |= {k.value for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)
                      and isinstance(v, ast.Constant) and v.value == package}
        elif (isinstance(node, ast.DictComp) and isinstance(node.value, ast.Constant) and node.value.value == package
              and isinstance(node.generators[0].iter, (ast.Tuple, ast.List))):
            taken |= {e.value for e in node.generators[0].iter.elts if isinstance(e, ast.Constant)}
    return taken


def test_names_taken_from_a_surface_are_found_however_written():
    src = ('from runtime import A, B\nimport runtime\nx = runtime.C\nT = {"D": "runtime", "E": "elastic.trainer"}\n'
           'U = {**{n: "runtime" for n in ("F", "G")}}\ndef f():\n    from runtime.core.errors import H\n')
    assert names_taken_from("runtime", src, "elastic") == {"A", "B", "C", "D", "F", "G"}


def _docs_text() -> str:
    return "\n".join(f.read_text() for f in [ROOT / "README.md", ROOT / "examples/README.md",
                                              *sorted((ROOT / "docs").rglob("*.md"))])


def test_runtime_and_chaos_export_only_what_their_users_take():
    """Every exported name (``__all__`` and the lazy table) is imported by a package other than tests, or is a
    documented user name; so the surface cannot grow back with names only tests need."""
    import importlib

    docs = _docs_text()
    bad = []
    for package, user_names in USER_NAMES.items():
        mod = importlib.import_module(package)
        exported = set(mod.__all__)
        bad += [f"{package}._LAZY names {n}, which is not in {package}.__all__" for n in set(mod._LAZY) - exported]
        taken = set()
        for f in py_files(*SURFACE_USERS):
            if f.relative_to(ROOT).parts[0] != package:
                taken |= names_taken_from(package, f.read_text(), package_of(f))
        bad += [f"{package}.{n} is exported but no package imports it and it is no documented user name "
                "(tests import it from its module)" for n in sorted(exported - taken - user_names)]
        bad += [f"USER_NAMES[{package!r}] lists {n}, which {package} does not export" for n in sorted(user_names - exported)]
        bad += [f"USER_NAMES[{package!r}] lists {n}, which no doc mentions" for n in sorted(user_names)
                if not re.search(rf"\b{n}\b", docs)]
    assert not bad, bad


def _module_name(f: pathlib.Path) -> str:
    name = ".".join(f.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def test_no_import_cycle_anywhere():
    """No module of ours imports (directly or through others, inside functions too) one that imports it.

    ``from P import m`` of a submodule ``m`` counts as importing ``P.m``; any other name from ``P``, as
    importing ``P`` (its ``__init__``)."""
    files = list(py_files("runtime", "elastic", "chaos", "integrations"))
    modules = {_module_name(f) for f in files}
    graph = {}
    for f in files:
        deps = set()
        for module, names in file_imports(f):
            subs = {f"{module}.{n}" for n in names or () if f"{module}.{n}" in modules}
            deps |= subs
            if not names or len(subs) < len(names):
                deps.add(module)
        graph[_module_name(f)] = {d for d in deps if d in modules and d != _module_name(f)}
    cycles, state = [], {}

    def visit(node, path):   # depth-first; a node met again on the current path closes a cycle
        state[node] = "open"
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                cycles.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)


# Inside runtime/: the layers of the two programs (each subpackage's __init__ docstring says the same). A module
# imports only its own subpackage, the ones listed here, and the generated runtime._proto; runtime/__init__ (the
# public surface, lazily) may name any of them.
RUNTIME_LAYERS = {
    "core": set(),
    "pipeline": {"core"},
    "wire": {"core"},
    "state": {"core", "wire"},
    "worker": {"core", "wire", "state", "pipeline"},
    "launch": {"core", "wire", "worker"},
    "control": {"core", "wire", "state", "launch", "pipeline"},
    "pool": {"core", "wire", "state", "launch"},
}


def test_runtime_is_its_subpackages_and_their_imports_flow_one_way():
    flat = [rel(f) for f in (ROOT / "runtime").glob("*.py") if f.name != "__init__.py"]
    assert not flat, f"a runtime module belongs in one of its subpackages {sorted(RUNTIME_LAYERS)}: {flat}"
    found = {p.name for p in (ROOT / "runtime").iterdir() if (p / "__init__.py").exists()} - {"_proto"}
    assert found == set(RUNTIME_LAYERS), f"runtime's subpackages are {sorted(found)}: declare each in RUNTIME_LAYERS"
    bad = []
    for layer, allowed in RUNTIME_LAYERS.items():
        assert ast.get_docstring(ast.parse((ROOT / "runtime" / layer / "__init__.py").read_text())), layer
        for f in py_files(f"runtime/{layer}"):
            for module, names in file_imports(f):
                parts = module.split(".")
                if parts[0] != "runtime" or parts[1:2] in ([layer], ["_proto"]):
                    continue
                if len(parts) == 1:   # from runtime import X: the package's public surface, i.e. every layer
                    bad.append(f"{rel(f)} imports from runtime itself (import the module it lives in)")
                elif parts[1] not in allowed:
                    bad.append(f"{rel(f)} ({layer}) imports {module}")
    assert not bad, bad
