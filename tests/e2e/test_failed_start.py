"""A start that only a replica can find bad, through `serve run` as users start it: the
cause on the console and a failed exit (its own module: no other server may run beside
it, since this `serve run` starts its own Ray instance)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.e2e.serving import ROOT


def test_a_replica_that_cannot_start_says_why_and_fails_the_exit(llama_dir):
    """Here a KV cache larger than any memory: the builder cannot know, the batcher
    replica finds out. Ray's CLI alone would end with status 0."""
    serve_bin = Path(sys.executable).with_name("serve")
    done = subprocess.run([str(serve_bin), "run", "deployments.app:build_app",
                           f"model={llama_dir}", f"kv_cache_memory={10**14}"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "RAY_ENABLE_AUTO_CONNECT": "0"})
    console = done.stderr + done.stdout
    assert done.returncode == 1, console[-2000:]
    assert "raygen: the Batcher replica failed to start:" in console
