"""report_to (TensorBoard, W&B offline, MLflow to a local store) and push_to_hub (offline): read back.

Each tracker is fed a short run's events through the sink, and what it wrote is read back
with the tracker's own reader (TensorBoard's EventAccumulator, MLflow's client, W&B's record
protobufs in its offline ``.wandb`` file).
"""
from __future__ import annotations

import glob
import json
import struct

import pytest

import outcore
from outcore.errors import ConfigError
from outcore.events import EvalEvent, RunFinished, RunStarted, StepEvent, TierStats
from outcore.training.config import TRACKERS, load_config
from outcore.training.hub import HubError, push_to_hub
from outcore.tui import make_sink
from outcore.tui import trackers as trackers_mod

LOSSES = [4.0, 3.5, 3.25]


def _run_events(out) -> list:
    started = RunStarted(run_name="t", model="tiny", n_params=10, n_trainable=10, total_steps=3,
                         output_dir=str(out), config={"lr": 1e-4, "report_to": ["x"]})
    steps = [StepEvent(step=i + 1, total_steps=3, loss=loss, lr=1e-4 * (i + 1), tokens_per_s=100.0 + i,
                       step_s=0.5, elapsed_s=0.5 * (i + 1), rss_bytes=2**20, grad_norm=1.5,
                       tiers={"HOST": TierStats(held_bytes=4096 * (i + 1), read_gbps=1.25)})
             for i, loss in enumerate(LOSSES)]
    return [started, *steps, EvalEvent(step=3, eval_loss=3.0, perplexity=20.0),
            RunFinished(steps_done=3, wall_s=1.5, peak_rss_bytes=2**20, output_dir=str(out))]


def _feed(out, names) -> None:
    sink = make_sink("none", out, report_to=names)
    for e in _run_events(out):
        sink.emit(e)
    sink.close()


def test_the_tracker_names_are_the_configs():
    assert tuple(trackers_mod.PACKAGES) == TRACKERS
    assert load_config(overrides=["report_to=tensorboard,mlflow"]).report_to == ["tensorboard", "mlflow"]
    with pytest.raises(ConfigError, match="report_to='neptune'"):
        load_config(overrides=["report_to=neptune"])


def test_event_metrics_carry_the_step_and_the_tiers():
    step, m = trackers_mod.event_metrics(_run_events("o")[1])
    assert step == 1 and m["train/loss"] == 4.0 and m["train/grad_norm"] == 1.5
    assert m["tiers/HOST/held_bytes"] == 4096 and m["tiers/HOST/read_gbps"] == 1.25
    assert trackers_mod.event_metrics(_run_events("o")[-2]) == (3, {"eval/loss": 3.0, "eval/perplexity": 20.0})


def test_tensorboard_logs_every_metric_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _feed(tmp_path, ["tensorboard"])
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(s.step, s.value) for s in acc.Scalars("train/loss")] == list(zip([1, 2, 3], LOSSES))
    assert [s.value for s in acc.Scalars("eval/loss")] == [3.0]
    assert [s.value for s in acc.Scalars("tiers/HOST/held_bytes")] == [4096.0, 8192.0, 12288.0]


def test_mlflow_logs_to_a_local_store(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    _feed(tmp_path, ["mlflow"])
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("outcore").experiment_id])
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert sorted((m.step, m.value) for m in history) == list(zip([1, 2, 3], LOSSES))
    assert run.data.params["lr"] == "0.0001" and run.info.status == "FINISHED"


def _wandb_history(path) -> list[dict]:
    """The history records of an offline ``.wandb`` file (W&B's log format: 7-byte file header,
    32 KiB blocks of records with a crc32 / length / type header, each a ``Record`` protobuf)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, pos, block, rows, buf = open(path, "rb").read(), 7, 32768, [], b""
    while pos + 7 <= len(raw):
        left = block - pos % block
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if n == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf, pos = buf + raw[pos + 7:pos + 7 + n], pos + 7 + n
        if kind in (1, 4):  # FULL or LAST piece of a record
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return rows


@pytest.mark.slow(ci=True)  # wandb starts its service process (~10 s)
def test_wandb_logs_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    _feed(tmp_path, ["wandb"])
    (path,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    rows = [r for r in _wandb_history(path) if "train/loss" in r]
    assert [(r["_step"], r["train/loss"]) for r in rows] == list(zip([1, 2, 3], LOSSES))


def test_a_missing_tracker_library_is_one_line_naming_the_package(monkeypatch):
    real = trackers_mod.importlib.util.find_spec
    monkeypatch.setattr(trackers_mod.importlib.util, "find_spec", lambda m: None if m == "mlflow" else real(m))
    with pytest.raises(ConfigError, match=r"report_to=mlflow needs the 'mlflow-skinny' package; "
                                          r"run `pip install mlflow-skinny`"):
        make_sink("none", None, report_to=["tensorboard", "mlflow"])


def test_finetune_reports_to_tensorboard(tiny_run_inputs, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    outcore.finetune(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                     max_steps=2, eval_every=0, eval_batches=1, output=str(out), ui="none", val_fraction=0.1,
                     offload="cpu", report_to="tensorboard", export=False)
    rows = [json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in r]
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert [s.value for s in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in rows if "step" in r])
    assert "tiers/HOST/held_bytes" in acc.Tags()["scalars"]


def test_push_to_hub_offline_is_one_line_and_keeps_the_outputs(tiny_run_inputs, tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    out = tmp_path / "run"
    with pytest.raises(HubError) as err:
        outcore.finetune(model=str(tiny_run_inputs / "model"), data=str(tiny_run_inputs / "data.txt"), seq_len=32,
                         max_steps=1, eval_every=0, eval_batches=1, output=str(out), ui="none", val_fraction=0.1,
                         offload="none", push_to_hub="me/tiny")
    msg = str(err.value)
    assert "\n" not in msg and "push_to_hub='me/tiny'" in msg and "offline" in msg.lower()
    assert f"hf upload me/tiny {out / 'final'}" in msg
    assert (out / "final" / "config.json").is_file() and (out / "metrics.jsonl").is_file()


def test_push_to_hub_without_network_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    (tmp_path / "final").mkdir()
    with pytest.raises(HubError, match=r"push_to_hub='me/tiny' failed \(") as err:
        push_to_hub(tmp_path / "final", "me/tiny")
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="set export=true"):
        load_config(overrides=["push_to_hub=me/tiny", "export=false"])
