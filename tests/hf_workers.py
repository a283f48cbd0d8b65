"""What each rank runs in the Hugging Face Trainer tests: a tiny GPT-2, built from a config (no download),
trained a few steps by a real ``Trainer`` with ``LayerGradNormsCallback``, under DeepSpeed or without it.

Besides the Trainer's ``log_history`` a run records, independently of the callback, what the engine
reported after each step (``engine.get_layer_grad_norms()``) or, without DeepSpeed, the gradient as
it was before the Trainer clipped it.
"""

import contextlib
import glob
import io
import logging
import os
import re
import tempfile
import traceback
import warnings
from typing import Any, Dict, Hashable, Optional

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from reference import bucket_stats

STEPS = 3
MAX_GRAD_NORM = 0.05  # small enough that the Trainer clips every step
GPT2_LAYER = re.compile(r"\.h\.(\d+)\.")


def gpt2_bucket(name: str) -> Hashable:
    """The documented bucket of a GPT-2 parameter: ``h.N.`` gives layer N, others their module."""
    match = GPT2_LAYER.search(name)
    return int(match.group(1)) if match else name.rpartition(".")[0]


def tiny_gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=3, n_head=2))


class SyntheticText(torch.utils.data.Dataset):
    """Random token sequences, each its own label."""

    def __init__(self, size: int = 32, length: int = 16) -> None:
        generator = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (size, length), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def ds_config(stage: int, block: Optional[dict]) -> Dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {"stage": stage},
        "steps_per_print": 10**9,
    }
    if block is not None:
        config["layer_grad_norms"] = block
    return config


def make_trainer(output_dir: str, deepspeed: Optional[dict], callback, gas: int = 1, added_late: bool = False):
    """A ``Trainer`` with ``callback`` (given to the Trainer, or with ``added_late`` through
    ``trainer.add_callback`` once it is built), a recorder of what happens outside it, and TensorBoard logging."""
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, gradient_accumulation_steps=gas,
                             max_steps=STEPS, logging_steps=1, learning_rate=1e-3, max_grad_norm=MAX_GRAD_NORM,
                             use_cpu=True, deepspeed=deepspeed, report_to=["tensorboard"], save_strategy="no",
                             disable_tqdm=True, seed=0)
    model = tiny_gpt2()
    recorder = Recorder()
    trainer = RecordingTrainer(model=model, args=args, train_dataset=SyntheticText(),
                               callbacks=[recorder] if added_late or callback is None else [callback, recorder])
    if added_late:
        trainer.add_callback(callback)
    recorder.trainer = trainer
    return trainer, recorder


class Recorder(TrainerCallback):
    """The engine's own result after each optimizer step (DeepSpeed)."""

    def __init__(self) -> None:
        self.trainer = None
        self.engine_results = []

    def on_step_end(self, args, state, control, **kwargs):
        engine = self.trainer.model_wrapped
        if hasattr(engine, "get_layer_grad_norms"):
            self.engine_results.append(engine.get_layer_grad_norms())


class RecordingTrainer(Trainer):
    """Keeps each step's gradient as it was before the Trainer clipped it (without DeepSpeed)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pre_clip_grads = []

    def _clip_grad_norm(self, model):
        self.pre_clip_grads.append(
            {name: p.grad.detach().double().clone()
             for name, p in model.named_parameters() if p.grad is not None})
        return super()._clip_grad_norm(model)


def tensorboard_tags(log_dir: str) -> Dict[str, Dict[int, float]]:
    """Every scalar the Trainer's TensorBoard integration wrote: tag -> {step: value}."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: Dict[str, Dict[int, float]] = {}
    for events in glob.glob(os.path.join(log_dir, "**", "events.out.tfevents.*"), recursive=True):
        accumulator = EventAccumulator(events)
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update((e.step, e.value) for e in accumulator.Scalars(tag))
    return scalars


FAULTY_STEP = 2
"""The logging step at which a callback of ``faulty_callback`` fails."""


def new_callback(options: Optional[dict]):
    """Made before the model: under ZeRO-3 the model is built partitioned, which needs the patch installed.
    ``None``: no callback; ``{"fault": True, ...}``: one whose reading of the values raises at ``FAULTY_STEP``."""
    from deepspeed_patch.hf import LayerGradNormsCallback

    if options is None:
        return None
    options = dict(options)
    if not options.pop("fault", False):
        return LayerGradNormsCallback(**options)

    class Faulty(LayerGradNormsCallback):
        def _values(self, args, state, logs):
            if state.global_step == FAULTY_STEP:
                raise RuntimeError("injected failure")
            return super()._values(args, state, logs)

    return Faulty(**options)


class Failures(logging.Handler):
    """The messages logged with a traceback."""

    def __init__(self) -> None:
        super().__init__()
        self.messages = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.messages.append(record.getMessage())


def run(deepspeed: Optional[dict], callback_options: Optional[dict], gas: int = 1, callback=None,
        added_late: bool = False, output_root: Optional[str] = None) -> Dict[str, Any]:
    """One Trainer run (with ``callback``, else a new one of ``callback_options``, ``None`` for none), its output
    (TensorBoard's included) in a new folder of ``output_root``; what the tests check, or the error (a refusal at
    initialize is a result too). ``console``: the lines the Trainer's console callback printed (``disable_tqdm``:
    its ``PrinterCallback``); ``failures``: what was logged with a traceback."""
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    failures, console = Failures(), io.StringIO()
    logging.getLogger().addHandler(failures)
    with tempfile.TemporaryDirectory(dir=output_root) as output_dir, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            callback = callback or new_callback(callback_options)
            trainer, recorder = make_trainer(output_dir, deepspeed, callback, gas, added_late)
            with contextlib.redirect_stdout(console):
                trainer.train()
        except Exception:
            return {"error": traceback.format_exc()}
        finally:
            logging.getLogger().removeHandler(failures)
        record = {
            "console": [line for line in console.getvalue().splitlines() if line.startswith("{")],
            "failures": failures.messages,
            "warnings": [str(w.message) for w in caught if "LayerGradNormsCallback" in str(w.message)],
            "log_history": trainer.state.log_history,
            "engine_results": recorder.engine_results,
            "reference": [bucket_stats(grads, gpt2_bucket) for grads in trainer.pre_clip_grads],
            "tensorboard": tensorboard_tags(output_dir),
        }
        if hasattr(trainer.model_wrapped, "destroy"):
            trainer.model_wrapped.destroy()
        return record


def run_deepspeed_cases(cases: Dict[str, dict]) -> Dict[str, Any]:
    """Each case ``{"stage", "block", "gas", "options", "reuse"}`` on this rank, in one launch, in order;
    ``reuse`` names an earlier case whose callback this one's Trainer is given again."""
    callbacks, records = {}, {}
    for name, case in cases.items():
        callbacks[name] = callbacks[case["reuse"]] if "reuse" in case else new_callback(case.get("options", {}))
        records[name] = run(ds_config(case["stage"], case["block"]), {}, case.get("gas", 1), callbacks[name])
    return records


def run_with_every_log(output_dir: str, monitors: str) -> Dict[str, Any]:
    """A ZeRO-2 Trainer run leaving every log ``plot`` and ``report`` read: the Trainer's TensorBoard
    (``report_to``) and ``trainer_state.json``, DeepSpeed's TensorBoard and CSV monitors (in ``monitors``), and
    the JSONL dump, rotated at every line; every optimizer kind on. Returns the Trainer's ``log_history``."""
    from deepspeed_patch.hf import LayerGradNormsCallback

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    config = ds_config(2, {"enabled": True, "optimizer_statistics": ["param", "update", "exp_avg", "exp_avg_sq"],
                           "dump": {"path": os.path.join(output_dir, "dump.jsonl"), "max_bytes": 1024, "backups": 10}})
    config.update(tensorboard={"enabled": True, "output_path": monitors, "job_name": "tb"},
                  csv_monitor={"enabled": True, "output_path": monitors, "job_name": "csv"})
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=2, max_steps=EVERY_LOG_STEPS,
                             logging_steps=1, learning_rate=1e-3, use_cpu=True, deepspeed=config,
                             report_to=["tensorboard"], save_strategy="no", disable_tqdm=True, seed=0)
    callback = LayerGradNormsCallback()
    trainer = Trainer(model=tiny_gpt2(), args=args, train_dataset=SyntheticText(), callbacks=[callback])
    trainer.train()
    trainer.save_state()
    trainer.model_wrapped.destroy()
    return {"log_history": trainer.state.log_history}


EVERY_LOG_STEPS = 6
