"""The rollout service: one inference engine per replica plus the loop that leases prompt groups
from the coordinator, generates n samples with per-token logprobs and policy versions, scores them
and submits them.

    engines/      the engine contract (base.py), registry, `transformers` and `vllm` backends
    worker.py     RolloutWorker: lease → generate → score → submit; weight updates; drain
    convert.py    proto <-> python
    servicer.py   meshrl.v1.RolloutService (Generate, UpdateWeights, GetRolloutStatus, Drain)
    factory.py    build engine / worker from a MeshConfig
    deployment.py the Ray Serve deployment (autoscaling on in-flight groups, graceful drain)
"""
