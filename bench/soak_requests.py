"""The soak test's requests: a seeded mix of good, aborted and invalid requests, each sent over
real HTTP and judged by what its answer must be (see bench/soak.py, which drives a server
with them)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

MODEL_NAME = "soak"
API_KEY = "soak-key"
ANSWER_LIMIT_S = 600
"""How long a request that should finish may take (it may queue behind long prompts)."""
VOCAB_RANGE = (1000, 40000)  # ordinary token ids of SmolLM2's 49,152, away from the specials
WORDS = (
    "river stone lantern harbour maple orbit velvet copper meadow signal thunder "
    "paper falcon silver garden winter engine candle mirror forest planet ladder"
).split()
KIND_WEIGHTS = {
    "finished": 38,
    "n>1": 10,
    "near-limit": 8,
    "timeout": 10,
    "dropped": 14,
    "invalid": 20,
}


@dataclass
class Planned:
    """One request to send, and what its answer must be."""

    kind: str
    variant: str
    path: str
    body: Any = None
    raw: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = False
    n: int = 1
    max_tokens: int = 0
    timeout_s: float | None = None
    drop_after: int = 0
    expect_status: int = 200


@dataclass
class Outcome:
    """What one request got. `result` is finished, timed out, dropped, refused or failed."""

    kind: str
    variant: str
    status: int | None
    result: str
    problem: str | None = None


# --- the request mix -----------------------------------------------------------------------


def plan_requests(max_model_len: int, count: int, rng: random.Random) -> list[Planned]:
    """`count` requests drawn from KIND_WEIGHTS with `rng`, for a server of `max_model_len`."""
    kinds = rng.choices(list(KIND_WEIGHTS), weights=list(KIND_WEIGHTS.values()), k=count)
    prefixes = [random_tokens(rng, max_model_len // 4) for _ in range(4)]
    planners = {
        "finished": lambda: plan_generation(rng, "finished", n=1),
        "n>1": lambda: plan_generation(rng, "n>1", n=rng.randint(2, 3)),
        "near-limit": lambda: plan_near_limit(rng, max_model_len, prefixes),
        "timeout": lambda: plan_abort(rng, max_model_len, "timeout"),
        "dropped": lambda: plan_abort(rng, max_model_len, "dropped"),
        "invalid": lambda: plan_invalid(rng, max_model_len),
    }
    return [planners[kind]() for kind in kinds]


def random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(*VOCAB_RANGE) for _ in range(count)]


def random_text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.randint(3, 12)))


def generation(
    rng: random.Random, kind: str, *, chat: bool, stream: bool, n: int, max_tokens: int, prompt: Any
) -> Planned:
    """A completion or chat request that always generates exactly `max_tokens` per sample."""
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": max_tokens, "n": n}
    body["ignore_eos"] = True  # so that the output's length is known
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if n == 1 and rng.random() < 0.5:
        body["temperature"] = 0.0  # greedy; n > 1 must sample
    else:
        body["temperature"], body["seed"] = 0.8, rng.randrange(1 << 30)
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    variant = ("chat" if chat else "completion") + (" stream" if stream else "")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Planned(kind, variant, path, body, stream=stream, n=n, max_tokens=max_tokens)


def plan_generation(rng: random.Random, kind: str, n: int) -> Planned:
    max_tokens = rng.randint(1, 12) if n == 1 else rng.randint(1, 8)
    chat, stream = rng.random() < 0.5, rng.random() < 0.5
    return generation(
        rng, kind, chat=chat, stream=stream, n=n, max_tokens=max_tokens, prompt=random_text(rng)
    )


def plan_near_limit(rng: random.Random, max_model_len: int, prefixes: list[list[int]]) -> Planned:
    """A prompt of token ids 4 to 24 tokens short of the limit; max_tokens fills the rest."""
    max_tokens = rng.randint(4, 24)
    start = rng.choice(prefixes) if rng.random() < 0.5 else []
    prompt = start + random_tokens(rng, max_model_len - max_tokens - len(start))
    stream = rng.random() < 0.5
    return generation(
        rng, "near-limit", chat=False, stream=stream, n=1, max_tokens=max_tokens, prompt=prompt
    )


def plan_abort(rng: random.Random, max_model_len: int, kind: str) -> Planned:
    """A request that would run to the context limit, which the client gives up on early."""
    chat = rng.random() < 0.5
    stream = kind == "dropped" or rng.random() < 0.5
    max_tokens = max_model_len - 64  # a chat prompt of 12 words is about 45 tokens
    planned = generation(
        rng, kind, chat=chat, stream=stream, n=1, max_tokens=max_tokens, prompt=random_text(rng)
    )
    if kind == "timeout":
        planned.timeout_s = rng.uniform(0.1, 1.0)
    else:
        planned.drop_after = rng.randint(1, 3)
    return planned


def plan_invalid(rng: random.Random, max_model_len: int) -> Planned:
    """A request the server must refuse with a 4xx before it reaches the engine."""
    good = {"model": MODEL_NAME, "prompt": random_text(rng), "max_tokens": 4}
    cases: dict[str, tuple[int, dict[str, Any]]] = {
        "bad JSON": (400, {"raw": b'{"model": "soak", "prompt": "an unfinished'}),
        "wrong type": (400, {"body": {**good, "max_tokens": "ten"}}),
        # vLLM cuts a max_tokens past the prompt's room; past the context itself is a 400.
        "max_tokens too large": (400, {"body": {**good, "max_tokens": max_model_len + 1}}),
        "unknown model": (404, {"body": {**good, "model": "no-such-model"}}),
        "bad API key": (401, {"body": good, "headers": {"Authorization": "Bearer wrong"}}),
        "messages not a list": (400, {"body": {"model": MODEL_NAME, "messages": "hi"}}),
    }
    name = rng.choice(list(cases))
    status, fields = cases[name]
    path = "/v1/chat/completions" if name == "messages not a list" else "/v1/completions"
    return Planned("invalid", name, path, expect_status=status, **fields)


# --- sending one request ---------------------------------------------------------------------


async def send(session: aiohttp.ClientSession, url: str, planned: Planned) -> Outcome:
    """Send `planned` and judge its answer."""

    def outcome(status: int | None, result: str, problem: str | None = None) -> Outcome:
        return Outcome(planned.kind, planned.variant, status, result, problem)

    data = planned.raw if planned.raw is not None else json.dumps(planned.body).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    headers.update(planned.headers)
    limit = aiohttp.ClientTimeout(total=planned.timeout_s or ANSWER_LIMIT_S)
    status = None
    try:
        async with session.post(url + planned.path, data=data, headers=headers, timeout=limit) as r:
            status = r.status
            if status != 200:
                return outcome(status, *judge_refusal(planned, status, await r.read()))
            if not planned.stream:
                problem = check_output(planned, [await r.json()])
                return outcome(status, "failed" if problem else "finished", problem)
            events = []
            async for event in sse_events(r):
                events.append(event)
                if len(events) == planned.drop_after:
                    r.close()  # the connection goes: the server must abort the request
                    return outcome(status, "dropped")
            problem = check_output(planned, events)
            return outcome(status, "failed" if problem else "finished", problem)
    except asyncio.TimeoutError:
        if planned.timeout_s:
            return outcome(status, "timed out")
        return outcome(status, "failed", f"no answer within {ANSWER_LIMIT_S} s")
    except (aiohttp.ClientError, ValueError) as error:
        return outcome(status, "failed", f"{type(error).__name__}: {error}")


async def sse_events(response: aiohttp.ClientResponse) -> AsyncIterator[Any]:
    """The `data:` payloads of an SSE answer, JSON-decoded, and "[DONE]" as a string."""
    async for line in response.content:
        if line.startswith(b"data: "):
            payload = line[len(b"data: ") :].strip()
            yield "[DONE]" if payload == b"[DONE]" else json.loads(payload)


def judge_refusal(planned: Planned, status: int, body: bytes) -> tuple[str, str | None]:
    """(result, problem) of a non-200 answer: a refusal only if expected and OpenAI-shaped."""
    if status != planned.expect_status:
        return "failed", f"status {status}: {body[:300]!r}"
    try:
        error = json.loads(body)["error"]
        shaped = set(error) == {"message", "type", "param", "code"} and error["code"] == status
    except (ValueError, KeyError, TypeError):
        shaped = False
    return ("refused", None) if shaped else ("failed", f"not an OpenAI error: {body[:300]!r}")


def check_output(planned: Planned, answers: list[Any]) -> str | None:
    """What is wrong with a finished answer (a body, or a stream's events), or None."""
    if planned.expect_status != 200:
        return "an invalid request was answered 200"
    if planned.stream:
        if not answers or answers[-1] != "[DONE]":
            return "the stream did not end with [DONE]"
        answers = answers[:-1]
    errors = [a["error"] for a in answers if "error" in a]
    if errors:
        return f"error in the answer: {errors[0]}"
    choices = [c for a in answers for c in a["choices"] if c["finish_reason"] is not None]
    finish = {c["index"]: c["finish_reason"] for c in choices}
    if finish != {i: "length" for i in range(planned.n)}:
        return f"finish reasons {finish}, expected 'length' for {planned.n} choices"
    usage = [a["usage"] for a in answers if a.get("usage")]
    expected = planned.n * planned.max_tokens
    if not usage or usage[-1]["completion_tokens"] != expected:
        return f"usage {usage[-1:] or None}, expected {expected} completion tokens"
    return None


async def drive(
    url: str, plans: list[Planned], concurrency: int, on_answer: Callable[[int], None] | None = None
) -> list[Outcome]:
    """Send `plans`, `concurrency` at a time; `on_answer(count)` after each answer."""
    outcomes: list[Outcome] = []
    queue = collections.deque(plans)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            while queue:
                outcomes.append(await send(session, url, queue.popleft()))
                if on_answer is not None:
                    on_answer(len(outcomes))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes
