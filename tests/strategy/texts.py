"""Made-up text for tests that need a corpus: deterministic, small, written in a moment."""

from __future__ import annotations

import random

WORDS = ("the a model layout switch tensor pipeline expert data parallel rank step loss batch memory engine "
         "router token shard buffer state optimizer moment gradient").split()


def generated_documents(count: int = 300, seed: int = 0) -> list[str]:
    """``count`` documents of seeded random words (5-80 each), each ending in ``".\\n"``."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80))) + ".\n" for _ in range(count)]
