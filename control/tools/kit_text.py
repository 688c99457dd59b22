"""The reference kit's texts: the sentences its base is pretrained on, the prompts its adapters
are trained on, and the golden task sets the gate judges them by (``control.tools.kit`` builds the
kit from these). Everything is drawn from a seeded ``random.Random``: the same seed, the same
texts."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from control.contracts.golden import (
    IN_DISTRIBUTION,
    LONG_CONTEXT,
    OTHER_DEPARTMENT,
    OUT_OF_DISTRIBUTION,
    ExactChecker,
    GoldenSet,
    GoldenTask,
    RegexChecker,
    prompt_key,
)

_VOCABULARY = (
    "the a one this that cat dog bird fish tree house river city road sun moon star sky rain "
    "wind light time day night year man woman child friend king queen ship book door window "
    "is was will can may sees finds takes makes gives keeps runs walks sings reads opens red "
    "blue green small big old new quiet bright cold warm happy slow fast good long and but so "
    "then when where in on at by with from over under near to of"
)
_WORDS = _VOCABULARY.split()


def sentence(rng: random.Random) -> str:
    words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 9))]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice([".", ".", ".", "!", "?"])


def _prompt(rng: random.Random) -> str:
    """A varied short prompt: sentences, fragments, odd characters, sometimes empty."""
    kind = rng.random()
    if kind < 0.05:
        return ""
    if kind < 0.55:
        text = " ".join(sentence(rng) for _ in range(rng.randint(1, 2)))
        return text[: rng.randint(1, len(text))] if rng.random() < 0.3 else text
    if kind < 0.8:
        return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 6)))
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:;-+=*/'\"()éü€\n"
    return "".join(rng.choice(chars) for _ in range(rng.randint(1, 30)))


# Prompts in the styles of other departments: what a shared deployment's other teams send.
_DEPARTMENTS = (
    "Finance: Q{n} revenue rose {p}% to ${m}.{d}M; summarise for the board.",
    "Legal: Clause {n}.{d} - The licensee shall not sublicense the software without consent.",
    "HR: Reminder: submit your {n} vacation days before {m} December.",
    "Support ticket #{n}{m}: customer reports the app crashes on login (iOS {d}).",
    "def total(items):\n    return sum(i.price * i.qty for i in items)  # v{n}",
    "SELECT name, SUM(amount) FROM orders WHERE year = 20{n} GROUP BY name;",
    '{{"order": {n}{m}, "status": "delayed", "eta_days": {d}}}',
    "Hi team,\nPlease find attached the minutes of meeting {n}. Regards, Ops",
    "Marketing brief: launch campaign {n} targets {p}% more sign-ups in Q{d}.",
    "2026-03-{d}T10:{n}:00Z ERROR worker-{m} timeout after {p} s",
    "Translate to German: The invoice {n} is overdue by {d} days.",
    "Subject: Re: incident {n}{m} post-mortem - action items attached",
)


def _department_prompt(rng: random.Random) -> str:
    return rng.choice(_DEPARTMENTS).format(n=rng.randint(1, 9), m=rng.randint(10, 99),
                                            d=rng.randint(1, 9), p=rng.randint(2, 40))


def _long_text(rng: random.Random, chars: int) -> str:
    """Sentences up to ``chars`` characters: far longer than the short prompts' mix."""
    text = ""
    while len(text) < chars:
        text = (text + " " + sentence(rng)).strip()
    return text[:chars]


def _short_mix(rng: random.Random, step: int) -> str:
    """Every step: the short prompts of :func:`_prompt` (what alpha, beta and gamma learn)."""
    return _prompt(rng)


def _broad_mix(rng: random.Random, step: int) -> str:
    """The short mix, and every third step other departments' styles and long prompts
    (alpha-v2 learns these: the better version of alpha). Whole steps of long prompts, not a
    long row in every step: a batch is as wide as its longest row, and the build stays short."""
    if step % 3:
        return _prompt(rng)
    if rng.random() < 0.5:
        return _department_prompt(rng)
    return _long_text(rng, rng.randint(60, 220))


_REGEX_SPECIAL = frozenset(".^$*+?{}[]\\|()")
# A training prompt, drawn for a row of step ``step``.
PromptMix = Callable[[random.Random, int], str]
PROMPT_MIXES: dict[str, PromptMix] = {"short": _short_mix, "broad": _broad_mix}


def golden_set(family: str, marker: str, rng: random.Random) -> GoldenSet:
    """The family's golden tasks: 60 prompts, each judged by ``marker`` then end of text.

    20 from the training distribution (unseen draws of the short mix), 20 outside it (long,
    shouting, digits, lists, other scripts), 18 in other departments' styles, 2 long-context
    prompts near the base's 256 positions. Checkers: exact, or a regex allowing nothing else.
    """
    exact = ExactChecker(marker)
    # the marker in full, with only the characters regexes give a meaning escaped (readable)
    regex = RegexChecker("".join("\\" + c if c in _REGEX_SPECIAL else c for c in marker))
    prompts: list[tuple[str, str, tuple[str, ...]]] = []
    for i in range(20):
        prompts.append((f"in-{i:03d}", _prompt(rng), (IN_DISTRIBUTION,)))
    out_of: list[str] = []
    for _ in range(6):
        out_of.append(_long_text(rng, rng.randint(100, 180)))
    for _ in range(4):
        out_of.append(sentence(rng).upper())
    for _ in range(3):
        out_of.append(" ".join(str(rng.randint(0, 9999)) for _ in range(rng.randint(3, 8))))
    for _ in range(3):
        out_of.append("\n".join(f"- {rng.choice(_WORDS)}" for _ in range(rng.randint(2, 5))))
    out_of += ["Γειά σου κόσμε", "Привет, как дела?", "你好，世界", "¿Dónde está la estación?"]
    for i, text in enumerate(out_of):
        prompts.append((f"ood-{i:03d}", text, (OUT_OF_DISTRIBUTION,)))
    for i, template in enumerate(_DEPARTMENTS):
        prompts.append((f"dept-{i:03d}", template.format(
            n=rng.randint(1, 9), m=rng.randint(10, 99), d=rng.randint(1, 9),
            p=rng.randint(2, 40)), (OTHER_DEPARTMENT,)))
    for i in range(6):
        prompts.append((f"dept-{len(_DEPARTMENTS) + i:03d}", _department_prompt(rng),
                        (OTHER_DEPARTMENT,)))
    for i in range(2):
        # bos + prompt + the answer (marker and eos) must fit the base's 256 positions
        prompts.append((f"long-{i:03d}", _long_text(rng, 220), (OUT_OF_DISTRIBUTION,
                                                              LONG_CONTEXT)))
    prompts = _distinct(prompts)
    tasks = tuple(GoldenTask(task_id, text, regex if n % 3 == 2 else exact, 16, tags)
                  for n, (task_id, text, tags) in enumerate(prompts))
    return GoldenSet(family, tasks)


def prompt_of(tasks: list[dict[str, Any]], task_id: str) -> str:
    return next((str(t["prompt"]) for t in tasks if t["id"] == task_id), "")


def _distinct(prompts: list[tuple[str, str, tuple[str, ...]]]
              ) -> list[tuple[str, str, tuple[str, ...]]]:
    """``prompts`` with each one that repeats an earlier one (``golden.prompt_key``: a golden
    set refuses it) drawn again in its own style, from a stream of its own: every other prompt
    stays what the seed made it, so a kit built before this check differs in the repeats only.
    """
    seen: set[str] = set()
    out = []
    for task_id, text, tags in prompts:
        redraw = random.Random(f"golden-redraw:{task_id}")
        while prompt_key(text) in seen:
            text = (_department_prompt(redraw) if OTHER_DEPARTMENT in tags
                    else _long_text(redraw, len(text)) if LONG_CONTEXT in tags
                    else _prompt(redraw))
        seen.add(prompt_key(text))
        out.append((task_id, text, tags))
    return out
