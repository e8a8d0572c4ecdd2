"""Helpers shared by test modules: the one place a test module imports another test file's code from.

A test module (``test_*.py``) is never imported by another; what two of them need lives here, a module per idea:
``events`` (building and reading run logs), ``worker_harness`` (one real worker process driven over real gRPC),
``fake_group`` (the one worker group the unit tests step the controller and its modules against),
``fake_controller`` (the controller as the fault injector sees it), ``controller_run`` (the fake group's
expected results), ``example_diff`` (how an example differs from its original loop) and ``signals`` (a child
stopped by SIGINT however the suite was started).
"""
