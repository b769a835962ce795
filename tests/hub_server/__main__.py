"""Run the local Hub server standalone: ``cd tests && python -m hub_server --port 8080``."""

from __future__ import annotations

import argparse
import signal
import sys
import time

from .protocol import DEFAULT_USER
from .server import HubServer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Local Hugging Face Hub-compatible test server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--root", default=None, help="storage directory (default: temp dir)")
    parser.add_argument("--user", default=DEFAULT_USER)
    parser.add_argument("--token", default=None, help="only accept this token (default: any)")
    parser.add_argument("--lfs-threshold", type=int, default=10 * 1024 * 1024)
    opts = parser.parse_args(argv)
    server = HubServer(root=opts.root, host=opts.host, port=opts.port, user=opts.user, token=opts.token,
                       lfs_threshold=opts.lfs_threshold)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so `finally` removes the temp storage
    server.start()
    print(f"Local Hub serving at {server.url} (storage: {server.root}); "
          f"use HF_ENDPOINT={server.url} HF_HUB_DISABLE_XET=1 HF_TOKEN=<anything>", flush=True)
    try:
        while True:
            time.sleep(3600)
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
