"""`sparseattn lm --parallel context` (issue 42 item 6): the byte LM trained under
`torchrun --nproc-per-node 2` with every window's sequence sharded over the two processes
equals the single-process run of the same config, step by step — the training loss of each of
20 steps and the validation loss, to 1e-9 relative in float64 and 1e-4 in float32.

Each torchrun run is a subprocess in its own session (gloo on localhost, a free port from
``--standalone``), killed with its workers after 120 s. The patterns cross the shard boundary
at position 32 of n = 64: Child's causal STRIDED (the previous 8 bytes and every 8th earlier
one) and causal STAR (a band of 8, and the relay, the last position, reading every key: a
global row merged across the ranks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from sparseattn.lab.experiments import lm
from sparseattn.lab.experiments.lm import LMConfig
from sparseattn.lab.models import Encoder, EncoderConfig
from sparseattn.lab.results import torch_threads
from sparseattn.patterns import block_local

pytestmark = pytest.mark.timeout(300)

COLUMNS = ("strided-union", "star")
W, STEPS, BATCH = 8, 20, 4
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}
TIMEOUT = 120


def _torchrun(args: list[str], cwd, timeout: int = TIMEOUT) -> str:
    """``torchrun --nproc-per-node 2 --standalone -m sparseattn.lab.cli *args``; its output.
    Past ``timeout`` seconds torchrun and its workers (one process group) are killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--standalone", "-m", "sparseattn.lab.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun ran past {timeout} s: {' '.join(cmd)}\n{out[-4000:]}")
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-4000:]}"
    return out


@pytest.mark.parametrize("dtype", TOLERANCE)
def test_context_parallel_lm_equals_one_process(dtype, tmp_path):
    """Two processes, each holding half of every window, train both cells; every step's loss
    (the mean over all 4 × 64 predicted bytes) and the final validation loss are those of one
    process on whole windows."""
    args = ["lm", "--quick", "--patterns", ",".join(COLUMNS), "--widths", str(W)]
    args += ["--steps", str(STEPS), "--batch-size", str(BATCH), "--dtype", dtype]
    args += ["--parallel", "context", "--out-dir", str(tmp_path / "cp")]
    _torchrun(args, tmp_path)
    config = lm.quick_config(
        widths=(W,), steps=STEPS, batch_size=BATCH, dtype=dtype, columns=COLUMNS, progress=False
    )
    data = lm.datasets(config)
    tol = TOLERANCE[dtype]
    for column in COLUMNS:
        name = lm.cell_name(column, W, 0)
        (path,) = (tmp_path / "cp").glob(f"*/cells/{name}.json")
        got = json.loads(path.read_text())
        assert got["workers"] == 2 and got["parallel"] == "context"
        with torch_threads(1):
            _, want = lm.train(config, column, W, 0, data=data)
        assert want["workers"] == 1 and want["parallel"] is None
        assert len(got["train_losses"]) == len(want["train_losses"]) == STEPS
        worst = max(
            abs(a - b) / abs(b)
            for a, b in zip(got["train_losses"], want["train_losses"], strict=True)
        )
        assert worst <= tol, f"{column} {dtype}: training losses differ by {worst:.2e} relative"
        assert got["loss"] == pytest.approx(want["loss"], rel=tol), column
        assert got["eval_bytes"] == want["eval_bytes"]
        assert want["train_losses"][-1] < want["train_losses"][0]  # it trained


def test_dropout_is_refused_with_context_parallelism():
    """Each rank would draw its own dropout masks: not the single-process run."""
    with pytest.raises(ValueError, match="dropout must be 0 with parallel='context'"):
        LMConfig(parallel="context", dropout=0.1).validate()
    LMConfig(parallel="context").validate()
    with pytest.raises(ValueError, match="parallel must be 'cells', 'data' or 'context'"):
        LMConfig(parallel="sequence").validate()


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_a_part_of_the_sequence_gets_its_global_positions(positions):
    """With a pattern whose rows read only themselves, the hidden states of ids[:, s:] run
    with ``start=s`` are rows s… of the whole sequence's: the part takes the position
    embeddings of its global positions (what each rank's shard needs)."""
    torch.manual_seed(0)
    cfg = EncoderConfig(
        vocab_size=256, max_len=24, dim=16, heads=2, dropout=0.0, positions=positions
    )
    model = Encoder(cfg).double().eval()
    ids = torch.randint(256, (2, 24))
    with torch.no_grad():
        whole = model(ids, block_local(1))
        part = model(ids[:, 10:], block_local(1), start=10)
        shifted = model(ids[:, 10:], block_local(1))
    torch.testing.assert_close(part, whole[:, 10:], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(shifted, whole[:, 10:])
    with pytest.raises(ValueError, match="from position 10 exceeds max_len=24"):
        model(ids[:, 9:], block_local(1), start=10)
