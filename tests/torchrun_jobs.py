"""torchrun jobs in the tests: how a test starts one, and what its ranks share.

A job is a module of this package run on every rank (``torchrun -m``) from the
repository root, so it imports ``tests.*`` like the test that starts it. Its
ranks check what they compute in a :class:`Tally`, merge it over ranks, and rank
0 writes the result as JSON; the test reads it (:func:`read_result`) and
asserts. The tests of ``examples/`` start the example scripts the same way
(:func:`torchrun_command` with a script path).

Test side::

    job = run_job(torchrun_command(2, "-m", "tests.sharding.dist_worker", out))
    result = read_result(out, job)

Rank side::

    with gloo_job():
        tally = Tally(tol=1e-5)
        tally.diff("outputs", got, want)
        result = tally.result()  # collective
        if dist.get_rank() == 0:
            write_result(out, result)
"""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

#: The repository root: jobs run here.
ROOT = Path(__file__).resolve().parents[1]


# -------------------------------------------------------------- test side
def torchrun_command(world_size: int, *target: str) -> list[str]:
    """torchrun (standalone, this interpreter) on ``world_size`` local processes;
    ``target``: a script path and its arguments, or ``"-m", module, arguments``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        *target,
    ]


def run_job(
    command: list[str], timeout: float = 240, triton_interpret: bool = True
) -> subprocess.CompletedProcess:
    """Run ``command`` from the repository root, one OMP thread per process, output
    captured. ``triton_interpret=False`` drops ``TRITON_INTERPRET`` from its
    environment (the examples run as a user runs them)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if not triton_interpret:
        env.pop("TRITON_INTERPRET", None)
    return subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def read_result(path: Path, job: subprocess.CompletedProcess) -> dict:
    """The JSON result a job wrote to ``path`` (printed for the test log); the test
    fails with the job's stderr if there is none."""
    if not path.exists():
        pytest.fail(f"the job wrote no result (exit {job.returncode}):\n{job.stderr[-6000:]}")
    result = json.loads(path.read_text())
    print(json.dumps(result, indent=1, sort_keys=True))
    return result


def assert_scenarios_passed(result: dict, job: subprocess.CompletedProcess, names: set) -> None:
    """Every scenario of a :func:`run_scenarios` job passed, the job ran exactly
    ``names``, and it exited cleanly."""
    failed = {n: r for n, r in result["scenarios"].items() if not r["passed"]}
    assert not failed, json.dumps(failed, indent=1)
    assert set(result["scenarios"]) == set(names)
    assert job.returncode == 0, job.stderr[-6000:]


# -------------------------------------------------------------- rank side
@contextmanager
def gloo_job() -> Iterator[None]:
    """One rank of a test job: warnings and logs quiet, one torch thread, the gloo
    process group. On a normal exit the models are freed (they hold the group),
    the ranks meet and the group is destroyed; an exception leaves it to torchrun."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    yield
    gc.collect()  # why: free the models (they hold the process group) before it goes
    dist.barrier()
    dist.destroy_process_group()


def run_scenarios(out_path: str, scenarios: dict[str, Callable[[], dict]]) -> None:
    """Run every scenario in order on this rank (inside ``gloo_job``); rank 0 writes
    ``{"world_size", "scenarios": {name: result}}`` to ``out_path``. A scenario that
    raises is recorded with its traceback, written, and re-raised (the other ranks
    are stuck in a collective: torchrun then stops them)."""
    rank = dist.get_rank()
    results: dict[str, Any] = {"world_size": dist.get_world_size(), "scenarios": {}}
    for name, run in scenarios.items():
        try:
            results["scenarios"][name] = run()
            gc.collect()  # why: free the scenario's models (they hold the process group)
        except Exception:
            results["scenarios"][name] = {"passed": False, "error": traceback.format_exc()}
            if rank == 0:
                write_result(out_path, results)
            raise
    if rank == 0:
        write_result(out_path, results)


def scenarios_main(scenarios: dict[str, Callable[[], dict]]) -> None:
    """A scenario job's entry point: ``python -m <job> OUT_JSON [WORK_DIR]`` on every
    rank runs ``scenarios`` in one gloo job (:func:`run_scenarios`)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with gloo_job():
        run_scenarios(sys.argv[1], scenarios)


def gather(obj: Any) -> list:
    """``obj`` of every rank, in rank order (``[obj]`` without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def write_result(path: str | os.PathLike, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)


class Tally:
    """Largest differences and pass/fail checks seen by a rank, by name.

    ``diff`` keeps the largest absolute difference (in float64) under a name,
    ``check`` and ``exact`` a check that holds only if it held every time;
    ``result()`` merges them over ranks and passes when every difference is at
    most ``tol`` and every check held.
    """

    def __init__(self, tol: float) -> None:
        self.tol = tol
        self.figures: dict[str, float] = {}
        self.checks: dict[str, bool] = {}

    def diff(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        if a.shape != b.shape:
            self.check(f"{name} shape", False)
            return
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        self.figures[name] = max(self.figures.get(name, 0.0), d)

    def check(self, name: str, ok: bool) -> None:
        self.checks[name] = self.checks.get(name, True) and bool(ok)

    def exact(self, name: str, a: torch.Tensor, b: torch.Tensor) -> None:
        """Same shape, dtype and values, bit for bit."""
        self.check(name, a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))

    def result(self) -> dict:
        """``max_abs_diff``, ``checks`` and ``passed``, worst over ranks (a collective
        under a process group: every rank calls it; ranks may hold different names)."""
        figures: dict[str, float] = {}
        checks: dict[str, bool] = {}
        for part_figures, part_checks in gather((self.figures, self.checks)):
            for n, v in part_figures.items():
                figures[n] = max(figures.get(n, 0.0), v)
            for n, ok in part_checks.items():
                checks[n] = checks.get(n, True) and ok
        passed = all(v <= self.tol for v in figures.values()) and all(checks.values())
        return {"max_abs_diff": figures, "checks": checks, "passed": passed}
