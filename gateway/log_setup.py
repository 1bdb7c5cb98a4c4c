"""The serving processes' log lines: stderr, as text or one JSON object a line (`voxgate serve` and every front of
`--fronts N` set up the same)."""

from __future__ import annotations

import json
import logging


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, as_json: bool) -> None:
    """Log lines to stderr at `level`, as text or one JSON object each (a gateway front sets up the same)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if as_json else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    numeric = logging.getLevelNamesMapping()[level.upper()]  # GatewayConfig checked the name
    logging.basicConfig(level=numeric, handlers=[handler], force=True)
    logging.getLogger("aiohttp.access").setLevel(max(numeric, logging.WARNING))
