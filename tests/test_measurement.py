"""The per-step measurement and the step schedule: their states, failures, and what they allocate."""

import subprocess
import sys
import textwrap

import pytest
import torch

from deepspeed_patch.config import LayerGradNormsConfig
from deepspeed_patch.plain import LayerGradNorms
from deepspeed_patch.statistics.layer_map import build_layer_map
from deepspeed_patch.statistics.measurement import Measurement
from deepspeed_patch.statistics.partition_slices import slices_of_spans
from deepspeed_patch.statistics.reduction import REPLICATED
from megatron_integration.tiny_gpt import TinyGPT, TinyGPTConfig, synthetic_batch


def test_observe_after_the_step_is_finished_is_an_error():
    measurement = Measurement(step=1, num_buckets=1, num_partitions=1, device="cpu", extra=())
    measurement.observe(0, [torch.ones(4)], torch.tensor([0]))
    result = measurement.finish(REPLICATED, overflow=False, keys=[0], selected=[0])
    assert result["pre_clip"][0]["norm"] == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="step 1 is finished"):
        measurement.observe(0, [torch.ones(4)], torch.tensor([0]))


def test_a_step_missing_a_group_reports_nothing():
    measurement = Measurement(step=3, num_buckets=1, num_partitions=2, device="cpu", extra=())
    measurement.observe(0, [torch.ones(4)], torch.tensor([0]))
    assert measurement.finish(REPLICATED, overflow=False, keys=[0], selected=[0]) is None


def _measure_four_steps(norms: LayerGradNorms, model: TinyGPT, at_step_2=None) -> list:
    results = []
    for step in range(4):
        model.zero_grad()
        model(synthetic_batch(model.config, 2, seed=step)).backward()
        if step == 1 and at_step_2 is not None:
            at_step_2()
        results.append(norms.measure())
    return results


def test_a_failure_after_the_reduction_leaves_no_stale_result_and_switches_off_at_the_next_measured_step(
        monkeypatch, caplog):
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    norms = LayerGradNorms(model)
    from deepspeed_patch.statistics import measurement

    original, calls = measurement.step_result, []

    def failing_result(*args):  # once: a failure after step 2's reduction, on this rank
        calls.append(args)
        if len(calls) == 1:
            raise ValueError("injected")
        return original(*args)

    results = _measure_four_steps(norms, model,
                                  lambda: monkeypatch.setattr(measurement, "step_result", failing_result))
    assert results[0]["step"] == 1
    assert results[1] is None and norms.adapter.result() is None  # not step 1's result
    assert results[2] is None and norms.adapter.latch.broken  # announced through step 3's reduction
    assert results[3] is None
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "finishing the step failed at step 2" in tracebacks[0].getMessage()
    assert sum("could not measure step 3" in record.getMessage() for record in caplog.records) == 1


def test_a_failing_dump_stops_itself_alone_logged_once(tmp_path, caplog):
    torch.manual_seed(0)
    model = TinyGPT(TinyGPTConfig())
    norms = LayerGradNorms(model, dump={"path": str(tmp_path / "dump.jsonl")})
    dump = norms.adapter.publisher.dump

    def failing_write(record):
        raise OSError("disk full")

    results = _measure_four_steps(norms, model, lambda: setattr(dump.reader, "write", failing_write))
    assert [result["step"] for result in results] == [1, 2, 3, 4]  # the statistics go on
    assert not norms.adapter.latch.broken and dump.failed
    tracebacks = [record for record in caplog.records if record.exc_info]
    assert len(tracebacks) == 1 and "the JSONL dump failed at step 2" in tracebacks[0].getMessage()
    with open(tmp_path / "dump.jsonl") as lines:
        assert len(lines.readlines()) == 1  # step 1's


def test_chunked_views_are_the_runs_of_the_concatenated_chunks():
    chunks = [torch.arange(start, start + size, dtype=torch.float32) for start, size in ((0, 5), (5, 1), (6, 7))]
    runs = [(0, 3, 0), (3, 4, 1), (8, 3, 2), (11, 2, 0)]  # the second run crosses two chunk boundaries
    slices = slices_of_spans(runs)
    views, buckets = slices.chunked_views(chunks)
    flat = torch.cat(chunks)
    by_bucket = {bucket: [] for bucket in range(3)}
    for view, bucket in zip(views, buckets.tolist()):
        by_bucket[bucket].append(view)
    expected = {bucket: [] for bucket in range(3)}
    for view, bucket in zip(slices.views(flat), slices.buckets.tolist()):
        expected[bucket].append(view)
    for bucket in range(3):
        assert torch.equal(torch.cat(by_bucket[bucket]), torch.cat(expected[bucket]))
    assert all(view.untyped_storage().data_ptr() in {c.untyped_storage().data_ptr() for c in chunks} for view in views)


def test_step_schedule_numbers_steps_from_the_engine_count():
    model = TinyGPT(TinyGPTConfig())
    named = list(model.named_parameters())
    layer_map = build_layer_map(named, [name for name, _ in named])
    completed = [41]
    from deepspeed_patch.statistics.steps import StepSchedule

    schedule = StepSchedule(LayerGradNormsConfig(enabled=True, interval=2), layer_map, lambda: completed[0])
    assert schedule.next_step() is True and schedule.step == 42
    completed[0] = 42
    assert schedule.next_step() is False and schedule.step == 43


PEAK_MEMORY_SCRIPT = textwrap.dedent("""
    import resource, torch
    from deepspeed_patch.statistics.measurement import Measurement
    from deepspeed_patch.adapters.optimizer import observe_chunks
    from deepspeed_patch.statistics.partition_slices import slices_of_spans
    from deepspeed_patch.statistics.kernels import STOCK, chunk_partition

    sizes = [12_000_000, 20_000_000, 18_000_000]  # a 50M-element fp16 partition, as per-parameter pieces
    chunks = [torch.full((size,), 0.5, dtype=torch.float16) for size in sizes]
    chunks[1][7] = float("inf")
    table = chunk_partition(slices_of_spans([(0, 30_000_000, 0), (30_000_000, 20_000_000, 1)]), "cpu", kernel=STOCK)
    measurement = Measurement(step=1, num_buckets=2, num_partitions=1, device="cpu", extra=())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    observe_chunks(measurement, 0, table, chunks)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    print(grown, int(measurement.stats[0, 1]), int(measurement.stats[1, 1]))
""")


def test_reading_a_skipped_steps_fp16_pieces_copies_no_partition():
    """The fp16 partition (100 MB) is read piece by piece: a converted or concatenated copy would add
    100 to 200 MB to the peak memory of the process; the scratch buffer adds 2 MiB."""
    result = subprocess.run([sys.executable, "-c", PEAK_MEMORY_SCRIPT], capture_output=True, text=True, check=True)
    grown_kib, nonfinite_first, nonfinite_second = map(int, result.stdout.split()[-3:])
    assert (nonfinite_first, nonfinite_second) == (1, 0)
    assert grown_kib < 16 * 1024, f"peak memory grew by {grown_kib} KiB reading the partition"
