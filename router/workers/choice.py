"""Which worker takes a leg: the policy's pick among the live members, only workers whose KV
can pair with the other leg's, and the host KV pool a worker could fetch a prompt's blocks
from. Every figure about the prompt comes from its PromptView (router/workers/prompt_view.py),
made here once per run; membership and liveness are the pool's (router/workers/pool.py)."""

from pdserve.core.kinds import Role
from pdserve.protocol import worker_pb2
from router.http.errors import worker_unavailable
from router.workers.handle import WorkerHandle
from router.workers.kv_pool_contents import pool_name
from router.workers.policies import pool_load_saves, reusable_tokens
from router.workers.pool import WorkerPool
from router.workers.prompt_view import NO_PROMPT, PromptView


class WorkerChoice:
    def __init__(self, pool: WorkerPool, policy) -> None:
        self.pool = pool
        self.policy = policy  # router/workers/policies.py's, by --policy

    def prompt_view(self, prompt) -> PromptView:
        """What each member's prefix cache and each host KV pool hold of `prompt`, now."""
        tokens = tuple(prompt)
        return PromptView(
            tokens,
            self.policy.cached_on_each(self.pool.workers, tokens),
            self.pool.pool_contents.held(tokens),
        )

    def pick(
        self,
        roles: tuple[Role, ...],
        view: PromptView = NO_PROMPT,
        avoid: frozenset[str] = frozenset(),
        pairs_with: WorkerHandle | None = None,
    ) -> WorkerHandle:
        """A live worker of `roles` not in `avoid`, by the policy; a 503 when there is none.
        `pairs_with`: only workers whose KV that worker can take (equal compatibility
        fingerprints: the handshake between them would succeed)."""
        candidates = [w for w in self.pool.live(roles) if w.address not in avoid]
        if not candidates:
            raise worker_unavailable(f"no {' or '.join(roles)} worker is available; retry later")
        if pairs_with is not None:
            fingerprint = pairs_with.identity.kv_compatibility
            others = candidates
            candidates = [w for w in candidates if w.identity.kv_compatibility == fingerprint]
            if not candidates:
                theirs = "; ".join(
                    f"{w.identity.worker_id} has {w.identity.kv_compatibility}" for w in others
                )
                raise worker_unavailable(
                    f"no {' or '.join(roles)} worker's KV is compatible with worker "
                    f"{pairs_with.identity.worker_id}'s ({fingerprint}): {theirs}"
                )
        return self.policy.choose(candidates, view)

    def reusable_tokens(self, worker: WorkerHandle, view: PromptView) -> int:
        """Of the prompt, the tokens `worker` likely need not compute: its cached ones, those its
        host KV pool holds at what a load saves it, and those another host's pool holds at what
        fetching them saves it (router/workers/policies.py's reusable_tokens): what the path's
        price counts as not computed."""
        _source, fetchable = self.pool_source(worker, view)
        saves, fetch_saves = pool_load_saves(worker), pool_load_saves(worker, fetched=True)
        own, pooled = view.cached_on(worker), view.pooled_for(worker)
        return int(reusable_tokens(own, pooled, saves, fetchable, fetch_saves))

    def pool_source(
        self, worker: WorkerHandle, view: PromptView
    ) -> tuple[WorkerHandle | None, int]:
        """The serving worker of another host KV pool that holds more of the prompt's leading
        blocks than `worker`'s pool does, and the tokens it holds: (None, 0) when none does (or
        `worker` is in no pool). Only a pool of workers whose KV is compatible with `worker`'s
        and of its tensor-parallel size: the blocks must mean the same to its engine, and a
        pool's blocks hold a part per rank (another size's pool refuses the fetch)."""
        if not worker.identity.kv_pool:
            return None, 0
        best, most = None, view.pooled_for(worker)
        for other in self.pool.workers:
            if (
                other.identity.kv_pool
                and other.identity.kv_compatibility == worker.identity.kv_compatibility
                and other.identity.tensor_parallel_size == worker.identity.tensor_parallel_size
                and pool_name(other) != pool_name(worker)
                and self.pool.serving(other)
            ):
                held = view.pooled_for(other)
                if held > most:
                    best, most = other, held
        return (best, most) if best is not None else (None, 0)

    def pool_fetch(self, worker: WorkerHandle, view: PromptView) -> worker_pb2.PoolFetch | None:
        """What `worker` should fetch into its host KV pool before computing the prompt
        (pdserve/worker/pool_peers.py): another pool's leading blocks of it, when a fetch
        saves it time (not when its own prefix cache likely holds them: the cache-aware
        policy's estimate)."""
        source, tokens = self.pool_source(worker, view)
        if source is None or pool_load_saves(worker, fetched=True) <= 0:
            return None
        if tokens <= view.cached_on(worker):
            return None
        return worker_pb2.PoolFetch(source=source.address, tokens=tokens)
