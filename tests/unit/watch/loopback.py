"""Real HTTP servers on 127.0.0.1 for the watch tests: a recorded vLLM page, a page that is not
vLLM, and a receiver that records what is POSTed to it."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PAGE = (
    Path(__file__).parents[2] / "integration" / "data" / "metrics_vllm_0.32.0_after_burst.txt"
).read_text()


@contextmanager
def http_server(
    get: Callable[[str], tuple[int, str]] | None = None,
    post_statuses: list[int] | None = None,
) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(base URL, received POSTs) of a server answering GET with ``get(path)`` and POST with
    the statuses in ``post_statuses`` in turn (then 200)."""
    received: list[dict[str, Any]] = []
    statuses = list(post_statuses or [])

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            status, body = get(self.path) if get else (404, "not found")
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length) or b"null")
            status = statuses.pop(0) if statuses else 200
            received.append({"path": self.path, "status": status, "body": body})
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()
        server.server_close()


def vllm_page(path: str) -> tuple[int, str]:
    """A vLLM server's /metrics (the recorded page)."""
    return (200, PAGE) if path == "/metrics" else (404, "")


def not_vllm_page(path: str) -> tuple[int, str]:
    """Some other service: its /metrics has no vLLM metric."""
    return (
        (200, "# TYPE http_requests_total counter\nhttp_requests_total 3\n")
        if path == "/metrics"
        else (404, "")
    )
