"""Tracker backends written and read back with the tool's own reader: scalars, histograms and the run's settings as
hyperparameters (TensorBoard's HParams, MLflow's params). W&B is read back from the end-to-end run's `crl track`
(tests/e2e/test_run.py): its offline writer finishes in a service process that a process of its own waits for."""

from __future__ import annotations

import importlib.util
import os

import pytest

from pipeline.tracking.backends import MlflowBackend, TensorBoardBackend
from pipeline.tracking.fold import Histogram, Scalar, Text, as_table, hparams
from pipeline.tracking.readback import mlflow_entries, tensorboard_entries
from pipeline.tracking.settings import TrackerSettings

RUN = "backends-run"
CONFIG = {"scheduler": {"arm": "complementary", "steps": 4}, "actor_trainer": {"lr": 1e-5, "group_size": 8},
          "kafka": {"bootstrap_servers": "localhost:9092"}}
ENTRIES = [Scalar("train/actor/entropy", 1, 1.75, 1_700_000_000.0),
           Histogram("train/actor/advantages", 1, (1.5, -0.5, -0.5, -0.5), 1_700_000_000.0),
           Histogram("train/actor/rewards", 1, (1.0, 0.0, 0.0, 0.0), 1_700_000_000.0),
           Text("extractor/generations", 1, "**g** answer", 1_700_000_000.0)]


def _needs(name: str) -> None:
    if importlib.util.find_spec(name) is None:
        message = f"{name} not installed (pip install -e '.[tracking]')"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def test_tensorboard_writes_histograms_and_the_hparams_of_the_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    backend = TensorBoardBackend(tmp_path / "tensorboard", RUN, CONFIG)
    backend.write(ENTRIES)
    backend.close()
    assert tensorboard_entries(tmp_path / "tensorboard") == as_table(ENTRIES)
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    [tag] = [tag for tag in accumulator.Tags()["tensors"]
             if accumulator.SummaryMetadata(tag).plugin_data.plugin_name == "hparams"]
    data = plugin_data_pb2.HParamsPluginData.FromString(accumulator.SummaryMetadata(tag).plugin_data.content)
    shown = dict(data.session_start_info.hparams)
    assert shown["scheduler.arm"].string_value == "complementary"
    assert shown["actor_trainer.lr"].number_value == 1e-5
    assert "kafka.bootstrap_servers" not in shown  # where a run ran is not what it was
    assert data.session_start_info.group_name == RUN


def test_mlflow_keeps_a_histogram_as_its_summary_metrics_and_the_settings_as_params(tmp_path):
    _needs("mlflow")
    backend = MlflowBackend(tmp_path, RUN, CONFIG, TrackerSettings())
    backend.write(ENTRIES)
    backend.close()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    read = mlflow_entries(uri, RUN)
    assert read == {key: value for key, value in as_table(ENTRIES).items() if not key.startswith("text")}
    from mlflow.tracking import MlflowClient

    params = MlflowClient(tracking_uri=uri).get_run(backend.run_id).data.params
    assert params == {name: str(value) for name, value in hparams(CONFIG).items()}
