"""A live HTTP server in this process: the app over an engine, served by uvicorn in a thread
on a free loopback port (tests/server, tests/engine)."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.support.server_process import free_port


class LiveServer:
    """The app over `engine`, served by `GracefulServer` (what `pagedserve serve` runs) in a
    thread on a free loopback port; stop() is what SIGTERM does."""

    def __init__(self, engine: Any, tenants: Any = None, **config: Any) -> None:
        from server.app import GracefulServer, build_app
        from server.config import ServerConfig

        server_config = ServerConfig(port=free_port(), log_level="warning", **config)
        self.engine = engine
        self.url = f"http://127.0.0.1:{server_config.port}"
        app = build_app(engine, server_config, tenants)
        self.server = GracefulServer(app, engine, server_config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self, timeout_s: float = 20.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the server did not stop"
