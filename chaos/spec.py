"""The fault grammar: pure parsing and checking of fault specs, no side effects.

A fault list reads ``KIND[(OPTIONS)][:TARGET]@WHEN``, comma separated, e.g.::

    kill@step=10,hang(resume=3s):slice=2@step=20,kill:role=spare@time=30s,kill:all@step=40,
    kill_save@step=5,kill:everything@checkpoint=12,kill:all@snapshot=20,
    kill:client@step=25,hang(resume=8s):client@step=30,kill:client@transfer,
    kill:stage=1@step=3,hang(resume=3s):stage=0,replica=1@step=2

The target ``stage=K[,replica=R]`` is for pipelined runs
(``dcn_pipeline_parallelism`` > 1): the worker running stage K of pipeline
replica R (replica 0 when R is left out). Its comma does not separate faults:
a comma followed by ``replica=`` belongs to the ``stage=K`` before it, and
``replica=`` anywhere else is an error.

The target ``client`` is the process driving the run (the one calling
``fit``), not a worker: ``kill:client`` SIGKILLs it, ``hang(resume=S):client``
stops it for S seconds; the chaos harness plays the supervisor that restarts
it (:mod:`chaos.supervisor`).

Contract:

* :func:`parse_faults` turns such text into :class:`Fault` values, or raises
  :class:`FaultSpecError` whose message names the fault (1-based index and its
  text) and the offending piece. It checks grammar and combinations
  (``@transfer`` only with ``kill``/``hang`` and ``role=source``/``role=dest``;
  ``role=source``/``role=dest`` only with ``@transfer``; ``role=writer`` only
  with ``kill_save``, whose default target it is; the target ``client`` only
  with ``kill`` (no options) and ``hang`` (with ``resume``), at any trigger;
  ``replica=R`` only right after ``stage=K``).
* :func:`validate` re-checks faults built any way and also rejects what the
  runtime cannot do (none today: every kind is injectable). The caller (the
  chaos runner) calls it before starting a run;
  :func:`chaos.scenario.load_scenario` calls it for you.
* ``parse_faults(f.spec()) == [f]`` for every valid fault ``f``.

This module is the one place the user-facing fault kinds are spelled
(:data:`KINDS`); the injector maps them to the runtime's worker-side actions
and the report folds the ``fault_kind`` each injection recorded.

The full reference is ``docs/chaos-guide.md``.
"""

from __future__ import annotations

import dataclasses
import math
import re

from runtime import FAULT_PHASES

__all__ = [
    "CLIENT_KINDS",
    "INJECTABLE_KINDS",
    "KINDS",
    "ROLES",
    "TARGET_KINDS",
    "TRANSFER_KINDS",
    "TRANSFER_ROLES",
    "Fault",
    "FaultSpecError",
    "Target",
    "When",
    "format_duration",
    "parse_duration",
    "parse_faults",
    "split_faults",
    "validate",
]

#: Every fault kind the grammar knows: the one list of user-facing fault kinds.
KINDS = ("kill", "hang", "straggle", "partition", "corrupt", "kill_save")
# Kinds the grammar reads but the runtime cannot inject yet, with the reason validate() gives.
_NOT_INJECTABLE: dict[str, str] = {}
#: The kinds a run can be faulted with today (random schedules draw from these).
INJECTABLE_KINDS = tuple(k for k in KINDS if k not in _NOT_INJECTABLE)
TARGET_KINDS = ("slice", "stage", "worker", "role", "random", "all", "everything", "client")
ROLES = ("active", "spare", "source", "dest", "writer", "trainer", "sampler")   # trainer: an active slice (of an RL run)
TRANSFER_KINDS = ("kill", "hang")
TRANSFER_ROLES = ("source", "dest")
#: The kinds that can hit the client (target ``client``): SIGKILL, or SIGSTOP for ``resume`` seconds.
CLIENT_KINDS = ("kill", "hang")
# Targets that take no value.
_BARE_TARGETS = ("random", "all", "everything", "client")

# Options each kind accepts, with their defaults (None: no default, the option changes behaviour).
_OPTIONS: dict[str, dict[str, float | None]] = {
    "kill": {"phase": None},  # with phase: die inside that phase of the step after WHEN
    "hang": {"resume": None},  # without resume the worker stays stopped
    "straggle": {"factor": 3.0, "for": 10.0},
    "partition": {"for": 5.0},
    "corrupt": {},
    "kill_save": {},  # its writer dies mid-save: the save it writes at WHEN, or its next one
}
if set(_OPTIONS) != set(KINDS) or not set(_NOT_INJECTABLE) <= set(KINDS) or not set(TRANSFER_KINDS) <= set(KINDS) \
        or not set(CLIENT_KINDS) <= set(KINDS):
    raise RuntimeError("chaos.spec: the fault kinds of _OPTIONS, _NOT_INJECTABLE, TRANSFER_KINDS and CLIENT_KINDS "
                       "must be KINDS")
_DURATION_OPTIONS = frozenset({"resume", "for"})
_DURATION_NAMES = frozenset({"seconds", "for", "duration", "time"})   # what a hang's length is mistaken for
# Options whose value is a word from a fixed list (kept as text).
_CHOICE_OPTIONS: dict[str, tuple[str, ...]] = {"phase": FAULT_PHASES}
_INT = re.compile(r"[0-9]+")
# A comma that carries a stage target's replica (``stage=1,replica=0``) or a slice's host (``slice=1,host=1``)
# rather than separating faults.
_REPLICA = re.compile(r",\s*(replica|host)\s*=")
_MISPLACED_REPLICA = "replica=R is only valid right after a stage=K target (e.g. kill:stage=1,replica=0@step=3)"
_MISPLACED_HOST = ("host=K is only valid right after a slice=N or worker=ID target (e.g. kill:slice=1,host=1@step=3, "
                   "a slice of several hosts)")
_WORKER_ID = re.compile(r"[A-Za-z0-9_.\-]+")
_DURATION = re.compile(r"(?P<num>(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)(?P<unit>ms|s|m)?")
_UNITS = {None: 1.0, "s": 1.0, "ms": 1e-3, "m": 60.0}


class FaultSpecError(ValueError):
    """A fault spec, fault or scenario file is invalid; the message names the bad piece."""


@dataclasses.dataclass(frozen=True)
class Target:
    """Whom a fault hits; resolved to worker ids at injection time (``chaos.schedule``)."""

    kind: str  # "slice" | "stage" | "worker" | "role" | "random" | "all" | "everything" | "client"
    value: int | str | None = None  # slice index, stage index, worker id, role name, or None
    replica: int | None = None  # kind "stage" only: the pipeline replica (None: replica 0)
    host: int | None = None  # kinds "slice" and "worker": that host of a slice of several (None: a random one)

    def spec(self) -> str:
        text = self.kind if self.value is None else f"{self.kind}={self.value}"
        if self.host is not None:
            text = f"{text},host={self.host}"
        return text if self.replica is None else f"{text},replica={self.replica}"


@dataclasses.dataclass(frozen=True)
class When:
    """When a fault fires; exactly one of the five is set."""

    step: int | None = None  # inject once this many steps are committed
    time: float | None = None  # seconds since training started
    transfer: bool = False  # during the next state transfer
    checkpoint: int | None = None  # once a checkpoint of at least this step is saved (complete)
    snapshot: int | None = None  # once an in-memory snapshot of at least this step is in place (and copied)

    def spec(self) -> str:
        if self.transfer:
            return "transfer"
        if self.step is not None:
            return f"step={self.step}"
        if self.checkpoint is not None:
            return f"checkpoint={self.checkpoint}"
        if self.snapshot is not None:
            return f"snapshot={self.snapshot}"
        return f"time={format_duration(self.time if self.time is not None else 0.0)}"


@dataclasses.dataclass(frozen=True)
class Fault:
    """One fault to inject. ``options`` are sorted ``(name, value)`` pairs given
    explicitly; durations are in seconds."""

    kind: str
    target: Target
    when: When
    options: tuple[tuple[str, float], ...] = ()

    def option(self, name: str, default: float | None = None) -> float | None:
        """The value of option ``name``: the explicit one, else ``default``, else the
        kind's documented default (``straggle``: factor 3, for 10 s; ``partition``:
        for 5 s), else None. Raises KeyError for a name the kind does not take."""
        allowed = _OPTIONS.get(self.kind, {})
        if name not in allowed:
            raise KeyError(f"fault kind {self.kind!r} has no option {name!r} (options: {_names(allowed)})")
        for key, value in self.options:
            if key == name:
                return value
        return default if default is not None else allowed[name]

    @property
    def hits_client(self) -> bool:
        """Whether this fault hits the run's client (target ``client``) rather than workers."""
        return self.target.kind == "client"

    def spec(self) -> str:
        """Canonical text of this fault; ``parse_faults(f.spec()) == [f]``."""
        text = self.kind
        if self.options:
            text += "(" + ",".join(f"{k}={_format_option(k, v)}" for k, v in self.options) + ")"
        if self.target != Target("random"):
            text += f":{self.target.spec()}"
        return f"{text}@{self.when.spec()}"


# --------------------------------------------------------------------------- parsing


def parse_duration(text: str) -> float:
    """Seconds in ``30s``, ``1.5s``, ``500ms``, ``2m`` or a bare number (seconds)."""
    m = _DURATION.fullmatch(text.strip())
    if not m:
        raise FaultSpecError(f"bad duration {text!r} (expected e.g. 30s, 1.5s, 500ms, 2m or a number of seconds)")
    value = float(m["num"]) * _UNITS[m["unit"]]
    if not math.isfinite(value):
        raise FaultSpecError(f"bad duration {text!r}: not finite")
    return value


def format_duration(seconds: float) -> str:
    """Text that :func:`parse_duration` reads back as exactly ``seconds``."""
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{float(seconds)!r}s"


def parse_faults(text: str) -> list[Fault]:
    """Parse a comma-separated fault list; raises FaultSpecError naming the bad fault and piece."""
    if not text or not text.strip():
        raise FaultSpecError("empty fault spec (expected e.g. kill@step=10)")
    pieces = split_faults(text)
    faults = []
    for i, piece in enumerate(pieces, 1):
        where = f"fault {i} {piece.strip()!r}"
        if not piece.strip():
            what = "trailing comma" if i == len(pieces) else "empty fault between commas"
            raise FaultSpecError(f"fault {i}: {what} in {text!r}")
        try:
            fault = _parse_one(piece.strip())
            _check(fault)
        except FaultSpecError as e:
            raise FaultSpecError(f"{where}: {e}{_split_hint(piece, pieces[i:i + 1])}") from None
        faults.append(fault)
    return faults


def validate(faults: list[Fault] | tuple[Fault, ...]) -> None:
    """Raise FaultSpecError for a fault the grammar forbids or the runtime cannot inject."""
    for i, fault in enumerate(faults, 1):
        try:
            _check(fault)
            if fault.kind in _NOT_INJECTABLE:
                raise FaultSpecError(_NOT_INJECTABLE[fault.kind])
        except FaultSpecError as e:
            raise FaultSpecError(f"fault {i} {_safe_spec(fault)!r}: {e}") from None


def split_faults(text: str) -> list[str]:
    """The pieces of a fault list between top-level commas (commas inside ``(...)`` do not split, nor does one
    followed by ``replica=``: it belongs to the ``stage=K`` target before it).

    Pieces are not stripped or checked; raises FaultSpecError for unbalanced parentheses.
    """
    pieces, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise FaultSpecError(f"unbalanced ')' at position {i} in {text!r}")
        elif ch == "," and depth == 0 and not _REPLICA.match(text, i):
            pieces.append(text[start:i])
            start = i + 1
    if depth:
        raise FaultSpecError(f"unclosed '(' in {text!r}")
    pieces.append(text[start:])
    return pieces


def _split_hint(piece: str, following: list[str]) -> str:
    """For a fault without '@' followed by a piece that is no fault: a comma cut it in two (``kill:client,x=0``)."""
    if "@" in piece or not following:
        return ""
    nxt = following[0].strip()
    word = re.match(r"\w*", nxt).group(0)
    if not nxt or word in KINDS:
        return ""
    return f" (a comma separates faults, so {nxt!r} was read as another fault; a fault has one ':TARGET')"


def _parse_one(piece: str) -> Fault:
    head, at, when_text = piece.partition("@")
    if _REPLICA.search(when_text):
        raise FaultSpecError(_MISPLACED_REPLICA)
    if "@" in when_text:
        raise FaultSpecError("more than one '@'")
    m = re.match(r"\s*(\w*)\s*", head)
    kind, rest = m.group(1), head[m.end():]
    if kind not in KINDS:
        raise FaultSpecError(f"unknown kind {kind!r} (expected {_names(KINDS)})")
    options: dict[str, float] = {}
    if rest.startswith("("):
        close = rest.find(")")
        if close < 0:   # the list was cut by '@' (balanced only across it): 'kill(phase=grad@step=1)'
            raise FaultSpecError(f"unclosed '(' in {head.strip()!r} (close the option list before '@')")
        options = _parse_options(kind, rest[1:close])
        rest = rest[close + 1:].strip()
    if rest and not rest.startswith(":"):
        if _REPLICA.search(rest):
            raise FaultSpecError(_MISPLACED_REPLICA)
        raise FaultSpecError(f"unexpected {rest!r} after kind {kind!r} (expected '(OPTIONS)', ':TARGET' or '@WHEN')")
    target = _parse_target(rest[1:].strip(), kind) if rest else None   # its errors first: 'kill:client,replica=0'
    if not at:
        raise FaultSpecError("missing '@WHEN' (e.g. @step=10, @time=30s, @transfer, @checkpoint=8)")
    when = _parse_when(when_text.strip())
    if target is None:
        target = Target("role", "source") if when.transfer else Target("role", "writer") if kind == "kill_save" \
            else Target("random")
    return Fault(kind, target, when, tuple(sorted(options.items())))


def _parse_options(kind: str, text: str) -> dict[str, float]:
    allowed = _OPTIONS[kind]
    out: dict[str, float] = {}
    if not text.strip():
        raise FaultSpecError("empty option list '()' (drop the parentheses)")
    for item in text.split(","):
        name, eq, value = (s.strip() for s in item.partition("="))
        if not name or not eq or not value:
            raise FaultSpecError(f"bad option {item.strip()!r} (expected name=value)")
        if name not in allowed:
            hint = " (how long a hang lasts is resume=DURATION)" if kind == "hang" and name in _DURATION_NAMES else ""
            raise FaultSpecError(f"unknown option {name!r} for {kind} (options: {_names(allowed)}){hint}")
        if name in out:
            raise FaultSpecError(f"option {name!r} given twice")
        if name in _DURATION_OPTIONS:
            out[name] = parse_duration(value)
        elif name in _CHOICE_OPTIONS:
            out[name] = value   # checked by _check, like every option value
        else:
            try:
                out[name] = float(value)
            except ValueError:
                raise FaultSpecError(f"option {name!r} must be a number, got {value!r}") from None
    return out


def _parse_target(text: str, kind: str = "kill") -> Target:
    if "(" in text:   # options after the target: 'hang:client(resume=8s)'
        name, _, options = text.partition("(")
        raise FaultSpecError(f"options go right after the kind, before ':TARGET': "
                             f"{kind}({options.rstrip(')').strip()}):{name.strip()}, not {kind}:{text}")
    text, comma, replica = text.partition(",")
    name, eq, value = (s.strip() for s in text.partition("="))
    if comma and name in ("slice", "worker") and replica.partition("=")[0].strip() == "host":
        target = _parse_target(text, kind)
        return dataclasses.replace(target, host=_parse_host(replica))
    if name == "host" or (comma and replica.partition("=")[0].strip() == "host"):
        raise FaultSpecError(_MISPLACED_HOST + (f", not after {text.strip()!r}" if comma else ""))
    if name == "replica" or (comma and name != "stage"):
        raise FaultSpecError(_MISPLACED_REPLICA + (f", not after {text.strip()!r}" if comma else ""))
    if name not in TARGET_KINDS:
        raise FaultSpecError(f"unknown target {name!r} (expected {_names(TARGET_KINDS)})")
    if name in _BARE_TARGETS:
        if eq:
            raise FaultSpecError(_no_value(name, text))
        return Target(name)
    if not value:
        raise FaultSpecError(f"target {name!r} needs a value ({name}=...)")
    if name in ("slice", "stage"):
        if not _INT.fullmatch(value):
            raise FaultSpecError(f"target {name} needs an integer >= 0, got {value!r}")
        return Target(name, int(value), _parse_replica(replica) if comma else None)   # a slice has no comma here
    return Target(name, value)


def _parse_host(text: str) -> int:
    """The ``K`` of ``slice=N,host=K``, given the text after the comma."""
    value = text.partition("=")[2].strip()
    if not _INT.fullmatch(value):
        got = "nothing" if not value else repr(value)
        raise FaultSpecError(f"target host needs an integer >= 0 (e.g. slice=1,host=1), got {got}")
    return int(value)


def _parse_replica(text: str) -> int:
    """The ``R`` of ``stage=K,replica=R``, given the text after the comma."""
    name, _, value = (s.strip() for s in text.partition("="))
    if name != "replica":
        raise FaultSpecError(f"unexpected {text.strip()!r} after a stage target (expected stage=K or "
                             "stage=K,replica=R)")
    if _REPLICA.search(value):
        raise FaultSpecError("replica= given twice (a stage target takes one: stage=K,replica=R)")
    if not _INT.fullmatch(value):
        got = "nothing" if not value else repr(value)
        raise FaultSpecError(f"target replica needs an integer >= 0 (e.g. stage=1,replica=0), got {got}")
    return int(value)


def _parse_when(text: str) -> When:
    name, eq, value = (s.strip() for s in text.partition("="))
    if name == "transfer" and not eq:
        return When(transfer=True)
    if name == "step" and value:
        if not _INT.fullmatch(value):
            raise FaultSpecError(f"bad when {text!r}: step needs an integer >= 0")
        return When(step=int(value))
    if name in ("checkpoint", "snapshot") and value:
        if not _INT.fullmatch(value):
            raise FaultSpecError(f"bad when {text!r}: {name} needs an integer >= 0 (a step)")
        return When(**{name: int(value)})
    if name == "time" and value:
        try:
            return When(time=parse_duration(value))
        except FaultSpecError as e:
            raise FaultSpecError(f"bad when {text!r}: {e}") from None
    raise FaultSpecError(f"bad when {text!r} (expected step=N, time=DURATION, transfer, checkpoint=STEP or "
                         "snapshot=STEP)")


def _check(f: Fault) -> None:
    """Structural rules shared by parse_faults and validate; also types every field of a hand-built fault."""
    if not isinstance(f, Fault):
        raise FaultSpecError(f"not a Fault: {f!r}")
    if not isinstance(f.kind, str) or f.kind not in KINDS:
        raise FaultSpecError(f"unknown kind {f.kind!r} (expected {_names(KINDS)})")
    t, w = f.target, f.when
    if not isinstance(t, Target):
        raise FaultSpecError(f"target must be a Target, got {t!r}")
    if not isinstance(w, When):
        raise FaultSpecError(f"when must be a When, got {w!r}")
    if not isinstance(t.kind, str) or t.kind not in TARGET_KINDS:
        raise FaultSpecError(f"unknown target {t.kind!r} (expected {_names(TARGET_KINDS)})")
    if t.kind in ("slice", "stage") and not _index(t.value):
        raise FaultSpecError(f"target {t.kind} needs an integer >= 0, got {t.value!r}")
    if t.replica is not None and not (t.kind == "stage" and _index(t.replica)):
        raise FaultSpecError(f"target replica needs an integer >= 0, got {t.replica!r}" if t.kind == "stage"
                             else f"{_MISPLACED_REPLICA}, not with target {t.kind!r}")
    if t.host is not None and not (t.kind in ("slice", "worker") and _index(t.host)):
        raise FaultSpecError(f"target host needs an integer >= 0, got {t.host!r}" if t.kind in ("slice", "worker")
                             else f"{_MISPLACED_HOST}, not with target {t.kind!r}")
    if t.kind == "worker" and not (isinstance(t.value, str) and _WORKER_ID.fullmatch(t.value)):
        raise FaultSpecError(f"target worker needs an id of letters, digits, '_', '.', '-', got {t.value!r}")
    if t.kind == "role" and not (isinstance(t.value, str) and t.value in ROLES):
        raise FaultSpecError(f"unknown role {t.value!r} (expected {_names(ROLES)})")
    if t.kind in _BARE_TARGETS and t.value is not None:
        raise FaultSpecError(_no_value(t.kind, t.value))
    if not isinstance(w.transfer, bool):
        raise FaultSpecError(f"when.transfer must be True or False, got {w.transfer!r}")
    if sum((w.step is not None, w.time is not None, w.transfer, w.checkpoint is not None,
            w.snapshot is not None)) != 1:
        raise FaultSpecError(f"when must set exactly one of step, time, transfer, checkpoint, snapshot, got {w}")
    for name in ("step", "checkpoint", "snapshot"):
        n = getattr(w, name)
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise FaultSpecError(f"{name} must be an integer >= 0, got {n!r}")
    if w.time is not None and not ((seconds := _real(w.time)) is not None and seconds >= 0):
        raise FaultSpecError(f"time must be a finite number of seconds >= 0, got {w.time!r}")
    is_transfer_role = t.kind == "role" and t.value in TRANSFER_ROLES
    if t.kind == "client" and f.kind not in CLIENT_KINDS:
        raise FaultSpecError(f"only kill and hang hit the client (the process driving the run), not {f.kind!r}")
    if w.transfer and f.kind not in TRANSFER_KINDS:
        raise FaultSpecError(f"@transfer works only with kill and hang, not {f.kind!r}")
    if w.transfer and not is_transfer_role and t.kind != "client":
        raise FaultSpecError(f"@transfer needs target role=source or role=dest, got {t.spec()!r}")
    if is_transfer_role and not w.transfer:
        raise FaultSpecError(f"target role={t.value} exists only during a transfer: use @transfer")
    if (t.kind == "role" and t.value == "writer") != (f.kind == "kill_save" and t.kind == "role"):
        if f.kind == "kill_save":
            raise FaultSpecError(f"kill_save hits the worker writing a checkpoint: target role=writer (the default),"
                                 f" a slice, a stage or a worker, not {t.spec()!r}")
        raise FaultSpecError("target role=writer works only with kill_save (the worker that writes the next "
                             "checkpoint)")
    if f.kind == "kill_save" and t.kind in ("random", "all", "everything"):
        raise FaultSpecError(f"kill_save hits the worker writing a checkpoint: target role=writer (the default), "
                             f"a slice, a stage or a worker, not {t.spec()!r}")
    allowed = _OPTIONS[f.kind]
    if not (isinstance(f.options, tuple) and all(isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str)
                                                 for o in f.options)):
        raise FaultSpecError(f"options must be (name, value) pairs sorted by name, got {f.options!r}")
    names = [k for k, _ in f.options]
    if names != sorted(set(names)):
        raise FaultSpecError(f"options must be sorted with unique names, got {names}")
    for name, value in f.options:
        if name not in allowed:
            raise FaultSpecError(f"unknown option {name!r} for {f.kind} (options: {_names(allowed)})")
        if name in _CHOICE_OPTIONS:
            if value not in _CHOICE_OPTIONS[name]:
                raise FaultSpecError(f"option {name!r} must be one of {', '.join(_CHOICE_OPTIONS[name])}, "
                                     f"got {value!r}")
            continue
        number = _real(value)
        if number is None:
            raise FaultSpecError(f"option {name!r} must be a number, got {value!r}")
        if not (number >= 1.0 if name == "factor" else number > 0.0):
            bound = ">= 1" if name == "factor" else "> 0"
            raise FaultSpecError(f"option {name!r} must be {bound}, got {value!r}")
    if t.kind == "client":
        _check_client(f)


def _check_client(f: Fault) -> None:
    """The options of a fault on the ``client``: ``kill`` none, ``hang`` ``resume`` (how long it stays stopped)."""
    names = [k for k, _ in f.options]
    if f.kind == "kill" and f.options:
        raise FaultSpecError("kill:client takes no options: the client is SIGKILLed at once (phase= is a worker's "
                             "step phase)")
    if f.kind == "hang" and "resume" not in names:
        raise FaultSpecError("hang:client needs resume=DURATION, how long the client stays stopped (e.g. "
                             "hang(resume=8s):client@step=10); a client that never wakes is kill:client")


def _no_value(name: str, got) -> str:
    if name == "client":
        return (f"target 'client' takes no value, got {got!r}: it is the one process driving the run "
                "(e.g. kill:client@step=10); to hit a worker, use slice=N or worker=ID")
    return f"target {name!r} takes no value, got {got!r}"


def _index(x) -> bool:
    """Whether ``x`` is an int >= 0 (not a bool): a slice, stage or replica index."""
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _real(x) -> float | None:
    """``x`` as a finite float when it is an int or float that a float holds exactly (so its text reads back
    as itself), else None."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    try:
        value = float(x)
    except OverflowError:
        return None
    return value if math.isfinite(value) and value == x else None


def _format_option(name: str, value: float | str) -> str:
    if isinstance(value, str):
        return value
    if name in _DURATION_OPTIONS:
        return format_duration(value)
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def _safe_spec(f: Fault) -> str:
    try:
        return f.spec()
    except Exception:  # a malformed fault built by hand: show the dataclass instead
        return repr(f)


def _names(items) -> str:
    return ", ".join(items) if items else "none"
