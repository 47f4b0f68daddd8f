"""Where a GPU host's start-up seconds go, piece by piece, each in a fresh process: the imports a
service replica makes, CUDA's initialization, transformers' load of a checkpoint onto the GPU, a
local Ray and Serve's start. Prints one JSON object (seconds).

    (GPU host) python3 scripts/gpu/startup_diag.py CHECKPOINT_DIR > diag.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

PIECES = {
    "import_torch": "import torch",
    "import_torch_cuda_init": "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()",
    "import_transformers_auto": "from transformers import AutoConfig",
    "import_transformers_models": "from transformers import AutoModelForCausalLM, AutoTokenizer",
    "import_ray": "import ray",
    "import_ray_serve": "from ray import serve",
    "import_trainer_deployment": "import services.trainer.deployment",
    "import_rollout_deployment": "import services.rollout.deployment",
    "import_trainer_workers": "import services.trainer.workers",
    "import_coordinator_deployment": "import services.coordinator.deployment",
    "import_meshrl_train": "import meshrl.train",
}

STEPS = """
import json, sys, time
t = time.perf_counter(); out = {}
def mark(k):
    global t
    now = time.perf_counter(); out[k] = round(now - t, 3); t = now
import torch; mark("import_torch")
torch.zeros(1, device="cuda"); torch.cuda.synchronize(); mark("cuda_init")
from transformers import AutoModelForCausalLM, AutoTokenizer; mark("import_transformers_models")
tok = AutoTokenizer.from_pretrained(sys.argv[1]); mark("tokenizer")
m = AutoModelForCausalLM.from_pretrained(sys.argv[1]); mark("model_load_cpu")
m = m.to("cuda"); torch.cuda.synchronize(); mark("model_to_cuda")
ids = torch.tensor([[1, 2, 3]], device="cuda")
m.generate(ids, max_new_tokens=8, do_sample=False); torch.cuda.synchronize(); mark("first_generate")
print(json.dumps(out))
"""

RAY = """
import json, time
t = time.perf_counter(); out = {}
def mark(k):
    global t
    now = time.perf_counter(); out[k] = round(now - t, 3); t = now
from services.common.serve_util import init_ray, start_serve; mark("import_serve_util")
init_ray(num_cpus=16, log_to_driver=False); mark("ray_init")
from services.common.serve_util import free_port
start_serve(free_port(), http_port=free_port()); mark("serve_start")
import ray; ray.shutdown(); mark("ray_shutdown")
print(json.dumps(out))
"""


def timed(args: list[str]) -> dict[str, object]:
    t0 = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True, timeout=300)
    return {"s": round(time.perf_counter() - t0, 3), "rc": p.returncode, "stdout": p.stdout[-2000:],
            "stderr": p.stderr[-1500:] if p.returncode else ""}


def top_imports(module: str, n: int = 15) -> list[tuple[str, float]]:
    p = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True,
                       timeout=300)
    rows = []
    for line in p.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line.split("|")
        try:
            rows.append((parts[2].rstrip(), int(parts[1]) / 1e6))
        except ValueError:
            continue
    return sorted(rows, key=lambda r: -r[1])[:n]


def main() -> None:
    ckpt = sys.argv[1]
    out: dict[str, object] = {}
    for name, code in PIECES.items():
        out[name] = timed([sys.executable, "-c", code])["s"]
        out[name + "_again"] = timed([sys.executable, "-c", code])["s"]  # page cache warm
    out["steps"] = timed([sys.executable, "-c", STEPS, ckpt])
    out["ray"] = timed([sys.executable, "-c", RAY])
    out["top_imports"] = {m: top_imports(m) for m in ("services.trainer.deployment", "services.rollout.deployment",
                                                       "services.trainer.workers")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
