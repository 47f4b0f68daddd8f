"""A short coordinator demo over real gRPC: a rollout client leases prompts and submits groups,
a trainer client fetches batches and commits versions, and the staleness budget paces them.
(The built-in training example, `meshrl train`, replaces this once the mesh is complete.)"""

from __future__ import annotations

import asyncio
import tempfile

from meshrl.v1 import common_pb2, coordinator_pb2
from services.common.config import load_config
from services.coordinator.client import CoordinatorClient
from services.coordinator.server import CoordinatorServer


async def _demo() -> None:
    cfg = load_config(None, [
        "coordinator.port=0", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "async_training.staleness_threshold=0.5",
        "async_training.trigger_parameter_sync_step=1", "rollout.total_rollout_steps=24",
    ])
    with tempfile.TemporaryDirectory() as run_dir:
        server = CoordinatorServer(cfg, run_dir)
        await server.start()
        async with CoordinatorClient(server.address) as c:
            version = 0
            for step in range(1, 7):
                grant = await c.lease("demo-rollout", 16)
                groups = []
                for lease in grant.leases:
                    g = common_pb2.TrajectoryGroup(lease_id=lease.lease_id, prompt=lease.prompt,
                                                   min_policy_version=version, max_policy_version=version)
                    for i in range(grant.sampling.n):
                        g.responses.add(sample_index=i, token_ids=[1, 2], logprobs=[-0.1, -0.2], versions=[version] * 2)
                    groups.append(g)
                if groups:
                    await c.submit("demo-rollout", groups)
                batch = await c.fetch_batch("demo-trainer", step, 4, timeout_ms=1000)
                version += 1
                await c.commit_version("demo-trainer", common_pb2.WeightsRef(policy_version=version))
                limit = coordinator_pb2.LeaseLimit.Name(grant.limit).removeprefix("LEASE_LIMIT_").lower()
                print(f"step {step}: leased {len(grant.leases)} (limit: {limit}), "
                      f"trained {len(batch.groups)} groups, staleness {list(batch.staleness)}, now v{version}")
            st = await c.status()
            print(f"done: issued {st.totals.prompts_issued}/{st.totals.prompts_total}, consumed {st.totals.consumed}, "
                  f"queued {st.totals.queued}, histogram {[(b.staleness, b.groups) for b in st.staleness_histogram]}")
        await server.stop()


def main() -> None:
    asyncio.run(_demo())


if __name__ == "__main__":
    main()
