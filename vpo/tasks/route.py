"""The route task: grid routes with conflicting bonus regions and partly hidden lava.

An N x N grid (default 6 x 6) has the start ``S`` in the top-left corner and the exit ``E`` in
the bottom-right one. Bonus region A (``a``) is the three-cell L in the top-right corner and
bonus region B (``b``) the one in the bottom-left corner. ``#`` cells are walls, ``~`` cells
are lava the prompt shows, ``.`` is free floor. An answer is a string of moves ``U D L R``.

Walls (1 to 4 by default) may fall on any floor cell, the border corridors included
(``border_walls=True``, the default), so no fixed route is legal on every problem and a policy has
to read the grid. With walls on interior cells only (``border_walls=False``) the two border routes
``RRRRRDDDDD`` and ``DDDDDRRRRR`` are always legal and collect a whole bonus region; trained
policies then answer the same routes on every problem and search has nothing to choose from
(README, "What the main job shows").

Conflict by construction (VPO_SPEC section 3, Maze): the step budget is the length of the
shortest route that collects all of A or all of B, whichever is longer, plus ``slack``; no
legal route within the budget touches both regions (checked for every generated problem).

Hidden information (notes/route-task.md, lesson 1): besides the lava the prompt shows, each
problem has lava cells the prompt does NOT show, drawn independently of everything it shows.
With ``hidden_sides="both"`` (the default) ``n_hidden`` of them sit in the neighbourhood of
bonus A (the region and the cells next to it) and ``n_hidden`` in that of bonus B, so every
bonus route gambles on where they are and several route variants per side are worth trying:
the prompt-only oracle (:func:`hedge_curve`) keeps improving up to about ten answers. With
``hidden_sides="one"`` all ``n_hidden`` sit next to A with probability ``p_hidden_a``,
otherwise next to B; then one route per side is always enough (the oracle stops at k=2),
which is why it is not the default: nothing can be gained from search past k=3.

Reward vector (d = 4), all zeros unless the answer is a legal route (only ``UDLR``, never off
the grid or into a wall) that ends on the exit within the budget:

* ``exit``: 1.
* ``bonus_a`` / ``bonus_b``: fraction of the region's cells the route visits.
* ``no_lava``: ``max(0, 1 - n / lava_tolerance)`` where n is the number of distinct lava cells
  (shown or hidden) the route visits. The paper's Maze uses 1 - (lava fraction of the route);
  on our short routes (about 11 cells) one lava cell would then cost 0.02 on the mean scalar,
  below sampling noise, so the hazards would not matter. With the default tolerance 1 the
  dimension reads "no lava touched" (one lava cell costs 0.25 on the mean scalar).

The deployment scalar (GRPO, evaluation) is the mean of the four (``VectorReward.w_star``).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
from collections.abc import Iterable, Mapping, Sequence
from functools import cached_property
from typing import Any

import numpy as np

from vpo import metrics
from vpo.rewards import VectorReward
from vpo.tasks import DrawnTask, register_task

__all__ = [
    "MOVES",
    "RouteReward",
    "RouteTask",
    "achievable_vectors",
    "best_scalar",
    "generate_problem",
    "hedge_curve",
    "hedge_values",
    "hidden_outcomes",
    "make_route_task",
    "optimal_vectors",
    "route_charset",
    "route_vector",
    "walk",
]

MOVES: dict[str, tuple[int, int]] = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
FREE, WALL, LAVA, START, EXIT, BONUS_A, BONUS_B = ".", "#", "~", "S", "E", "a", "b"
GRID_CHARS = FREE + WALL + LAVA + START + EXIT + BONUS_A + BONUS_B
TAG = "r"
NAMES = ("exit", "bonus_a", "bonus_b", "no_lava")


def route_charset() -> str:
    """Every character a route prompt or completion can contain (the tiny tokenizer's vocabulary)."""
    return "".join(sorted(set(GRID_CHARS + "".join(MOVES) + "\n<>/_?" + TAG + "0123456789")))


# --------------------------------------------------------------------------------------------
# geometry


def bonus_cells(size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Flat indices of bonus regions A (top-right L) and B (bottom-left L) on a size x size grid."""
    n = size
    a = ((0, n - 1), (0, n - 2), (1, n - 1))
    b = ((n - 1, 0), (n - 2, 0), (n - 1, 1))
    return tuple(r * n + c for r, c in a), tuple(r * n + c for r, c in b)


def _neighbourhood(cells: Iterable[int], size: int) -> set[int]:
    """The cells plus their 4-neighbours."""
    out: set[int] = set()
    for cell in cells:
        r, c = divmod(cell, size)
        out.add(cell)
        for dr, dc in MOVES.values():
            rr, cc = r + dr, c + dc
            if 0 <= rr < size and 0 <= cc < size:
                out.add(rr * size + cc)
    return out


def _bfs_dist(size: int, walls: frozenset[int], source: int) -> list[int]:
    """Shortest step counts from ``source`` to every cell avoiding walls (-1 = unreachable)."""
    dist = [-1] * (size * size)
    dist[source] = 0
    frontier = [source]
    while frontier:
        nxt: list[int] = []
        for cell in frontier:
            r, c = divmod(cell, size)
            for dr, dc in MOVES.values():
                rr, cc = r + dr, c + dc
                if 0 <= rr < size and 0 <= cc < size:
                    j = rr * size + cc
                    if j not in walls and dist[j] < 0:
                        dist[j] = dist[cell] + 1
                        nxt.append(j)
        frontier = nxt
    return dist


def _reachable_masks(size: int, walls: frozenset[int], budget: int, relevant: Sequence[int]) -> set[int]:
    """Bit masks (over ``relevant`` cells) of the visited sets of all legal routes that end on the
    exit within ``budget`` moves. Breadth-first over (position, mask) states, so exact."""
    bit = {cell: 1 << i for i, cell in enumerate(relevant)}
    start, goal = 0, size * size - 1
    to_goal = _bfs_dist(size, walls, goal)
    nbrs: list[list[int]] = []
    for cell in range(size * size):
        r, c = divmod(cell, size)
        nbrs.append(
            [
                (r + dr) * size + c + dc
                for dr, dc in MOVES.values()
                if 0 <= r + dr < size and 0 <= c + dc < size and (r + dr) * size + c + dc not in walls
            ]
        )
    state0 = (start, bit.get(start, 0))
    seen = {state0}
    frontier = [state0]
    finals = {state0[1]} if start == goal else set()
    for step in range(1, budget + 1):
        nxt = []
        left = budget - step
        for pos, mask in frontier:
            for j in nbrs[pos]:
                if to_goal[j] < 0 or to_goal[j] > left:
                    continue
                state = (j, mask | bit.get(j, 0))
                if state not in seen:
                    seen.add(state)
                    nxt.append(state)
                    if j == goal:
                        finals.add(state[1])
        frontier = nxt
    return finals


# --------------------------------------------------------------------------------------------
# problems


def _problem_walls(row: Mapping[str, Any]) -> frozenset[int]:
    return frozenset(i for i, ch in enumerate("".join(row["grid"])) if ch == WALL)


def _visible_lava(row: Mapping[str, Any]) -> list[int]:
    return [i for i, ch in enumerate("".join(row["grid"])) if ch == LAVA]


def hidden_candidates(row: Mapping[str, Any]) -> tuple[list[int], list[int]]:
    """The cells where hidden lava may sit next to bonus A and next to bonus B, given the prompt."""
    size = int(row["size"])
    flat = "".join(row["grid"])
    a, b = bonus_cells(size)
    ok = {FREE, BONUS_A, BONUS_B}
    side_a = sorted(i for i in _neighbourhood(a, size) if flat[i] in ok)
    side_b = sorted(i for i in _neighbourhood(b, size) if flat[i] in ok)
    return side_a, side_b


def generate_problem(
    rng: random.Random,
    size: int = 6,
    n_walls: tuple[int, int] = (1, 4),
    n_lava: tuple[int, int] = (1, 2),
    n_hidden: int = 1,
    p_hidden_a: float = 0.5,
    slack: int = 2,
    border_walls: bool = True,
    max_tries: int = 1000,
    hidden_sides: str = "both",
) -> dict[str, Any]:
    """Draw one problem: walls and shown lava first, then the hidden lava given the shown grid.

    Walls go on any floor cell when ``border_walls`` (then the border corridors can be blocked and
    the budget grows with the detour), on interior cells only otherwise. Returns a
    JSON-serialisable dict with ``size``, ``grid`` (the shown rows), ``lava`` (flat indices of all
    lava, shown and hidden), ``hidden`` (the hidden subset) and ``budget``.
    """
    if size < 4:
        raise ValueError(f"size must be >= 4, got {size}")
    _check_sides(hidden_sides)
    a, b = bonus_cells(size)
    start, goal = 0, size * size - 1
    special = {start, goal, *a, *b}
    floor = [i for i in range(size * size) if i not in special]
    interior = [i for i in floor if 0 < i // size < size - 1 and 0 < i % size < size - 1]
    wall_cells = floor if border_walls else interior
    for _ in range(max_tries):
        walls = frozenset(rng.sample(wall_cells, rng.randint(*n_walls)))
        d_start = _bfs_dist(size, walls, start)
        d_goal = _bfs_dist(size, walls, goal)
        if d_start[goal] < 0:
            continue
        open_cells = [i for i in floor if i not in walls]
        lava = rng.sample(open_cells, rng.randint(*n_lava))
        grid = [FREE] * (size * size)
        for i in walls:
            grid[i] = WALL
        for i in lava:
            grid[i] = LAVA
        for i in a:
            grid[i] = BONUS_A
        for i in b:
            grid[i] = BONUS_B
        grid[start], grid[goal] = START, EXIT
        rows = ["".join(grid[r * size : (r + 1) * size]) for r in range(size)]
        full_a = _full_region_length(size, walls, a, d_start, d_goal)
        full_b = _full_region_length(size, walls, b, d_start, d_goal)
        if full_a is None or full_b is None:
            continue
        budget = max(full_a, full_b) + slack
        masks = _reachable_masks(size, walls, budget, list(a) + list(b))
        mask_a, mask_b = (1 << len(a)) - 1, ((1 << len(b)) - 1) << len(a)
        if any(m & mask_a and m & mask_b for m in masks):
            continue  # both regions reachable within the budget: no conflict, redraw
        problem = {"size": size, "grid": rows, "budget": budget}
        side_a, side_b = hidden_candidates(problem)
        if hidden_sides == "both":
            if min(len(side_a), len(side_b)) < n_hidden:
                continue
            hidden = sorted(rng.sample(side_a, n_hidden) + rng.sample(side_b, n_hidden))
        else:
            side = side_a if rng.random() < p_hidden_a else side_b
            if len(side) < n_hidden:
                continue
            hidden = sorted(rng.sample(side, n_hidden))
        problem["hidden"] = hidden
        problem["lava"] = sorted(set(lava) | set(hidden))
        return problem
    raise RuntimeError(f"could not draw a valid route problem in {max_tries} tries (size={size})")


def _check_sides(hidden_sides: str) -> None:
    if hidden_sides not in ("one", "both"):
        raise ValueError(f"hidden_sides must be 'one' or 'both', got {hidden_sides!r}")


def _full_region_length(
    size: int, walls: frozenset[int], region: Sequence[int], d_start: list[int], d_goal: list[int]
) -> int | None:
    """Length of the shortest legal route that visits every cell of ``region`` (None: impossible)."""
    best: int | None = None
    for order in itertools.permutations(region):
        if d_start[order[0]] < 0 or d_goal[order[-1]] < 0:
            continue
        total = d_start[order[0]] + d_goal[order[-1]]
        for x, y in itertools.pairwise(order):
            dxy = _bfs_dist(size, walls, x)[y]
            if dxy < 0:
                total = -1
                break
            total += dxy
        if total >= 0 and (best is None or total < best):
            best = total
    return best


def _problem_key(problem: Mapping[str, Any]) -> str:
    return json.dumps([problem["grid"], problem["hidden"], problem["budget"]])


# --------------------------------------------------------------------------------------------
# scoring


def walk(route: str, row: Mapping[str, Any]) -> list[int] | None:
    """Cells (flat indices, start included) a route visits, or None if it is illegal: a char other
    than U/D/L/R, a move off the grid or into a wall, more moves than the budget, or not ending on
    the exit."""
    size = int(row["size"])
    flat = "".join(row["grid"])
    moves = "".join(route.split())
    if not moves or len(moves) > int(row["budget"]) or any(ch not in MOVES for ch in moves):
        return None
    r = c = 0
    cells = [0]
    for ch in moves:
        dr, dc = MOVES[ch]
        r, c = r + dr, c + dc
        if not (0 <= r < size and 0 <= c < size) or flat[r * size + c] == WALL:
            return None
        cells.append(r * size + c)
    return cells if cells[-1] == size * size - 1 else None


def _vector_from_cells(visited: set[int], size: int, lava: Iterable[int], tol: float) -> np.ndarray:
    a, b = bonus_cells(size)
    n_lava = len(visited.intersection(lava))
    return np.array(
        [
            1.0,
            len(visited.intersection(a)) / len(a),
            len(visited.intersection(b)) / len(b),
            max(0.0, 1.0 - n_lava / tol),
        ]
    )


def route_vector(route: str, row: Mapping[str, Any], lava_tolerance: float = 1.0) -> np.ndarray:
    """Reward vector [exit, bonus_a, bonus_b, no_lava] of one answer; all zeros if illegal."""
    cells = walk(route, row)
    if cells is None:
        return np.zeros(len(NAMES))
    return _vector_from_cells(set(cells), int(row["size"]), row["lava"], lava_tolerance)


class RouteReward(VectorReward):
    """Vector reward of the route task (see the module docstring for the four dimensions)."""

    names = NAMES
    answer_tag = TAG

    def __init__(self, lava_tolerance: float = 1.0) -> None:
        if lava_tolerance <= 0:
            raise ValueError(f"lava_tolerance must be > 0, got {lava_tolerance}")
        self.lava_tolerance = float(lava_tolerance)

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        """Score each answer (a move string) for problem ``row``; shape (len(answers), 4)."""
        out = np.zeros((len(answers), len(NAMES)))
        for i, ans in enumerate(answers):
            out[i] = route_vector(ans, row, self.lava_tolerance)
        return out

    def dedup_key(self, answer: str) -> str:
        """Two answers are the same answer when their move strings are equal."""
        return "".join(answer.split())


# --------------------------------------------------------------------------------------------
# oracles


def _mask_vectors(
    row: Mapping[str, Any], relevant: Sequence[int], masks: Iterable[int], lava: Iterable[int], tol: float
) -> np.ndarray:
    size = int(row["size"])
    lava = set(lava)
    out = []
    for mask in masks:
        visited = {cell for i, cell in enumerate(relevant) if mask >> i & 1}
        out.append(_vector_from_cells(visited, size, lava, tol))
    return np.array(out).reshape(-1, len(NAMES))


def achievable_vectors(row: Mapping[str, Any], lava_tolerance: float = 1.0) -> np.ndarray:
    """All distinct reward vectors of legal routes (full information, hidden lava included), by
    exhaustive search over visited sets; shape (n, 4), sorted."""
    size = int(row["size"])
    a, b = bonus_cells(size)
    relevant = sorted(set(a) | set(b) | set(row["lava"]))
    masks = _reachable_masks(size, _problem_walls(row), int(row["budget"]), relevant)
    vecs = _mask_vectors(row, relevant, masks, row["lava"], lava_tolerance)
    return np.unique(vecs, axis=0)


def best_scalar(row: Mapping[str, Any], lava_tolerance: float = 1.0) -> float:
    """The best mean-scalar score any legal route reaches on this problem (full information)."""
    return float(achievable_vectors(row, lava_tolerance).mean(axis=1).max())


def optimal_vectors(row: Mapping[str, Any], lava_tolerance: float = 1.0) -> list[tuple[float, ...]]:
    """The distinct reward vectors that reach :func:`best_scalar` (full information)."""
    vecs = achievable_vectors(row, lava_tolerance)
    scal = vecs.mean(axis=1)
    best = scal.max()
    return [tuple(float(x) for x in v) for v in vecs[np.isclose(scal, best)]]


def hidden_outcomes(
    row: Mapping[str, Any], n_hidden: int = 1, p_hidden_a: float = 0.5, hidden_sides: str = "both"
) -> list[tuple[float, tuple[int, ...]]]:
    """The exact distribution of the hidden lava given only what the prompt shows, as
    (probability, hidden cells) pairs; it is the generator's own hidden-lava step."""
    _check_sides(hidden_sides)
    side_a, side_b = hidden_candidates(row)
    if hidden_sides == "both":
        combos_a = list(itertools.combinations(side_a, n_hidden))
        combos_b = list(itertools.combinations(side_b, n_hidden))
        n = len(combos_a) * len(combos_b)
        return [(1.0 / n, tuple(sorted(x + y))) for x in combos_a for y in combos_b]
    out: list[tuple[float, tuple[int, ...]]] = []
    for p_side, side in ((p_hidden_a, side_a), (1.0 - p_hidden_a, side_b)):
        combos = list(itertools.combinations(side, n_hidden))
        if p_side <= 0 or not combos:
            continue
        out.extend((p_side / len(combos), combo) for combo in combos)
    total = sum(p for p, _ in out)
    return [(p / total, cells) for p, cells in out]


def _outcome_matrix(
    row: Mapping[str, Any], n_hidden: int, p_hidden_a: float, hidden_sides: str, lava_tolerance: float
) -> tuple[np.ndarray, np.ndarray]:
    """(scal, probs): scal[i, o] is the mean scalar of undominated route class i under hidden
    outcome o, probs[o] the outcome's probability given the prompt."""
    size = int(row["size"])
    a, b = bonus_cells(size)
    outcomes = hidden_outcomes(row, n_hidden, p_hidden_a, hidden_sides)
    side_a, side_b = hidden_candidates(row)
    shown = _visible_lava(row)
    relevant = sorted(set(a) | set(b) | set(shown) | set(side_a) | set(side_b))
    masks = sorted(_reachable_masks(size, _problem_walls(row), int(row["budget"]), relevant))
    probs = np.array([p for p, _ in outcomes])
    scal = np.stack(
        [
            _mask_vectors(row, relevant, masks, set(shown) | set(cells), lava_tolerance).mean(axis=1)
            for _, cells in outcomes
        ],
        axis=1,
    )
    return _undominated(np.unique(scal, axis=0)), probs


def hedge_values(
    row: Mapping[str, Any],
    k_max: int = 3,
    n_hidden: int = 1,
    p_hidden_a: float = 0.5,
    lava_tolerance: float = 1.0,
    hidden_sides: str = "both",
) -> list[float]:
    """Best expected best-of-k mean scalar for k = 1..k_max when the k routes are chosen from the
    prompt alone (hidden lava unknown, averaged over its exact distribution). Entry k-1 is what
    an ideal k-answer policy can reach; the gap between k=1 and k>1 is what hedging is worth.
    Exact (exhaustive over route classes) for k_max <= 3."""
    return metrics.hedge_values(*_outcome_matrix(row, n_hidden, p_hidden_a, hidden_sides, lava_tolerance), k_max)


def hedge_curve(
    row: Mapping[str, Any],
    k_max: int = 30,
    n_hidden: int = 1,
    p_hidden_a: float = 0.5,
    lava_tolerance: float = 1.0,
    hidden_sides: str = "both",
) -> list[float]:
    """Greedy prompt-only best-of-k for k = 1..k_max: add, one at a time, the route that raises
    the expected best mean scalar most. Expected best-of-k is monotone submodular in the set, so
    entry k is within a factor 1 - 1/e of the optimum (and exact at k = 1); it shows how far
    past k = 3 search can still gain on a problem."""
    return metrics.greedy_hedge_curve(*_outcome_matrix(row, n_hidden, p_hidden_a, hidden_sides, lava_tolerance),
                                      k_max)


def _undominated(scal: np.ndarray) -> np.ndarray:
    """Rows not weakly dominated by another row (they can never help a best-of-k set)."""
    keep = []
    for i in range(len(scal)):
        dom = np.all(scal >= scal[i], axis=1) & np.any(scal > scal[i], axis=1)
        if not dom.any():
            keep.append(i)
    return scal[keep]


# --------------------------------------------------------------------------------------------
# demonstrations for the supervised base stage


def _random_shortest(size: int, walls: frozenset[int], src: int, dst: int, rng: random.Random) -> str:
    """A random shortest legal move string from ``src`` to ``dst`` (uniform choice per step)."""
    dist = _bfs_dist(size, walls, dst)
    if dist[src] < 0:
        raise ValueError("destination unreachable")
    out = []
    cur = src
    while cur != dst:
        r, c = divmod(cur, size)
        options = []
        for ch, (dr, dc) in MOVES.items():
            rr, cc = r + dr, c + dc
            if 0 <= rr < size and 0 <= cc < size and dist[rr * size + cc] == dist[cur] - 1:
                options.append((ch, rr * size + cc))
        ch, cur = rng.choice(options)
        out.append(ch)
    return "".join(out)


def demo_route(row: Mapping[str, Any], rng: random.Random, kind: str | None = None) -> str:
    """One legal, within-budget route for the supervised mixture, blind to lava: via region A,
    via region B, or any route ("free"), each optionally through a random detour waypoint."""
    size = int(row["size"])
    walls = _problem_walls(row)
    budget = int(row["budget"])
    a, b = bonus_cells(size)
    start, goal = 0, size * size - 1
    kind = kind or rng.choices(("a", "b", "free"), weights=(0.35, 0.35, 0.30))[0]
    for _ in range(50):
        points = [start]
        if kind in ("a", "b"):
            region = a if kind == "a" else b
            # the corner cell collects the whole L on a shortest route; other cells give partial routes
            points.append(region[0] if rng.random() < 0.7 else rng.choice(region))
        if rng.random() < 0.3:
            free = [i for i in range(size * size) if i not in walls]
            points.insert(rng.randint(1, len(points)), rng.choice(free))
        points.append(goal)
        try:
            route = "".join(_random_shortest(size, walls, x, y, rng) for x, y in itertools.pairwise(points))
        except ValueError:
            continue
        if route and len(route) <= budget and walk(route, row) is not None:
            return route
    return _random_shortest(size, walls, start, goal, rng)


def format_answers(routes: Sequence[str]) -> str:
    """The completion text for a list of routes: ``<r_1>..</r_1><r_2>..</r_2>...``."""
    return "".join(f"<{TAG}_{i}>{r}</{TAG}_{i}>" for i, r in enumerate(routes, start=1))


# --------------------------------------------------------------------------------------------
# the task


class RouteTask(DrawnTask):
    """Seeded route problems with disjoint train/test splits, compact char prompts and oracles."""

    name = "route"
    full_information_oracle = "best single route knowing the hidden lava"

    def __init__(
        self,
        size: int = 6,
        n_train: int = 1000,
        n_test: int = 100,
        seed: int = 0,
        n_walls: tuple[int, int] | Sequence[int] = (1, 4),
        n_lava: tuple[int, int] | Sequence[int] = (1, 2),
        n_hidden: int = 1,
        p_hidden_a: float = 0.5,
        slack: int = 2,
        border_walls: bool = True,
        lava_tolerance: float = 1.0,
        hidden_sides: str = "both",
    ) -> None:
        self.size = int(size)
        self.n_train, self.n_test, self.seed = int(n_train), int(n_test), int(seed)
        self.n_walls = (int(n_walls[0]), int(n_walls[1]))
        self.n_lava = (int(n_lava[0]), int(n_lava[1]))
        self.n_hidden, self.p_hidden_a, self.slack = int(n_hidden), float(p_hidden_a), int(slack)
        self.border_walls = bool(border_walls)
        _check_sides(hidden_sides)
        self.hidden_sides = hidden_sides
        self.reward = RouteReward(lava_tolerance)
        self._splits: dict[str, list[dict[str, Any]]] = {}

    @property
    def params(self) -> dict[str, Any]:
        """The generator parameters (JSON-serialisable), e.g. for run manifests."""
        return {
            "size": self.size,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "seed": self.seed,
            "n_walls": list(self.n_walls),
            "n_lava": list(self.n_lava),
            "n_hidden": self.n_hidden,
            "p_hidden_a": self.p_hidden_a,
            "slack": self.slack,
            "border_walls": self.border_walls,
            "hidden_sides": self.hidden_sides,
            "lava_tolerance": self.reward.lava_tolerance,
        }

    @cached_property
    def charset(self) -> str:
        """Characters of every prompt and completion this task produces."""
        return route_charset()

    def _draw(self, split: str, n: int, exclude: set[str]) -> list[dict[str, Any]]:
        digest = hashlib.sha256(f"route:{self.seed}:{split}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        rows: list[dict[str, Any]] = []
        seen = set(exclude)
        while len(rows) < n:
            prob = generate_problem(
                rng,
                self.size,
                self.n_walls,
                self.n_lava,
                self.n_hidden,
                self.p_hidden_a,
                self.slack,
                self.border_walls,
                hidden_sides=self.hidden_sides,
            )
            key = _problem_key(prob)
            visible = "\n".join(prob["grid"])
            if key in seen or visible in seen:  # no two problems share a prompt (no leak across splits)
                continue
            seen.update((key, visible))
            rows.append(
                {
                    "id": f"route-{split}-{self.seed}-{len(rows):05d}",
                    "prompt": "\n".join(prob["grid"]),
                    **prob,
                }
            )
        return rows

    def split_keys(self, row: Mapping[str, Any]) -> set[str]:
        """No train problem repeats a test problem (grid, hidden cells and budget) or its prompt."""
        return {_problem_key(row), row["prompt"]}

    def format_prompt(self, row: Mapping[str, Any], m: int) -> str:
        """The grid followed by a short answer-count flag: ``...\\n?1>`` or ``...\\n?3>``."""
        if m < 1:
            raise ValueError(f"m must be >= 1, got {m}")
        return f"{row['prompt']}\n?{m}>"

    def demonstration(self, row: Mapping[str, Any], m: int, rng: random.Random) -> str:
        """A supervised target completion: m distinct lava-blind legal routes in numbered tags."""
        routes: list[str] = []
        for _ in range(20 * m):
            r = demo_route(row, rng)
            if r not in routes:
                routes.append(r)
            if len(routes) == m:
                break
        return format_answers(routes)

    def is_pass(self, vector: Sequence[float]) -> bool:
        """pass@k's "pass": the exit is reached and no lava (shown or hidden) is touched."""
        v = np.asarray(vector, dtype=np.float64)
        return bool(v[0] >= 1.0 and v[3] >= 1.0)

    def best_scalar(self, row: Mapping[str, Any]) -> float:
        """Full-information oracle: the best mean scalar any legal route reaches."""
        return best_scalar(row, self.reward.lava_tolerance)

    def optimal_vectors(self, row: Mapping[str, Any]) -> list[tuple[float, ...]]:
        """Full-information oracle: the distinct reward vectors that reach the best scalar."""
        return optimal_vectors(row, self.reward.lava_tolerance)

    def _hidden_args(self) -> tuple[int, float, float, str]:
        """(n_hidden, p_hidden_a, lava_tolerance, hidden_sides): what the prompt-only oracles need."""
        return self.n_hidden, self.p_hidden_a, self.reward.lava_tolerance, self.hidden_sides

    def hedge_values(self, row: Mapping[str, Any], k_max: int = 3) -> list[float]:
        """Prompt-only oracle: best expected best-of-k for k = 1..k_max (see :func:`hedge_values`)."""
        return hedge_values(row, k_max, *self._hidden_args())

    def hedge_curve(self, row: Mapping[str, Any], k_max: int = 30) -> list[float]:
        """Prompt-only greedy best-of-k for k = 1..k_max (see :func:`hedge_curve`)."""
        return hedge_curve(row, k_max, *self._hidden_args())


@register_task("route")
def make_route_task(**params: Any) -> RouteTask:
    """Factory for the registry: ``get_task("route", size=6, n_train=1000, ...)``."""
    return RouteTask(**params)
