"""A fresh Python process for the round trips that must not share state with the test run."""

import json
import os
import subprocess
import sys
import textwrap

import torch


def fresh(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a new Python process with this one's torch thread count (another count
    reduces in another order: equal outputs are then close, not equal; a test earlier in the
    run may have set one thread); it prints one JSON line, returned."""
    threads = f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n"
    run = subprocess.run(
        [sys.executable, "-c", threads + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
