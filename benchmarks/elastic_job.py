"""An elastic job on this machine, as an operator runs one: ``dynatrain store`` in its own process,
the first processes under ``torchrun``, later ones as ``python elastic_fit.py``; the store read
through a real client to follow the job. Every process's output goes to one log file. The elastic
tests (tests/elastic) and ``benchmarks/elastic.py`` drive their jobs with it; the tests start the
``python elastic_fit.py`` processes and the store warm (``ElasticJob(..., warm=True)``: forked from a
server that imported torch, megatron-core and Lightning once), the benchmarks as fresh interpreters.

Example::

    with ElasticJob(tmp_path) as job:
        job.start_torchrun(2)
        job.wait_for(lambda: job.step() >= 3)
        joiner = job.start_python()
        job.wait_for(lambda: job.installed_size() == 3)
        results = job.finish()       # every training process's OUT/<pid>.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from benchmarks.baselines.launch import WarmScript

REPO = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("elastic_fit.py")
TOKEN = "test-job-token"


def torchrun(nproc: int, *script: str) -> list[str]:
    """``torchrun --standalone --nproc-per-node N --max-restarts 0 SCRIPT...`` (a launch of its own)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "--max-restarts", "0", *script]


class ElasticJob:
    """A store process and the training processes of one job (see the module docstring)."""

    def __init__(self, out: Path, *, max_steps: int, step_seconds: float, dead_after: float = 4.0,
                 suspect_after: float | None = None, fit_args: tuple[str, ...] = (), warm: bool = False,
                 script: Path = SCRIPT) -> None:
        """``script``: the training script (``elastic_fit.py``, the Trainer's; ``elastic_loop.py``, the
        Fabric loop engine's), which takes ``OUT --max-steps N --step-seconds S``. ``warm``: start the ``python elastic_fit.py`` processes (``start_python``, ``start_launch``)
        and the store process from a server that imported torch, megatron-core and Lightning once
        (``WarmScript``), not as fresh interpreters: for tests, never where a process's start is
        measured. ``torchrun`` launches stay real."""
        self.out, self.max_steps, self.step_seconds, self.dead_after = out, max_steps, step_seconds, dead_after
        self.suspect_after = suspect_after
        self.fit_args = fit_args
        self.warm = warm
        self.script = script
        self.log_path = out / "job.log"
        self.procs: list[subprocess.Popen | WarmScript] = []
        self.env = dict(os.environ, PYTHONPATH=str(REPO), DYNATRAIN_TOKEN=TOKEN, OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1")

    def __enter__(self) -> "ElasticJob":
        from lightning_dynatrain.elastic.client import JobStore

        self.out.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        self.log = open(self.log_path, "a")  # every process appends: a warm child opens the file itself
        store = ["store", "--host", "127.0.0.1", "--port", "0", "--dead-after", str(self.dead_after),
                 *(("--suspect-after", str(self.suspect_after)) if self.suspect_after is not None else ())]
        self._store_log = None
        if self.warm:  # its first line, ``DYNATRAIN_STORE=host:port``, is the log's too
            self.store_proc = WarmScript("lightning_dynatrain.cli", store, env=self.env, cwd=REPO, log=self.log_path,
                                         module=True)
            port = self._store_port()
        else:
            self.store_proc = subprocess.Popen([sys.executable, "-m", "lightning_dynatrain.cli", *store],
                                               env=self.env, stdout=subprocess.PIPE, stderr=self.log, text=True)
            port = self.store_proc.stdout.readline().strip().rsplit(":", 1)[-1]
            self._store_log = threading.Thread(target=self._copy_store_log, daemon=True)
            self._store_log.start()
        self.env["DYNATRAIN_STORE"] = f"127.0.0.1:{port}"
        self.client = JobStore.connect(self.env["DYNATRAIN_STORE"], TOKEN)
        return self

    def _store_port(self, timeout: float = 120.0) -> str:
        """The port the warm store process printed to the log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("DYNATRAIN_STORE="):
                    return line.rsplit(":", 1)[-1]
            if self.store_proc.poll() is not None:
                break
            time.sleep(0.02)
        raise AssertionError(f"the store process printed no address; log:\n{self.tail()}")

    def _copy_store_log(self) -> None:
        """The store process's own lines (its decisions: ``[dynatrain store] ...``) into the job's log."""
        for line in self.store_proc.stdout:
            self.log.write(line)
            self.log.flush()

    def __exit__(self, *exc: object) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        self.store_proc.kill()
        self.store_proc.wait()
        if self._store_log is not None:
            self._store_log.join(timeout=10)
        self.log.close()

    # ------------------------------------------------------------------------------ processes
    def _args(self, *extra: str) -> list[str]:
        return [str(self.script), str(self.out), "--max-steps", str(self.max_steps), "--step-seconds",
                str(self.step_seconds), *self.fit_args, *extra]

    def start_torchrun(self, nproc: int, *extra: str) -> subprocess.Popen:
        return self.start(torchrun(nproc, *self._args(*extra)))

    def start_python(self, *extra: str, env: dict[str, str] | None = None) -> subprocess.Popen | WarmScript:
        if self.warm:
            proc = WarmScript(self.script, self._args(*extra)[1:], env={**self.env, **(env or {})}, cwd=REPO,
                              log=self.log_path)
            self.procs.append(proc)
            return proc
        return self.start([sys.executable, *self._args(*extra)], env=env)

    def start_launch(self, nproc: int, *extra: str, env: dict[str, str] | None = None,
                     rank_env: dict[int, dict[str, str]] | None = None,
                     node_rank: int = 0) -> list[subprocess.Popen | WarmScript]:
        """``nproc`` processes of one launch, each its own child of this process or of the warm server
        (as ``srun`` starts them: one dying ends none of the others), the launcher's variables set as torchrun would;
        ``rank_env``: more variables for some of them; ``node_rank``: the launcher's node rank (a
        launch with another one counts as another node, a failure domain of its own)."""
        import socket

        with socket.socket() as s:  # the launch's identity (no store listens there)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        launcher = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
                    "LOCAL_WORLD_SIZE": str(nproc), "NODE_RANK": str(node_rank)}
        return [self.start_python(*extra, env={**(env or {}), **launcher, "RANK": str(r), "LOCAL_RANK": str(r),
                                               **(rank_env or {}).get(r, {})}) for r in range(nproc)]

    def start(self, cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Run ``cmd`` as a process of this job (its store in the environment, its output in the log)."""
        proc = subprocess.Popen(cmd, env={**self.env, **(env or {})}, stdout=self.log, stderr=subprocess.STDOUT,
                                cwd=REPO)
        self.procs.append(proc)
        return proc

    # ------------------------------------------------------------------------------ the store
    def step(self) -> int:
        s = self.client.store
        return int(s.get("step")) if s.check(["step"]) else -1

    def installed(self) -> tuple[str, ...]:
        """The members of the world running now (the last generation the trainers installed)."""
        s = self.client.store
        if not s.check(["installed"]):
            return ()
        return self.client.membership(int(s.get("installed"))).members

    def installed_size(self) -> int:
        return len(self.installed())

    def signal_member(self, rank: int, sig: int) -> int:
        """Send ``sig`` to the process at ``rank`` of the running world (its id holds its pid)."""
        pid = int(self.installed()[rank].split(":")[1])
        os.kill(pid, sig)
        return pid

    def wait_for(self, condition: Callable[[], bool], *, timeout: float = 180.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what or condition}; log:\n{self.tail()}")
            if self.procs and all(p.poll() is not None for p in self.procs):  # (none: another launcher's)
                raise AssertionError(f"every process ended while waiting for {what}; log:\n{self.tail()}")
            time.sleep(0.2)

    def wait(self, proc: subprocess.Popen | WarmScript, timeout: float = 300.0) -> int:
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"a process did not end in {timeout} s; log:\n{self.tail()}") from None

    def results(self) -> dict[int, dict]:
        return {int(p.stem): json.loads(p.read_text()) for p in self.out.glob("*.json")}

    def described(self, name: str, pids: Iterable[int] | None = None) -> list[dict]:
        """What ``elastic_fit.py --describe-at`` (``name`` ``"described.<step>"``) or
        ``--describe-recovered`` (``"recovered"``) wrote: each process's pieces of the state, as
        megatron describes them (``tests/megatron_description.py``), in no particular order; of the
        processes ``pids`` only, if given (a process that died later left what it wrote before)."""
        import pickle

        paths = sorted(self.out.glob(f"*.{name}.pkl"))
        if pids is not None:
            paths = [p for p in paths if int(p.name.split(".")[0]) in set(pids)]
        return [pickle.loads(p.read_bytes()) for p in paths]

    def text(self) -> str:
        """The whole log, without c10d's store-wait timeouts and Python's warnings (what a test
        searches for may be anywhere in it: a thread dump or a long tail can push it far back)."""
        self.log.flush()
        return "\n".join(line for line in self.log_path.read_text(errors="replace").splitlines()
                         if "waitForInput" not in line and "Warning" not in line and "warnings.warn" not in line)

    def tail(self, lines: int = 80) -> str:
        """The log's last ``lines`` lines, as :meth:`text` reads it (for a failure's message)."""
        return "\n".join(self.text().splitlines()[-lines:])


__all__ = ["ElasticJob", "SCRIPT", "TOKEN"]
