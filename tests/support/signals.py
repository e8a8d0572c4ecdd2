"""Signals as a test's child process gets them, whatever the suite was started from.

A shell that runs a job in the background without job control (``nohup bash scripts/test.sh &``, a CI
step's ``cmd &``) starts it with SIGINT ignored, and every child inherits that, so a test that stops a child
with SIGINT (a terminal's Ctrl-C) would wait for ever. A child given ``preexec_fn=default_sigint`` has
SIGINT's default disposition (Python then turns it into ``KeyboardInterrupt``) however the suite started.
"""

import signal


def default_sigint() -> None:
    """``subprocess.Popen(..., preexec_fn=default_sigint)``: runs in the child before it execs."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
