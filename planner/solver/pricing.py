"""Pricing the configurations in order of their time bound, on one core or several.

The search (planner/solver/solve.py `search`) prices configurations in ascending order of
their lower bound (planner/solver/bounds.py) and stops at the first whose bound reaches the
k-th best time priced so far (`cap`): no configuration after it can enter the top k. Each
pricing (planner/solver/search.py `evaluate_config`: the inter-op DP and the price of its
cuts) is independent of the others but for the cap, which only lets the DP skip stage ranges
that cannot be in a plan faster than the k-th best. So configurations can be priced on
several processes at once (issue #17: the machine has two cores): the first
`SEQUENTIAL_FIRST` are priced in the calling process (a search that stops by then forks
nothing, and later workers inherit the tables those built), then `workers` forked processes
take the rest in bound order, at most `2 x workers` in flight; the cap is updated as results come
back, and no new one is started once the next bound reaches it. A worker prices with the cap
known when its configuration was sent, a larger one than the sequential loop would pass: that
prunes less and never changes a price. The top k is therefore the sequential loop's; the
search may price a few configurations more (those in flight when the cap fell below them).

Before the first configuration's turn the search may have refined several batches of bounds
(`refined_order`: the weak bound orders them, and a refined bound can sit far above it), each
computing its costliest parts for every configuration while there is no cap. `Scout` prices
the best refined ones early to give the later batches a cap; they are not priced again in
their turn.

A search large enough (planner/solver/solve.py `split_blocks`) is split instead: its blocks
are dealt to `workers` processes (`run_split`), each building its own tables, bounds and
pricing loop over its part, all reading and raising one cap (`SharedTopK`): a part stops at
the k-th best time any part has found, and the union of what they price holds every
configuration below the final cap, so the top k is again the sequential loop's. A part
prices in bound order itself and hands configurations to the parts already done, which serve
until every part is done (`Helpers`); the pool above is for searches too small to split.

Processes are forked (the tables, bounds and environment are inherited, not copied through
pipes); only the results travel back. Fork needs a POSIX system and a process without
threads that hold locks: the CLI's solve imports no torch and uses it; `search()` called from
Python defaults to one worker.
"""

from __future__ import annotations

import heapq
import itertools
import math
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from typing import Any

import numpy as np

from planner.errors import PlannerError
from planner.solver.search import Evaluation

WORKERS_ENV = "PLANNER_SOLVE_WORKERS"
"""Processes `planner solve` prices with (default: the CPUs this process may use)."""
MIN_PARALLEL = 24
"""Fewer configurations to price than this are priced in the calling process: forking costs
more than it saves."""
SEQUENTIAL_FIRST = 8
"""Configurations priced in the calling process before the workers start (`price_in_order`)."""
SCOUTS = 6
"""Most configurations `Scout` prices ahead of their turn (twice the default top k)."""
SERVE_POLL_S = 0.002
"""How often a serving process (`Helpers.serve`) looks whether every part is done, and a
waiting one whether its server still runs."""

_PRICE: Callable[[int, float], Evaluation] | None = None
"""The pricing function of the current parallel search, inherited by the forked workers."""


def default_workers() -> int:
    """`WORKERS_ENV`, else the CPUs this process may run on."""
    value = os.environ.get(WORKERS_ENV)
    if value:
        return max(int(value), 1)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _price_in_worker(index: int, cap: float) -> Evaluation:
    assert _PRICE is not None, "forked without a pricing function"
    return _PRICE(index, cap)


class TopK:
    """The k fastest feasible times so far; `cap` is the k-th (inf until k are known)."""

    def __init__(self, keep: int):
        self.keep, self.cap = keep, math.inf
        self._times: list[float] = []

    def add(self, seconds: float) -> None:
        heapq.heappush(self._times, -seconds)  # slowest on top
        if len(self._times) > self.keep:
            heapq.heappop(self._times)
        if len(self._times) == self.keep:
            self.cap = -self._times[0]


class SharedTopK:
    """`TopK` held in shared memory, for a search split across forked processes (`run_split`):
    each part adds the times it prices and reads the cap of all of them, so a part stops at the
    k-th best time any part has found."""

    def __init__(self, keep: int):
        context = multiprocessing.get_context("fork")
        self.keep = keep
        self._times = context.RawArray("d", [math.inf] * keep)
        self._lock = context.Lock()

    @property
    def cap(self) -> float:
        with self._lock:
            return max(self._times)

    def add(self, seconds: float) -> None:
        with self._lock:
            slowest = max(range(self.keep), key=self._times.__getitem__)
            if seconds < self._times[slowest]:
                self._times[slowest] = seconds


Top = TopK | SharedTopK
"""The k best times of one process, or of the processes of a split search."""


def _priced(price: Callable[[Any, float], Evaluation], item, top: Top) -> Evaluation:
    """`price(item, cap)` at the current cap, its time added to `top` when it is feasible."""
    result = price(item, top.cap)
    if result.feasible:
        top.add(result.iteration_time_s)
    return result


class Helpers:
    """Pricing help between the processes of a split search (`run_split`): a process whose own
    part is done serves the others (`serve`: it prices the configurations they hand out and adds
    their times to the shared cap), and a process still pricing its part hands out its next
    configurations while some process serves (`price_in_order`'s `helpers`), two in flight per
    server, pricing the rest itself. The parts' blocks are dealt before anyone knows where the
    configurations worth a DP lie (they gather in the best layouts' blocks, one part's), so
    without this one process would price them while the other waits. A request travels as
    (owner part, index, what the server prices it from); the owner counts it as priced."""

    def __init__(self, parts: int):
        context = multiprocessing.get_context("fork")
        self.parts = parts
        self.requests = context.Queue()
        self.results = [context.Queue() for _ in range(parts)]
        self._serving = context.Value("i", 0)
        self._done = context.Value("i", 0)
        self._served = context.Value("i", 0)
        self.part = 0
        """This process's part: its answers come to `results[part]` (each part sets it before
        it hands anything out)."""

    @property
    def serving(self) -> int:
        """Processes serving now (their own parts done)."""
        return self._serving.value

    @property
    def served(self) -> int:
        """Configurations priced for another part so far."""
        return self._served.value

    def serve(self, price: Callable[[Any, float], Evaluation], top: Top) -> None:
        """Mark this process's part done and price the others' requests by `price(request, cap)`,
        their times added to `top`, until every part is done (an owner marks its part done only
        once its requests are answered, so none is left behind)."""
        with self._done.get_lock():
            self._done.value += 1
        with self._serving.get_lock():
            self._serving.value += 1
        while True:
            try:
                owner, index, request = self.requests.get(timeout=SERVE_POLL_S)
            except queue.Empty:
                if self._done.value >= self.parts or not peers_alive():
                    return
                continue
            try:
                answer: Evaluation | BaseException = _priced(price, request, top)
                pickle.dumps(answer)  # the queue pickles in a thread that drops what fails: fail here instead
            except Exception:  # the owner raises it (as text: the error itself may not pickle), not waits
                answer = RuntimeError(f"pricing {request!r} for part {owner} failed:\n{traceback.format_exc()}")
            self.results[owner].put((index, answer))
            with self._served.get_lock():
                self._served.value += 1

    def close(self) -> None:
        """Release the queues (every request is answered by the time the parts are done; after a
        failure what is left in them is dropped, not waited for)."""
        for q in (self.requests, *self.results):
            q.cancel_join_thread()
            q.close()


def refined_order(weak: np.ndarray, refine: Callable[[list[int]], np.ndarray], batch: int = 256,
                  scout: Callable[[list[int]], None] | None = None,
                  cap: Callable[[], float] = lambda: math.inf) -> Iterator[tuple[int, float]]:
    """Configurations with their stronger bound, ascending, computing it only for those reached.

    `weak[i]` is a lower bound on configuration i's time and `refine(indices)` a stronger one (at
    least `weak`). Configurations not refined yet wait in ascending `weak`; those refined wait in
    a heap by their stronger bound. The heap's top is yielded while it is at most the next weak
    bound (every unrefined configuration's stronger bound is at least its weak one, so nothing
    below it remains); otherwise the next `batch` in weak order are refined at once (one numpy
    pass) and pushed. The bounds come out non-decreasing, so `price_in_order` may stop at the
    first that reaches the cap, and only the configurations below the final cap are refined.

    `cap()` is the k-th best time priced so far: once the next weak bound reaches it, nothing
    left can enter the top k and no more are refined. Before refining more, `scout` (if given) is
    shown the refined configurations with the least bounds, fastest first (`Scout`: it prices a
    few while there is no cap yet, so the refinement of the next batches knows one)."""
    order = np.argsort(weak, kind="stable")
    heap: list[tuple[float, int, int]] = []  # (bound, position in weak order, index)
    position = 0
    while True:
        following = float(weak[order[position]]) if position < len(order) else math.inf
        if heap and heap[0][0] <= following:
            bound, _, index = heapq.heappop(heap)
            yield index, bound
            continue
        if position >= len(order):
            return
        if heap and scout is not None:
            scout([index for _, _, index in heapq.nsmallest(SCOUTS, heap)])
        if following >= cap():  # the heap's top is above it too
            return
        chunk = order[position:position + batch].tolist()
        for offset, (index, bound) in enumerate(zip(chunk, refine(chunk).tolist(), strict=True)):
            heapq.heappush(heap, (max(bound, float(weak[index])), position + offset, index))
        position += len(chunk)


class Scout:
    """Prices a search's most promising configurations before their turn, while it has no cap
    (fewer than k feasible times): the refinement of the next batches (`refined_order`) then
    computes its costly parts only below that cap (planner/solver/bounds.py `TimeBound.many`).
    Pricing out of order changes no result (the top k is whatever is priced below the final
    cap, and each price is the same whatever the cap: `_parallel`); `price_in_order` takes the
    scouted evaluations in their turn instead of pricing them again. It prices those with the
    least refined bounds, which would be priced anyway unless k faster plans turn up."""

    def __init__(self, price: Callable[[int, float], Evaluation], top: Top):
        self.price, self.top, self.priced = price, top, 0
        self.results: dict[int, Evaluation] = {}
        """Scouted evaluations not yet taken in their turn (`price_in_order`); the feasible
        ones' times are in `top`."""

    def __call__(self, best: list[int]) -> None:
        for index in best:
            if self.top.cap < math.inf or self.priced >= SCOUTS:
                return
            if index not in self.results:
                self.priced += 1
                self.results[index] = _priced(self.price, index, self.top)


def price_in_order(price: Callable[[int, float], Evaluation], candidates: Iterable[tuple[int, float]], count: int,
                   keep: int, workers: int = 1, top: Top | None = None, scout: Scout | None = None,
                   helpers: Helpers | None = None,
                   request: Callable[[int], object] | None = None) -> tuple[list[Evaluation], int, float]:
    """Price the `count` configurations `candidates` yields, (index, lower bound) with bounds
    non-decreasing, by `price(index, cap)` until the next bound reaches the k-th best time
    (module docstring). Returns the feasible evaluations in that order, how many were priced,
    and the least memory an infeasible one needed. `top` (a fresh `TopK(keep)` by default)
    holds the k best times as they come: the caller may read its cap while `candidates` runs
    (the search bounds only what can still beat it: planner/solver/solve.py `search`). `scout`:
    what it priced ahead of their turn (while `candidates` ran) is taken from it, not priced
    again; those whose turn never came are listed last. `helpers` (a part of a split search):
    configurations handed to the serving processes as `request(index)` while some serve
    (`Helpers`), the rest priced here."""
    top = TopK(keep) if top is None else top
    ahead = {} if scout is None else scout.results
    if helpers is not None:
        ranked, evaluated, least = _sequential(price, candidates, top, ahead, helpers, request)
    else:
        ranked, evaluated, least = _in_order(price, candidates, count, top, workers, ahead)
    for result in ahead.values():  # their bounds reached the cap: priced, but after the last taken
        evaluated += 1
        if result.feasible:
            ranked.append(result)
        else:
            least = min(least, result.min_memory_bytes)
    return ranked, evaluated, least


def _in_order(price, candidates, count: int, top: Top, workers: int,
              ahead: dict[int, Evaluation]) -> tuple[list[Evaluation], int, float]:
    if workers <= 1 or count < MIN_PARALLEL or not can_fork():
        return _sequential(price, candidates, top, ahead)
    # The first few in this process: most searches stop within a few dozen, and workers forked
    # after them inherit the tables and frontiers those built (`Environment.memo`).
    stream = iter(candidates)
    ranked, evaluated, least = _sequential(price, itertools.islice(stream, SEQUENTIAL_FIRST), top, ahead)
    if evaluated < SEQUENTIAL_FIRST:  # the cap stopped it, or nothing is left
        return ranked, evaluated, least
    more, priced, unfit = _parallel(price, stream, top, workers, ahead)
    return ranked + more, evaluated + priced, min(least, unfit)


_PART: Callable[[int], object] | None = None
"""The part runner of the current split search, inherited by the forked processes."""
_SPLIT: _Split | None = None
"""The current split search's shared state (`run_split`), inherited by the forked processes."""


class _Split:
    """Who the processes of one split search are: a forked part watches its parent, the parent
    its forked parts (`peers_alive`)."""

    def __init__(self):
        self.parent = os.getpid()
        self.children: list = []

    def alive(self) -> bool:
        if os.getpid() != self.parent:
            return os.getppid() == self.parent
        # A forked part exits once every part is done (it serves until then): one that has exited
        # while this process waits or serves has failed. The parent is the one that notices:
        # it then raises that part's error and kills the others (`run_split`).
        return all(c.exitcode is None for c in self.children)


def peers_alive() -> bool:
    """Whether the other processes of the current split search still run: a part that sees
    otherwise stops serving and waiting (`Helpers`). True outside a split."""
    return _SPLIT is None or _SPLIT.alive()


def run_split(part: Callable[[int], object], parts: int) -> list:
    """`part(i)` for i in 0 .. parts - 1: part 0 in this process, the others in forked processes
    at the same time (what they return comes back pickled); in order of i. A search split this
    way (planner/solver/solve.py `search`) shares its cap through a `SharedTopK` and its pricing
    through `Helpers`. When a part fails (raises, or dies without an answer) this process stops
    serving or waiting for it (`peers_alive`), kills the others and raises its error, whichever
    part it is; a forked part also dies with this process (Linux: the parent-death signal;
    elsewhere at its next `peers_alive`)."""
    global _PART, _SPLIT
    context = multiprocessing.get_context("fork")
    _PART, _SPLIT = part, _Split()
    children, receivers = _SPLIT.children, []
    try:
        for index in range(1, parts):
            receiver, sender = context.Pipe(duplex=False)
            child = context.Process(target=_run_part, args=(index, sender), daemon=True)
            child.start()
            sender.close()
            children.append(child)
            receivers.append(receiver)
        results: dict[int, object] = {0: part(0)}
        pending = dict(enumerate(receivers, start=1))
        while pending:
            ready = multiprocessing.connection.wait(list(pending.values()))
            for index in [i for i, r in pending.items() if r in ready]:
                try:
                    done, value = pending.pop(index).recv()
                except EOFError:
                    child = children[index - 1]
                    child.join(timeout=1)
                    raise PlannerError(f"The search's process for part {index} of {parts} ended without an answer "
                                       f"(exit code {child.exitcode}: killed, or out of memory?).",
                                       f"Solve again, or on one process: {WORKERS_ENV}=1.") from None
                if not done:
                    raise value
                results[index] = value
        return [results[i] for i in range(parts)]
    except BaseException:
        for child in children:  # they may be serving or waiting on the failed part
            child.kill()
        raise
    finally:
        _PART, _SPLIT = None, None
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()


def _run_part(index: int, sender) -> None:
    """A forked part of `run_split`: run it and send back (True, what it returned) or (False, its error)."""
    _die_with_parent()
    assert _PART is not None and _SPLIT is not None, "forked without a part runner"
    try:
        answer: tuple[bool, object] = (True, _PART(index))
    except BaseException as error:  # noqa: BLE001 - sent to the parent, which raises it
        answer = (False, error)
    try:
        sender.send(answer)
    except Exception as error:  # an error that does not pickle
        sender.send((False, RuntimeError(f"part {index} failed: {answer[1]!r} ({error})")))
    finally:
        sender.close()


def _die_with_parent() -> None:
    """Linux: ask for SIGKILL when the parent process dies (prctl PR_SET_PDEATHSIG), so a split
    search's forked part never outlives a killed `planner solve`. Elsewhere nothing: the part
    stops at its next `peers_alive` check."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def can_fork() -> bool:
    """Whether this system can fork worker processes (POSIX)."""
    return "fork" in multiprocessing.get_all_start_methods()


def _sequential(price, candidates, top: Top, ahead: dict[int, Evaluation], helpers: Helpers | None = None,
                request: Callable[[int], object] | None = None) -> tuple[list[Evaluation], int, float]:
    """Price in bound order until the cap. With `helpers` (a part of a split search), hand
    configurations to the serving processes as `request(index)` while some serve, two in flight
    per server; their answers are taken as they come and all of them before returning."""
    ranked: list[Evaluation] = []
    evaluated, least, waiting = 0, math.inf, 0

    def take(result: Evaluation | BaseException) -> None:
        nonlocal least
        if isinstance(result, BaseException):
            raise result
        if result.feasible:
            ranked.append(result)
        else:
            least = min(least, result.min_memory_bytes)

    def answers(block: bool) -> None:
        nonlocal waiting
        assert helpers is not None
        mine = helpers.results[helpers.part]
        while waiting:
            try:
                _, result = mine.get(timeout=SERVE_POLL_S) if block else mine.get_nowait()
            except queue.Empty:
                if not block:
                    return
                if not peers_alive():
                    raise PlannerError("A process of the split search died while pricing a configuration for this one.",
                                       f"Solve again, or on one process: {WORKERS_ENV}=1.") from None
                continue
            waiting -= 1
            take(result)

    for index, bound in candidates:
        if waiting:
            answers(block=False)
        if bound >= top.cap:
            break
        evaluated += 1
        result = ahead.pop(index, None)  # scouted: its time is in `top` already
        if result is None and helpers is not None and request is not None and waiting < 2 * helpers.serving:
            helpers.requests.put((helpers.part, index, request(index)))  # the server adds its time to `top`
            waiting += 1
            continue
        take(_priced(price, index, top) if result is None else result)
    if waiting:
        answers(block=True)
    return ranked, evaluated, least


def _parallel(price, candidates, top: Top, workers, ahead: dict[int, Evaluation]) -> tuple[list[Evaluation], int, float]:
    global _PRICE
    _PRICE = price
    results, least = {}, math.inf
    pending: dict[Future, int] = {}
    taken: list[int] = []
    stream = iter(candidates)
    following = next(stream, None)
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            while True:
                while following is not None and len(pending) < 2 * workers and following[1] < top.cap:
                    index = following[0]
                    taken.append(index)
                    known = ahead.pop(index, None)  # scouted: its time is in `top` already
                    if known is None:
                        pending[pool.submit(_price_in_worker, index, top.cap)] = index
                    else:
                        results[index] = known
                        if not known.feasible:
                            least = min(least, known.min_memory_bytes)
                    following = next(stream, None)
                if not pending:
                    break
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    result = results[index] = future.result()
                    if result.feasible:
                        top.add(result.iteration_time_s)
                    else:
                        least = min(least, result.min_memory_bytes)
    finally:
        _PRICE = None
    ranked = [results[i] for i in taken if results[i].feasible]  # as the sequential loop lists them
    return ranked, len(results), least
