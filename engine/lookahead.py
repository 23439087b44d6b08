"""What a step computes past each request's next token: drafts and multi-steps.

The scheduler (engine/scheduler.py) decides which requests a step computes; this decides
how far ahead each goes, and settles the step when it returns.
- Drafts (`speculate` > 0, engine/speculation.py): a decoding request whose tokens are all
  known may bring drafts, checked in the same forward as its next token; the step keeps
  the drafts that match what the request draws, plus one token of its own. A request that
  drafts is not scheduled again until its step returns (its next positions depend on how
  many drafts it kept), so the scheduler drafts only while the batch is small, and a
  request whose drafts keep failing goes back to plain, overlapped decoding for a while.
- Multi-steps (`num_scheduler_steps` > 1): while nothing waits or prefills, a step of plain
  decodes of a small batch carries several steps, which the shard runs back to back;
  inside them the shard drafts itself (StepDrafting), since only it knows the tokens the
  steps before drew. A request that arrives cuts them short, and each request computes
  again from where its steps stopped.
"""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.messages import StepDrafting, StepOutput
from engine.request import Request

# Multi-steps only for steps of up to this many requests. A message's cost is shared by
# its rows, so a bigger batch gains little from fewer messages, and there requests arrive
# every few steps, cutting multi-steps short and each time giving up async scheduling's
# overlap: at 16 and 32 requests multi-steps of 4 read 0.89-1.27x and 0.87-1.05x the
# tok/s of single steps, at 1 1.08-1.45x (benchmarks/NOTES.md 65).
MULTI_STEP_MAX_ROWS = 8
# Drafts inside a multi-step fill its steps up to this many rows, the requests' own
# included (8 drafts at most among a multi-step's 8 requests). A CPU step's cost grows
# with its rows, so how far drafts pay depends on the products: through `serve run`, with
# SmolLM2's Q4_1 file, 8 requests on grounded prompts read 1.25-1.27x the tok/s of no
# drafts on a Zen 4 EPYC with this cap, 1.05x with a cap of 8 rows; on a Zen 3 one, where a
# 16-row step cost 1.8x an 8-row one, this cap read 0.97-0.98x the cap of 8
# (benchmarks/NOTES.md 79, 98).
MULTI_STEP_DRAFT_MAX_ROWS = 16


def speculates(request: Request) -> bool:
    """Whether the request waits for its step in flight: it brought drafts (its next
    positions are not known yet), or it is likely to find some once that step's token is
    known (`Lookahead.hold`)."""
    return request.num_draft_tokens > 0 or (
        request.speculation is not None and request.speculation.hold)


def rows_per_request(output: StepOutput | None, request_ids) -> dict[str, int]:
    """How many of the step's output rows each of `request_ids` got."""
    rows = dict.fromkeys(request_ids, 0)
    for request_id in output.request_ids if output else ():
        if request_id in rows:
            rows[request_id] += 1
    return rows


class Lookahead:
    """The scheduler's drafting and multi-step decisions, and their settling."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, stats):
        self.config = config
        self.block_manager = block_manager
        self.stats = stats  # the scheduler's SchedulerStats: drafts made and kept

    # -- drafts in single steps ----------------------------------------------------
    def draft_rows(self, running: list[Request]) -> int:
        """Draft tokens a single step may compute in all: drafts are cheap while the
        step's rows are few (its cost is the weights' reading), so they fill up to
        `speculate_max_rows` rows beside the running requests' own; with multi-steps on,
        only for a batch that does not multi-step: too big, or with a grammar's row
        (smaller ones draft inside their multi-steps, on the shard)."""
        if not self.config.speculate:
            return 0
        if (self.config.num_scheduler_steps > 1 and len(running) <= MULTI_STEP_MAX_ROWS
                and not any(r.params.grammar is not None for r in running)):
            # A draft of the scheduler's would make its step a single step for every row
            # in it, and beside other requests multi-steps paid more than such drafts did
            # (0.87x at 4 requests, 0.75x at 8: benchmarks/NOTES.md 67).
            return 0
        return max(0, self.config.speculate_max_rows - len(running))

    def hold(self, request: Request, running: list[Request]) -> None:
        """With a step in flight, decide whether the request waits for it rather than
        decode on at once: it does where its text so far (one token short) has a match,
        since drafting needs every token known, and only as many requests wait as the
        next step has drafts for. A waiting request leaves the overlap of async
        scheduling, which a synchronous batch of 8 paid for with a fifth of its tok/s
        (benchmarks/NOTES.md 60)."""
        spec = request.speculation
        rows = self.draft_rows(running)
        spec.hold = False
        if spec.skip or not rows:
            return
        waiting = sum(map(speculates, running))
        spec.hold = (waiting < -(-rows // self.config.speculate)
                     and bool(spec.propose(request.token_ids, 1)))

    def draft(self, request: Request, most: int) -> list[int]:
        """Drafts for a decoding request whose tokens are all known: at most `most`, and
        none past its length limits (the step yields one token more than it drafts)."""
        spec = request.speculation
        spec.hold = False
        if not spec.wants_draft() or request.num_placeholders:
            return []
        left = min(request.params.max_new_tokens - request.num_output_tokens,
                   self.config.max_model_len - request.num_tokens) - 1
        return spec.propose(request.token_ids, min(self.config.speculate, most, left))

    def settle_drafts(self, drafts: dict[str, list[int]], output: StepOutput,
                      requests: dict[str, Request]) -> None:
        """Count what the drafts bought; a request still running recomputes from the
        first position whose draft failed (the shards overwrite those KV slots)."""
        rows = rows_per_request(output, drafts)
        for request_id, drafted in drafts.items():
            kept = max(0, rows[request_id] - 1)
            self.stats.num_draft_tokens += len(drafted)
            self.stats.num_accepted_tokens += kept
            request = requests.get(request_id)
            if request is None or request.num_draft_tokens == 0:
                continue  # ended (its blocks are freed), or preempted since
            request.num_draft_tokens = 0
            request.num_computed_tokens -= len(drafted) - kept
            request.speculation.record(len(drafted), kept)

    # -- multi-steps ---------------------------------------------------------------
    def multi_step(self, scheduled: dict[str, int], requests: dict[str, Request]
                   ) -> tuple[int, StepDrafting | None]:
        """Make a step of plain decodes (nothing waits, nothing prefills or drafts) of at
        most MULTI_STEP_MAX_ROWS requests a multi-step of up to num_scheduler_steps: each
        request takes part in as many steps as its length limits leave, if the KV cache has
        blocks for all of them. With speculation on, each step may also check drafts that
        the shard finds (StepDrafting): a request's scheduled tokens are then the most it
        may take, drafts kept included, and its blocks are taken for all of them (if
        there are not enough, the multi-step goes without drafts). Returns the step's
        number of steps (1: one step) and its drafting."""
        most = self.config.num_scheduler_steps
        if most == 1 or not scheduled or len(scheduled) > MULTI_STEP_MAX_ROWS:
            return 1, None
        left: dict[str, int] = {}
        for request_id in scheduled:
            request = requests[request_id]
            if request.params.grammar is not None:  # its matcher advances a token a step
                return 1, None
            pending = request.num_tokens + request.num_placeholders
            left[request_id] = min(request.params.max_new_tokens
                                   - (pending - request.num_prompt_tokens),
                                   self.config.max_model_len - pending)
        num_steps = max(1, min(most, max(left.values())))
        if num_steps == 1:
            return 1, None
        options: list[StepDrafting | None] = [None]
        max_rows = min(self.config.speculate_max_rows, MULTI_STEP_DRAFT_MAX_ROWS) - len(scheduled)
        if self.config.speculate and max_rows > 0:
            options.insert(0, StepDrafting(self.config.speculate, max_rows,
                                           self.config.prompt_lookup_min,
                                           self.config.prompt_lookup_max))
        bm = self.block_manager
        for drafting in options:
            per_step = 1 + (drafting.speculate if drafting else 0)
            tokens = {r: max(1, min(most * per_step, n)) for r, n in left.items()}
            needed = sum(bm.num_blocks_to_allocate(r, requests[r].num_computed_tokens + n)
                         for r, n in tokens.items())
            if needed <= bm.num_free_blocks:
                break
        else:
            return 1, None
        for request_id, n in tokens.items():
            bm.allocate(request_id, requests[request_id].num_computed_tokens + n)
            scheduled[request_id] = n
        return num_steps, drafting

    def settle_steps(self, scheduled: dict[str, int], output: StepOutput | None,
                     requests: dict[str, Request]) -> None:
        """After a multi-step: count the shard's drafts; a request still running that took
        fewer tokens than scheduled (its steps were cut short, or drafts failed) computes
        again from where it stopped."""
        for drafted, kept in output.drafted.values() if output else ():
            self.stats.num_draft_tokens += drafted
            self.stats.num_accepted_tokens += kept
        rows = rows_per_request(output, scheduled)
        for request_id, n in scheduled.items():
            request = requests.get(request_id)
            if request is None or request.num_step_tokens == 0:
                continue  # ended (its blocks are freed), or preempted since
            request.num_step_tokens = 0
            request.num_computed_tokens -= n - rows[request_id]
