"""detrl: study and remove nondeterminism in RL training of LLMs."""

import os

# The rollout workers are processes that share the cores with this one, so this process's idle OpenMP
# threads should sleep at once rather than spin: libgomp's default spin after the trainer's last parallel
# region cost the next rollout ~40% on 2 cores (measured: 18.1 vs 26.8 ms for 32 x 16 tokens; the
# trainer's matmuls did not slow down). libgomp reads this when torch loads it: import detrl first.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")

__version__ = "0.1.0"
