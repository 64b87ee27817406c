"""An engine in a process of its own for the side-by-side benchmarks: it reads JSON lines on stdin and
answers each with one JSON line on a pipe of its own (``--result-fd``), so whatever the engine prints
goes to its log file, not into the answers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class WorkerProcess:
    """Starts ``cmd`` (with ``--result-fd FD`` appended) in the repository root, its output in ``log``.
    The worker's first answer (its ``ready`` line) is in ``ready``."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict | None = None):
        self.name, self.log = name, log
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", **(env or {}))
        with open(log, "w") as f:
            self.proc = subprocess.Popen(
                [*cmd, "--result-fd", str(write_fd)],
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                text=True,
                env=env,
                cwd=str(ROOT),
            )
        os.close(write_fd)
        self.results = os.fdopen(read_fd)
        self.ready = self.reply()

    def reply(self) -> dict:
        line = self.results.readline()
        if not line:
            self.proc.wait()
            tail = "".join(self.log.read_text().splitlines(keepends=True)[-30:])
            raise SystemExit(f"{self.name} worker exited ({self.proc.returncode}); last lines of {self.log}:\n{tail}")
        return json.loads(line)

    def ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
