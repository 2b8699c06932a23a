"""What a tracker backend holds, read back with the tool's own reader, as `{entry_key: value or text}` (the shape
of `pipeline.tracking.fold.as_table`), so a run's tracked entries can be checked against its archive.

- TensorBoard: `EventAccumulator`, TensorBoard's own reader (scalars are stored as float32).
- MLflow: `MlflowClient`'s metric histories (texts are artifacts and are not read back).
- W&B, offline: the run's `.wandb` file is a LevelDB-style log of protobuf `Record`s (the format `wandb sync`
  uploads); its history rows are read with W&B's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pipeline.errors import InvalidArgumentError

_SCALAR, _TEXT, _HISTOGRAM = "scalar", "text", "histogram"


def tensorboard_entries(directory: Path) -> dict[str, Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    accumulator = EventAccumulator(str(directory), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    entries: dict[str, Any] = {}
    for tag in tags["scalars"]:
        for event in accumulator.Scalars(tag):
            entries[f"{_SCALAR}\t{tag}\t{event.step}"] = event.value
    for tag in tags["histograms"]:
        for event in accumulator.Histograms(tag):
            value = event.histogram_value
            entries[f"{_HISTOGRAM}\t{tag}\t{event.step}"] = (value.num, value.sum, value.min, value.max)
    for tag in tags["tensors"]:
        if accumulator.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            continue  # the HParams summary: the run's settings, not an entry
        for event in accumulator.Tensors(tag):
            entries[f"{_TEXT}\t{tag}\t{event.step}"] = tensor_util.make_ndarray(event.tensor_proto).item().decode()
    return entries


def mlflow_entries(tracking_uri: str, run_id: str) -> dict[str, Any]:
    """The scalars of the MLflow run tagged `crl.run_id = run_id` in any experiment of the store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    [run] = client.search_runs(experiments, f"tags.`crl.run_id` = '{run_id}'")
    entries: dict[str, Any] = {}
    parts: dict[tuple[str, int], dict[str, float]] = {}
    for key in run.data.metrics:
        tag, marker, part = key.rpartition(HISTOGRAM_MARKER)
        for metric in client.get_metric_history(run.info.run_id, key):
            if marker:
                parts.setdefault((tag, metric.step), {})[part] = metric.value
            else:
                entries[f"{_SCALAR}\t{key}\t{metric.step}"] = metric.value
    for (tag, step), summary in parts.items():
        entries[f"{_HISTOGRAM}\t{tag}\t{step}"] = (summary["count"], summary["sum"], summary["min"], summary["max"])
    return entries


HISTOGRAM_MARKER = "/histogram/"
"""MLflow has no histogram: `<tag>/histogram/<count, sum, min, mean, max>` are its metrics (`MlflowBackend`)."""


def _log_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log: a 7-byte header (`:W&B`, magic, version), then 32 KiB blocks of
    chunks, each with a 7-byte header (crc32, length, type: 1 full, 2 first, 3 middle, 4 last)."""
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise InvalidArgumentError(f"{path} is not a W&B transaction log (it does not start with :W&B)")
    records: list[bytes] = []
    position, block, pending = 7, 32768, b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:  # a block's tail too short for a header is padding
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position:position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    return records


def wandb_entries(directory: Path) -> dict[str, Any]:
    """The scalars, and which texts were logged (their value: the HTML file W&B wrote), of every offline W&B run
    under `directory` (its `wandb/` folder)."""
    from wandb.proto import wandb_internal_pb2

    entries: dict[str, Any] = {}
    for path in sorted(directory.glob("wandb/offline-run-*/run-*.wandb")):
        for data in _log_records(path):
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = row.get("step")
            texts = {key.removesuffix("/_type") for key, value in row.items()
                     if key.endswith("/_type") and value == "html-file"}
            histograms = {key.removesuffix("/_type") for key, value in row.items()
                          if key.endswith("/_type") and value == "histogram"}
            for tag in texts:
                entries[f"{_TEXT}\t{tag}\t{step}"] = row[f"{tag}/path"]
            for tag in histograms:  # W&B keeps the bins, not the values: which histograms were logged
                entries[f"{_HISTOGRAM}\t{tag}\t{step}"] = sum(row.get(f"{tag}/values", []))
            for key, value in row.items():
                if key == "step" or key.startswith("_") or any(key.startswith(f"{tag}/")
                                                                for tag in (*texts, *histograms)):
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    entries[f"{_SCALAR}\t{key}\t{step}"] = value
    return entries
