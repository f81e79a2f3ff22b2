"""The users of ``lakeshard bench batching``: 16 different chat and code questions.

Each user asks a different one, so the streams of a batch have different prompt lengths (with
a chat template, from about 20 to 120 tokens). Short and long ones alternate, so every number
of users has a mix of both.
"""

from __future__ import annotations

from agent.runtime.tokenizer import ChatTokenizer

_FIB = """def fib(n):
    if n < 2:
        return n
    return fib(n - 1) + fib(n - 2)"""

_WORDS = """def count_words(path):
    counts = {}
    for line in open(path):
        for word in line.split():
            word = word.lower().strip(".,;:!?")
            counts[word] = counts.get(word, 0) + 1
    return counts"""

_STACK = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, x):
        self.items.append(x)

    def pop(self):
        return self.items.pop()

    def peek(self):
        return self.items[-1]"""

TEXTS = [
    "Why is the sky blue?",
    f"Explain what this function does and how fast it is.\n\n```python\n{_FIB}\n```",
    "Write a Python function that checks whether a string is a palindrome.",
    f"Find the bugs in this function and give a fixed version.\n\n```python\n{_WORDS}\n```",
    "Give me three tips for writing clear emails at work.",
    f"Add an is_empty method and type hints to this class. Reply with the full class.\n\n```python\n{_STACK}\n```",
    "What is the difference between a list and a tuple in Python?",
    "Plan a relaxed one-day visit to Lisbon for someone who likes food, old streets and history, "
    "with a lunch place and a view for the sunset.",
    "Translate 'thank you very much' into Spanish, French and German.",
    "Write a SQL query that returns the ten customers with the highest total order amount, "
    "given tables customers(id, name) and orders(id, customer_id, amount, created_at), "
    "counting only orders from the last 30 days.",
    "How does a hash map work?",
    "Write a bash one-liner that finds the five largest files under the current directory, "
    "including files in subdirectories, and prints their sizes in a human-readable form.",
    "Summarise the causes of the French Revolution in four sentences.",
    "Explain the difference between a process and a thread to a new programmer, with an example "
    "of when to use each, and what can go wrong when threads share memory without locks.",
    "Write a haiku about a laptop that lends its processor to its colleagues at night.",
    "Write a JavaScript function that debounces another function: it waits until the calls have "
    "stopped for a given number of milliseconds before calling it once with the last arguments.",
]


def user_prompts(tok: ChatTokenizer, users: int) -> list[list[int]]:
    """The chat-template token ids of the first ``users`` questions (repeated past 16)."""
    return [tok.chat_ids([{"role": "user", "content": TEXTS[i % len(TEXTS)]}]) for i in range(users)]
