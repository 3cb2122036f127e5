"""The phrase task: write a short phrase under rules that cannot all be kept at once.

Each problem lists ``n_keywords`` words to use, a banned letter, a word limit, a closing mark,
and ``n_favourites`` candidate words one of which is the reader's secret favourite::

    Write a short phrase.
    Rules:
    - at most 3 words;
    - use the words: river, maple, stone;
    - no word may contain the letter "e";
    - end with "!".
    Bonus: the reader has one secret favourite word among: moon, drum, owl. Using it earns a bonus.

Reward vector (d = 5, all in [0, 1], all zeros for an answer without a word):

* ``keywords``: fraction of the listed words the answer uses (whole words, any case);
* ``brevity``: 1 within the word limit, minus ``1 / length_slack`` per word beyond it;
* ``lipogram``: 1 minus ``1 / lipogram_tolerance`` per word containing the banned letter;
* ``ending``: 1 when the answer ends with the closing mark;
* ``favourite``: 1 when the answer uses the secret favourite (hidden: the row holds it, the
  prompt does not; it is uniform over the candidates, drawn independently of everything shown).

Conflict by construction: ``n_conflicting`` keywords contain the banned letter (keywords vs
lipogram), and the word limit is ``n_keywords + extra_words``, so with the default
``extra_words=0`` using every keyword leaves no room for a favourite (keywords and favourite vs
brevity). No answer scores 1 on every dimension (checked for every generated problem).

Room for sets: the favourite is hidden, so one answer names one or two candidates and gambles;
k answers naming different candidates cover them all. With the defaults the prompt-only oracle
(:func:`hedge_curve`) is 0.80 at k = 1 and 0.93 at k = 3, the full-information best. Weightings
other than the mean prefer other answers (e.g. every keyword, banned letter or not), which is
what E_w[best@k] rewards. Scoring is a regex and a few set lookups.

The deployment scalar is the mean of the five (``VectorReward.w_star``).
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
import string
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vpo import metrics
from vpo.rewards import VectorReward
from vpo.tasks import DrawnTask, register_task

__all__ = [
    "NAMES",
    "PhraseReward",
    "PhraseTask",
    "best_scalar",
    "class_answers",
    "generate_problem",
    "hedge_curve",
    "hedge_values",
    "make_phrase_task",
    "phrase_vector",
]

NAMES = ("keywords", "brevity", "lipogram", "ending", "favourite")
MARKS = ("!", "?", ".")
BANNED = "aeilnorst"
FILLER = "my"  # contains no letter of BANNED: the oracle's one-word answer without listed words
SYSTEM_PROMPT = ("You write very short phrases. Follow the rules as well as you can; when rules conflict, "
                 "decide which one to break.")
WORDS = (
    "acorn", "anchor", "apple", "bamboo", "basket", "bell", "bottle", "bread", "button", "cactus", "candle",
    "carpet", "castle", "chair", "cherry", "cloud", "coin", "cookie", "desert", "dolphin", "dragon", "drum",
    "engine", "falcon", "feather", "fish", "forest", "frog", "garden", "glacier", "goat", "guitar",
    "hammer", "harbor", "hill", "honey", "horse", "igloo", "insect", "island", "jacket", "jungle", "kettle",
    "kite", "koala", "ladder", "lamp", "lantern", "leaf", "lemon", "lizard", "magnet", "maple", "meadow",
    "milk", "mirror", "moon", "muffin", "needle", "nest", "noodle", "nugget", "olive", "orange", "owl",
    "oyster", "parrot", "pencil", "pepper", "piano", "pillow", "planet", "pond", "quartz", "quilt",
    "rabbit", "rainbow", "ring", "river", "robot", "rocket", "saddle", "ship", "shovel", "sock", "star",
    "stone", "sugar", "sunset", "tent", "tiger", "tomato", "train", "tunnel", "turtle", "umbrella",
    "valley", "velvet", "violin", "wagon", "wallet", "walrus", "whale", "window", "wolf", "yarn", "yogurt",
    "zebra"
)
_WORD_RE = re.compile(r"[A-Za-z]+(?:'[A-Za-z]+)?")


def words_of(answer: str) -> list[str]:
    """The answer's words, lower-cased (letters with an optional apostrophe part)."""
    return [w.lower() for w in _WORD_RE.findall(answer)]


def phrase_vector(answer: str, row: Mapping[str, Any], length_slack: int = 2, lipogram_tolerance: int = 2,
                  ) -> np.ndarray:
    """Reward vector [keywords, brevity, lipogram, ending, favourite] of one answer for ``row``."""
    words = words_of(answer)
    if not words:
        return np.zeros(len(NAMES))
    used = set(words)
    keywords = list(row["keywords"])
    banned = str(row["banned"])
    n_over = max(0, len(words) - int(row["max_words"]))
    n_banned = sum(banned in w for w in words)
    return np.array([
        sum(k in used for k in keywords) / len(keywords),
        max(0.0, 1.0 - n_over / length_slack),
        max(0.0, 1.0 - n_banned / lipogram_tolerance),
        1.0 if answer.rstrip().endswith(str(row["mark"])) else 0.0,
        1.0 if str(row["favourite"]) in used else 0.0,
    ])


class PhraseReward(VectorReward):
    """Vector reward of the phrase task (see the module docstring for the five dimensions)."""

    names = NAMES

    def __init__(self, length_slack: int = 2, lipogram_tolerance: int = 2) -> None:
        if length_slack < 1 or lipogram_tolerance < 1:
            raise ValueError(f"length_slack and lipogram_tolerance must be >= 1, got {length_slack}, "
                             f"{lipogram_tolerance}")
        self.length_slack, self.lipogram_tolerance = int(length_slack), int(lipogram_tolerance)

    def score(self, answers: Sequence[str], row: Mapping[str, Any]) -> np.ndarray:
        """Score each answer for problem ``row``; shape (len(answers), 5)."""
        out = np.zeros((len(answers), len(NAMES)))
        for i, ans in enumerate(answers):
            out[i] = phrase_vector(ans, row, self.length_slack, self.lipogram_tolerance)
        return out

    def dedup_key(self, answer: str) -> str:
        """Two answers are the same answer when their words (case-folded) and closing character are."""
        stripped = answer.rstrip()
        return " ".join(words_of(answer)) + "|" + stripped[-1:]


# --------------------------------------------------------------------------------------------
# problems


def generate_problem(rng: random.Random, n_keywords: int = 3, n_conflicting: int = 1, n_favourites: int = 3,
                     extra_words: int = 0) -> dict[str, Any]:
    """Draw one problem: banned letter, keywords (``n_conflicting`` of them containing it),
    favourite candidates (none containing it), word limit, closing mark, and the hidden favourite."""
    for _ in range(100):
        banned = rng.choice(BANNED)
        dirty = [w for w in WORDS if banned in w]
        clean = [w for w in WORDS if banned not in w]
        if len(dirty) >= n_conflicting and len(clean) >= n_keywords - n_conflicting + n_favourites:
            break
    else:  # pragma: no cover - the word list has enough of both for every letter in BANNED
        raise RuntimeError("could not draw a phrase problem")
    picked = rng.sample(clean, n_keywords - n_conflicting + n_favourites)
    keywords = rng.sample(dirty, n_conflicting) + picked[: n_keywords - n_conflicting]
    rng.shuffle(keywords)
    favourites = picked[n_keywords - n_conflicting:]
    row = {
        "keywords": keywords,
        "banned": banned,
        "favourites": favourites,
        "max_words": n_keywords + extra_words,
        "mark": rng.choice(MARKS),
        "favourite": rng.choice(favourites),
    }
    row["prompt"] = problem_text(row)
    return row


def problem_text(row: Mapping[str, Any]) -> str:
    """The rules as the user sees them (the hidden favourite is not in it)."""
    return "\n".join([
        "Write a short phrase.",
        "Rules:",
        f"- at most {row['max_words']} words;",
        f"- use the words: {', '.join(row['keywords'])};",
        f"- no word may contain the letter \"{row['banned']}\";",
        f"- end with \"{row['mark']}\".",
        f"Bonus: the reader has one secret favourite word among: {', '.join(row['favourites'])}. Using it earns "
        + "a bonus.",
    ])


# --------------------------------------------------------------------------------------------
# oracles: an answer is characterised by which listed words it uses; extra words never help


def class_answers(row: Mapping[str, Any]) -> list[str]:
    """One answer per subset of the listed words (keywords and candidates), with the right mark:
    every reward vector an answer can reach is reached (or beaten) by one of these."""
    listed = list(row["keywords"]) + list(row["favourites"])
    out = []
    for r in range(len(listed) + 1):
        for subset in itertools.combinations(listed, r):
            out.append(" ".join(subset or (FILLER,)) + str(row["mark"]))
    return out


def _scalars(row: Mapping[str, Any], reward: PhraseReward) -> tuple[list[str], np.ndarray]:
    """(answers, scal): scal[i, o] is the mean scalar of class answer i when the favourite is
    candidate o (uniform over the candidates given the prompt)."""
    answers = class_answers(row)
    w = reward.w_star()
    scal = np.stack([reward.score(answers, {**row, "favourite": f}) @ w for f in row["favourites"]], axis=1)
    return answers, scal


def best_scalar(row: Mapping[str, Any], length_slack: int = 2, lipogram_tolerance: int = 2) -> float:
    """Full information (the favourite known): the best mean scalar any answer reaches."""
    reward = PhraseReward(length_slack, lipogram_tolerance)
    return float((reward.score(class_answers(row), row) @ reward.w_star()).max())


def hedge_values(row: Mapping[str, Any], k_max: int = 3, length_slack: int = 2, lipogram_tolerance: int = 2,
                 ) -> list[float]:
    """Exact prompt-only best expected best-of-k mean scalar for k = 1..k_max (k_max <= 3): the
    best a k-answer policy can do without knowing the favourite."""
    _, scal = _scalars(row, PhraseReward(length_slack, lipogram_tolerance))
    scal = np.unique(scal, axis=0)
    return metrics.hedge_values(scal, np.full(scal.shape[1], 1.0 / scal.shape[1]), k_max)


def hedge_curve(row: Mapping[str, Any], k_max: int = 10, length_slack: int = 2, lipogram_tolerance: int = 2,
                ) -> list[float]:
    """Greedy prompt-only best-of-k for k = 1..k_max (add the answer raising the expected best
    mean scalar most; within 1 - 1/e of the optimum, exact at k = 1)."""
    _, scal = _scalars(row, PhraseReward(length_slack, lipogram_tolerance))
    return metrics.greedy_hedge_curve(scal, np.full(scal.shape[1], 1.0 / scal.shape[1]), k_max)


# --------------------------------------------------------------------------------------------
# the task


class PhraseTask(DrawnTask):
    """Seeded phrase problems with disjoint train/test splits, demonstrations and oracles."""

    name = "phrase"
    system_prompt = SYSTEM_PROMPT
    full_information_oracle = "best single phrase knowing the secret favourite"

    def __init__(self, *, n_train: int = 500, n_test: int = 50, seed: int = 0, n_keywords: int = 3,
                 n_conflicting: int = 1, n_favourites: int = 3, extra_words: int = 0, length_slack: int = 2,
                 lipogram_tolerance: int = 2) -> None:
        if n_train < 0 or n_test < 1:
            raise ValueError(f"need n_train >= 0 and n_test >= 1, got {n_train} and {n_test}")
        if n_keywords < 1 or not 0 <= n_conflicting <= n_keywords:
            raise ValueError(f"need n_keywords >= 1 and 0 <= n_conflicting <= n_keywords, got {n_keywords}, "
                             f"{n_conflicting}")
        if n_favourites < 1 or extra_words < 0:
            raise ValueError(f"need n_favourites >= 1 and extra_words >= 0, got {n_favourites}, {extra_words}")
        self.n_train, self.n_test, self.seed = int(n_train), int(n_test), int(seed)
        self.n_keywords, self.n_conflicting = int(n_keywords), int(n_conflicting)
        self.n_favourites, self.extra_words = int(n_favourites), int(extra_words)
        self.reward = PhraseReward(length_slack, lipogram_tolerance)
        self._splits: dict[str, list[dict[str, Any]]] = {}

    @property
    def params(self) -> dict[str, Any]:
        """The generator parameters (JSON-serialisable), e.g. for run manifests."""
        return {"n_train": self.n_train, "n_test": self.n_test, "seed": self.seed, "n_keywords": self.n_keywords,
                "n_conflicting": self.n_conflicting, "n_favourites": self.n_favourites,
                "extra_words": self.extra_words, "length_slack": self.reward.length_slack,
                "lipogram_tolerance": self.reward.lipogram_tolerance}

    @property
    def charset(self) -> str:
        """Every character prompts and demonstrations can contain (for a char-level tokenizer)."""
        return "".join(sorted(set(string.printable) - set("\t\r\x0b\x0c")))

    def _draw(self, split: str, n: int, exclude: set[str]) -> list[dict[str, Any]]:
        digest = hashlib.sha256(f"phrase:{self.seed}:{split}".encode()).digest()
        rng = random.Random(int.from_bytes(digest[:8], "big"))
        rows: list[dict[str, Any]] = []
        seen = set(exclude)
        for _ in range(100 * n + 100):
            if len(rows) == n:
                break
            prob = generate_problem(rng, self.n_keywords, self.n_conflicting, self.n_favourites, self.extra_words)
            if prob["prompt"] in seen:  # no two problems share a prompt, within or across splits
                continue
            seen.add(prob["prompt"])
            rows.append({"id": f"phrase-{split}-{self.seed}-{len(rows):05d}", **prob})
        if len(rows) < n:
            raise RuntimeError(f"could only draw {len(rows)} distinct {split} problems of {n}")
        return rows

    def demonstration(self, row: Mapping[str, Any], m: int, rng: random.Random) -> str:
        """A supervised target: m distinct plausible answers (random subsets of the listed words,
        sometimes a candidate, sometimes a filler word), blind to the favourite, in numbered tags."""
        answers: list[str] = []
        keys: set[str] = set()
        for _ in range(50 * m):
            ans = demo_answer(row, rng)
            if self.reward.dedup_key(ans) not in keys:
                keys.add(self.reward.dedup_key(ans))
                answers.append(ans)
            if len(answers) == m:
                break
        tag = self.reward.answer_tag
        return "".join(f"<{tag}_{i}>{a}</{tag}_{i}>" for i, a in enumerate(answers, start=1))

    def reference_answers(self, row: Mapping[str, Any]) -> list[str]:
        """For each candidate, the best answer were it the favourite (together: the hedge set)."""
        answers = class_answers(row)
        out = []
        for f in row["favourites"]:
            scal = self.reward.score(answers, {**row, "favourite": f}) @ self.reward.w_star()
            best = answers[int(scal.argmax())]
            if best not in out:
                out.append(best)
        return out

    def is_pass(self, vector: Sequence[float]) -> bool:
        """pass@k's "pass": every hard rule kept (brevity, lipogram, ending) and the favourite used."""
        v = np.asarray(vector, dtype=np.float64)
        return bool(np.all(v[1:] >= 1.0))

    def best_scalar(self, row: Mapping[str, Any]) -> float:
        """Full-information oracle: the best mean scalar knowing the favourite."""
        return best_scalar(row, self.reward.length_slack, self.reward.lipogram_tolerance)

    def hedge_values(self, row: Mapping[str, Any], k_max: int = 3) -> list[float]:
        """Prompt-only oracle, exact for k = 1..k_max <= 3 (see :func:`hedge_values`)."""
        return hedge_values(row, k_max, self.reward.length_slack, self.reward.lipogram_tolerance)

    def hedge_curve(self, row: Mapping[str, Any], k_max: int = 10) -> list[float]:
        """Prompt-only greedy best-of-k for k = 1..k_max (see :func:`hedge_curve`)."""
        return hedge_curve(row, k_max, self.reward.length_slack, self.reward.lipogram_tolerance)


def demo_answer(row: Mapping[str, Any], rng: random.Random) -> str:
    """One plausible answer for the supervised mixture: each keyword with probability 0.6, a
    random candidate with probability 0.6, a filler word now and then, the right mark mostly."""
    words = [k for k in row["keywords"] if rng.random() < 0.6]
    if rng.random() < 0.6:
        words.insert(rng.randint(0, len(words)), rng.choice(list(row["favourites"])))
    if not words or rng.random() < 0.15:
        words.insert(rng.randint(0, len(words)), rng.choice(("my", "big", "and", "with", "the")))
    text = " ".join(words)
    mark = str(row["mark"]) if rng.random() < 0.9 else rng.choice(MARKS)
    return text[0].upper() + text[1:] + mark


@register_task("phrase")
def make_phrase_task(*, n_train: int = 500, n_test: int = 50, seed: int = 0, n_keywords: int = 3,
                     n_conflicting: int = 1, n_favourites: int = 3, extra_words: int = 0, length_slack: int = 2,
                     lipogram_tolerance: int = 2) -> PhraseTask:
    """Factory for the registry: ``get_task("phrase", n_train=500, n_keywords=3, ...)``."""
    return PhraseTask(n_train=n_train, n_test=n_test, seed=seed, n_keywords=n_keywords,
                      n_conflicting=n_conflicting, n_favourites=n_favourites, extra_words=extra_words,
                      length_slack=length_slack, lipogram_tolerance=lipogram_tolerance)
