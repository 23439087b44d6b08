"""One request of the soak's mixed load, and the account of how it ended: shared by
benchmarks/soak.py and benchmarks/chaos.py (so neither imports the other's internals).

Every request must end in one of: succeeded (complete output), rejected as expected (a bad
request got its 4xx), failed with a clear error (an error body or event), cancelled (the
client left on purpose), hung (nothing for the client's read timeout); anything else is
lost."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import dataclass, field

import httpx

BAD_BODIES = [
    b'{"inputs": ""}',
    b'{"inputs": "hi", "parameters": {"temperature": -1}}',
    b'{"inputs": "hi", "parameters": {"max_new_tokens": 1000000}}',
    b'{"inputs": 5}',
    b'{"inputs": "hi", "parameters": {"top_p": NaN}}',
    b'\xff\xfe',
]


@dataclass
class Tally:
    counts: Counter = field(default_factory=Counter)
    lost: list[str] = field(default_factory=list)  # ended with neither output nor error

    def as_dict(self) -> dict:
        return {"sent": sum(self.counts.values()) + len(self.lost), "hung": 0, **self.counts,
                "lost": len(self.lost)}


async def one(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random,
              tally: Tally) -> None:
    prompt = f"kari tona {rng.randint(0, 10**6)}"
    n = rng.randint(1, 24)
    try:
        if kind == "bad":
            r = await client.post(url + "/generate", content=rng.choice(BAD_BODIES),
                                  headers={"content-type": "application/json"})
            try:
                ok = 400 <= r.status_code < 500 and "error" in r.json()
            except ValueError:
                ok = False
            if ok:
                tally.counts["rejected_as_expected"] += 1
            else:
                tally.lost.append(f"bad request got {r.status_code}: {r.text[:100]}")
            return
        if kind == "generate":
            r = await client.post(url + "/generate", json={"inputs": prompt, "parameters": {
                "max_new_tokens": n, "details": True}})
            _account_body(r, lambda b: b["details"]["generated_tokens"] >= 1, tally)
            return
        if kind == "chat":
            r = await client.post(url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": n})
            _account_body(r, lambda b: b["choices"][0]["finish_reason"] in ("stop", "length"),
                          tally)
            return
        stop_after = rng.randint(1, 3) if kind == "cancel" else None
        seen, last = 0, None
        async with client.stream("POST", url + "/generate_stream", json={
                "inputs": prompt, "parameters": {"max_new_tokens": n + 8}}) as r:
            if r.status_code != 200:
                _account_body(r, lambda b: False, tally, await r.aread())
                return
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    last = json.loads(line[5:])
                    seen += 1
                    if stop_after and seen >= stop_after:
                        tally.counts["cancelled"] += 1
                        return
        if last is not None and last.get("details"):
            tally.counts["succeeded"] += 1
        elif last is not None and last.get("error"):
            tally.counts["failed_with_error"] += 1
        else:
            tally.lost.append(f"stream ended without details or error after {seen} events")
    except httpx.TimeoutException:  # nothing for the client's whole read timeout
        tally.counts["hung"] += 1
    except httpx.HTTPError as exc:  # a connection cut or refused: no output, no error
        tally.lost.append(f"{kind}: {type(exc).__name__}")


def _account_body(r: httpx.Response, complete, tally: Tally, raw: bytes | None = None) -> None:
    try:
        body = json.loads(raw if raw is not None else r.content)
    except ValueError:
        tally.lost.append(f"status {r.status_code} with a body that is not JSON")
        return
    if r.status_code == 200 and complete(body):
        tally.counts["succeeded"] += 1
    elif r.status_code >= 400 and "error" in body:
        tally.counts["failed_with_error"] += 1
    else:
        tally.lost.append(f"status {r.status_code}: {str(body)[:200]}")
