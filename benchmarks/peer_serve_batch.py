"""A peer for benchmarks.compare: the recipe people write by hand on Ray Serve,
`@serve.batch` around transformers' `generate` (static batches, no KV paging).

    serve run benchmarks.peer_serve_batch:build model=DIR [max_batch_size=32]

POST /v1/completions takes a string prompt; the batch's `generate` runs to its longest
member, then each request gets its whole completion in one event (stream) or one JSON body.
Greedy only: `temperature` is ignored, as this recipe usually does."""

import asyncio
import json
import os

import torch
from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer

app = FastAPI()


@serve.deployment(max_ongoing_requests=512, ray_actor_options={"num_cpus": 0})
@serve.ingress(app)
class BatchedGenerate:
    def __init__(self, model: str, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.05):
        # Ray gives a num_cpus=0 actor OMP_NUM_THREADS=1: without this torch runs one thread.
        torch.set_num_threads(len(os.sched_getaffinity(0)))
        self.tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.generate_batch.set_max_batch_size(max_batch_size)
        self.generate_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.05)
    async def generate_batch(self, items: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        return await asyncio.to_thread(self._generate, items)

    def _generate(self, items: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
        batch = self.tokenizer([prompt for prompt, _ in items], return_tensors="pt", padding=True,
                               return_token_type_ids=False)
        with torch.inference_mode():
            out = self.model.generate(**batch, do_sample=False,
                                      max_new_tokens=max(n for _, n in items),
                                      pad_token_id=self.tokenizer.pad_token_id)
        results = []
        for row, (_, max_tokens) in enumerate(items):
            new = out[row, batch.input_ids.shape[1]:][:max_tokens].tolist()
            for i, token in enumerate(new):
                if token in self.eos:
                    new = new[: i + 1]
                    break
            prompt_tokens = int(batch.attention_mask[row].sum())
            results.append((self.tokenizer.decode(new, skip_special_tokens=True), prompt_tokens,
                            len(new)))
        return results

    @app.post("/v1/completions")
    async def completions(self, request: Request):
        body = await request.json()
        text, prompt_tokens, completion_tokens = await self.generate_batch(
            (body["prompt"], int(body.get("max_tokens", 16))))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        choice = {"index": 0, "text": text, "finish_reason": "length"}
        if not body.get("stream"):
            return JSONResponse({"object": "text_completion", "choices": [choice], "usage": usage})

        async def events():
            yield f"data: {json.dumps({'choices': [choice]})}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health(self):
        return {"status": "ok"}


def build(args: dict):
    return BatchedGenerate.bind(args["model"], int(args.get("max_batch_size", 32)),
                                float(args.get("batch_wait_timeout_s", 0.05)))
