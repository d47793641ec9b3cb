"""`python -m detrl.serve`: the SGLang stand-in (detrl.rollout.sglang.app)."""

from detrl.rollout.sglang.app import main

if __name__ == "__main__":
    main()
