"""The fake fork's training script, run by the harness as ``pretrain_gpt.py ARGS``."""

from megatron.training import pretrain

if __name__ == "__main__":
    pretrain()
