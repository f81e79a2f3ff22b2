"""Prompt sets for ``lakeshard bench spec``.

``code``: code completion and edits, where much of the answer restates code in the prompt
(prompt lookup's best case, and the draft model's). ``chat``: open questions with free prose.
"""

from __future__ import annotations

_MERGE = """def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out"""

_STATS = """class RunningStats:
    def __init__(self):
        self.n = 0
        self.mean = 0.0
        self.m2 = 0.0

    def push(self, x):
        self.n += 1
        delta = x - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (x - self.mean)

    def variance(self):
        return self.m2 / (self.n - 1) if self.n > 1 else 0.0"""

_PARSE = """import csv

def load_sales(path):
    totals = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            region = row["region"]
            amount = float(row["amount"])
            if region not in totals:
                totals[region] = 0.0
            totals[region] += amount
    return sorted(totals.items(), key=lambda kv: kv[1], reverse=True)"""

_CACHE = """class LRUCache:
    def __init__(self, capacity):
        self.capacity = capacity
        self.data = {}
        self.order = []

    def get(self, key):
        if key not in self.data:
            return None
        self.order.remove(key)
        self.order.append(key)
        return self.data[key]

    def put(self, key, value):
        if key in self.data:
            self.order.remove(key)
        elif len(self.data) >= self.capacity:
            oldest = self.order.pop(0)
            del self.data[oldest]
        self.data[key] = value
        self.order.append(key)"""

PROMPTS: dict[str, list[str]] = {
    "code": [
        "Add type hints and a docstring to this function. Reply with the full function only.\n\n"
        f"```python\n{_MERGE}\n```",
        f"Rename `delta` to `diff` and `m2` to `sum_sq` everywhere in this class, and add a `stddev` method. "
        f"Reply with the full class.\n\n```python\n{_STATS}\n```",
        f"Rewrite this function to use collections.defaultdict. Reply with the full code.\n\n```python\n{_PARSE}\n```",
        f"Rewrite this class to use collections.OrderedDict, keeping the same methods. Reply with the full "
        f"class.\n\n```python\n{_CACHE}\n```",
    ],
    "chat": [
        "What are three good habits for staying focused while working from home?",
        "Explain the difference between a process and a thread to a new programmer.",
        "Plan a relaxed one-day visit to Lisbon for someone who likes food and history.",
        "Why do leaves change colour in autumn?",
    ],
}
