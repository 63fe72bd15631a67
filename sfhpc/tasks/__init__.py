"""Tasks: environments the agents act in, each with a verifiable reward. `get_task(spec)` builds one."""

from sfhpc.tasks.base import Episode, Problem, StepResult, Task
from sfhpc.tasks.registry import get_task

__all__ = ["Episode", "Problem", "StepResult", "Task", "get_task"]
