"""The one error type of the schedule package.

It lives in its own module because both the cost model (deadlock detection) and the validator
raise it, and the validator uses the cost model.
"""


class ScheduleError(ValueError):
  """A schedule that cannot run as written: malformed, deadlocked or over its memory cap."""
