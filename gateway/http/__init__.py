"""The gateway's plain-HTTP surface beside the WebSocket: the voices and pronunciation-dictionary APIs, readiness
and drain, typed HTTP error responses and the log of refused requests."""
