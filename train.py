"""detrl's one entrypoint.

python train.py                                   # tiny dense Qwen3, GRPO, determinism on, CPU
python train.py algo=dapo model=qwen3_moe determinism=off
python train.py -m determinism=on,off repeat=0,1,2
"""

import hydra
from omegaconf import DictConfig

from detrl.cli import main_task
from detrl.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> None:
    main_task(cfg)


if __name__ == "__main__":
    main()
