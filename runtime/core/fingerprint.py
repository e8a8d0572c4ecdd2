"""Which math a set of programs is: fingerprints of exported programs, blind to where the code lives.

Used by the worker (the fingerprint a checkpoint records, checked when one
is restored) and by the client (one fingerprint per program, recorded in the
event log so that a later attempt of a run can say which program changed
before anything starts). Pure: text in, digest out.

The StableHLO text of an exported program carries source locations (file,
line, the whole call stack the step was traced under, which also numbers
the ``#loc`` aliases) and the module's name: they change when code moves or
is called from elsewhere, never the math, so they are stripped first.
"""

from __future__ import annotations

import hashlib
import re

__all__ = ["legacy_programs_fingerprint", "program_fingerprint", "programs_fingerprint", "strip_locations"]

_LOC_LINE = re.compile(r"^#loc[0-9]* = .*\n?", re.MULTILINE)
_MODULE_NAME = re.compile(r"^module @[^ ]+", re.MULTILINE)


def strip_locations(text: str) -> str:
    """StableHLO text without its source locations: ``#loc`` lines and every inline ``loc(...)`` (nested
    ``callsite``/``fused``/named ones included, balanced, quotes respected), and without blank lines.

    Where the code lives, the call stack it was traced under (which numbers the ``#loc`` aliases) and the
    module's name never change the math."""
    text = _LOC_LINE.sub("", text)
    out, i, n = [], 0, len(text)
    while True:
        j = text.find("loc(", i)
        if j < 0:
            out.append(text[i:])
            break
        if j > 0 and (text[j - 1].isalnum() or text[j - 1] in "_.#"):
            out.append(text[i:j + 4])   # part of another word (alloc(...)): not a location
            i = j + 4
            continue
        out.append(text[i:j].rstrip(" "))
        depth, k, quoted = 0, j + 3, False
        while k < n:
            c = text[k]
            if quoted:
                if c == "\\":
                    k += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    break
            k += 1
        i = k + 1
    text = _MODULE_NAME.sub("module", "".join(out))
    return "\n".join(line for line in text.splitlines() if line.strip())



def program_fingerprint(serialized: bytes) -> str:
    """sha256 of one exported program's StableHLO text without source locations or module name."""
    import jax

    text = jax.export.deserialize(bytearray(serialized)).mlir_module()
    return hashlib.sha256(strip_locations(text).encode()).hexdigest()


#: Programs that only read the state (the held-out loss): a run with or without them trains the same state, so
#: they are no part of which math a state belongs to.
READ_ONLY_PROGRAMS = frozenset({"eval"})


def programs_fingerprint(programs: dict[str, bytes]) -> str:
    """One digest over ``{name: serialized program}`` (in name order): which math a checkpoint belongs to (the
    programs that only read the state, :data:`READ_ONLY_PROGRAMS`, left out: a run with eval resumes one
    without and the other way round)."""
    h = hashlib.sha256()
    for name in sorted(set(programs) - READ_ONLY_PROGRAMS):
        h.update(name.encode() + b"\0" + bytes.fromhex(program_fingerprint(programs[name])))
    return h.hexdigest()


# What checkpoints written before 2026-12-01 record: only simple inline locations were stripped, so a nested
# ``loc(callsite(...))`` (a step traced under another call stack) changed it. Still accepted when restoring.
_OLD_LOCATION = re.compile(r'^#loc[0-9]* = .*$|\s*loc\((?:"[^"]*"|#loc[0-9]*|unknown)\)', re.MULTILINE)


def legacy_programs_fingerprint(programs: dict[str, bytes]) -> str:
    """The fingerprint of :func:`programs_fingerprint`'s predecessor, for checkpoints that recorded it."""
    import jax

    h = hashlib.sha256()
    for name in sorted(set(programs) - READ_ONLY_PROGRAMS):
        text = jax.export.deserialize(bytearray(programs[name])).mlir_module()
        text = _MODULE_NAME.sub("module", _OLD_LOCATION.sub("", text))
        h.update(name.encode() + b"\0" + hashlib.sha256(text.encode()).digest())
    return h.hexdigest()
