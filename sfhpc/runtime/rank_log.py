"""Where a rank's lines go: the console shows the run's own lines; the rank's log holds the rest.

Every rank writes ``logs/rank-NNN.log`` in the run folder: sfhpc's log lines, the traceback of a fault
(`sfhpc.runtime.fault`), and the libraries' chatter. vLLM logs several INFO lines per weight update
(pause, prefix cache, reload) and a score of warnings at every start (Triton, tcmalloc, eager mode), which
would bury the step lines a person follows on the console. It
configures its logging itself when an engine starts, in this process and in each engine process it
starts, from its environment: so `set_up` points ``VLLM_LOGGING_CONFIG_PATH`` at a configuration
(`vllm_logging_config`) that writes vLLM's records to the rank's log (the engine processes inherit the
variables and append to the same file) and copies only its errors to stderr, and applies it
here at once, for what vLLM logs before an engine starts. (An engine process's own first lines, before
vLLM configures it, still take Python's default: warnings on stderr.)
Hugging Face progress bars (a model written, a tokenizer trained), vLLM's at a weight load, FutureWarnings
and torch's C++ warnings are off for the same reason.

``sfhpc run --verbose`` (`set_up(..., verbose=True)`) leaves all of it as the libraries set it up, on
the console. A user who configured vLLM's logging themselves (``VLLM_LOGGING_CONFIG_PATH``, or
``VLLM_CONFIGURE_LOGGING=0``) keeps their own.
"""

from __future__ import annotations

import json
import logging
import logging.config
import os
from pathlib import Path
from typing import Any

RANK_LOG_ENV = "SFHPC_RANK_LOG"  # the rank's log file, for the handler vLLM's configuration builds
VLLM_CONFIG_NAME = "vllm-logging.json"  # in the run's logs folder, the same for every rank


def set_up(path: Path, rank: int, *, verbose: bool = False) -> None:
    """Send this rank's sfhpc log (and, unless `verbose`, the libraries' INFO lines) to `path`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank {rank} %(levelname)s %(message)s"))
    log = logging.getLogger("sfhpc")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    # A record the log cannot take (a full disk) is dropped, not reported with a traceback on stderr for
    # every line: the console keeps the one line that says what failed.
    logging.raiseExceptions = False
    if verbose:
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    # Warnings for the libraries' developers, on the console of every engine process vLLM starts (which read
    # their filters from the environment): FutureWarnings of vLLM's own imports, and multiprocessing's
    # resource tracker at exit about a shared-memory block vLLM's engine leaves to it; torch's C++ warnings
    # (NUMA binding on CPU).
    quiet = ("ignore::FutureWarning", "ignore::UserWarning:multiprocessing.resource_tracker")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, (os.environ.get("PYTHONWARNINGS"), *quiet)))
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return
    os.environ[RANK_LOG_ENV] = str(path)
    config = vllm_logging_config()
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(_write_once(path.parent / VLLM_CONFIG_NAME,
                                                             json.dumps(config, indent=2) + "\n"))
    logging.config.dictConfig(config)


def vllm_logging_config() -> dict[str, Any]:
    """vLLM's logging (a `logging.config.dictConfig`): every record of the ``vllm`` loggers to the rank's
    log, errors to stderr as well."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"console": {"format": "vllm %(levelname)s %(message)s"}},
        "filters": {"engine_death": {"()": f"{__name__}.EngineDeathReported"}},
        "handlers": {
            "rank_log": {"()": f"{__name__}.rank_log_handler", "level": "INFO"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "level": "ERROR",
                        "formatter": "console", "filters": ["engine_death"]},
        },
        "loggers": {"vllm": {"handlers": ["rank_log", "console"], "level": "INFO", "propagate": False}},
    }


class EngineDeathReported(logging.Filter):
    """Keeps vLLM's report of its engine core's death (``EngineDeadError``, with its traceback) off the console:
    sfhpc says it there in its own line (the engine restarted, or the run's fault line); the rank's log keeps it."""

    def filter(self, record: logging.LogRecord) -> bool:
        kind = record.exc_info[0] if record.exc_info else None
        return kind is None or kind.__name__ != "EngineDeadError"


def rank_log_handler() -> logging.Handler:
    """The handler vLLM's configuration builds, in the rank's process and in its engine processes: an
    append to the rank's log (``$SFHPC_RANK_LOG``), the process named on each line."""
    handler = logging.FileHandler(os.environ[RANK_LOG_ENV], encoding="utf-8", delay=True)
    handler.setFormatter(logging.Formatter("%(asctime)s vllm %(processName)s %(levelname)s %(message)s"))
    return handler


def _write_once(path: Path, text: str) -> Path:
    """Write `text` to `path` whole (ranks write the same text, each through a file of its own)."""
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(text, encoding="utf-8")
        temporary.replace(path)
    return path
