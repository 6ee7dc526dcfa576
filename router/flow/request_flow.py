"""One request through the router, step by step; each step is a module of its own:

    admit   validate the body, tokenize (off the event loop), build a run and a worker request
            per prompt (router/flow/admission.py, router/flow/worker_request.py)
    start   send each run on its path (router/flow/route_choice.py) and wait for its first chunk,
            trying other workers when one is unavailable (router/flow/retries.py; the disaggregated
            path's two legs: router/flow/disaggregation.py)
    relay   pass the chunks on as they come, collected or streamed (router/flow/relay.py); a decode
            worker lost mid-stream hands the rest to another one (router/flow/migration.py)
    finish  count the request in the metrics and return its usage (router/flow/accounting.py)

The HTTP layer (router/http/) only calls these steps; they know nothing of FastAPI, so they
can be driven with fake workers. Every failure is an OpenAIError with its status code.
"""

from pdserve.protocol import worker_pb2
from pdserve.settings import json_logs
from pdserve.settings.router import RouterSettings
from router.flow.accounting import Accounting
from router.flow.admission import admit
from router.flow.relay import Relay
from router.flow.request_run import Admitted, RequestRun, Started
from router.flow.retries import Starter
from router.flow.tokenization import TokenizerThreads
from router.http.errors import ErrorCode, OpenAIError, invalid_request
from router.http.responses import MAX_RESPONSE_ENTRIES, ResponseShape, logprob_entries
from router.metrics import RouterMetrics
from router.workers.pool import WorkerPool


class RequestFlow:
    """The steps over one pool of workers, with the router's settings and metrics."""

    def __init__(
        self, settings: RouterSettings, pool: WorkerPool, tokenizer, metrics: RouterMetrics
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.tokenizer = tokenizer  # router/flow/tokenization.py's PromptTokenizer
        self.metrics = metrics
        self.accounting = Accounting(metrics, pool.cache_lost)
        self.starter = Starter(settings, pool, metrics)
        self.relay = Relay(self.accounting)
        self.tokenizing = TokenizerThreads()

    async def admit_off_loop(self, *http_request, **options) -> Admitted:
        """`admit`, in the tokenizer's threads: the event loop goes on serving meanwhile."""
        admitted = await self.off_loop(self.admit, *http_request, **options)
        json_logs.request_id.set(admitted.request_id)  # set in the thread's copy of the context
        return admitted

    async def off_loop(self, function, *args, **kwargs):
        """`function(*args, **kwargs)` in the tokenizer's threads (router/flow/tokenization.py)."""
        return await self.tokenizing.run(function, *args, **kwargs)

    def admit(self, endpoint: str, *http_request, **options) -> Admitted:
        """router/flow/admission.py's admit over this flow's settings, pool and tokenizer; a 400
        for a response over MAX_RESPONSE_ENTRIES logprob entries."""
        admitted = admit(
            self.settings, self.pool, self.tokenizer, endpoint, *http_request, **options
        )
        vocab_size = getattr(self.tokenizer, "vocab_size", 0) or 1 << 20
        entries = sum(
            logprob_entries(
                request.sampling,
                len(request.prompt_token_ids),
                admitted.options,
                endpoint == "completions",
                vocab_size,
            )
            for request in admitted.worker_requests
        )
        if entries > MAX_RESPONSE_ENTRIES:
            raise invalid_request(
                f"the response would carry up to {entries} logprob entries, more than "
                f"{MAX_RESPONSE_ENTRIES} (choices x (echoed prompt + max_tokens) x "
                "(logprobs + 1)): ask for fewer choices, tokens or logprobs",
                param="logprobs",
                code=ErrorCode.INVALID_VALUE,
            )
        return admitted

    async def start(self, run: RequestRun, request: worker_pb2.GenerateRequest) -> Started:
        return await self.starter.start(run, request)

    async def start_all(self, admitted: Admitted) -> list[Started]:
        return await self.starter.start_all(admitted)

    async def collect(
        self, admitted: Admitted, started: list[Started], shape: ResponseShape, endpoint: str
    ) -> dict:
        return await self.relay.collect(admitted, started, shape, endpoint)

    def stream(
        self, admitted: Admitted, started: list[Started], shape: ResponseShape, endpoint: str
    ):
        return self.relay.stream(admitted, started, shape, endpoint)

    def count_error(self, error: OpenAIError, endpoint: str) -> None:
        self.accounting.error(error, endpoint)

    def count_disconnect(self, endpoint: str) -> None:
        self.accounting.disconnect(endpoint)
