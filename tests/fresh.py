"""A fresh Python process for the round trips that must not share state with the test run."""

import json
import os
import subprocess
import sys
import textwrap

import torch

#: One parallel op before the code: on the project's 2-core machines the first parallel
#: element-wise op of a new process gets its second thread's half wrong by ~3e-4 relative in a
#: few processes of a hundred (torch alone does it: ``scripts/first_parallel_op.py``), which made
#: the exact round trips fail at random; the ops after the first are exact.
WARM_UP = "torch.full((1 << 16,), 0.5).sqrt()\n"


def fresh(code: str, timeout: float = 300) -> dict:
    """Run ``code`` in a new Python process with this one's torch thread count (another count
    reduces in another order: equal outputs are then close, not equal; a test earlier in the
    run may have set one thread), after :data:`WARM_UP`; it prints one JSON line, returned."""
    threads = f"import torch\ntorch.set_num_threads({torch.get_num_threads()})\n{WARM_UP}"
    run = subprocess.run(
        [sys.executable, "-c", threads + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])
