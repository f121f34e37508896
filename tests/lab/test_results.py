"""The run-folder helpers every experiment writes through (sparseattn/lab/results.py)."""

import json

import pytest
import torch

from sparseattn.lab.results import (
    StepClock,
    cpu_name,
    machine_facts,
    run_folder,
    timing_facts,
    torch_threads,
)


def test_run_folder_pins_its_identity(tmp_path):
    identity = {"n": 256, "depths": (1, 2), "path": tmp_path}  # tuples and paths as JSON gives back
    folder = run_folder(tmp_path / "run", identity, ("cells",))
    assert (folder / "cells").is_dir()
    assert json.loads((folder / "config.json").read_text())["depths"] == [1, 2]
    assert run_folder(tmp_path / "run", identity) == folder  # the same run resumes
    with pytest.raises(ValueError, match="different config"):
        run_folder(tmp_path / "run", identity | {"n": 64})


def test_torch_threads_restores_the_count_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(RuntimeError), torch_threads(1):
        assert torch.get_num_threads() == 1
        raise RuntimeError
    assert torch.get_num_threads() == before


def test_step_clock_keeps_earlier_steps(tmp_path):
    clock = StepClock(tmp_path / "steps.json")
    with clock.step("a"):
        sum(range(1000))
    resumed = StepClock(tmp_path / "steps.json")
    with resumed.step("b"):
        pass
    assert set(resumed.steps) == {"a", "b"}
    assert resumed.total(skip=("a",)) == {
        key: resumed.steps["b"][key] for key in ("wall_seconds", "cpu_seconds")
    }


def test_timing_facts_name_the_cpu_of_the_machine_facts():
    facts = timing_facts(3)
    assert facts["cpu"] == cpu_name() == machine_facts()["cpu"] and facts["cpu"]
    assert facts["threads"] == 3 and facts["torch"] == torch.__version__
    assert facts["load before"] >= 0
