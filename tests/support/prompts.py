"""The prompts that parity and cluster tests ask the model (one list, so their answers compare)."""

from __future__ import annotations

PROMPTS = [
    "What is the capital of France? Tell me about the city.",
    "Write a short Python function that checks whether a number is prime.",
    "List three tips for staying focused while working from home.",
]
