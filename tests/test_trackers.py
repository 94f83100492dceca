"""--report_to: TensorBoard, W&B and MLflow hold the values metrics.jsonl holds, offline; a tracker
that cannot start is one error line; 'all' and 'none'. W&B and MLflow: requirements-trackers.txt."""

import glob
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import pytest

from common import metrics
from common.args import parse_args
from common.errors import Stop
from conftest import corpus_args, launch, read_metrics

TRACKERS = ["tensorboard", "wandb", "mlflow"]


@dataclass
class NoFlags:
    """A recipe without flags of its own."""


def offline(tmp_path):
    """W&B offline, MLflow's file store: both in `tmp_path`, nothing sent, no login."""
    return {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),  # (its service's logs)
        "WANDB_API_KEY": None,
        "MLFLOW_TRACKING_URI": (tmp_path / "mlruns").as_uri(),
        "MLFLOW_ALLOW_FILE_STORE": "true",  # (MLflow 3 prefers a database; skinny has none)
    }


def wandb_records(path):
    """The records of a W&B run file (run-ID.wandb): LevelDB's log format, 32 KiB blocks of chunks
    (CRC32C, length, type: 1 whole, 2 first, 3 middle, 4 last) after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, pos, chunks = Path(path).read_bytes(), 7, b""
    assert data[:7] == b":W&B\xe1\xbe\x00", data[:7]
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or kind == 0:  # the block's zero padding
            pos += left
            continue
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            yield record
            chunks = b""


def logged(record):
    """What a recipe sends the trackers from a metrics.jsonl line: its numbers, nulls left out."""
    return {k: v for k, v in record.items() if isinstance(v, (int, float))}


def test_trackers_hold_what_metrics_jsonl_holds(tmp_path, cache_dir, small_corpus):
    pytest.importorskip("wandb", reason="pip install -r requirements-trackers.txt")
    pytest.importorskip("mlflow", reason="pip install -r requirements-trackers.txt")
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "out"
    env = offline(tmp_path)
    launch(
        "ddp",  # two ranks: the main process alone starts the trackers
        "recipes/llama.py",
        *corpus_args(small_corpus),
        *("--output_dir", out, "--report_to", ",".join(TRACKERS)),
        *("--block_size", 64, "--per_device_train_batch_size", 1, "--max_steps", 3),
        *("--logging_steps", 1, "--eval_steps", 3, "--max_eval_samples", 4, "--sample_tokens", 0),
        cache_dir=cache_dir,
        env=env,
        timeout=300,
    )
    steps = {r["step"]: logged(r) for r in read_metrics(out)[0]}
    assert sorted(steps) == [1, 2, 3] and "eval_loss" in steps[3], steps
    assert json.loads((out / "run_info.json").read_text())["trackers"] == TRACKERS

    # TensorBoard: float32 values
    boards = [EventAccumulator(str(p.parent)) for p in out.rglob("events.out.tfevents.*")]
    board = next(b for b in boards if "loss" in b.Reload().Tags()["scalars"])
    board_steps = {}
    for key in board.Tags()["scalars"]:
        for event in board.Scalars(key):
            board_steps.setdefault(event.step, {})[key] = event.value
    assert board_steps.keys() == steps.keys()
    for step, values in steps.items():
        assert board_steps[step] == pytest.approx(values, rel=2**-24), step

    # W&B: the offline run's history, exact
    (run_file,) = glob.glob(f"{tmp_path}/**/offline-run-*/*.wandb", recursive=True)  # rank 0 only
    records = list(wandb_records(run_file))
    history = [
        {i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    assert {h["_step"]: {k: v for k, v in h.items() if k[0] != "_"} for h in history} == steps
    config = [r.config for r in records if r.WhichOneof("record_type") == "config"]
    assert {u.key: json.loads(u.value_json) for c in config for u in c.update}["max_steps"] == 3
    (end,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert end.exit_code == 0

    # MLflow: the file store, exact
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # (restored after the test)
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.params["max_steps"] == "3"
    flow_steps = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            flow_steps.setdefault(m.step, {})[key] = m.value
    assert flow_steps == steps

    # no process left behind (W&B's service): none holds this test's WANDB_DIR
    for environ in glob.glob("/proc/[0-9]*/environ"):
        try:
            held = f"WANDB_DIR={env['WANDB_DIR']}\0".encode() in Path(environ).read_bytes()
        except OSError:  # ended meanwhile
            continue
        assert not held, environ


@pytest.fixture
def accelerator_with():
    """`make(log_with, project_dir)`: a real one-process Accelerator on the CPU (Accelerate's state
    is a per-process singleton: reset before and after)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    def make(log_with, out):
        reset()
        return Accelerator(cpu=True, log_with=log_with, project_dir=out)

    yield make
    reset()


def run_log(accelerator, out, report_to):
    """A recipe's `RunLog` for `out` (which exists), its trackers `report_to`."""
    args = parse_args(NoFlags, argv=["--output_dir", str(out), "--report_to", report_to])
    return metrics.RunLog(accelerator, args, "llama", run_info={})


def test_none_writes_metrics_jsonl_only(tmp_path, accelerator_with, monkeypatch):
    for key, value in offline(tmp_path).items():  # where W&B and MLflow would write
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)
    out = tmp_path / "out"
    out.mkdir()
    log = run_log(accelerator_with(None, out), out, "none")
    log.log({"step": 1, "loss": 2.5, "grad_norm": float("nan")})
    assert sorted(os.listdir(tmp_path)) == ["out"]
    assert sorted(os.listdir(out)) == ["metrics.jsonl", "run_info.json"]
    assert json.loads((out / "run_info.json").read_text())["trackers"] == []


def test_a_tracker_that_cannot_start_is_one_line(tmp_path, accelerator_with):
    out, blocked = tmp_path / "out", tmp_path / "file"
    out.mkdir()
    blocked.write_text("")  # in the way of TensorBoard's directory
    with pytest.raises(Stop) as stop:
        run_log(accelerator_with(["tensorboard"], blocked), out, "tensorboard")
    assert str(stop.value) == (
        "--report_to tensorboard: tensorboard failed to start: NotADirectoryError: "
        f"[Errno 20] Not a directory: '{blocked / 'llama'}'"
    )
    assert os.listdir(out) == []


def test_all_is_every_installed_tracker(tmp_path):
    pytest.importorskip("wandb", reason="pip install -r requirements-trackers.txt")
    pytest.importorskip("mlflow", reason="pip install -r requirements-trackers.txt")
    args = parse_args(NoFlags, argv=["--output_dir", str(tmp_path), "--report_to", "all"])
    assert args.report_to.split(",")[:3] == TRACKERS  # (LoggerType's order)
