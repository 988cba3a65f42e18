"""Offline checks of the planners, never on the run-time path: an exact solver to compare the
adaptive planner against (`exact.py`) and the planner tables of the tests and benchmarks
(`report.py`)."""
