"""detrl: study and remove nondeterminism in RL training of LLMs."""

__version__ = "0.1.0"
