"""Verifiable tasks for the demo, tests and benchmarks: arithmetic (with difficulty levels), Countdown and
Reverse (long-tailed completion lengths).

Each is an `Environment` (tidal.core.interfaces): `tasks(split, seed)` yields `Task`s, `score(task,
completion)` gives the reward. Problems are split into train and held-out eval by a hash of the prompt,
so an eval problem is never trained on, whatever the seeds. Prompts use only characters of the tiny
tokenizer's alphabet (`tidal.rollout.tiny.ALPHABET`).
"""

from __future__ import annotations

import ast
import itertools
import operator
import random
import re
import zlib
from collections import Counter
from collections.abc import Iterator

from tidal.core.interfaces import Task

EVAL_EVERY = 5  # one problem in 5 (by prompt hash) is held out for evaluation


def _split_of(prompt: str) -> str:
    return "eval" if zlib.crc32(prompt.encode()) % EVAL_EVERY == 0 else "train"


def _stream(make, split: str, seed: int, eval_size: int) -> Iterator[Task]:
    """Train: endless; eval: the first `eval_size` distinct held-out problems for this seed."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")
    rng = random.Random(seed)
    seen: set[str] = set()
    attempts = 0
    while True:
        task = make(rng)
        attempts += 1
        if _split_of(task.prompt) != split:
            continue
        if split == "eval":
            if task.prompt in seen:
                if attempts > 200 * eval_size:
                    return  # the problem space has fewer held-out problems than asked for
                continue
            seen.add(task.prompt)
        yield task
        if split == "eval" and len(seen) >= eval_size:
            return


def _answer_of(completion: str) -> str:
    """What the model answered: the completion up to the first newline, without surrounding spaces."""
    return completion.split("\n", 1)[0].strip()


class Arithmetic:
    """`a+b=`, `a-b=`, `a*b=` problems; the reward is 1 for the exact integer answer, else 0.

    Levels: 1 = one-digit addition; 2 = two-digit addition and subtraction; 3 = adds one-digit by
    two-digit multiplication; 4 = three-digit addition/subtraction and two-digit multiplication;
    5 = two-digit plus one-digit addition (a carry drill: its sub-skills are shared between train and
    held-out problems, so what is learnt on one transfers to the other). `level` may be a list to mix
    levels. The answer must be the whole completion (up to a newline). Additions whose units digits
    carry are marked ``metadata["carry"] = "1"``.
    """

    domain = "arithmetic"

    def __init__(self, level: int | list[int] = 1, eval_size: int = 200, partial_credit: float = 0.0) -> None:
        self.levels = [level] if isinstance(level, int) else list(level)
        bad = [lv for lv in self.levels if lv not in (1, 2, 3, 4, 5)]
        if bad or not self.levels:
            raise ValueError(f"arithmetic levels are 1..5, got {level!r}")
        if not 0.0 <= partial_credit < 1.0:
            raise ValueError(f"partial_credit is a reward in [0, 1), got {partial_credit}")
        self.eval_size = eval_size
        self.partial_credit = partial_credit

    def _make(self, rng: random.Random) -> Task:
        level = rng.choice(self.levels)
        if level == 1:
            op, a, b = "+", rng.randint(0, 9), rng.randint(0, 9)
        elif level == 2:
            op, a, b = rng.choice("+-"), rng.randint(10, 99), rng.randint(0, 99)
        elif level == 3:
            op = rng.choice("+-*")
            a, b = (rng.randint(10, 99), rng.randint(2, 9)) if op == "*" else (rng.randint(10, 99), rng.randint(0, 99))
        elif level == 4:
            op = rng.choice("+-*")
            a, b = (rng.randint(10, 99), rng.randint(10, 99)) if op == "*" else (rng.randint(100, 999), rng.randint(0, 999))
        else:
            op, a, b = "+", rng.randint(10, 99), rng.randint(0, 9)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        meta = {"level": str(level)}
        if op == "+" and a % 10 + b % 10 >= 10:
            meta["carry"] = "1"
        return Task(prompt=f"{a}{op}{b}=", answer=str(value), domain=self.domain, metadata=meta)

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return _stream(self._make, split, seed, self.eval_size)

    def score(self, task: Task, completion: str) -> float:
        """1 for the exact answer. With `partial_credit` p > 0, a wrong answer of the right length earns
        p x (fraction of its characters that are right), a denser signal for small models; evaluation
        counts exact answers only (see `exact_match`)."""
        got = _answer_of(completion)
        if got == task.answer:
            return 1.0
        if self.partial_credit and len(got) == len(task.answer):
            return self.partial_credit * sum(a == b for a, b in zip(got, task.answer, strict=True)) / len(got)
        return 0.0


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_EXPR = re.compile(r"^[0-9+\-*/() ]+$")


def evaluate_expression(text: str) -> tuple[float, list[int]] | None:
    """(value, numbers used) of an arithmetic expression of integers, + - * / and parentheses, or None
    when it is anything else (parsed with `ast`, never `eval`)."""
    if not text or len(text) > 64 or not _EXPR.match(text):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None
    numbers: list[int] = []

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            numbers.append(node.value)
            return float(node.value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError("not allowed")

    try:
        return walk(tree), numbers
    except (ValueError, ZeroDivisionError):
        return None


class Countdown:
    """Reach a target from given numbers with + - * / and parentheses, each number used at most once
    (`exact_use=True`: exactly once, as in TinyZero). Prompt: `3 5 7 to 22:`; reward 1 for a correct
    expression, `format_reward` for a well-formed expression that misses, else 0. Every generated
    problem is solvable (the target is built from a random expression over the numbers)."""

    domain = "countdown"

    def __init__(self, numbers: int = 3, max_number: int = 20, exact_use: bool = True,
                 format_reward: float = 0.0, eval_size: int = 200) -> None:
        if not 2 <= numbers <= 5:
            raise ValueError(f"countdown uses 2..5 numbers, got {numbers}")
        self.count, self.max_number, self.exact_use = numbers, max_number, exact_use
        self.format_reward, self.eval_size = format_reward, eval_size

    def _make(self, rng: random.Random) -> Task:
        while True:
            nums = [rng.randint(1, self.max_number) for _ in range(self.count)]
            order = nums[:]
            rng.shuffle(order)
            expr = str(order[0])
            for n in order[1:]:
                op = rng.choice("+-*")
                expr = f"({expr}){op}{n}" if op == "*" and ("+" in expr or "-" in expr) else f"{expr}{op}{n}"
            value = evaluate_expression(expr)
            if value is not None and value[0] == int(value[0]) and 0 < value[0] <= 999:
                target = int(value[0])
                return Task(prompt=f"{' '.join(map(str, nums))} to {target}:", answer=expr, domain=self.domain,
                            metadata={"numbers": " ".join(map(str, nums)), "target": str(target)})

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return _stream(self._make, split, seed, self.eval_size)

    def score(self, task: Task, completion: str) -> float:
        got = evaluate_expression(_answer_of(completion).replace(" ", ""))
        if got is None:
            return 0.0
        value, used = got
        available = Counter(int(x) for x in task.metadata["numbers"].split())
        need = Counter(used)
        fits = need == available if self.exact_use else not (need - available)
        ok = fits and abs(value - int(task.metadata["target"])) < 1e-9
        return 1.0 if ok else self.format_reward


class Reverse:
    """Write a word backwards: prompt `rev abc:`, answer `cba`; reward 1 for the exact reversal. Word
    lengths have a long tail: most words have `min_len`..`short_len` letters, a fraction `tail` has
    `long_len`..`max_len`, so completion lengths do too (one token per letter with the char tokenizer).
    The long-tail workload of `tools/bench/vs_trl.py`: the slowest group gates a synchronous step."""

    domain = "reverse"
    LETTERS = "abcdefghijklmnopqrstuvwxyz"

    def __init__(self, min_len: int = 2, short_len: int = 6, long_len: int = 24, max_len: int = 48,
                 tail: float = 0.15, eval_size: int = 200) -> None:
        if not 1 <= min_len <= short_len <= max_len or not short_len <= long_len <= max_len:
            raise ValueError(f"reverse needs 1 <= min_len <= short_len <= long_len <= max_len, got "
                             f"{min_len}, {short_len}, {long_len}, {max_len}")
        if not 0.0 <= tail <= 1.0:
            raise ValueError(f"tail is a probability in [0, 1], got {tail}")
        self.min_len, self.short_len, self.long_len, self.max_len = min_len, short_len, long_len, max_len
        self.tail, self.eval_size = tail, eval_size

    def _make(self, rng: random.Random) -> Task:
        lo, hi = (self.long_len, self.max_len) if rng.random() < self.tail else (self.min_len, self.short_len)
        word = "".join(rng.choice(self.LETTERS) for _ in range(rng.randint(lo, hi)))
        return Task(prompt=f"rev {word}:", answer=word[::-1], domain=self.domain, metadata={"length": str(len(word))})

    def tasks(self, split: str, seed: int) -> Iterator[Task]:
        return _stream(self._make, split, seed, self.eval_size)

    def score(self, task: Task, completion: str) -> float:
        return 1.0 if _answer_of(completion) == task.answer else 0.0


def exact_match(task: Task, completion: str) -> float:
    """Reward function: 1 when the completion (up to a newline, trimmed) equals the task's answer."""
    return 1.0 if _answer_of(completion) == task.answer else 0.0


def first_tasks(env, split: str, seed: int, n: int) -> list[Task]:
    """The first `n` tasks of a stream (eval streams may be shorter)."""
    return list(itertools.islice(env.tasks(split, seed), n))
