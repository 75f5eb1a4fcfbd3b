"""Recomputation chosen unit by unit inside a stage: a multiple-choice knapsack per unit range.

A stage holding units [i, j) picks a mode r_u in the allowed ones ("none", "selective",
"full") for each unit u. With t_r,u its seconds per micro-batch (`stage_arrays`, the range's
start term first_r,i folded into unit i), a_r,u its stored activation bytes per micro-batch in
flight, F its fixed bytes (model states, tied copies, p2p buffers), L its micro-batches in
flight and T_ij = max_{u in [i, j)} transient_full,u:

    minimise   sum_u t_{r_u},u
    subject to F + L sum_u a_{r_u},u + T_ij [some r_u = full] <= M

The transient term is conservative: the largest full-recomputation transient of the whole
range, as soon as any unit recomputes fully (only one unit's backward replays at a time,
but that unit need not be the range's largest).

Exact method (`UnitChoices`): for each start i, grow j one unit at a time and keep the Pareto
frontier of (time, activation bytes) over the assignments of [i, j), in two sets: without any
full unit and with one at least (the transient term tells them apart). A point on neither
frontier is beaten in both time and memory by one on it, so for every (L, M) the fastest
fitting frontier point is the knapsack's optimum (`fastest_fitting`). A frontier longer than
`FRONTIER_CAP` points is thinned to that many, evenly along it, always keeping its fastest
and its smallest point: every kept point is a real assignment, so the thinned table is never
better than the truth and never loses feasibility (the least-memory assignment stays), but
it may miss the optimum by the gap between neighbouring kept points.

Ranges whose units repeat an earlier start's sequence (transformer blocks) share that start's
frontiers for the common prefix (`_shared_prefix`), which keeps the table O(n) merges for a
model of n identical blocks instead of O(n^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

FRONTIER_CAP = 64
"""Most points a frontier keeps (module docstring: thinning is conservative)."""


@dataclass(frozen=True)
class Frontier:
    """Pareto frontier of the assignments of units [start, start + length): first set 0 (no unit
    full), then set 1 (some unit full), each fastest first."""

    time_s: np.ndarray
    """Seconds per micro-batch of each point (ascending within a set)."""
    activation_bytes: np.ndarray
    """Stored activation bytes per micro-batch of each point (descending within a set)."""
    last_mode: np.ndarray
    """The mode index of the range's last unit at each point."""
    parent: np.ndarray
    """The point of the frontier one unit shorter it extends (-1 for length 1)."""
    num_without_full: int
    """How many points are in set 0 (they come first)."""


def pareto(time_s: np.ndarray, act: np.ndarray, in_set1: np.ndarray, cap: int | None) -> tuple[np.ndarray, int]:
    """Indices of the non-dominated (time, act) points of each set, set 0 first, each fastest
    first and at most `cap` long (thinned evenly, ends kept), and how many are in set 0."""
    order = np.lexsort((act, time_s, in_set1))
    split = int(np.count_nonzero(~in_set1))
    kept = []
    for part in (order[:split], order[split:]):
        if part.size == 0:
            kept.append(part)
            continue
        act_sorted = act[part]
        best_before = np.minimum.accumulate(act_sorted)
        keep = part[np.concatenate([[True], act_sorted[1:] < best_before[:-1]])]
        if cap is not None and keep.size > cap:
            keep = keep[np.unique(np.round(np.linspace(0, keep.size - 1, cap)).astype(int))]
        kept.append(keep)
    return np.concatenate(kept), kept[0].size


def _first(unit_time: np.ndarray, act: np.ndarray, full_mode: np.ndarray) -> Frontier:
    """The frontier of one unit (its start term already in `unit_time`)."""
    keep, split = pareto(unit_time, act, full_mode, None)
    return Frontier(unit_time[keep], act[keep], keep, np.full(keep.size, -1), split)


def _grow(prev: Frontier, unit_time: np.ndarray, act: np.ndarray, full_mode: np.ndarray, cap: int | None) -> Frontier:
    """The frontier one unit longer: every point extended by every mode; a point of set 1, or
    one extended by full, lands in set 1."""
    n, num_modes = prev.time_s.size, unit_time.size
    time_s = (prev.time_s[:, None] + unit_time[None, :]).ravel()
    bytes_ = (prev.activation_bytes[:, None] + act[None, :]).ravel()
    in_set1 = ((np.arange(n) >= prev.num_without_full)[:, None] | full_mode[None, :]).ravel()
    keep, split = pareto(time_s, bytes_, in_set1, cap)
    return Frontier(time_s[keep], bytes_[keep], keep % num_modes, keep // num_modes, split)


class UnitChoices:
    """The frontiers of the unit ranges (module docstring), grown on demand: a search asks only
    for the ranges its time bound keeps, often short ones.

    `unit_time[r, u]`: seconds of unit u under mode r inside a range; `start_time[r, u]`: what
    the range starting at u adds under u's mode r; `act[r, u]`: stored activation bytes;
    `full`: the indices of the modes that rebuild a unit's activations in its backward ("full",
    "op"; the transient term tells their assignments apart: set 1), or one index, or None."""

    def __init__(self, unit_time: np.ndarray, start_time: np.ndarray, act: np.ndarray, full: int | list[int] | None,
                 cap: int | None = FRONTIER_CAP):
        num_modes, num_units = unit_time.shape
        self._unit_time, self._start_time, self._act, self._cap = unit_time, start_time, act, cap
        self._full_mode = np.isin(np.arange(num_modes), [] if full is None else full)
        self.num_units = num_units
        kinds = np.unique(np.concatenate([unit_time, act]), axis=1, return_inverse=True)[1].ravel()
        starts = np.unique(np.concatenate([unit_time + start_time, act]), axis=1, return_inverse=True)[1].ravel()
        self._source: list[tuple[int, int]] = []
        """Per start: (an earlier start whose frontiers it shares, how many), or (-1, 0)."""
        last_of_kind: dict[int, int] = {}
        for i in range(num_units):
            earlier = last_of_kind.get(int(starts[i]))
            self._source.append((-1, 0) if earlier is None else (earlier, _shared_prefix(kinds, i, earlier)))
            last_of_kind[int(starts[i])] = i
        self.frontiers: list[list[Frontier]] = [[] for _ in range(num_units)]
        """frontiers[i][length - 1]: the frontier of [i, i + length), once grown."""
        self.width = 1
        """K: the points per set in `padded` (grows with the frontiers it has padded)."""
        self._row_of: dict[int, int] = {}
        self._rows: list[Frontier] = []
        self._index = np.full((num_units + 1, num_units + 1), -1)
        self._registered = np.zeros(num_units, dtype=int)
        """Per start: how many of its frontiers have rows in the padded arrays."""
        self._time_s, self._act_bytes, self._lasts = np.zeros((0, 2)), np.zeros((0, 2)), np.zeros((0, 2), dtype=int)

    def grow(self, start: int, length: int) -> None:
        """Make sure the frontiers of [start, start + 1 .. start + length) exist."""
        row = self.frontiers[start]
        if len(row) >= length:
            return
        source, shared = self._source[start]
        if len(row) < shared:
            upto = min(length, shared)
            self.grow(source, upto)
            row.extend(self.frontiers[source][len(row):upto])
        if not row:
            row.append(_first(self._unit_time[:, start] + self._start_time[:, start], self._act[:, start], self._full_mode))
        while len(row) < length:
            j = start + len(row)
            row.append(_grow(row[-1], self._unit_time[:, j], self._act[:, j], self._full_mode, self._cap))

    def rows(self, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """The row of each range [starts, ends) in `padded`, growing what is missing."""
        if starts.size and (ends - starts > self._registered[starts]).any():
            order = np.argsort(starts, kind="stable")
            first, at = np.unique(starts[order], return_index=True)
            longest = np.maximum.reduceat((ends - starts)[order], at)
            for i, length in zip(first.tolist(), longest.tolist(), strict=True):
                if length > self._registered[i]:
                    self.grow(i, length)
                    self._register(i)
        return self._index[starts, ends]

    @property
    def padded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(time [row, 2K], activation bytes [row, 2K], last columns [row, 2]) per frontier row:
        the two sets side by side, each padded to K = `width` points with inf (never fits,
        never fastest), and each set's least-memory column."""
        return self._time_s, self._act_bytes, self._lasts

    def _register(self, start: int) -> None:
        """Give the new frontiers of `start` rows of the padded arrays (re-padding all when one is wider)."""
        new: list[Frontier] = []
        for length in range(self._registered[start] + 1, len(self.frontiers[start]) + 1):
            f = self.frontiers[start][length - 1]
            if id(f) not in self._row_of:
                self._row_of[id(f)] = len(self._rows) + len(new)
                new.append(f)
            self._index[start, start + length] = self._row_of[id(f)]
        self._registered[start] = len(self.frontiers[start])
        if not new:
            return
        width = max(self.width, *(max(f.num_without_full, f.time_s.size - f.num_without_full) for f in new))
        if width > self.width:
            self.width, new = width, self._rows + new
            self._rows = []
            self._time_s, self._act_bytes, self._lasts = np.zeros((0, 2 * width)), np.zeros((0, 2 * width)), np.zeros((0, 2), dtype=int)
        time_s, act = np.full((len(new), 2 * width), np.inf), np.full((len(new), 2 * width), np.inf)
        lasts = np.zeros((len(new), 2), dtype=int)
        for n, f in enumerate(new):
            split, rest = f.num_without_full, f.time_s.size - f.num_without_full
            time_s[n, :split], time_s[n, width:width + rest] = f.time_s[:split], f.time_s[split:]
            act[n, :split], act[n, width:width + rest] = f.activation_bytes[:split], f.activation_bytes[split:]
            lasts[n] = max(split - 1, 0), width + max(rest - 1, 0)
        self._rows += new
        self._time_s = np.concatenate([self._time_s.reshape(-1, 2 * width), time_s])
        self._act_bytes = np.concatenate([self._act_bytes.reshape(-1, 2 * width), act])
        self._lasts = np.concatenate([self._lasts, lasts])

    def modes(self, start: int, end: int, point: int, width: int) -> tuple[int, ...]:
        """The mode index of each unit of [start, end) at column `point` of the `padded` arrays
        as they were when `width` was K."""
        s, idx = divmod(point, width)
        f = self.frontiers[start][end - start - 1]
        idx += s * f.num_without_full  # the column's index in the frontier
        out = []
        for length in range(end - start, 0, -1):
            f = self.frontiers[start][length - 1]
            out.append(int(f.last_mode[idx]))
            idx = int(f.parent[idx])
        return tuple(reversed(out))


def _shared_prefix(kinds: np.ndarray, start: int, earlier: int | None) -> int:
    """How many frontiers start `start` can take from `earlier` (same kind of first unit, then
    the same kinds of units): 1 + the common length of the unit kinds after each."""
    if earlier is None:
        return 0
    tail = kinds[start + 1:]
    other = kinds[earlier + 1:earlier + 1 + tail.size]
    differ = np.flatnonzero(tail != other)
    return 1 + (int(differ[0]) if differ.size else tail.size)


def fastest_fitting(choices: UnitChoices, rows: np.ndarray, room: np.ndarray,
                    levels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per in-flight level L and range: the least frontier time over the points of its `padded`
    row (`rows[range]`) whose L x activation bytes fit the range's room (`room[range, 2]`, per
    set: the memory limit less its fixed and transient bytes; or `room[level, range, 2]`, one per
    level), and its column (-1 and inf: none
    fits), as [level, range] arrays. A set whose fastest point fits, or whose least-memory point
    does not, or which cannot beat the other set, is settled without looking further; the others
    are bisected (a frontier's bytes fall as its time grows)."""
    time_all, act_all, lasts_all = choices.padded
    width = time_all.shape[1] // 2
    room = np.broadcast_to(room, (len(levels), len(rows), 2))  # [level, range, set]: one room for all levels, or one each
    firsts = np.broadcast_to(np.array([0, width]), (len(rows), 2))
    lasts = lasts_all[rows]
    scale = np.asarray(levels, dtype=float)[:, None, None]
    first_fits = scale * act_all[rows[:, None], firsts][None] <= room  # [level, range, set]
    last_fits = scale * act_all[rows[:, None], lasts][None] <= room
    settled = np.where(first_fits, time_all[rows[:, None], firsts][None], np.where(last_fits, np.nan, np.inf))
    settled = np.broadcast_to(settled, (len(levels), len(rows), 2)).copy()
    column = np.where(first_fits, firsts[None], -1)
    # An open set cannot win if the other set is settled at most its fastest point's time
    # (strictly less for set 0, which wins ties).
    fastest = time_all[rows[:, None], firsts][None]
    other = settled[..., ::-1]
    hopeless = np.isnan(settled) & ~np.isnan(other) & np.where(np.array([True, False]), other < fastest, other <= fastest)
    settled[hopeless] = np.inf
    level_of, range_of, set_of = np.nonzero(np.isnan(settled))
    if level_of.size:  # bisect each open (level, range, set): its first point fails, its last fits
        row, room_of, scale_of = rows[range_of], room[level_of, range_of, set_of], scale[level_of, 0, 0]
        low, high = firsts[range_of, set_of], lasts[range_of, set_of]
        while True:  # bytes fall strictly along a frontier, so "fits" flips once: at `high`
            wide = high - low > 1
            if not wide.any():
                break
            middle = (low + high) // 2
            fits = scale_of * act_all[row, middle] <= room_of
            high = np.where(wide & fits, middle, high)
            low = np.where(wide & ~fits, middle, low)
        settled[level_of, range_of, set_of] = time_all[row, high]
        column[level_of, range_of, set_of] = high
    pick = np.argmin(settled, axis=2)[..., None]  # set 0 on ties, as a scan over the padded row would
    cost = np.take_along_axis(settled, pick, axis=2)[..., 0]
    chosen = np.take_along_axis(column, pick, axis=2)[..., 0]
    return cost, np.where(np.isfinite(cost), chosen, -1)
