"""Structured logs: one JSON object per line, with request_id (and session_id) carried across hops, and the
router's caller (its token's name, never the token)."""

from __future__ import annotations

import json
import logging
import sys
import time

_FIELDS = ("request_id", "caller", "session_id", "chain", "stage", "code", "peer", "reason")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value not in (None, ""):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class _StderrHandler(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record, not as it was at set-up (an embedding program or
    a test harness may swap it, and the old one may be closed by then)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


class TextFormatter(logging.Formatter):
    """One line a person reads: time, level, logger, message, then the request's fields as key=value."""

    def format(self, record: logging.LogRecord) -> str:
        when = time.strftime("%H:%M:%S", time.localtime(record.created)) + f".{int(record.msecs):03d}"
        fields = [f"{key}={value}" for key in _FIELDS if (value := getattr(record, key, None)) not in (None, "")]
        line = f"{when} {record.levelname.lower():7} {record.name}: {record.getMessage()}"
        if fields:
            line += "  " + " ".join(fields)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


LOG_FORMATS = {"json": JsonFormatter, "text": TextFormatter}


def setup_logging(level: str = "info", log_format: str = "json") -> None:
    """Every record to stderr, as JSON lines (for a log pipeline) or text (for a person at a terminal)."""
    handler = _StderrHandler()
    handler.setFormatter(LOG_FORMATS[log_format]())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
