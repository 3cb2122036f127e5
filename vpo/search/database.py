"""Program database for evolutionary test-time search: islands of MAP-Elites niches.

Every island maps a *niche key* to its elite program. The niche key is the program's reward
vector discretised into ``bins`` bins per dimension, with ``None`` where the dimension is absent
(NaN): FunSearch's "signature" idea (programs that pass the same tests share a niche), so the
database keeps behaviourally different programs even when their scalar scores tie.

* **Elitism:** a niche keeps its best program by scalar score ``w*·r`` (renormalised over the
  present dimensions); ties go to the shorter text, then to the incumbent.
* **Parent sampling** on one island mixes exploration (uniform over the island's elites),
  exploitation (uniform over the island's Pareto front) and fitness-weighted sampling
  (softmax of the scalar score with a temperature).
* **Pareto-aware selection:** programs not dominated over the reward vector form the front;
  exploitation and inspirations prefer them, so a program that passes a rare test survives
  as a parent even when its mean is lower.
* **Migration:** every ``migration_interval`` iterations, each island sends copies of its best
  elites to the next island in a ring (they enter through the same niche elitism).

All randomness comes from one seeded :class:`random.Random`; :meth:`ProgramDatabase.to_dict`
captures the whole state including the RNG, so a restored database continues identically.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vpo.atomic import atomic_write_json

__all__ = [
    "AddResult",
    "Program",
    "ProgramDatabase",
    "dominates",
    "niche_key",
    "pareto_indices",
    "scalarize",
    "write_json",
]

NicheKey = tuple[int | None, ...]


def scalarize(vector: Sequence[float], w: Sequence[float]) -> float:
    """The scalar score ``w·r`` renormalised over present (non-NaN) dimensions; 0.0 if none."""
    v = np.asarray(vector, dtype=np.float64)
    wv = np.asarray(w, dtype=np.float64)
    if v.shape != wv.shape:
        raise ValueError(f"vector has shape {v.shape}, weights {wv.shape}")
    present = ~np.isnan(v)
    total = float(wv[present].sum())
    if not present.any() or total <= 0.0:
        return 0.0
    return float(np.dot(wv[present], v[present]) / total)


def niche_key(vector: Sequence[float], bins: int) -> NicheKey:
    """Discretise a reward vector in [0, 1] into ``bins`` bins per dimension (None where NaN)."""
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    key: list[int | None] = []
    for x in vector:
        xf = float(x)
        key.append(None if math.isnan(xf) else min(max(int(xf * bins), 0), bins - 1))
    return tuple(key)


def _fill(vector: Sequence[float]) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float64)
    return np.where(np.isnan(v), -1.0, v)


def dominates(a: Sequence[float], b: Sequence[float]) -> bool:
    """True if ``a`` is at least as good as ``b`` everywhere and strictly better somewhere.

    An absent (NaN) dimension counts as worse than any present value and equal to another NaN.
    """
    fa, fb = _fill(a), _fill(b)
    return bool(np.all(fa >= fb) and np.any(fa > fb))


def pareto_indices(vectors: Sequence[Sequence[float]]) -> list[int]:
    """Indices of the non-dominated vectors (equal vectors are all kept), in input order."""
    if len(vectors) == 0:
        return []
    arr = np.stack([_fill(v) for v in vectors])
    keep: list[int] = []
    for i in range(arr.shape[0]):
        ge = np.all(arr >= arr[i], axis=1)
        gt = np.any(arr > arr[i], axis=1)
        if not np.any(ge & gt):
            keep.append(i)
    return keep


@dataclass(frozen=True)
class Program:
    """One scored candidate: its text, reward vector (NaN = absent), scalar score and lineage."""

    id: int
    text: str
    vector: tuple[float, ...]
    score: float
    niche: NicheKey
    parent_id: int | None = None
    iteration: int = 0
    island: int = 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (NaN written as null)."""
        return {
            "id": self.id,
            "text": self.text,
            "vector": [None if math.isnan(x) else x for x in self.vector],
            "score": self.score,
            "niche": list(self.niche),
            "parent_id": self.parent_id,
            "iteration": self.iteration,
            "island": self.island,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Program:
        """Inverse of :meth:`to_dict`."""
        return cls(
            id=int(d["id"]),
            text=str(d["text"]),
            vector=tuple(float("nan") if x is None else float(x) for x in d["vector"]),
            score=float(d["score"]),
            niche=tuple(d["niche"]),
            parent_id=None if d.get("parent_id") is None else int(d["parent_id"]),
            iteration=int(d.get("iteration", 0)),
            island=int(d.get("island", 0)),
        )


@dataclass(frozen=True)
class AddResult:
    """Outcome of :meth:`ProgramDatabase.add`: the program, whether it became its niche's elite,
    whether the niche was new on that island, and the id it displaced (if any)."""

    program: Program
    inserted: bool
    new_niche: bool
    replaced_id: int | None


def _better(a: Program, b: Program) -> bool:
    """Strictly better for a niche: higher score, then shorter text."""
    if a.score != b.score:
        return a.score > b.score
    return len(a.text) < len(b.text)


def _rank_key(p: Program) -> tuple[float, int, int]:
    return (-p.score, len(p.text), p.id)


class ProgramDatabase:
    """Islands of MAP-Elites niches keyed by the discretised reward vector (see module doc)."""

    def __init__(
        self,
        w_star: Sequence[float],
        *,
        num_islands: int = 4,
        bins: int = 10,
        exploration_ratio: float = 0.2,
        exploitation_ratio: float = 0.5,
        temperature: float = 0.1,
        num_inspirations: int = 2,
        migration_interval: int = 10,
        migration_rate: float = 0.1,
        seed: int = 0,
    ) -> None:
        if num_islands < 1:
            raise ValueError(f"num_islands must be >= 1, got {num_islands}")
        if not (0.0 <= exploration_ratio and 0.0 <= exploitation_ratio <= 1.0 - exploration_ratio):
            raise ValueError("need 0 <= exploration_ratio, exploitation_ratio and their sum <= 1")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        if not 0.0 < migration_rate <= 1.0:
            raise ValueError(f"migration_rate must be in (0, 1], got {migration_rate}")
        self.w_star = tuple(float(x) for x in w_star)
        self.dim = len(self.w_star)
        self.num_islands = num_islands
        self.bins = bins
        self.exploration_ratio = exploration_ratio
        self.exploitation_ratio = exploitation_ratio
        self.temperature = temperature
        self.num_inspirations = num_inspirations
        self.migration_interval = migration_interval
        self.migration_rate = migration_rate
        self.seed = seed
        self.rng = random.Random(seed)
        self.programs: dict[int, Program] = {}
        self.islands: list[dict[NicheKey, int]] = [{} for _ in range(num_islands)]
        self.next_id = 0
        self.migrations = 0

    # ------------------------------------------------------------------ insertion

    def niche_key(self, vector: Sequence[float]) -> NicheKey:
        """The niche key of ``vector`` under this database's binning."""
        return niche_key(vector, self.bins)

    def add(
        self,
        text: str,
        vector: Sequence[float],
        *,
        island: int,
        parent_id: int | None = None,
        iteration: int = 0,
    ) -> AddResult:
        """Score ``vector`` with w*, create a program and offer it to ``island``'s niche."""
        vec = tuple(float(x) for x in vector)
        if len(vec) != self.dim:
            raise ValueError(f"vector has {len(vec)} dimensions, database has {self.dim}")
        self._check_island(island)
        prog = Program(
            id=self.next_id,
            text=text,
            vector=vec,
            score=scalarize(vec, self.w_star),
            niche=self.niche_key(vec),
            parent_id=parent_id,
            iteration=iteration,
            island=island,
        )
        self.next_id += 1
        inserted, new_niche, replaced = self._place(island, prog)
        return AddResult(prog, inserted, new_niche, replaced)

    def add_everywhere(self, text: str, vector: Sequence[float], *, iteration: int = 0) -> Program:
        """Seed a program (e.g. a starter program) into every island; returns it."""
        res = self.add(text, vector, island=0, iteration=iteration)
        for i in range(1, self.num_islands):
            self._place(i, res.program)
        return res.program

    def _place(self, island: int, prog: Program) -> tuple[bool, bool, int | None]:
        niches = self.islands[island]
        cur_id = niches.get(prog.niche)
        if cur_id is None:
            niches[prog.niche] = prog.id
            self.programs[prog.id] = prog
            return True, True, None
        if cur_id == prog.id or not _better(prog, self.programs[cur_id]):
            return False, False, None
        niches[prog.niche] = prog.id
        self.programs[prog.id] = prog
        self._collect(cur_id)
        return True, False, cur_id

    def _collect(self, pid: int) -> None:
        """Forget a program no island references any more."""
        if not any(pid in isl.values() for isl in self.islands):
            self.programs.pop(pid, None)

    # ------------------------------------------------------------------ queries

    def _check_island(self, island: int) -> None:
        if not 0 <= island < self.num_islands:
            raise IndexError(f"island {island} out of range 0..{self.num_islands - 1}")

    def elites(self, island: int | None = None) -> list[Program]:
        """Niche elites of one island (or unique elites of all islands), best first."""
        if island is None:
            ids = {pid for isl in self.islands for pid in isl.values()}
        else:
            self._check_island(island)
            ids = set(self.islands[island].values())
        return sorted((self.programs[i] for i in ids), key=_rank_key)

    def best(self, island: int | None = None) -> Program | None:
        """The best elite by scalar score (ties: shorter, then older), or None if empty."""
        el = self.elites(island)
        return el[0] if el else None

    def pareto_front(self, island: int | None = None) -> list[Program]:
        """Elites not dominated over the reward vector (one island or all), best scalar first."""
        el = self.elites(island)
        return [el[i] for i in pareto_indices([p.vector for p in el])]

    def __len__(self) -> int:
        return len(self.programs)

    # ------------------------------------------------------------------ sampling

    def _weighted(self, progs: Sequence[Program]) -> Program:
        top = max(p.score for p in progs)
        weights = [math.exp((p.score - top) / self.temperature) for p in progs]
        return self.rng.choices(list(progs), weights=weights, k=1)[0]

    def sample_parent(self, island: int) -> Program | None:
        """Pick a parent on ``island``: explore (uniform), exploit (Pareto front) or
        fitness-weighted; None when the island is still empty."""
        el = self.elites(island)
        if not el:
            return None
        u = self.rng.random()
        if u < self.exploration_ratio:
            return self.rng.choice(el)
        if u < self.exploration_ratio + self.exploitation_ratio:
            return self.rng.choice(self.pareto_front(island))
        return self._weighted(el)

    def sample_inspirations(self, island: int, parent: Program | None, k: int | None = None) -> list[Program]:
        """Up to k other elites of ``island``: Pareto-front members first (shuffled), then
        fitness-weighted draws without replacement from the rest."""
        k = self.num_inspirations if k is None else k
        pid = None if parent is None else parent.id
        front = [p for p in self.pareto_front(island) if p.id != pid]
        self.rng.shuffle(front)
        chosen = front[:k]
        taken = {p.id for p in chosen}
        rest = [p for p in self.elites(island) if p.id != pid and p.id not in taken]
        while len(chosen) < k and rest:
            pick = self._weighted(rest)
            chosen.append(pick)
            rest = [p for p in rest if p.id != pick.id]
        return chosen

    def sample(self, island: int) -> tuple[Program | None, list[Program]]:
        """A parent and its inspirations from ``island``."""
        parent = self.sample_parent(island)
        return parent, (self.sample_inspirations(island, parent) if parent is not None else [])

    # ------------------------------------------------------------------ migration

    def migrate(self) -> int:
        """Ring migration: copies of each island's top ``ceil(rate·n)`` elites (at least one)
        are offered to the next island's niches. Uses a snapshot, so a program moves at most
        one island per call. Returns how many copies were accepted."""
        if self.num_islands < 2:
            return 0
        snapshot = [self.elites(i) for i in range(self.num_islands)]
        accepted = 0
        for i, el in enumerate(snapshot):
            if not el:
                continue
            k = max(1, math.ceil(self.migration_rate * len(el)))
            dest = (i + 1) % self.num_islands
            for prog in el[:k]:
                accepted += int(self._place(dest, prog)[0])
        self.migrations += 1
        return accepted

    def maybe_migrate(self, iteration: int) -> int:
        """Migrate when ``iteration`` is a positive multiple of ``migration_interval``."""
        if self.migration_interval > 0 and iteration > 0 and iteration % self.migration_interval == 0:
            return self.migrate()
        return 0

    # ------------------------------------------------------------------ (de)serialisation

    def options(self) -> dict[str, Any]:
        """Constructor options (without the weights), for fingerprints and serialisation."""
        return {
            "num_islands": self.num_islands,
            "bins": self.bins,
            "exploration_ratio": self.exploration_ratio,
            "exploitation_ratio": self.exploitation_ratio,
            "temperature": self.temperature,
            "num_inspirations": self.num_inspirations,
            "migration_interval": self.migration_interval,
            "migration_rate": self.migration_rate,
            "seed": self.seed,
        }

    def to_dict(self) -> dict[str, Any]:
        """The whole state (programs, islands, counters, RNG) as a JSON-ready dict."""
        version, internal, gauss = self.rng.getstate()
        return {
            "version": 1,
            "w_star": list(self.w_star),
            "options": self.options(),
            "rng": [version, list(internal), gauss],
            "next_id": self.next_id,
            "migrations": self.migrations,
            "programs": [self.programs[i].to_dict() for i in sorted(self.programs)],
            "islands": [
                [[list(key), pid] for key, pid in sorted(isl.items(), key=lambda kv: kv[1])]
                for isl in self.islands
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProgramDatabase:
        """Restore a database written by :meth:`to_dict` (RNG included)."""
        if d.get("version") != 1:
            raise ValueError(f"unsupported database version {d.get('version')!r}")
        db = cls(d["w_star"], **d["options"])
        version, internal, gauss = d["rng"]
        db.rng.setstate((version, tuple(internal), gauss))
        db.next_id = int(d["next_id"])
        db.migrations = int(d.get("migrations", 0))
        db.programs = {p["id"]: Program.from_dict(p) for p in d["programs"]}
        db.islands = [{tuple(key): int(pid) for key, pid in isl} for isl in d["islands"]]
        missing = {pid for isl in db.islands for pid in isl.values()} - set(db.programs)
        if missing:
            raise ValueError(f"database references unknown programs {sorted(missing)[:5]}")
        return db

    def save(self, path: str | os.PathLike[str]) -> None:
        """Atomically write :meth:`to_dict` as JSON to ``path``."""
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProgramDatabase:
        """Read a database saved with :meth:`save`."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))


def write_json(path: str | os.PathLike[str], obj: Any) -> None:
    """How the search writes JSON: atomically, compact, keys in the order given, NaN refused."""
    atomic_write_json(path, obj, indent=None, sort_keys=False, allow_nan=False)
