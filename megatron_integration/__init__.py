"""The Megatron-DeepSpeed side of layer-grad-norms: a small Megatron-style GPT for tests and the demo.

The training-log and TensorBoard integration with the forks is not built yet (see the project issues).
"""
