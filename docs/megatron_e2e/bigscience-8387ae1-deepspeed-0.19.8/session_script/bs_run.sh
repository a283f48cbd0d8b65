#!/bin/bash
# The BLOOM set-up on the bigscience-workshop fork, 2 CPU ranks, 10 iterations. FORK: a checkout of 8387ae17 with
# megatron_integration/patches/bigscience.patch applied; DATA: the tiny data set megatron-e2e builds
# (runs/megatron-e2e/data, NullTokenizer ids 0-99, end of document 100); VOCAB: vocab.json {"0": 0, ...,
# "99": 99, "<|endoftext|>": 100} and merges.txt "#version: 0.2" (this fork has no NullTokenizer); OUT: output.
HERE=$(cd "$(dirname "$0")" && pwd)
cd "$FORK"
export DS_ACCELERATOR=cpu
python3 -m deepspeed.launcher.runner --num_gpus 2 --master_port "${PORT:-29731}" "$HERE/bs_entry.py" pretrain_gpt.py \
 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 \
 --micro-batch-size 2 --global-batch-size 8 --train-iters "${ITERS:-10}" --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine \
 --lr-warmup-iters 2 --weight-decay 0.01 --clip-grad 1.0 --seed 1234 --tokenizer-type GPT2BPETokenizer \
 --vocab-file "$VOCAB/vocab.json" --merge-file "$VOCAB/merges.txt" --split 98,2,0 \
 --eval-interval 1000 --eval-iters 1 --log-interval 5 --tensorboard-log-interval 1 \
 --log-layer-grad-norms --layer-grad-norms-layers all \
 --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion --use-cpu-initialization \
 --distributed-backend gloo --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 --bf16 \
 --data-path "$DATA/tiny_text_document" --tensorboard-dir "$OUT/tensorboard" \
 --deepspeed --deepspeed_config "$HERE/../bloom/ds_config.json"
