"""Which replica serves a request (`serve --data-parallel N`): pure functions, no I/O.

Each replica keeps its own context cache, so a conversation is cheapest on the replica that
served its last turn. The router keys each generation request and sends the key to the same
replica every time, by rendezvous (highest-random-weight) hashing over the replicas that are live:

    weight(key, i) = first 8 bytes of blake2b(key, salt i)      highest live weight wins

Removing replica i moves only the keys whose winner was i (each to its runner-up); when i comes
back, exactly those keys return. Replica identity is its index, stable across restarts.

Keys, in order: OpenAI `prompt_cache_key`, else OpenAI `user`, else Anthropic `metadata.user_id`
(the same session hints the context cache reads); without one, a digest of the prompt's start:
the first system message and the first user message of a chat (so the turns of one conversation,
and agents started alike, meet), the first PREFIX_CHARS characters of a /v1/completions prompt.

A load bound overrides the key: when the key's replica has more than `slack` requests outstanding
beyond the least-loaded live replica, the least-loaded one serves (ties go to the key's runner-up
order, so overflow is also stable). Routes with no context to reuse go to the least-loaded replica.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

# the generation routes whose prompts the context cache can reuse, by protocol
AFFINE_ROUTES = {"/v1/chat/completions": "openai_chat", "/v1/completions": "openai_completion",
                 "/v1/messages": "anthropic"}
PREFIX_CHARS = 2048         # characters of a prompt's start that key a request without a hint
PREFIX_TOKEN_IDS = 512      # token ids of a token-id prompt's start, likewise

# Choice.rule values: why a replica was chosen
SESSION = "session"         # the request's session hint, hashed
PREFIX = "prefix"           # the digest of its prompt's start, hashed
LOAD_BOUND = "load_bound"   # the hashed replica was too busy: the least-loaded one instead
ANY = "any"                 # a route with nothing to reuse: the least-loaded replica
RULES = (SESSION, PREFIX, LOAD_BOUND, ANY)


@dataclass(frozen=True, slots=True)
class Choice:
    replica: int
    rule: str


def session_key(path: str, body) -> Optional[str]:
    """The request's session hint, or None. A hint of the wrong type is ignored here (the
    replica answers its 400)."""
    kind = AFFINE_ROUTES.get(path)
    if kind is None or not isinstance(body, dict):
        return None
    if kind == "anthropic":
        metadata = body.get("metadata")
        candidates = (metadata.get("user_id"),) if isinstance(metadata, dict) else ()
    else:
        candidates = (body.get("prompt_cache_key"), body.get("user"))
    return next((c for c in candidates if isinstance(c, str) and c), None)


def prefix_digest(path: str, body) -> Optional[str]:
    """A digest of the prompt's start (module docstring), or None when there is no prompt to
    read (the replica will refuse the request anyway)."""
    kind = AFFINE_ROUTES.get(path)
    if kind is None or not isinstance(body, dict):
        return None
    if kind == "openai_completion":
        start = _completion_start(body.get("prompt"))
    else:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        dicts = [m for m in messages if isinstance(m, dict)]
        if kind == "anthropic":
            system = body.get("system")
        else:
            system = next((m.get("content") for m in dicts
                           if m.get("role") in ("system", "developer")), None)
        user = next((m.get("content") for m in dicts if m.get("role") == "user"), None)
        start = None if system is None and user is None else \
            json.dumps([system, user], sort_keys=True, ensure_ascii=False)[:PREFIX_CHARS]
    if start is None:
        return None
    return hashlib.blake2b(start.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _completion_start(prompt) -> Optional[str]:
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]                  # a one-element batch: that prompt
    if isinstance(prompt, str):
        return "t:" + prompt[:PREFIX_CHARS]
    if isinstance(prompt, list) and prompt:
        return "i:" + json.dumps(prompt[:PREFIX_TOKEN_IDS])
    return None


def affinity_key(path: str, body) -> Optional[tuple]:
    """(rule, hashed key) of a request: (SESSION, hint) or (PREFIX, digest); None: no affinity."""
    key = session_key(path, body)
    if key is not None:
        return SESSION, "s:" + key
    digest = prefix_digest(path, body)
    return None if digest is None else (PREFIX, "p:" + digest)


def weight(key: str, replica: int) -> int:
    h = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=8,
                        salt=replica.to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little")


def rendezvous_order(key: str, replicas: Sequence[int]) -> list:
    """The replicas by the key's weight, highest first (ties, which 64 bits make unlikely, by
    index)."""
    return sorted(replicas, key=lambda i: (-weight(key, i), i))


def least_loaded(order: Sequence[int], outstanding: Mapping[int, int]) -> int:
    """The first replica of `order` with the fewest outstanding requests."""
    return min(order, key=lambda i: (outstanding.get(i, 0), order.index(i)))


def choose(key: Optional[tuple], live: Sequence[int], outstanding: Mapping[int, int],
           slack: int, any_order: Optional[Sequence[int]] = None) -> Optional[Choice]:
    """The replica for a request of affinity `key` (affinity_key's) among `live` replica
    indices; None when none is live. `any_order`: the preference among equally loaded replicas
    for a request without a key (the router rotates it so such requests spread)."""
    if not live:
        return None
    if key is None:
        order = [i for i in (any_order or live) if i in live] or list(live)
        return Choice(least_loaded(order, outstanding), ANY)
    rule, hashed = key
    order = rendezvous_order(hashed, live)
    fewest = min(outstanding.get(i, 0) for i in live)
    if outstanding.get(order[0], 0) > fewest + slack:
        return Choice(least_loaded(order, outstanding), LOAD_BOUND)
    return Choice(order[0], rule)
