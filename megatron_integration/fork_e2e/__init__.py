"""End to end in a real Megatron-DeepSpeed fork: ``layer-grad-norms megatron-e2e --fork DIR``.

- ``setups``: the set-ups (ZeRO-1, ZeRO-2, the BLOOM set-up, tensor parallel 2, and in 3D the BLOOM set-up
  and ZeRO-1), their flags and ds_config;
- ``launch``: the tiny data set (the fork's ``tools/preprocess_data.py``) and the DeepSpeed launcher;
- ``entry``, ``shims``: what each rank runs, the CPU shims, then the fork's ``pretrain_gpt.py``;
- ``checks``, ``verdict``: the log line, the TensorBoard scalars and layout, the root-sum-square;
- ``run``: all of it, per set-up, into ``OUT/summary.json`` and ``OUT/summary.md``.

The fork's code is never copied: the harness takes a checkout and runs it as it is, with the patch applied.
"""
