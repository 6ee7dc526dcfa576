"""Prompts shared by the tests that compare pdserve's output with vLLM's offline engine."""

MAX_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a planet."},
    ],
    [{"role": "user", "content": "Write a haiku about the sea."}],
]

_STORY = (
    "The old lighthouse keeper climbed the stairs every evening, counting each step, "
    "listening to the sea, and writing the weather in a worn notebook. "
)


def long_prompt(approx_tokens: int) -> str:
    """A prompt of about `approx_tokens` tokens (the story sentence is ~30 tokens)."""
    return _STORY * max(1, approx_tokens // 30) + "One evening he wrote:"


# vLLM's sampling extensions (and the OpenAI fields that change which token comes first), each
# with a greedy request whose output they change; the same names in the request body and in
# vLLM's SamplingParams.
SAMPLING_CASES = [
    (PROMPTS[2], {"repetition_penalty": 1.3}),
    (PROMPTS[1], {"frequency_penalty": 1.0, "presence_penalty": 0.5, "min_tokens": 20}),
    (PROMPTS[0], {"stop": ["."], "include_stop_str_in_output": True}),
    (PROMPTS[3], {"bad_words": [" red", " Red"], "min_p": 0.05}),
]

# Short to ~1.5K tokens: below, across and far above one 128-token KV block.
DISAGGREGATED_PROMPTS = [long_prompt(n) for n in (10, 60, 130, 300, 520, 800, 1100, 1500)]
DISAGGREGATED_MAX_TOKENS = 12

# The KV pool's (test_kv_pool.py): a conversation's first and second turn (the second resends the
# first and a reply: ~5 full 128-token blocks of history), and another history for the fault test.
_TRIP = (
    "User: we plan a week in Italy by train, with museums, small hotels and long lunches; "
    "list the stops, the prices in euros and what to see. Assistant: day one, Milan. "
)
_HISTORY = _TRIP * 24  # ~720 tokens
POOL_TURNS = [
    _HISTORY + "User: and on day two?",
    _HISTORY + "User: and on day two? Assistant: Verona and its arena. User: and day three?",
]
POOL_FAULT_PROMPT = _TRIP.replace("Italy", "Spain").replace("Milan", "Madrid") * 24 + "User: go"
POOL_MAX_TOKENS = 8
# Two conversations through the 1P1D cluster's host KV pool (test_disaggregation.py): each first
# turn (~240 tokens) and its 40-token answer fill one more 128-token block than the prompt
# alone; the next turn resends both as token ids (tests/offline_reference.py).
DECODE_POOL_CONVERSATIONS = [
    {
        "first": (
            "User: our community garden has twelve raised beds, a compost corner and a rain "
            "barrel; plan the spring planting, the watering rota and who brings seeds. "
            "Assistant: bed one, tomatoes. "
        )
        * 6
        + "User: and then?",
        "first_max_tokens": 40,
        "then": " User: and the herbs?",
        "max_tokens": POOL_MAX_TOKENS,
    },
    {
        "first": (
            "User: write the harbour master's log for a stormy week, ships in and out, the "
            "tides, the cargo and the pilots on duty. Assistant: Monday, a gale from the west. "
        )
        * 6
        + "User: and then?",
        "first_max_tokens": 40,
        "then": " User: and on Sunday?",
        "max_tokens": POOL_MAX_TOKENS,
    },
]
# For the tiny random-weight model (tensor parallelism, bfloat16): short, varied prompts.
TINY_PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village, there lived",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
]
TINY_MAX_TOKENS = 12
TINY_LONG_PROMPT = " ".join(TINY_PROMPTS) * 16  # several of the KV pool's 128-token blocks
