from __future__ import annotations

import os
import re
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from shards.demo_model import write_demo_model  # noqa: E402

# The tiers (README: Tests). A test is `unit` unless its folder or its module says otherwise:
# tests/e2e is `e2e` (`serve run` and the official clients); a module that starts Ray in
# the test process declares `pytestmark = pytest.mark.integration`. `make test-unit` runs
# the unit tier alone, `make test` every tier, the unit tier first.
TIERS = ("unit", "integration", "e2e")
FOLDER_TIERS = {"e2e": "e2e"}


def tier_of(item) -> str:
    for tier in TIERS[1:]:
        if item.get_closest_marker(tier) is not None:
            return tier
    folder = item.path.parent.name
    return FOLDER_TIERS.get(folder, "unit")


# A module of the integration tier, told from its source without importing it.
MODULE_TIER = re.compile(r"^pytestmark = .*\bpytest\.mark\.(integration|e2e)\b", re.M)


def pytest_ignore_collect(collection_path, config):
    """The unit tier alone (`-m unit`, `make test-unit`) does not import the other tiers'
    modules only to deselect their tests: importing them (Ray, Serve, the applications)
    took 3.5-5 s of its collection's 17-19 s (benchmarks/NOTES.md 77)."""
    if config.getoption("markexpr") != "unit":
        return None
    if collection_path.is_dir():
        return True if collection_path.name in FOLDER_TIERS else None
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_"):
        return True if MODULE_TIER.search(collection_path.read_text()) else None
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        tier = tier_of(item)
        if item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))
    # Cheap tiers first: a broken unit fails the run in seconds, not after the clusters.
    items.sort(key=lambda item: TIERS.index(tier_of(item)))
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


_unit_running = False


def pytest_runtest_setup(item):
    global _unit_running
    _unit_running = tier_of(item) == "unit"


def pytest_configure(config):
    """A unit test that starts Ray is in the wrong tier: say so instead of starting it."""
    try:
        import ray
    except ImportError:  # the unit tier needs no Ray (a GPU box with torch alone, say)
        return

    init = ray.init

    def guarded_init(*args, **kwargs):
        if _unit_running:
            raise RuntimeError("a unit-tier test started Ray: mark its module "
                               "`pytestmark = pytest.mark.integration` (tests/conftest.py)")
        return init(*args, **kwargs)

    ray.init = guarded_init

    shutdown = ray.shutdown

    def joined_shutdown(*args, **kwargs):
        """A thread still inside Ray's API when Ray shuts down can crash the process later
        (ray-project/ray#31145: the suite once ended in a segfault after every test had
        passed): let a shut-down shard group's threads end first, and name any that do not."""
        deadline = time.monotonic() + 10
        for thread in threading.enumerate():
            if thread.name.startswith(("shard-group", "shard-watchdog", "shard-graph")):
                thread.join(max(0.0, deadline - time.monotonic()))
                if thread.is_alive():
                    print(f"\nconftest: thread {thread.name} outlives ray.shutdown",
                          file=sys.stderr)
        return shutdown(*args, **kwargs)

    ray.shutdown = joined_shutdown


_exit_status: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest process ends here, after its report, without the interpreter's teardown.
    Native threads that Ray, gRPC or torch leave behind can still be running when the
    process's static objects are destroyed at exit: two clean clones (entry 70 and 29 Nov,
    09:07) passed every test and then died of SIGSEGV in that teardown (a thread executing
    freed memory, ray-project/ray#31145), which turned `make test` red. Only the process that
    pytest's own command started ends this way (not a `pytest.main()` inside another)."""
    if _exit_status is None or os.path.basename(sys.argv[0]) not in ("pytest", "__main__.py",
                                                                       "py.test"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return str(write_demo_model(tmp_path_factory.mktemp("llama"), "tiny", "llama"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> str:
    return str(write_demo_model(tmp_path_factory.mktemp("qwen2"), "tiny", "qwen2"))


@pytest.fixture(scope="session")
def tokenizer(llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(llama_dir)
