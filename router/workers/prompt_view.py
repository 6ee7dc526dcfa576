"""What the workers hold of one prompt, computed once per run and passed down: each worker's
likely prefix-cache hit (the policy's index) and each host KV pool's loadable blocks (the
router's copy of the pools). Every question a run asks about the prompt (which worker, which
path, what the decode worker holds, where to fetch from) reads the same figures, taken before
the run sent anything anywhere."""

from collections.abc import Mapping
from dataclasses import dataclass, field

from router.workers.handle import WorkerHandle
from router.workers.kv_pool_contents import PoolName, pool_name


@dataclass(frozen=True)
class PromptView:
    tokens: tuple[int, ...] = ()
    cached: Mapping[str, int] = field(default_factory=dict)  # worker address -> leading tokens
    pooled: Mapping[PoolName, int] = field(default_factory=dict)  # host KV pool -> leading tokens

    def cached_on(self, worker: WorkerHandle) -> int:
        """Of the prompt, the leading tokens `worker` likely has in its prefix cache (0 for a
        worker that joined after the view was made, or a policy that keeps no index)."""
        return self.cached.get(worker.address, 0)

    def pooled_for(self, worker: WorkerHandle) -> int:
        """Of the prompt, the leading tokens `worker`'s host KV pool holds (0: in no pool, or
        none of its contents known)."""
        return self.pooled.get(pool_name(worker), 0) if worker.identity.kv_pool else 0


NO_PROMPT = PromptView()  # a pick that weighs no prompt (a migration's continuation)
