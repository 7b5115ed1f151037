"""Seed programs for the first training step.

Each seed is a small, deterministic Python program defining a function ``f``,
together with a handful of literal argument lists and a one-sentence hint that
describes the behaviour of ``f`` without giving the code away.

Conventions (checked by ``tests/test_seeds.py``):

* ``program`` is Python source defining exactly one top-level ``f`` (small
  helpers are allowed); the only permitted imports are math, itertools,
  functools, collections, heapq, bisect, string, re and operator.
* ``inputs`` holds 5 or 6 distinct argument-list texts made only of literals,
  e.g. ``"[3, 1, 2], 2"`` meaning ``f([3, 1, 2], 2)``.
* Every call returns a value whose ``repr`` parses back with
  ``ast.literal_eval`` to an equal value; no sets, no hash-order dependence.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SeedProgram:
    program: str  # source defining f (may define small helpers too, but one f)
    inputs: tuple[str, ...]  # 5 or 6 distinct argument-list texts
    message: str  # one-sentence hint describing what f does (induction tasks)


def _seed(program: str, inputs: tuple[str, ...], message: str) -> SeedProgram:
    return SeedProgram(program=program.strip("\n") + "\n", inputs=inputs, message=message)


SEED_PROGRAMS: tuple[SeedProgram, ...] = (
    # 1. strings: reverse words
    _seed(
        """
def f(s):
    words = s.split()
    words.reverse()
    return ' '.join(words)
""",
        ("'hello world'", "'a b c d'", "'one'", "''", "'the quick brown fox'"),
        "Returns the sentence with its words in reverse order.",
    ),
    # 2. strings: count vowels
    _seed(
        """
def f(s):
    count = 0
    for ch in s.lower():
        if ch in 'aeiou':
            count += 1
    return count
""",
        ("'hello'", "'AEIOU'", "'rhythm'", "''", "'Programming is fun'"),
        "Counts how many vowels appear in the text, ignoring case.",
    ),
    # 3. strings: palindrome check
    _seed(
        """
def f(s):
    cleaned = [c.lower() for c in s if c.isalnum()]
    return cleaned == cleaned[::-1]
""",
        ("'racecar'", "'A man, a plan, a canal: Panama'", "'hello'", "''", "'No lemon, no melon'", "'ab'"),
        "Checks whether the text reads the same backwards, ignoring case and punctuation.",
    ),
    # 4. strings: run-length encoding
    _seed(
        """
def f(s):
    out = []
    i = 0
    while i < len(s):
        j = i
        while j < len(s) and s[j] == s[i]:
            j += 1
        out.append(s[i] + str(j - i))
        i = j
    return ''.join(out)
""",
        ("'aaabbc'", "'abc'", "''", "'zzzzzz'", "'aabbaa'"),
        "Compresses the text by writing each run of repeated characters as the character followed by its run length.",
    ),
    # 5. strings: caesar shift
    _seed(
        """
def f(s, k):
    out = ''
    for c in s:
        if c.islower():
            out += chr((ord(c) - 97 + k) % 26 + 97)
        else:
            out += c
    return out
""",
        ("'abc', 1", "'xyz', 3", "'hello world', 13", "'Abc', 2", "'', 5", "'zebra', -1"),
        "Shifts every lowercase letter forward in the alphabet by k places, wrapping around, leaving other characters unchanged.",
    ),
    # 6. strings: longest word
    _seed(
        """
def f(s):
    best = ''
    for w in s.split():
        if len(w) > len(best):
            best = w
    return best
""",
        ("'the quick brown fox'", "'a bb ccc bb'", "''", "'same size word'", "'supercalifragilistic is long'"),
        "Returns the first longest word in the sentence.",
    ),
    # 7. strings: character frequency as sorted pairs
    _seed(
        """
def f(s):
    counts = {}
    for c in s:
        counts[c] = counts.get(c, 0) + 1
    return sorted(counts.items())
""",
        ("'banana'", "'abc'", "''", "'mississippi'", "'aaaa'"),
        "Returns a sorted list of (character, count) pairs for the text.",
    ),
    # 8. lists: running sum
    _seed(
        """
def f(nums):
    total = 0
    result = []
    for n in nums:
        total += n
        result.append(total)
    return result
""",
        ("[1, 2, 3, 4]", "[]", "[5]", "[3, -1, 4, -1, 5]", "[0, 0, 0]"),
        "Returns the running totals of the list.",
    ),
    # 9. lists: second largest distinct
    _seed(
        """
def f(nums):
    distinct = sorted(set(nums))
    if len(distinct) < 2:
        return None
    return distinct[-2]
""",
        ("[3, 1, 4, 1, 5]", "[7, 7, 7]", "[]", "[2, 9]", "[-3, -1, -2]"),
        "Returns the second largest distinct value, or None if there is none.",
    ),
    # 10. lists: remove duplicates preserving order
    _seed(
        """
def f(items):
    seen = []
    for x in items:
        if x not in seen:
            seen.append(x)
    return seen
""",
        ("[1, 2, 1, 3, 2]", "[]", "['a', 'b', 'a']", "[5, 5, 5, 5]", "[3, 2, 1]"),
        "Removes repeated elements while keeping the first occurrence order.",
    ),
    # 11. lists: chunk into groups
    _seed(
        """
def f(items, size):
    chunks = []
    for i in range(0, len(items), size):
        chunks.append(items[i:i + size])
    return chunks
""",
        ("[1, 2, 3, 4, 5], 2", "[1, 2, 3], 3", "[], 4", "['a', 'b', 'c', 'd'], 1", "[9, 8, 7, 6, 5, 4, 3], 3"),
        "Splits the list into consecutive pieces of the given size, the last one possibly shorter.",
    ),
    # 12. lists: rotate
    _seed(
        """
def f(items, k):
    if not items:
        return []
    k = k % len(items)
    return items[-k:] + items[:-k] if k else list(items)
""",
        ("[1, 2, 3, 4, 5], 2", "[1, 2, 3], 0", "[], 3", "['a', 'b', 'c'], 4", "[1, 2, 3, 4], -1"),
        "Rotates the list to the right by k positions.",
    ),
    # 13. lists: flatten one level
    _seed(
        """
def f(lists):
    out = []
    for sub in lists:
        for x in sub:
            out.append(x)
    return out
""",
        ("[[1, 2], [3], [4, 5, 6]]", "[]", "[[], [1], []]", "[['a'], ['b', 'c']]", "[[1, [2]], [3]]"),
        "Joins the inner lists together into one list.",
    ),
    # 14. lists: max subarray sum (Kadane)
    _seed(
        """
def f(nums):
    best = nums[0]
    cur = 0
    for n in nums:
        cur = max(n, cur + n)
        best = max(best, cur)
    return best
""",
        ("[-2, 1, -3, 4, -1, 2, 1, -5, 4]", "[1]", "[-3, -1, -2]", "[5, 4, -1, 7, 8]", "[0, 0, 0]"),
        "Returns the largest sum of any non-empty contiguous slice of the list.",
    ),
    # 15. dicts: invert mapping into sorted lists
    _seed(
        """
def f(d):
    inv = {}
    for k, v in d.items():
        inv.setdefault(v, []).append(k)
    return {v: sorted(ks) for v, ks in sorted(inv.items())}
""",
        ("{'a': 1, 'b': 2, 'c': 1}", "{}", "{'x': 'y'}", "{1: 'odd', 2: 'even', 3: 'odd'}", "{'p': 0, 'q': 0, 'r': 0}"),
        "Groups the keys by their values, giving each value the sorted list of keys that map to it.",
    ),
    # 16. dicts: word counts
    _seed(
        """
from collections import Counter

def f(text):
    counts = Counter(text.lower().split())
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
""",
        ("'the cat and the hat'", "''", "'a A a b'", "'one two three'", "'x y x z y x'"),
        "Counts the words ignoring case and lists them from most to least frequent, ties broken alphabetically.",
    ),
    # 17. dicts: merge by summing values
    _seed(
        """
def f(a, b):
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return sorted(out.items())
""",
        ("{'x': 1, 'y': 2}, {'y': 3, 'z': 4}", "{}, {}", "{'a': 5}, {}", "{}, {'b': -1}", "{'k': 1, 'm': 1}, {'k': 1, 'm': 1}"),
        "Merges two count tables by adding values for shared keys and returns the sorted key-value pairs.",
    ),
    # 18. arithmetic: digit sum
    _seed(
        """
def f(n):
    n = abs(n)
    total = 0
    while n > 0:
        total += n % 10
        n //= 10
    return total
""",
        ("12345", "0", "9", "-407", "1000001"),
        "Adds up the decimal digits of the number, ignoring its sign.",
    ),
    # 19. arithmetic: gcd and lcm
    _seed(
        """
import math

def f(a, b):
    g = math.gcd(a, b)
    l = a * b // g if g else 0
    return (g, l)
""",
        ("12, 18", "7, 5", "0, 9", "21, 6", "100, 75"),
        "Returns the greatest common divisor and the least common multiple of two numbers as a pair.",
    ),
    # 20. arithmetic: primes up to n
    _seed(
        """
def f(n):
    primes = []
    for x in range(2, n + 1):
        if all(x % p for p in primes if p * p <= x):
            primes.append(x)
    return primes
""",
        ("10", "2", "1", "30", "0"),
        "Lists all prime numbers up to and including n.",
    ),
    # 21. arithmetic: base conversion
    _seed(
        """
def f(n, base):
    if n == 0:
        return '0'
    digits = ''
    while n > 0:
        digits = '0123456789abcdef'[n % base] + digits
        n //= base
    return digits
""",
        ("10, 2", "255, 16", "0, 8", "7, 7", "100, 3"),
        "Writes the non-negative number in the given base using lowercase digits.",
    ),
    # 22. arithmetic: collatz steps
    _seed(
        """
def f(n):
    steps = 0
    while n != 1:
        n = n // 2 if n % 2 == 0 else 3 * n + 1
        steps += 1
    return steps
""",
        ("1", "6", "7", "27", "16"),
        "Counts how many halving or triple-plus-one steps it takes to reach 1.",
    ),
    # 23. arithmetic: mean rounded
    _seed(
        """
def f(nums):
    if not nums:
        return 0.0
    return round(sum(nums) / len(nums), 2)
""",
        ("[1, 2, 3, 4]", "[]", "[10]", "[1, 1, 2]", "[-5, 5, 7.5]"),
        "Returns the average of the numbers rounded to two decimals, or 0.0 for an empty list.",
    ),
    # 24. sorting: sort by length then alphabetically
    _seed(
        """
def by_length(w):
    return (len(w), w)

def f(words):
    return sorted(words, key=by_length)
""",
        ("['banana', 'kiwi', 'apple', 'fig']", "[]", "['bb', 'a', 'ab', 'b']", "['same', 'size', 'word']", "['z']"),
        "Sorts the words by length, breaking ties alphabetically.",
    ),
    # 25. sorting: k smallest with heapq
    _seed(
        """
import heapq

def f(nums, k):
    return heapq.nsmallest(k, nums)
""",
        ("[5, 1, 4, 2, 3], 2", "[], 3", "[7, 7, 1], 5", "[10, -1, 0], 0", "[9, 8, 7, 6], 3"),
        "Returns the k smallest numbers in increasing order.",
    ),
    # 26. sorting: insertion position with bisect
    _seed(
        """
import bisect

def f(sorted_nums, values):
    return [bisect.bisect_left(sorted_nums, v) for v in values]
""",
        ("[1, 3, 5, 7], [0, 4, 7, 9]", "[], [1, 2]", "[2, 2, 2], [2]", "[10, 20, 30], []", "[-5, 0, 5], [-10, 0, 10]"),
        "For each value, returns the index where it would be inserted to keep the sorted list ordered.",
    ),
    # 27. counting: most common element
    _seed(
        """
def f(items):
    best = None
    best_count = 0
    for x in items:
        c = items.count(x)
        if c > best_count:
            best, best_count = x, c
    return best
""",
        ("[1, 2, 2, 3, 3, 3]", "[]", "['a', 'b', 'a']", "[4, 5, 5, 4]", "[7]"),
        "Returns the most frequent element, choosing the earliest one on ties, or None for an empty list.",
    ),
    # 28. counting: count pairs summing to target
    _seed(
        """
def f(nums, target):
    count = 0
    for i in range(len(nums)):
        for j in range(i + 1, len(nums)):
            if nums[i] + nums[j] == target:
                count += 1
    return count
""",
        ("[1, 2, 3, 4], 5", "[], 0", "[2, 2, 2], 4", "[1, -1, 0, 0], 0", "[10, 20], 25"),
        "Counts the pairs of positions whose values add up to the target.",
    ),
    # 29. recursion: fibonacci
    _seed(
        """
def f(n):
    if n < 2:
        return n
    return f(n - 1) + f(n - 2)
""",
        ("0", "1", "5", "10", "15"),
        "Returns the n-th Fibonacci number computed recursively.",
    ),
    # 30. recursion: nested list depth
    _seed(
        """
def f(x):
    if not isinstance(x, list):
        return 0
    if not x:
        return 1
    return 1 + max(f(item) for item in x)
""",
        ("[1, 2, 3]", "[]", "5", "[1, [2, [3, [4]]]]", "[[], [[]]]"),
        "Returns how deeply the lists are nested, with a non-list counting as zero.",
    ),
    # 31. tuples: min and max together
    _seed(
        """
def f(nums):
    if not nums:
        return (None, None)
    lo = hi = nums[0]
    for n in nums[1:]:
        lo = min(lo, n)
        hi = max(hi, n)
    return (lo, hi)
""",
        ("[3, 1, 4, 1, 5]", "[]", "[7]", "[-2, -8, 0]", "[2.5, 1.5]"),
        "Returns the smallest and largest values as a pair, or a pair of None for an empty list.",
    ),
    # 32. tuples: zip into pairs with index
    _seed(
        """
def f(names, scores):
    pairs = list(zip(names, scores))
    pairs.sort(key=lambda p: p[1], reverse=True)
    return [(i + 1, name) for i, (name, _) in enumerate(pairs)]
""",
        ("['ann', 'bob', 'cid'], [70, 90, 80]", "[], []", "['x'], [1]", "['a', 'b'], [5, 5]", "['p', 'q', 'r'], [1, 2]"),
        "Ranks the names by their scores from highest to lowest and returns (rank, name) pairs.",
    ),
    # 33. sets -> sorted lists: common elements
    _seed(
        """
def f(a, b):
    common = set(a) & set(b)
    return sorted(common)
""",
        ("[1, 2, 3, 4], [3, 4, 5]", "[], [1]", "['x', 'y'], ['y', 'z', 'x']", "[1, 1, 2], [1]", "[5, 6], [7, 8]"),
        "Returns the sorted values that appear in both lists, without repeats.",
    ),
    # 34. sets -> sorted lists: symmetric difference of letters
    _seed(
        """
def f(s, t):
    only_s = sorted(set(s) - set(t))
    only_t = sorted(set(t) - set(s))
    return [only_s, only_t]
""",
        ("'apple', 'plum'", "'', 'abc'", "'same', 'same'", "'hello', 'world'", "'abc', ''"),
        "Returns the sorted letters found only in the first text and those found only in the second.",
    ),
    # 35. multi-argument: clamp values
    _seed(
        """
def f(nums, lo, hi):
    out = []
    for n in nums:
        out.append(max(lo, min(hi, n)))
    return out
""",
        ("[1, 5, 10], 2, 8", "[], 0, 1", "[-3, 0, 3], -1, 1", "[4, 4], 4, 4", "[0.5, 2.5], 1, 2"),
        "Limits every number to lie between the lower and upper bounds.",
    ),
    # 36. multi-argument: matrix transpose
    _seed(
        """
def f(matrix):
    if not matrix:
        return []
    return [[row[i] for row in matrix] for i in range(len(matrix[0]))]
""",
        ("[[1, 2, 3], [4, 5, 6]]", "[]", "[[1]]", "[[1], [2], [3]]", "[['a', 'b'], ['c', 'd']]"),
        "Swaps the rows and columns of the grid.",
    ),
    # 37. itertools: accumulate products
    _seed(
        """
import itertools
import operator

def f(nums):
    return list(itertools.accumulate(nums, operator.mul))
""",
        ("[1, 2, 3, 4]", "[]", "[5]", "[2, 0, 3]", "[-1, -1, -1]"),
        "Returns the running products of the list.",
    ),
    # 38. re: extract integers from text
    _seed(
        """
import re

def f(text):
    return [int(x) for x in re.findall(r'-?\\d+', text)]
""",
        ("'a1b22c333'", "'no numbers'", "''", "'x = -5, y = 10'", "'007 and 42'"),
        "Extracts every whole number written in the text, including negative ones.",
    ),
    # 39. dict: group words by first letter
    _seed(
        """
from collections import defaultdict

def f(words):
    groups = defaultdict(list)
    for w in words:
        groups[w[0]].append(w)
    return sorted(groups.items())
""",
        ("['apple', 'avocado', 'banana', 'cherry']", "[]", "['x']", "['bee', 'ant', 'bat', 'ape']", "['dog', 'dog']"),
        "Groups the words by their first letter and returns the groups sorted by letter.",
    ),
    # 40. string: is anagram
    _seed(
        """
def f(a, b):
    letters_a = sorted(a.replace(' ', '').lower())
    letters_b = sorted(b.replace(' ', '').lower())
    return letters_a == letters_b
""",
        ("'listen', 'silent'", "'abc', 'abd'", "'', ''", "'Dormitory', 'dirty room'", "'aab', 'abb'"),
        "Checks whether the two texts use exactly the same letters, ignoring spaces and case.",
    ),
)
