"""Builds ``problems.jsonl``, the embedded code task: 48 problems written for this project.

Each problem has a short ASCII statement, one or more reference solutions (several problems
have two or three solutions with genuinely different strategies, used for demonstrations and
to cross-check each other), and deterministic tests whose expected outputs are computed here by
running the first reference; every other reference must agree on every test.

    python -m vpo.data.code.build            # rewrite problems.jsonl next to this file
    python -m vpo.data.code.build --check    # exit 1 if problems.jsonl is out of date
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("problems.jsonl")


@dataclass
class Problem:
    id: str
    title: str
    statement: str
    solutions: dict[str, str]
    gen: Callable[[random.Random], list[Any]]  # stdio: input strings; call: argument lists
    entry_point: str | None = None
    starter: str = ""
    difficulty: str = "easy"
    tags: list[str] = field(default_factory=list)


P: list[Problem] = []


def stdio(id: str, title: str, statement: str, solutions: dict[str, str], gen: Callable[[random.Random], list[str]],
          difficulty: str = "easy", tags: tuple[str, ...] = ()) -> None:
    P.append(Problem(id, title, statement.strip(), {k: v.strip() + "\n" for k, v in solutions.items()}, gen,
                     difficulty=difficulty, tags=list(tags)))


def call(id: str, title: str, statement: str, entry: str, starter: str, solutions: dict[str, str],
         gen: Callable[[random.Random], list[list[Any]]], difficulty: str = "easy", tags: tuple[str, ...] = ()) -> None:
    P.append(Problem(id, title, statement.strip(), {k: v.strip() + "\n" for k, v in solutions.items()}, gen,
                     entry_point=entry, starter=starter.strip() + "\n", difficulty=difficulty, tags=list(tags)))


def ints(r: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [r.randint(lo, hi) for _ in range(n)]


def line(xs: list[Any]) -> str:
    return " ".join(map(str, xs))


def _matrix_text(r: random.Random, rows: int, cols: int) -> str:
    return f"{rows} {cols}\n" + "".join(line(ints(r, cols, -9, 99)) + "\n" for _ in range(rows))


def _word_lines(words: list[str]) -> str:
    return f"{len(words)}\n" + "".join(w + "\n" for w in words)


def _bit_grid(r: random.Random, h: int, w: int) -> str:
    return f"{h} {w}\n" + "".join("".join(r.choice("0001") for _ in range(w)) + "\n" for _ in range(h))


def _knapsack_text(r: random.Random, n: int) -> str:
    return f"{n} {r.randint(1, 60)}\n" + "".join(f"{r.randint(1, 20)} {r.randint(1, 50)}\n" for _ in range(n))


def _intervals_text(r: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        a = r.randint(0, 40)
        out.append(f"{a} {a + r.randint(0, 6)}\n")
    return f"{n}\n" + "".join(out)


def _matmul_args(r: random.Random, p: int, q: int, k: int) -> list[Any]:
    return [[ints(r, q, -5, 5) for _ in range(p)], [ints(r, k, -5, 5) for _ in range(q)]]


def _search_args(r: random.Random, xs: list[int]) -> list[Any]:
    return [xs, r.choice([*xs, 1000])]


# ============================================================================ stdin/stdout problems

stdio("sum-of-list", "Sum of a list", """
The first line contains n (1 <= n <= 1000). The second line contains n integers between -10^9 and 10^9.
Print their sum.
""", {
    "builtin": "n = int(input())\nprint(sum(map(int, input().split())))",
    "loop": "n = int(input())\ntotal = 0\nfor x in input().split():\n    total += int(x)\nprint(total)",
}, lambda r: ["1\n5\n", "3\n-1 -2 -3\n"] + [f"{n}\n{line(ints(r, n, -10**9, 10**9))}\n" for n in (2, 7, 40, 200, 1000, 13)])

stdio("max-subarray", "Maximum subarray sum", """
Given n integers (1 <= n <= 10^5) on the second line (first line: n), print the largest sum of a
non-empty contiguous subarray.
""", {
    "kadane": """
n = int(input())
a = list(map(int, input().split()))
best = cur = a[0]
for x in a[1:]:
    cur = max(x, cur + x)
    best = max(best, cur)
print(best)
""",
    "prefix-min": """
n = int(input())
a = list(map(int, input().split()))
best = a[0]
prefix = 0
low = 0
for x in a:
    prefix += x
    best = max(best, prefix - low)
    low = min(low, prefix)
print(best)
""",
}, lambda r: ["1\n-5\n", "5\n-2 1 -3 4 -1\n", "4\n-1 -2 -3 -4\n"]
   + [f"{n}\n{line(ints(r, n, -100, 100))}\n" for n in (3, 10, 50, 500, 5000)], "medium", ("dp",))

stdio("count-primes", "Count primes", """
Read an integer n (0 <= n <= 10^6). Print how many prime numbers are <= n.
""", {
    "sieve": """
n = int(input())
if n < 2:
    print(0)
else:
    s = bytearray([1]) * (n + 1)
    s[0] = s[1] = 0
    i = 2
    while i * i <= n:
        if s[i]:
            s[i * i::i] = bytearray(len(s[i * i::i]))
        i += 1
    print(sum(s))
""",
    "trial-division": """
n = int(input())
primes = []
for k in range(2, n + 1):
    ok = True
    for p in primes:
        if p * p > k:
            break
        if k % p == 0:
            ok = False
            break
    if ok:
        primes.append(k)
print(len(primes))
""",
}, lambda r: ["0\n", "1\n", "2\n", "10\n", "100\n", "9973\n", "30000\n", str(r.randint(1000, 5000)) + "\n"], "easy", ("math",))

stdio("reverse-words", "Reverse the words", """
Read one line of words separated by single spaces. Print the words in reverse order, separated by single spaces.
""", {
    "split": "print(' '.join(input().split()[::-1]))",
    "stack": "words = input().split()\nout = []\nwhile words:\n    out.append(words.pop())\nprint(' '.join(out))",
}, lambda r: ["hello\n", "a b\n", "the quick brown fox\n"]
   + [" ".join(r.choice(["alpha", "beta", "gamma", "delta", "x", "yy"]) for _ in range(r.randint(2, 12))) + "\n" for _ in range(5)])

stdio("palindrome", "Palindrome check", """
Read one line. Ignoring case and every character that is not a letter or digit, print YES if it
reads the same backwards, otherwise NO.
""", {
    "filter": "s = [c.lower() for c in input() if c.isalnum()]\nprint('YES' if s == s[::-1] else 'NO')",
    "two-pointers": """
s = input()
i, j = 0, len(s) - 1
ok = True
while i < j:
    if not s[i].isalnum():
        i += 1
    elif not s[j].isalnum():
        j -= 1
    elif s[i].lower() != s[j].lower():
        ok = False
        break
    else:
        i += 1
        j -= 1
print('YES' if ok else 'NO')
""",
}, lambda r: ["A man, a plan, a canal: Panama\n", "race a car\n", "x\n", "ab\n", "Was it a car or a cat I saw?\n",
              "No lemon, no melon\n", "12321\n", "123 21\n", "abcdba\n"])

stdio("fibonacci-mod", "Fibonacci modulo", """
Read n (0 <= n <= 10^6). Print F(n) modulo 1000000007, where F(0) = 0, F(1) = 1 and F(k) = F(k-1) + F(k-2).
""", {
    "iterative": "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, (a + b) % 1000000007\nprint(a)",
    "fast-doubling": """
M = 1000000007
def fib(n):
    if n == 0:
        return (0, 1)
    a, b = fib(n // 2)
    c = a * ((2 * b - a) % M) % M
    d = (a * a + b * b) % M
    return (d, (c + d) % M) if n % 2 else (c, d)
print(fib(int(input()))[0])
""",
    "matrix": """
M = 1000000007
def mul(x, y):
    return [[(x[0][0] * y[0][0] + x[0][1] * y[1][0]) % M, (x[0][0] * y[0][1] + x[0][1] * y[1][1]) % M],
            [(x[1][0] * y[0][0] + x[1][1] * y[1][0]) % M, (x[1][0] * y[0][1] + x[1][1] * y[1][1]) % M]]
n = int(input())
result = [[1, 0], [0, 1]]
base = [[1, 1], [1, 0]]
while n:
    if n & 1:
        result = mul(result, base)
    base = mul(base, base)
    n >>= 1
print(result[0][1])
""",
}, lambda r: ["0\n", "1\n", "2\n", "10\n", "50\n", "90\n", "1000\n", str(r.randint(10**4, 10**5)) + "\n"], "medium", ("math", "dp"))

stdio("gcd-lcm", "GCD and LCM", """
Read two positive integers a and b (at most 10^12) on one line. Print gcd(a, b) and lcm(a, b) separated by a space.
""", {
    "math": "import math\na, b = map(int, input().split())\ng = math.gcd(a, b)\nprint(g, a // g * b)",
    "euclid": "a, b = map(int, input().split())\nx, y = a, b\nwhile y:\n    x, y = y, x % y\nprint(x, a * b // x)",
}, lambda r: ["1 1\n", "12 18\n", "7 13\n", "1000000000000 999999999999\n"]
   + [f"{r.randint(1, 10**6)} {r.randint(1, 10**6)}\n" for _ in range(5)], "easy", ("math",))

stdio("transpose", "Matrix transpose", """
The first line has r and c (1 <= r, c <= 50). Then r lines follow with c integers each. Print the
transposed matrix: c lines with r integers each, separated by spaces.
""", {
    "zip": "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor row in zip(*m):\n    print(' '.join(row))",
    "index": "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor j in range(c):\n    print(' '.join(m[i][j] for i in range(r)))",
}, lambda r: ["1 1\n5\n", "2 3\n1 2 3\n4 5 6\n"]
   + [_matrix_text(r, r.randint(1, 6), r.randint(1, 6)) for _ in range(5)])

stdio("anagram-groups", "Anagram groups", """
The first line has n (1 <= n <= 1000), then n lowercase words, one per line. Print the number of
groups of words that are anagrams of each other (every word belongs to exactly one group).
""", {
    "sorted-key": "n = int(input())\nprint(len({''.join(sorted(input().strip())) for _ in range(n)}))",
    "count-key": """
from collections import Counter
n = int(input())
groups = set()
for _ in range(n):
    groups.add(tuple(sorted(Counter(input().strip()).items())))
print(len(groups))
""",
}, lambda r: ["1\nabc\n", "3\nlisten\nsilent\nenlist\n", "4\nab\nba\nabc\ncab\n"]
   + [_word_lines(["".join(r.sample("abcde", r.randint(1, 4))) for _ in range(r.randint(2, 30))]) for _ in range(5)],
   "easy", ("hashing",))

stdio("grid-path", "Shortest path in a grid", """
The first line has h and w (1 <= h, w <= 100). Then h lines of w characters: '.' free, '#' wall,
'S' start, 'E' exit (exactly one of each). Moving up, down, left or right onto free cells, print
the minimum number of moves from S to E, or -1 if E cannot be reached.
""", {
    "bfs": """
from collections import deque
h, w = map(int, input().split())
g = [input() for _ in range(h)]
for i in range(h):
    for j in range(w):
        if g[i][j] == 'S':
            s = (i, j)
dist = {s: 0}
q = deque([s])
ans = -1
while q:
    i, j = q.popleft()
    if g[i][j] == 'E':
        ans = dist[(i, j)]
        break
    for di, dj in ((1, 0), (-1, 0), (0, 1), (0, -1)):
        a, b = i + di, j + dj
        if 0 <= a < h and 0 <= b < w and g[a][b] != '#' and (a, b) not in dist:
            dist[(a, b)] = dist[(i, j)] + 1
            q.append((a, b))
print(ans)
""",
    "layered-sets": """
h, w = map(int, input().split())
g = [input() for _ in range(h)]
cells = {(i, j): g[i][j] for i in range(h) for j in range(w)}
start = next(p for p, ch in cells.items() if ch == 'S')
seen = {start}
frontier = {start}
steps = 0
ans = -1
while frontier:
    if any(cells[p] == 'E' for p in frontier):
        ans = steps
        break
    nxt = set()
    for i, j in frontier:
        for p in ((i + 1, j), (i - 1, j), (i, j + 1), (i, j - 1)):
            if p in cells and cells[p] != '#' and p not in seen:
                seen.add(p)
                nxt.add(p)
    frontier = nxt
    steps += 1
print(ans)
""",
}, lambda r: ["1 2\nSE\n", "3 3\nS#E\n.#.\n...\n", "3 3\nS#E\n##.\n...\n"] + [_grid(r, r.randint(3, 9), r.randint(3, 9)) for _ in range(6)],
   "medium", ("graphs", "bfs"))


def _grid(r: random.Random, h: int, w: int) -> str:
    g = [["#" if r.random() < 0.25 else "." for _ in range(w)] for _ in range(h)]
    cells = [(i, j) for i in range(h) for j in range(w)]
    (si, sj), (ei, ej) = r.sample(cells, 2)
    g[si][sj], g[ei][ej] = "S", "E"
    return f"{h} {w}\n" + "".join("".join(row) + "\n" for row in g)


stdio("coin-change", "Fewest coins", """
The first line has n and t (1 <= n <= 20, 0 <= t <= 10^4). The second line has n distinct positive
coin values. Using each coin value any number of times, print the fewest coins that sum exactly to t,
or -1 if that is impossible.
""", {
    "dp": """
n, t = map(int, input().split())
coins = list(map(int, input().split()))
INF = float('inf')
best = [0] + [INF] * t
for v in range(1, t + 1):
    for c in coins:
        if c <= v and best[v - c] + 1 < best[v]:
            best[v] = best[v - c] + 1
print(best[t] if best[t] != INF else -1)
""",
    "bfs": """
from collections import deque
n, t = map(int, input().split())
coins = list(map(int, input().split()))
dist = {0: 0}
q = deque([0])
while q:
    v = q.popleft()
    if v == t:
        break
    for c in coins:
        u = v + c
        if u <= t and u not in dist:
            dist[u] = dist[v] + 1
            q.append(u)
print(dist.get(t, -1))
""",
}, lambda r: ["1 0\n5\n", "3 11\n1 2 5\n", "1 3\n2\n", "2 7\n2 4\n"]
   + [f"{n} {r.randint(0, 300)}\n{line(r.sample(range(1, 40), n))}\n" for n in (2, 3, 4, 5, 6)], "medium", ("dp",))

stdio("lis-length", "Longest increasing subsequence", """
The first line has n (1 <= n <= 10^4), the second n integers. Print the length of the longest
strictly increasing subsequence.
""", {
    "quadratic-dp": """
n = int(input())
a = list(map(int, input().split()))
best = [1] * n
for i in range(n):
    for j in range(i):
        if a[j] < a[i] and best[j] + 1 > best[i]:
            best[i] = best[j] + 1
print(max(best))
""",
    "patience": """
from bisect import bisect_left
n = int(input())
tails = []
for x in map(int, input().split()):
    k = bisect_left(tails, x)
    if k == len(tails):
        tails.append(x)
    else:
        tails[k] = x
print(len(tails))
""",
}, lambda r: ["1\n7\n", "6\n10 9 2 5 3 7\n", "5\n1 1 1 1 1\n", "5\n5 4 3 2 1\n"]
   + [f"{n}\n{line(ints(r, n, 0, 50))}\n" for n in (8, 20, 100, 400)], "medium", ("dp", "binary-search"))

stdio("balanced-brackets", "Balanced brackets", """
Read one line made of the characters ()[]{}. Print YES if the brackets are balanced and properly nested, otherwise NO.
""", {
    "stack": """
s = input().strip()
pairs = {')': '(', ']': '[', '}': '{'}
st = []
ok = True
for c in s:
    if c in '([{':
        st.append(c)
    elif not st or st.pop() != pairs[c]:
        ok = False
        break
print('YES' if ok and not st else 'NO')
""",
    "replace": """
s = input().strip()
prev = None
while prev != s:
    prev = s
    s = s.replace('()', '').replace('[]', '').replace('{}', '')
print('YES' if not s else 'NO')
""",
}, lambda r: ["()\n", "([]{})\n", "(]\n", "((\n", "{[()()]}\n", "}{\n", "([)]\n"]
   + ["".join(r.choice("()[]{}") for _ in range(r.randint(2, 12))) + "\n" for _ in range(4)], "easy", ("stack",))

stdio("run-length-encode", "Run-length encoding", """
Read a non-empty string of lowercase letters. Replace every maximal run of equal letters by the
letter followed by the run length, and print the result (for example aaabcc becomes a3b1c2).
""", {
    "groupby": "from itertools import groupby\nprint(''.join(k + str(len(list(g))) for k, g in groupby(input().strip())))",
    "scan": """
s = input().strip()
out = []
i = 0
while i < len(s):
    j = i
    while j < len(s) and s[j] == s[i]:
        j += 1
    out.append(s[i] + str(j - i))
    i = j
print(''.join(out))
""",
}, lambda r: ["a\n", "aaabcc\n", "abc\n", "zzzzzzzzzzzz\n"] + ["".join(r.choice("ab") * r.randint(1, 4) for _ in range(r.randint(1, 8))) + "\n" for _ in range(5)])

stdio("islands", "Number of islands", """
The first line has h and w (1 <= h, w <= 200), then h lines of w characters '1' (land) or '0'
(water). Land cells that touch horizontally or vertically form one island. Print the number of islands.
""", {
    "dfs": """
h, w = map(int, input().split())
g = [list(input().strip()) for _ in range(h)]
count = 0
for i in range(h):
    for j in range(w):
        if g[i][j] == '1':
            count += 1
            stack = [(i, j)]
            g[i][j] = '0'
            while stack:
                a, b = stack.pop()
                for x, y in ((a + 1, b), (a - 1, b), (a, b + 1), (a, b - 1)):
                    if 0 <= x < h and 0 <= y < w and g[x][y] == '1':
                        g[x][y] = '0'
                        stack.append((x, y))
print(count)
""",
    "union-find": """
h, w = map(int, input().split())
g = [input().strip() for _ in range(h)]
parent = {}
def find(x):
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x
for i in range(h):
    for j in range(w):
        if g[i][j] == '1':
            parent[(i, j)] = (i, j)
for i in range(h):
    for j in range(w):
        if g[i][j] == '1':
            for x, y in ((i + 1, j), (i, j + 1)):
                if x < h and y < w and g[x][y] == '1':
                    parent[find((i, j))] = find((x, y))
print(len({find(p) for p in parent}))
""",
}, lambda r: ["1 1\n0\n", "1 1\n1\n", "3 3\n110\n010\n001\n"]
   + [_bit_grid(r, r.randint(2, 10), r.randint(2, 10)) for _ in range(6)], "medium", ("graphs",))

stdio("binary-ones", "Binary and its ones", """
Read a non-negative integer n (n <= 10^18). Print its binary representation (without leading zeros;
0 prints as 0) and, on the next line, the number of 1 bits.
""", {
    "format": "n = int(input())\nb = format(n, 'b')\nprint(b)\nprint(b.count('1'))",
    "division": """
n = int(input())
digits = []
m = n
while m:
    digits.append(str(m % 2))
    m //= 2
b = ''.join(reversed(digits)) or '0'
print(b)
print(digits.count('1'))
""",
}, lambda r: ["0\n", "1\n", "2\n", "255\n", "1000000000000000000\n"] + [f"{r.randint(0, 10**12)}\n" for _ in range(4)])

stdio("two-sum-indices", "Two sum", """
The first line has n and t (2 <= n <= 10^5). The second line has n integers. Exactly one pair of
positions i < j has a[i] + a[j] = t. Print i and j (1-based), separated by a space.
""", {
    "hash": """
n, t = map(int, input().split())
a = list(map(int, input().split()))
seen = {}
for j, x in enumerate(a):
    if t - x in seen:
        print(seen[t - x] + 1, j + 1)
        break
    seen.setdefault(x, j)
""",
    "sort-two-pointers": """
n, t = map(int, input().split())
a = list(map(int, input().split()))
order = sorted(range(n), key=lambda k: a[k])
i, j = 0, n - 1
while i < j:
    s = a[order[i]] + a[order[j]]
    if s == t:
        p, q = sorted((order[i], order[j]))
        print(p + 1, q + 1)
        break
    if s < t:
        i += 1
    else:
        j -= 1
""",
}, lambda r: ["2 5\n2 3\n", "4 9\n2 7 11 15\n"] + [_two_sum(r, n) for n in (3, 6, 10, 40, 100)], "easy", ("hashing",))


def _two_sum(r: random.Random, n: int) -> str:
    while True:
        a = r.sample(range(1, 1000), n)
        i, j = sorted(r.sample(range(n), 2))
        t = a[i] + a[j]
        pairs = [(p, q) for p in range(n) for q in range(p + 1, n) if a[p] + a[q] == t]
        if len(pairs) == 1:
            return f"{n} {t}\n{line(a)}\n"


stdio("average", "Average", """
The first line has n (1 <= n <= 1000), the second n integers. Print their average with at least 6
digits after the decimal point (answers within 1e-6 are accepted).
""", {
    "fixed": "n = int(input())\na = list(map(int, input().split()))\nprint(f'{sum(a) / n:.6f}')",
    "statistics": "import statistics\ninput()\nprint('%.9f' % statistics.fmean(map(int, input().split())))",
}, lambda r: ["1\n7\n", "3\n1 2 2\n", "2\n-1 2\n"] + [f"{n}\n{line(ints(r, n, -1000, 1000))}\n" for n in (5, 17, 300)], "easy", ("float",))

stdio("triangle-area", "Triangle area", """
Read six integers x1 y1 x2 y2 x3 y3 (absolute values at most 10^4): the corners of a triangle.
Print its area (answers within 1e-6 are accepted).
""", {
    "shoelace": "x1, y1, x2, y2, x3, y3 = map(int, input().split())\nprint(abs((x2 - x1) * (y3 - y1) - (x3 - x1) * (y2 - y1)) / 2)",
    "heron": """
import math
x1, y1, x2, y2, x3, y3 = map(int, input().split())
a = math.dist((x1, y1), (x2, y2))
b = math.dist((x2, y2), (x3, y3))
c = math.dist((x3, y3), (x1, y1))
s = (a + b + c) / 2
print('%.6f' % math.sqrt(max(0.0, s * (s - a) * (s - b) * (s - c))))
""",
}, lambda r: ["0 0 1 0 0 1\n", "0 0 4 0 0 3\n", "1 1 2 2 3 3\n"] + [line(ints(r, 6, -50, 50)) + "\n" for _ in range(5)], "easy", ("geometry", "float"))

stdio("knapsack", "0/1 knapsack", """
The first line has n and W (1 <= n <= 100, 0 <= W <= 10^4). Each of the next n lines has a weight
and a value (positive integers). Each item can be taken at most once. Print the largest total value
with total weight at most W.
""", {
    "table": """
n, W = map(int, input().split())
best = [0] * (W + 1)
for _ in range(n):
    w, v = map(int, input().split())
    for cap in range(W, w - 1, -1):
        if best[cap - w] + v > best[cap]:
            best[cap] = best[cap - w] + v
print(best[W])
""",
    "memo": """
import sys
from functools import lru_cache
sys.setrecursionlimit(10000)
n, W = map(int, input().split())
items = [tuple(map(int, input().split())) for _ in range(n)]
@lru_cache(maxsize=None)
def go(i, cap):
    if i == n:
        return 0
    w, v = items[i]
    best = go(i + 1, cap)
    if w <= cap:
        best = max(best, v + go(i + 1, cap - w))
    return best
print(go(0, W))
""",
}, lambda r: ["1 0\n1 5\n", "3 4\n1 1\n3 4\n4 5\n"]
   + [_knapsack_text(r, k) for k in (2, 4, 6, 10, 15)], "medium", ("dp",))

stdio("top-words", "Most frequent words", """
The first line has k. The second line has lowercase words separated by spaces. Print the k most
frequent words, one per line, most frequent first; ties are broken alphabetically. If there are fewer
than k distinct words, print all of them.
""", {
    "sort": """
from collections import Counter
k = int(input())
c = Counter(input().split())
for w, _ in sorted(c.items(), key=lambda p: (-p[1], p[0]))[:k]:
    print(w)
""",
    "heap": """
import heapq
k = int(input())
counts = {}
for w in input().split():
    counts[w] = counts.get(w, 0) + 1
for cnt, w in heapq.nsmallest(k, ((-c, w) for w, c in counts.items())):
    print(w)
""",
}, lambda r: ["1\na\n", "2\nb a b c a b\n", "5\nx y\n"]
   + [f"{r.randint(1, 4)}\n" + " ".join(r.choice(["red", "green", "blue", "cyan", "pink"]) for _ in range(r.randint(3, 25))) + "\n"
      for _ in range(5)], "easy", ("sorting",))

stdio("merge-intervals", "Merge intervals", """
The first line has n (1 <= n <= 10^4). Each of the next n lines has two integers l <= r. Merge all
overlapping or touching intervals ([1, 3] and [3, 5] merge, [1, 2] and [3, 4] do not) and print the
result, one interval per line as "l r", sorted by l.
""", {
    "sort-sweep": """
n = int(input())
iv = sorted(tuple(map(int, input().split())) for _ in range(n))
out = [list(iv[0])]
for l, r in iv[1:]:
    if l <= out[-1][1]:
        out[-1][1] = max(out[-1][1], r)
    else:
        out.append([l, r])
for l, r in out:
    print(l, r)
""",
    "events": """
n = int(input())
ev = []
for _ in range(n):
    l, r = map(int, input().split())
    ev.append((l, 0))
    ev.append((r, 1))
ev.sort()
depth = 0
start = None
for x, kind in ev:
    if kind == 0:
        if depth == 0:
            start = x
        depth += 1
    else:
        depth -= 1
        if depth == 0:
            print(start, x)
""",
}, lambda r: ["1\n1 2\n", "2\n1 3\n3 5\n", "2\n1 2\n3 4\n", "3\n5 6\n1 10\n2 3\n"]
   + [_intervals_text(r, k) for k in (3, 6, 12, 30)], "medium", ("sorting",))

stdio("digital-root", "Digital root", """
Read a non-negative integer n with up to 1000 digits. Repeatedly replace n by the sum of its decimal
digits until it has one digit, and print that digit.
""", {
    "loop": "s = input().strip()\nwhile len(s) > 1:\n    s = str(sum(map(int, s)))\nprint(s)",
    "mod9": "s = input().strip()\nn = sum(map(int, s))\nprint(0 if n == 0 else 1 + (n - 1) % 9)",
}, lambda r: ["0\n", "9\n", "38\n", "99999\n"] + ["".join(r.choice("0123456789") for _ in range(r.randint(1, 60))).lstrip("0") + "1\n" for _ in range(5)],
   "easy", ("math",))

stdio("count-inversions", "Count inversions", """
The first line has n (1 <= n <= 10^5), the second n integers. Print the number of pairs i < j with a[i] > a[j].
""", {
    "brute": """
n = int(input())
a = list(map(int, input().split()))
print(sum(1 for i in range(n) for j in range(i + 1, n) if a[i] > a[j]))
""",
    "merge-sort": """
def sort(a):
    if len(a) <= 1:
        return a, 0
    mid = len(a) // 2
    left, x = sort(a[:mid])
    right, y = sort(a[mid:])
    out, inv, i, j = [], x + y, 0, 0
    while i < len(left) and j < len(right):
        if right[j] < left[i]:
            out.append(right[j])
            inv += len(left) - i
            j += 1
        else:
            out.append(left[i])
            i += 1
    out += left[i:] + right[j:]
    return out, inv
input()
print(sort(list(map(int, input().split())))[1])
""",
    "fenwick": """
n = int(input())
a = list(map(int, input().split()))
ranks = {v: i + 1 for i, v in enumerate(sorted(set(a)))}
tree = [0] * (len(ranks) + 1)
inv = 0
for seen, x in enumerate(a):
    k = ranks[x]
    s = 0
    i = k
    while i > 0:
        s += tree[i]
        i -= i & -i
    inv += seen - s
    i = k
    while i < len(tree):
        tree[i] += 1
        i += i & -i
print(inv)
""",
}, lambda r: ["1\n5\n", "3\n3 2 1\n", "4\n1 2 3 4\n", "5\n2 2 1 1 3\n"] + [f"{n}\n{line(ints(r, n, 0, 30))}\n" for n in (7, 25, 120, 400)],
   "hard", ("sorting", "data-structures"))

stdio("edit-distance", "Edit distance", """
Read two lowercase words, one per line (each at most 2000 letters, possibly empty). Print the minimum
number of single-letter insertions, deletions and substitutions that turn the first into the second.
""", {
    "two-rows": """
a = input().strip()
b = input().strip()
prev = list(range(len(b) + 1))
for i, ca in enumerate(a, 1):
    cur = [i] + [0] * len(b)
    for j, cb in enumerate(b, 1):
        cur[j] = min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb))
    prev = cur
print(prev[-1])
""",
}, lambda r: ["kitten\nsitting\n", "abc\nabc\n", "\nabc\n", "abc\n\n", "intention\nexecution\n"]
   + ["".join(r.choice("abc") for _ in range(r.randint(0, 10))) + "\n" + "".join(r.choice("abc") for _ in range(r.randint(0, 10))) + "\n"
      for _ in range(5)], "medium", ("dp", "strings"))

# ============================================================================ function-call problems

call("is-prime", "Primality", "Return True if n is a prime number and False otherwise (n is an integer, n <= 10^12).",
     "is_prime", "def is_prime(n: int) -> bool:", {
         "trial": "def is_prime(n):\n    if n < 2:\n        return False\n    d = 2\n    while d * d <= n:\n        if n % d == 0:\n            return False\n        d += 1\n    return True",
         "six-k": """
def is_prime(n):
    if n < 4:
        return n >= 2
    if n % 2 == 0 or n % 3 == 0:
        return False
    k = 5
    while k * k <= n:
        if n % k == 0 or n % (k + 2) == 0:
            return False
        k += 6
    return True
""",
     }, lambda r: [[-7], [0], [1], [2], [3], [4], [97], [561], [7919], [1000003], [999999000001], [r.randint(10**5, 10**6)]],
     "easy", ("math",))

call("rotate-list", "Rotate a list", "Return a new list: xs rotated right by k positions (k >= 0 may exceed len(xs); an empty list stays empty).",
     "rotate", "def rotate(xs: list[int], k: int) -> list[int]:", {
         "slicing": "def rotate(xs, k):\n    if not xs:\n        return []\n    k %= len(xs)\n    return xs[-k:] + xs[:-k] if k else list(xs)",
         "deque": "from collections import deque\ndef rotate(xs, k):\n    d = deque(xs)\n    d.rotate(k)\n    return list(d)",
     }, lambda r: [[[], 3], [[1], 5], [[1, 2, 3], 0], [[1, 2, 3], 1], [[1, 2, 3], 4]]
     + [[ints(r, r.randint(2, 9), 0, 9), r.randint(0, 20)] for _ in range(5)])

call("roman-to-int", "Roman to integer", "Convert a valid Roman numeral (1 to 3999, symbols IVXLCDM with subtractive pairs) to an integer.",
     "roman_to_int", "def roman_to_int(s: str) -> int:", {
         "scan": """
def roman_to_int(s):
    v = {'I': 1, 'V': 5, 'X': 10, 'L': 50, 'C': 100, 'D': 500, 'M': 1000}
    total = 0
    for i, c in enumerate(s):
        if i + 1 < len(s) and v[c] < v[s[i + 1]]:
            total -= v[c]
        else:
            total += v[c]
    return total
""",
     }, lambda r: [["I"], ["IV"], ["IX"], ["LVIII"], ["MCMXCIV"], ["MMMCMXCIX"], ["XLII"], ["CDXLIV"]])

call("int-to-roman", "Integer to Roman", "Convert an integer 1 <= n <= 3999 to its Roman numeral (standard subtractive form).",
     "int_to_roman", "def int_to_roman(n: int) -> str:", {
         "greedy": """
def int_to_roman(n):
    table = [(1000, 'M'), (900, 'CM'), (500, 'D'), (400, 'CD'), (100, 'C'), (90, 'XC'),
             (50, 'L'), (40, 'XL'), (10, 'X'), (9, 'IX'), (5, 'V'), (4, 'IV'), (1, 'I')]
    out = []
    for v, s in table:
        while n >= v:
            out.append(s)
            n -= v
    return ''.join(out)
""",
         "digits": """
def int_to_roman(n):
    ones = ['', 'I', 'II', 'III', 'IV', 'V', 'VI', 'VII', 'VIII', 'IX']
    tens = ['', 'X', 'XX', 'XXX', 'XL', 'L', 'LX', 'LXX', 'LXXX', 'XC']
    hundreds = ['', 'C', 'CC', 'CCC', 'CD', 'D', 'DC', 'DCC', 'DCCC', 'CM']
    return 'M' * (n // 1000) + hundreds[n // 100 % 10] + tens[n // 10 % 10] + ones[n % 10]
""",
     }, lambda r: [[1], [4], [9], [14], [40], [90], [400], [1994], [3999]] + [[r.randint(1, 3999)] for _ in range(3)])

call("flatten", "Flatten nested lists", "Given a list whose items are integers or (nested) lists, return a flat list of all the integers in order.",
     "flatten", "def flatten(items: list) -> list[int]:", {
         "recursive": "def flatten(items):\n    out = []\n    for x in items:\n        if isinstance(x, list):\n            out.extend(flatten(x))\n        else:\n            out.append(x)\n    return out",
         "stack": """
def flatten(items):
    out = []
    stack = [iter(items)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out
""",
     }, lambda r: [[[]], [[1, 2, 3]], [[[1], [2, [3, [4]]], 5]], [[[[[]]]]], [[[], [1, []], 2]], [[[[[[7]]]], 8]]], "easy", ("recursion",))

call("unique-paths", "Grid paths", "Return the number of monotone paths (moves right or down only) from the top-left to the bottom-right cell of an m x n grid (1 <= m, n <= 60).",
     "unique_paths", "def unique_paths(m: int, n: int) -> int:", {
         "dp": "def unique_paths(m, n):\n    row = [1] * n\n    for _ in range(1, m):\n        for j in range(1, n):\n            row[j] += row[j - 1]\n    return row[-1]",
         "binomial": "import math\ndef unique_paths(m, n):\n    return math.comb(m + n - 2, m - 1)",
     }, lambda r: [[1, 1], [1, 5], [3, 2], [3, 7], [10, 10], [60, 60]] + [[r.randint(1, 30), r.randint(1, 30)] for _ in range(3)],
     "easy", ("dp", "math"))

call("common-prefix", "Longest common prefix", "Return the longest common prefix of a non-empty list of strings.",
     "common_prefix", "def common_prefix(words: list[str]) -> str:", {
         "zip": "def common_prefix(words):\n    out = []\n    for chars in zip(*words):\n        if len(set(chars)) != 1:\n            break\n        out.append(chars[0])\n    return ''.join(out)",
         "min-max": "def common_prefix(words):\n    a, b = min(words), max(words)\n    i = 0\n    while i < len(a) and i < len(b) and a[i] == b[i]:\n        i += 1\n    return a[:i]",
     }, lambda r: [[["flower", "flow", "flight"]], [["dog", "racecar", "car"]], [["a"]], [["", "b"]], [["same", "same"]],
                   [["interview", "internet", "interval"]]])

call("caesar", "Caesar cipher", "Shift every letter of s by k positions in the alphabet (wrapping around, keeping case); other characters stay. k may be negative or larger than 26.",
     "caesar", "def caesar(s: str, k: int) -> str:", {
         "ord": """
def caesar(s, k):
    out = []
    for c in s:
        if c.islower():
            out.append(chr((ord(c) - 97 + k) % 26 + 97))
        elif c.isupper():
            out.append(chr((ord(c) - 65 + k) % 26 + 65))
        else:
            out.append(c)
    return ''.join(out)
""",
         "translate": """
import string
def caesar(s, k):
    k %= 26
    lo, up = string.ascii_lowercase, string.ascii_uppercase
    return s.translate(str.maketrans(lo + up, lo[k:] + lo[:k] + up[k:] + up[:k]))
""",
     }, lambda r: [["abc", 1], ["xyz", 3], ["Hello, World!", 13], ["Hello, World!", -13], ["", 5], ["Zz", 52], ["Python 3.11", 100]])

call("matmul", "Matrix product", "Return the product of matrices a (p x q) and b (q x r) given as lists of rows.",
     "matmul", "def matmul(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:", {
         "loops": "def matmul(a, b):\n    return [[sum(a[i][k] * b[k][j] for k in range(len(b))) for j in range(len(b[0]))] for i in range(len(a))]",
         "zip": "def matmul(a, b):\n    cols = list(zip(*b))\n    return [[sum(x * y for x, y in zip(row, col)) for col in cols] for row in a]",
     }, lambda r: [[[[1]], [[2]]], [[[1, 2], [3, 4]], [[5, 6], [7, 8]]], [[[1, 0, 2]], [[1], [2], [3]]]]
     + [_matmul_args(r, r.randint(1, 4), r.randint(1, 4), r.randint(1, 4)) for _ in range(4)], "easy", ("math",))

call("max-profit", "Best time to buy and sell", "Given daily prices, return the maximum profit of one buy followed by one later sell (0 if no profit is possible).",
     "maxProfit", "class Solution:\n    def maxProfit(self, prices: List[int]) -> int:", {
         "min-so-far": "class Solution:\n    def maxProfit(self, prices):\n        low, best = float('inf'), 0\n        for p in prices:\n            low = min(low, p)\n            best = max(best, p - low)\n        return best",
         "max-suffix": "class Solution:\n    def maxProfit(self, prices):\n        best, high = 0, 0\n        for p in reversed(prices):\n            high = max(high, p)\n            best = max(best, high - p)\n        return best",
     }, lambda r: [[[7, 1, 5, 3, 6, 4]], [[7, 6, 4, 3, 1]], [[1]], [[2, 4, 1]], [[3, 3, 3]]] + [[ints(r, r.randint(2, 30), 1, 100)] for _ in range(4)],
     "easy", ("leetcode",))

call("climb-stairs", "Climbing stairs", "You climb 1 or 2 steps at a time. Return the number of distinct ways to climb n steps (1 <= n <= 90).",
     "climbStairs", "class Solution:\n    def climbStairs(self, n: int) -> int:", {
         "iterative": "class Solution:\n    def climbStairs(self, n):\n        a, b = 1, 1\n        for _ in range(n):\n            a, b = b, a + b\n        return a",
         "memo": "from functools import lru_cache\nclass Solution:\n    def climbStairs(self, n):\n        @lru_cache(maxsize=None)\n        def ways(k):\n            return 1 if k <= 1 else ways(k - 1) + ways(k - 2)\n        return ways(n)",
         "binomial": "import math\nclass Solution:\n    def climbStairs(self, n):\n        return sum(math.comb(n - k, k) for k in range(n // 2 + 1))",
     }, lambda r: [[1], [2], [3], [5], [10], [45], [90]], "easy", ("leetcode", "dp"))

call("top-k-frequent", "Top k frequent", "Return the k most frequent values of nums, most frequent first; ties by smaller value first.",
     "topKFrequent", "class Solution:\n    def topKFrequent(self, nums: List[int], k: int) -> List[int]:", {
         "sort": "from collections import Counter\nclass Solution:\n    def topKFrequent(self, nums, k):\n        c = Counter(nums)\n        return sorted(c, key=lambda v: (-c[v], v))[:k]",
         "buckets": """
class Solution:
    def topKFrequent(self, nums, k):
        count = {}
        for x in nums:
            count[x] = count.get(x, 0) + 1
        buckets = [[] for _ in range(len(nums) + 1)]
        for v, c in count.items():
            buckets[c].append(v)
        out = []
        for c in range(len(nums), 0, -1):
            for v in sorted(buckets[c]):
                if len(out) < k:
                    out.append(v)
        return out
""",
     }, lambda r: [[[1, 1, 1, 2, 2, 3], 2], [[1], 1], [[4, 4, 5, 5, 6], 2]] + [[ints(r, r.randint(3, 25), 0, 6), r.randint(1, 3)] for _ in range(4)],
     "medium", ("leetcode", "hashing"))

call("char-histogram", "Character counts", "Return a dict mapping every character of s to the number of times it occurs.",
     "char_counts", "def char_counts(s: str) -> dict[str, int]:", {
         "counter": "from collections import Counter\ndef char_counts(s):\n    return dict(Counter(s))",
         "dict": "def char_counts(s):\n    out = {}\n    for c in s:\n        out[c] = out.get(c, 0) + 1\n    return out",
     }, lambda r: [[""], ["a"], ["hello"], ["Mississippi"], ["a b a"]] + [["".join(r.choice("xyz!") for _ in range(r.randint(1, 15)))] for _ in range(2)])

call("pairs-with-sum", "Pairs with a given sum", "Return all pairs (a, b) with a < b of distinct values from xs such that a + b == target, as a sorted list of tuples.",
     "pairs_with_sum", "def pairs_with_sum(xs: list[int], target: int) -> list[tuple[int, int]]:", {
         "set": "def pairs_with_sum(xs, target):\n    vals = set(xs)\n    return sorted((a, target - a) for a in vals if a < target - a and target - a in vals)",
         "two-pointers": """
def pairs_with_sum(xs, target):
    v = sorted(set(xs))
    i, j, out = 0, len(v) - 1, []
    while i < j:
        s = v[i] + v[j]
        if s == target:
            out.append((v[i], v[j]))
            i += 1
            j -= 1
        elif s < target:
            i += 1
        else:
            j -= 1
    return out
""",
     }, lambda r: [[[1, 2, 3, 4, 5], 6], [[], 1], [[3, 3], 6], [[-1, 0, 1, 2], 1]] + [[ints(r, r.randint(3, 15), -5, 10), r.randint(0, 10)] for _ in range(4)],
     "easy", ("hashing",))

call("median", "Median", "Return the median of a non-empty list of numbers as a float (the mean of the two middle values for an even count).",
     "median", "def median(xs: list[float]) -> float:", {
         "sort": "def median(xs):\n    s = sorted(xs)\n    n = len(s)\n    return float(s[n // 2]) if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2",
         "statistics": "import statistics\ndef median(xs):\n    return float(statistics.median(xs))",
     }, lambda r: [[[1]], [[3, 1, 2]], [[4, 1, 2, 3]], [[0.5, 0.25]], [[-3, -1]]] + [[[round(r.uniform(-10, 10), 3) for _ in range(r.randint(1, 12))]] for _ in range(4)],
     "easy", ("float",))

call("group-by-length", "Group words by length", "Return a dict mapping each word length to the list of words of that length, in their original order.",
     "group_by_length", "def group_by_length(words: list[str]) -> dict[int, list[str]]:", {
         "setdefault": "def group_by_length(words):\n    out = {}\n    for w in words:\n        out.setdefault(len(w), []).append(w)\n    return out",
         "defaultdict": "from collections import defaultdict\ndef group_by_length(words):\n    out = defaultdict(list)\n    for w in words:\n        out[len(w)].append(w)\n    return dict(out)",
     }, lambda r: [[[]], [["a"]], [["ab", "c", "de", "fgh"]], [["same", "size", "word"]]]
     + [[[("".join(r.choice("ab") for _ in range(r.randint(1, 4)))) for _ in range(r.randint(1, 8))]] for _ in range(3)])

call("binary-search", "Binary search", "xs is sorted ascending with distinct values. Return the index of target in xs, or -1 if it is absent.",
     "search", "def search(xs: list[int], target: int) -> int:", {
         "manual": "def search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n    return -1",
         "bisect": "from bisect import bisect_left\ndef search(xs, target):\n    i = bisect_left(xs, target)\n    return i if i < len(xs) and xs[i] == target else -1",
     }, lambda r: [[[], 1], [[1], 1], [[1], 2], [[1, 3, 5, 7], 7], [[1, 3, 5, 7], 4], [[-5, 0, 9], -5]]
     + [_search_args(r, sorted(r.sample(range(-50, 50), r.randint(1, 20)))) for _ in range(4)], "easy", ("binary-search",))

call("count-vowels", "Count vowels", "Return how many characters of s are vowels (a, e, i, o, u, in either case).",
     "count_vowels", "def count_vowels(s: str) -> int:", {
         "sum": "def count_vowels(s):\n    return sum(c in 'aeiouAEIOU' for c in s)",
         "regex": "import re\ndef count_vowels(s):\n    return len(re.findall('[aeiou]', s, flags=re.I))",
     }, lambda r: [[""], ["xyz"], ["AEIOU"], ["Hello World"], ["Queueing"]] + [["".join(r.choice("abcdeuO ") for _ in range(r.randint(1, 20)))] for _ in range(3)])

call("rle-decode", "Run-length decoding", "Decode a string of letter+count groups (counts are positive and may have several digits): a3b1c12 becomes aaab followed by 12 c.",
     "rle_decode", "def rle_decode(s: str) -> str:", {
         "regex": "import re\ndef rle_decode(s):\n    return ''.join(ch * int(n) for ch, n in re.findall(r'([a-z])(\\d+)', s))",
         "scan": """
def rle_decode(s):
    out = []
    i = 0
    while i < len(s):
        ch = s[i]
        j = i + 1
        while j < len(s) and s[j].isdigit():
            j += 1
        out.append(ch * int(s[i + 1:j]))
        i = j
    return ''.join(out)
""",
     }, lambda r: [[""], ["a1"], ["a3b1c2"], ["z12"], ["a10b2"]] + [["".join(r.choice("abc") + str(r.randint(1, 12)) for _ in range(r.randint(1, 5)))] for _ in range(3)])

call("next-permutation", "Next permutation", "Return the next lexicographic permutation of xs; for the last permutation return the first (sorted ascending).",
     "next_permutation", "def next_permutation(xs: list[int]) -> list[int]:", {
         "pivot": """
def next_permutation(xs):
    a = list(xs)
    i = len(a) - 2
    while i >= 0 and a[i] >= a[i + 1]:
        i -= 1
    if i >= 0:
        j = len(a) - 1
        while a[j] <= a[i]:
            j -= 1
        a[i], a[j] = a[j], a[i]
    a[i + 1:] = reversed(a[i + 1:])
    return a
""",
     }, lambda r: [[[1, 2, 3]], [[3, 2, 1]], [[1, 1, 5]], [[1]], [[1, 3, 2]], [[2, 3, 1]]] + [[ints(r, r.randint(2, 7), 0, 4)] for _ in range(4)],
     "medium", ("arrays",))

call("word-break", "Word break", "Return True if s can be split into a sequence of one or more words from the list words (words may be reused).",
     "word_break", "def word_break(s: str, words: list[str]) -> bool:", {
         "dp": """
def word_break(s, words):
    ok = [True] + [False] * len(s)
    ws = set(words)
    for i in range(1, len(s) + 1):
        ok[i] = any(ok[j] and s[j:i] in ws for j in range(i))
    return ok[len(s)]
""",
         "memo-dfs": """
from functools import lru_cache
def word_break(s, words):
    ws = tuple(set(words))
    @lru_cache(maxsize=None)
    def can(i):
        if i == len(s):
            return True
        return any(s.startswith(w, i) and w and can(i + len(w)) for w in ws)
    return can(0)
""",
     }, lambda r: [["leetcode", ["leet", "code"]], ["applepenapple", ["apple", "pen"]], ["catsandog", ["cats", "dog", "sand", "and", "cat"]],
                   ["a", ["b"]], ["aaaaaaa", ["aaa", "aaaa"]]] + [["".join(r.choice("ab") for _ in range(r.randint(1, 12))), ["a", "bb", "ab"]] for _ in range(4)],
     "medium", ("dp", "strings"))

call("spiral-order", "Spiral order", "Return the elements of a matrix (list of equal-length rows, possibly empty) in clockwise spiral order starting top-left.",
     "spiral", "def spiral(m: list[list[int]]) -> list[int]:", {
         "peel": "def spiral(m):\n    m = [list(r) for r in m]\n    out = []\n    while m:\n        out += m.pop(0)\n        m = [list(r) for r in zip(*m)][::-1]\n    return out",
         "bounds": """
def spiral(m):
    out = []
    if not m or not m[0]:
        return out
    top, bottom, left, right = 0, len(m) - 1, 0, len(m[0]) - 1
    while top <= bottom and left <= right:
        out += [m[top][j] for j in range(left, right + 1)]
        out += [m[i][right] for i in range(top + 1, bottom + 1)]
        if top < bottom and left < right:
            out += [m[bottom][j] for j in range(right - 1, left - 1, -1)]
            out += [m[i][left] for i in range(bottom - 1, top, -1)]
        top, bottom, left, right = top + 1, bottom - 1, left + 1, right - 1
    return out
""",
     }, lambda r: [[[]], [[[1]]], [[[1, 2], [3, 4]]], [[[1, 2, 3], [4, 5, 6], [7, 8, 9]]], [[[1, 2, 3, 4]]], [[[1], [2], [3]]]]
     + [[[ints(r, c, 0, 9) for _ in range(h)]] for h, c in ((2, 5), (4, 3), (3, 3))], "medium", ("arrays",))

call("dedupe-sorted", "Remove duplicates, keep order", "Return xs without repeated values, keeping the first occurrence of each value in its original order.",
     "dedupe", "def dedupe(xs: list) -> list:", {
         "seen-set": "def dedupe(xs):\n    seen, out = set(), []\n    for x in xs:\n        if x not in seen:\n            seen.add(x)\n            out.append(x)\n    return out",
         "dict-keys": "def dedupe(xs):\n    return list(dict.fromkeys(xs))",
     }, lambda r: [[[]], [[1, 1, 1]], [[3, 1, 3, 2, 1]], [["b", "a", "b"]]] + [[ints(r, r.randint(1, 20), 0, 6)] for _ in range(20)])


# ============================================================================ building


def run_stdio(code: str, data: str) -> str:
    out = io.StringIO()
    old_in, old_out = sys.stdin, sys.stdout
    sys.stdin, sys.stdout = io.StringIO(data), out
    try:
        with contextlib.suppress(SystemExit):
            exec(compile(code, "<reference>", "exec"), {"__name__": "__main__"})  # noqa: S102 - our own references
    finally:
        sys.stdin, sys.stdout = old_in, old_out
    return out.getvalue()


PRELUDE = "from typing import *\n"


def run_call(code: str, entry: str, args: list[Any]) -> Any:
    ns: dict[str, Any] = {"__name__": "__solution__"}
    exec(compile(PRELUDE + code, "<reference>", "exec"), ns)  # noqa: S102 - our own references
    fn = ns.get(entry)
    if fn is None:
        fn = getattr(ns["Solution"](), entry)
    import copy

    return fn(*copy.deepcopy(args))


def build() -> list[dict[str, Any]]:
    """All problems in the vpo schema, expected outputs computed from the references."""
    from vpo.sandbox import TestCase, stdout_matches, values_match

    records = []
    ids = set()
    for prob in P:
        if prob.id in ids:
            raise ValueError(f"duplicate id {prob.id}")
        ids.add(prob.id)
        rng = random.Random(f"vpo-code-{prob.id}")
        inputs = prob.gen(rng)
        strategies = list(prob.solutions.items())
        tests = []
        for inp in inputs:
            if prob.entry_point is None:
                expected = run_stdio(strategies[0][1], inp)
                for name, code in strategies[1:]:
                    got = run_stdio(code, inp)
                    if not stdout_matches(expected, got):
                        raise AssertionError(f"{prob.id}: strategy {name} disagrees on {inp!r}: {got!r} vs {expected!r}")
                tests.append(TestCase.stdio(inp, expected).to_dict())
            else:
                expected = run_call(strategies[0][1], prob.entry_point, inp)
                for name, code in strategies[1:]:
                    got = run_call(code, prob.entry_point, inp)
                    if not values_match(expected, got):
                        raise AssertionError(f"{prob.id}: strategy {name} disagrees on {inp!r}: {got!r} vs {expected!r}")
                tests.append(TestCase.call(inp, expected).to_dict())
        for text in (prob.statement, *prob.solutions.values(), prob.starter):
            if not text.isascii():
                raise ValueError(f"{prob.id}: non-ASCII text")
        records.append({
            "id": prob.id,
            "title": prob.title,
            "prompt": prob.statement,
            "entry_point": prob.entry_point,
            "starter_code": prob.starter if prob.entry_point else "",
            "tests": tests,
            "solutions": [{"strategy": k, "code": v} for k, v in prob.solutions.items()],
            "difficulty": prob.difficulty,
            "tags": prob.tags,
        })
    return records


def dumps(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only check that problems.jsonl is up to date")
    args = ap.parse_args(argv)
    text = dumps(build())
    if args.check:
        current = OUT.read_text() if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date; run python -m vpo.data.code.build", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {len(P)} problems to {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
