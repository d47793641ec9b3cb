"""GSM8K: `question` / `answer` columns, the gold number after `#### `; reward = the final number, compared as a number.

Extraction follows verl's `verl/utils/reward_score/gsm8k.py` (ReFT's convention), with two modes
(`data.gsm8k_method`):

- `strict`: only a number written after `#### ` counts (verl's "strict": this also rewards the format);
- `flexible` (default): the number after the last `#### ` if there is one, else the last `\\boxed{...}`, else the
  last number in the response (verl's "flexible" takes the last number only).

Differences from verl, on purpose: the last `#### ` wins (verl: the first), and answers compare as exact
numbers, not strings, after normalising `$`, thousands commas, units and words after the number, a trailing
`.`, `%`, unicode minus, `\\frac{a}{b}` / `a/b` fractions and decimals ("18.00" == "18", "1,000" == "1000",
"1/2" == "0.5").
"""

from __future__ import annotations

import re
from fractions import Fraction

from detrl.data.base import ChatTask

# verl's GSM8K instruction (examples/data_preprocess/gsm8k.py), appended to each question
DEFAULT_TEMPLATE = 'Let\'s think step by step and output the final answer after "####".'

_NUM = r"-?\$?\s?(?:\d[\d,]*(?:\.\d+)?|\.\d+)(?:\s*/\s*\d+(?:\.\d+)?)?"
_NUM_RE = re.compile(_NUM)
_HASH_RE = re.compile(r"####\s*(" + _NUM + ")")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{\s*(-?[\d.,]+)\s*\}\s*\{\s*(-?[\d.,]+)\s*\}")


def to_number(text: str | None) -> Fraction | None:
    """'$1,234.50' -> Fraction(2469, 2); '3/4' -> 3/4; None when it is not one number."""
    if text is None:
        return None
    s = text.strip().replace("\u2212", "-").replace("$", "").replace(",", "").replace(" ", "")
    s = s.rstrip(".").rstrip("%")
    if not s:
        return None
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return Fraction(num) / Fraction(den)
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} (or \\fbox{...}), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _number_in(text: str) -> str | None:
    """The single number a short answer fragment states: a \\frac, else its last number."""
    text = text.replace("\u2212", "-")
    frac = _FRAC_RE.findall(text)
    if frac:
        num, den = frac[-1]
        return f"{num}/{den}"
    nums = [m for m in _NUM_RE.findall(text) if to_number(m) is not None]
    return nums[-1] if nums else None


def extract_answer(response: str, method: str = "flexible") -> str | None:
    """The final answer's number as written (see the module doc); None when there is none."""
    response = response.replace("\u2212", "-")
    hashes = [m for m in _HASH_RE.findall(response) if to_number(m) is not None]
    if hashes:
        return hashes[-1]
    if method == "strict":
        return None
    boxed = last_boxed(response)
    if boxed is not None:
        found = _number_in(boxed)
        if found is not None:
            return found
    return _number_in(response)


def gold_answer(answer: str) -> str:
    """GSM8K's answer column is a worked solution ending in '#### 72'; the gold is what follows."""
    return answer.split("####")[-1].strip().replace(",", "") if "####" in answer else answer.strip()


def gsm8k_reward(response: str, gold: str, method: str = "flexible") -> float:
    got, want = to_number(extract_answer(response, method)), to_number(gold)
    return 1.0 if got is not None and want is not None and got == want else 0.0


class GSM8KTask(ChatTask):
    name = "gsm8k"

    def __init__(self, prompts, answers, method: str = "flexible", **kw):
        super().__init__(prompts, [gold_answer(a) for a in answers], **kw)
        self.method = method

    def reward(self, response: str, answer: str) -> float:
        return gsm8k_reward(response, answer, self.method)
