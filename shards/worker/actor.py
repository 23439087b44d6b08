"""The shard actor: one tensor-parallel rank in its own process (one GPU, or CPU).

The batcher's ShardGroup creates one per rank; they meet through torch.distributed
(NCCL on GPU, gloo on CPU) at an address rank 0 reports, then each loads only its slice of
the weights and allocates its share of the KV cache. Every step the same StepInput object
ref goes to all ranks; rank 0 samples and returns the StepOutput, the others None.

All of a rank's torch work runs on one thread of its own, the torch thread: one OpenMP
team, bound one thread per core. Actor calls hand steps to it in the order the group sent
them, from two threads of their own (`STEP_CALLS`), so that Ray returns one step's output
and delivers the next step's input while the torch thread already runs that next step
(NOTES.md 43).

torch and the model stack are imported where a rank first needs them, in its own
process: the batcher imports this module to create the ranks and never loads torch (two
seconds off each batcher replica's start on 2 cores)."""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import socket
import threading
import time
from typing import TYPE_CHECKING

import ray

from engine.messages import StepInput, StepOutput
from shards.cpu import plan as cpu_plan
from shards.shard_config import ShardConfig
from shards.worker import logs

if TYPE_CHECKING:
    from shards.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# Only bounds a survivor stuck in a collective whose peer is gone; the group notices a dead
# rank far sooner (from the GCS) and kills the survivors. It must exceed any step's length:
# a rank that is slow (a long prefill on a busy core) is not dead.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)

# The actor's concurrency groups: `step_in_order` calls get two threads (the batcher has at
# most two steps in flight); everything else keeps the default group's one.
STEP_CALLS = "steps"
CONCURRENCY_GROUPS = {STEP_CALLS: 2}
# How long a step call waits for the call the group sent before it. Calls are delivered in
# order, so only a lost call could make this wait; it fails the step rather than hang.
PREVIOUS_CALL_TIMEOUT_S = 60.0


class Park:
    """A compiled graph's step that holds its ranks while the group is idle: a rank waits
    in it, blocked, until `ShardActor.unpark`. A rank that waits for its next step in the
    graph's shared-memory channel spins a core instead (Ray's reader polls with
    sched_yield), which an idle server should not."""


class ShardActor:
    def __init__(self, config: ShardConfig, rank: int, world_size: int):
        logs.to_stderr(f"shard rank {rank}/{world_size}")
        self.config = config
        self._unparked = threading.Event()
        self._parked = False
        self.rank = rank
        self.world_size = world_size
        self.runner: ModelRunner | None = None
        self.own_cores: list[int] | None = None  # set when the rank borrows reserved cores
        self.cores: list[int] | None = None  # what bind_cpus pinned the rank to
        self.cores_shared = 0  # of its cores, how many shards of other groups also use
        self._torch: concurrent.futures.ThreadPoolExecutor | None = None
        self._torch_tid: int | None = None  # the torch thread's native id, once it runs
        self._order = threading.Condition()  # step calls hand over in the group's order
        self._next_call = 0

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def bind_cpus(self, local_index: int, local_count: int, group: str = "") -> list[int]:
        """Pin this rank to its slice of the node's cores (shards/cpu/plan.py), before any
        torch thread exists; the model runner then sizes torch's threads to the slice
        (Ray sets OMP_NUM_THREADS to the actor's num_cpus, 1 when 0: never used as is).
        `group` names the rank's group in the node's claims file."""
        available = cpu_plan.available_cores()
        per_rank = self.config.cores_per_rank
        reserved = cpu_plan.resolve_reserved(self.config.reserved_cpus, len(available),
                                             local_count * (per_rank or 1))
        claims = cpu_plan.claims_path(self.node_id())
        if per_rank:
            pool, _ = cpu_plan.split(available, reserved)
            cores, self.cores_shared = cpu_plan.claim(claims, pool, per_rank, group=group)
            if self.cores_shared or len(cores) < per_rank:
                logger.warning("rank %d wanted %d cores of its own and got %s, %d of them "
                               "also held by other shards: the node's %d shard cores are "
                               "taken", self.rank, per_rank, cores, self.cores_shared,
                               len(pool))
        else:
            cores = cpu_plan.shard_cores(available, reserved, local_index, local_count)
        if self.config.borrow_reserved_cpus and reserved and not per_rank:
            borrowed = cpu_plan.borrowed_cores(available, reserved, local_count)
            if borrowed:
                self.own_cores, cores = cores, sorted(set(cores) | set(borrowed))
            elif self.config.reserved_cpus is not None:  # asked for explicitly
                logger.warning("rank %d borrows no reserved cores: %d ranks on its node, "
                               "%d cores", self.rank, local_count, len(available))
        if not per_rank:
            self.cores_shared = cpu_plan.register(claims, cores, group)
            if self.cores_shared:
                logger.warning("rank %d shares %d of its cores %s with shards of other "
                               "replicas on this node, whose ranks each split the node "
                               "alone: give every rank whole cores of its own (the app's "
                               "shard_cpus >= 1)", self.rank, self.cores_shared, cores)
        logger.info("core plan: %d of %d cores reserved for the serving plane%s; rank %d on "
                    "cores %s%s%s", reserved, len(available),
                    " (reserved_cpus unset)" if self.config.reserved_cpus is None else "",
                    self.rank, cores, " (claimed on the node)" if per_rank else "",
                    f", borrowing {sorted(set(cores) - set(self.own_cores))}"
                    if self.own_cores else "")
        os.sched_setaffinity(0, cores)
        self.cores = cores
        return cores

    def rendezvous_address(self) -> tuple[str, int]:
        """Rank 0's node address and a port for the process group, listened on from now
        until the group's store takes the socket: a port found free and bound only later
        was once taken in between (test_faults' five apps starting at once: EADDRINUSE)."""
        if self.world_size == 1:
            return ray.util.get_node_ip_address(), 0  # no group to join
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("", 0))
        self._listener.listen()
        return ray.util.get_node_ip_address(), self._listener.getsockname()[1]

    def _on_torch_thread(self, fn, *args):
        return self._torch_thread().submit(fn, *args).result()

    def _torch_thread(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that runs all of this rank's torch work, on the cores bind_cpus gave."""
        if self._torch is None:
            cores = self.cores

            def start() -> None:
                self._torch_tid = threading.get_native_id()
                if cores:
                    os.sched_setaffinity(0, cores)

            self._torch = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="shard-torch", initializer=start)
        return self._torch

    def init_model(self, address: str, port: int) -> int:
        """Join the process group, load this rank's weights; returns weight bytes held."""
        return self._on_torch_thread(self._init_model, address, port)

    def _init_model(self, address: str, port: int) -> int:
        import torch
        import torch.distributed as dist

        from shards.model.layers import TPContext
        from shards.worker.model_runner import ModelRunner, resolve_device

        device = resolve_device(self.config.device)
        if self.world_size > 1:
            backend = "nccl" if device.type == "cuda" else "gloo"
            if device.type == "cuda":
                torch.cuda.set_device(0)  # Ray exposes exactly this actor's GPU as device 0
            listener = self._listener.detach() if self.rank == 0 else None  # the store's now
            store = dist.TCPStore(address, port, self.world_size, is_master=self.rank == 0,
                                  timeout=COLLECTIVE_TIMEOUT, master_listen_fd=listener)
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world_size, timeout=COLLECTIVE_TIMEOUT)
        self.runner = ModelRunner(self.config, TPContext(self.rank, self.world_size),
                                  bind_threads=True)
        return self.weight_bytes()

    def weight_bytes(self) -> int:
        """Bytes of weights this rank holds: parameters, and weights reordered for oneDNN
        (whose plain copies were freed)."""
        seen, total = set(), 0
        for p in self.runner.model.parameters():
            if p.numel() and p.data_ptr() not in seen:
                seen.add(p.data_ptr())
                total += p.numel() * p.element_size()
        for module in self.runner.model.modules():
            packed = getattr(module, "packed", None)
            if packed is not None:
                total += packed.numel() * packed.element_size()
        return total

    def profile_num_blocks(self, max_batch_prefill_tokens: int) -> int:
        return self._on_torch_thread(self.runner.profile_num_blocks, max_batch_prefill_tokens)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self._on_torch_thread(self.runner.allocate_kv_cache, num_blocks)

    def step(self, step_input: StepInput | Park) -> StepOutput | None:
        """One step, on the torch thread (a compiled graph's steps come here)."""
        if isinstance(step_input, Park):
            self._parked = True
            self._unparked.wait()
            self._unparked.clear()
            self._parked = False
            return None
        return self._on_torch_thread(self._step, step_input)

    # Steps record no task events: one call per token would otherwise report its state
    # changes to the GCS (and fill the dashboard's task table with steps).
    @ray.method(concurrency_group=STEP_CALLS, enable_task_events=False)
    def step_in_order(self, step_input: StepInput, call: int) -> StepOutput | None:
        """The group's `call`-th step (from 0), by actor call. Two such calls can be here at
        once: each hands its step to the torch thread only after the one before it has,
        then waits for its output, so the next step is queued there before this one's
        output goes back."""
        deadline = time.monotonic() + PREVIOUS_CALL_TIMEOUT_S
        with self._order:
            while self._next_call != call:
                if not self._order.wait(max(0.0, deadline - time.monotonic())):
                    raise RuntimeError(f"step call {call} waited {PREVIOUS_CALL_TIMEOUT_S:g} s "
                                       f"for call {self._next_call}, which never came")
            done = self._torch_thread().submit(self._step, step_input)
            self._next_call += 1
            self._order.notify_all()
        return done.result()

    def _step(self, step_input: StepInput) -> StepOutput | None:
        return self.runner.step(step_input)

    def stage_adapter(self, name: str, path: str) -> None:
        """Read a LoRA adapter ahead of the step that loads it (ModelRunner.stage_adapter):
        on the actor's default thread, beside the steps on the torch thread."""
        self.runner.stage_adapter(name, path)

    def cut_short(self) -> None:
        """End the multi-step this rank runs after its current step (ModelRunner.cut_short):
        on the actor's default thread, beside the step on the torch thread."""
        if self.runner is not None:
            self.runner.cut_short()

    def unpark(self) -> None:
        """End the Park step this rank waits in (an actor call, so it runs on the actor's
        default thread while the compiled graph's loop holds its own)."""
        self._unparked.set()

    def parked(self) -> bool:
        """Whether this rank waits in a Park step (for tests)."""
        return self._parked

    def placement(self) -> dict:
        """Where Ray put this rank: for tests and the dashboard."""
        import torch

        ctx = ray.get_runtime_context()
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "actor_id": ctx.get_actor_id(),
            "node_id": ctx.get_node_id(),
            "placement_group_id": ctx.get_placement_group_id(),
            "assigned_resources": ctx.get_assigned_resources(),
            "gpu_ids": ray.get_gpu_ids(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "device": str(self.runner.device) if self.runner else None,
            "compute_path": self.runner.compute_path() if self.runner else None,
            "torch_threads": torch.get_num_threads(),
            # The rank's cores; torch's threads are then bound one per core within them.
            "cpu_affinity": self.cores or sorted(os.sched_getaffinity(0)),
            "thread_cores": self.runner.thread_cores if self.runner else None,
            # Where the thread that runs the forward may run, read from the kernel.
            "torch_thread_cores": (sorted(os.sched_getaffinity(self._torch_tid))
                                   if self._torch_tid else None),
            "cores_shared": self.cores_shared,
            "one_row_weights": self.runner.weights.one_row_weights if self.runner else None,
            "one_row_timings": self.runner.weights.one_row_timings if self.runner else None,
            "weight_copy": self.runner.weights.weight_copy if self.runner else None,
            "panel_rows": self.runner.weights.panel_rows if self.runner else None,
            "panel_timings": self.runner.weights.panel_timings if self.runner else None,
            # A GGUF file's quantized blocks: linears by type, and the steps that use them.
            "quant_types": self.runner.weights.quant_types if self.runner else None,
            "quant_rows": self.runner.weights.quant_rows if self.runner else None,
            "lane_rows": self.runner.weights.lane_rows_by_kind if self.runner else None,
        }
