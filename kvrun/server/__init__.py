"""kvrun serve: OpenAI's HTTP API on the continuous-batching engine (kvrun.run.engine).

app.py (the HTTP side, on the event loop), worker.py (the engine thread, every torch call),
schema.py (request bodies), guard.py (connection limits and timeouts), metrics.py (/metrics)."""

from __future__ import annotations

import time
import urllib.error
import urllib.request


def wait_ready(url: str, proc=None, timeout: float = 120.0) -> None:
    """Wait until GET url answers 200 (say a server's /health); RuntimeError when `proc` (a
    subprocess.Popen of the server, optional) exits first or `timeout` seconds pass. For
    scripts and tests that start a server."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer 200 within {timeout:.0f} s")
