"""`running(app)`: an app (`specplug.server.create_app`) served in a thread of the test's process."""
from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def running(app) -> Iterator[str]:
    """Serve `app` on a free 127.0.0.1 port in a thread; yields the base URL ("http://127.0.0.1:PORT")."""
    import uvicorn  # not at import: this module is loaded with the pytest plugin, by every test run

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=5))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    deadline = time.time() + 20
    while not server.started:
        assert time.time() < deadline and t.is_alive(), "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(10)
