"""Where tracked entries go: TensorBoard event files (the default), Weights & Biases, MLflow.

Each backend takes batches of entries (`pipeline.tracking.fold`), keyed by their step, and writes them with the
tool's own writer, so the tool's own reader loads them:

- `tensorboard`: event files under `RUN_DIR/tensorboard/`, written by the `tensorboard` package's
  `EventFileWriter`: scalars as `simple_value`s, texts through its text plugin (Markdown), histograms as its
  histogram protos, and the run's settings once for the HParams dashboard (`fold.hparams`). `tensorboard --logdir
  RUN_DIR/tensorboard` shows them; over several runs' directories the HParams tab lines the runs up.
- `wandb`: a W&B run named after the run, offline by default (`RUN_DIR/wandb/`, uploaded later with `wandb sync`;
  `tracker.wandb_mode: online` logs in as the `WANDB_API_KEY` says), its settings as the run's config. Every entry
  is logged with a `step` field that every other field is plotted against, so entries may arrive in any step order.
  Texts are logged as HTML, histograms as `wandb.Histogram`.
- `mlflow`: an MLflow run in a local SQLite store (`RUN_DIR/mlflow.db`, artifacts in `RUN_DIR/mlflow-artifacts/`)
  unless `tracker.mlflow_tracking_uri` names a server. MLflow's directory store is in maintenance mode and refuses
  to open by default, so the local default is its recommended database. The settings are the run's params; scalars
  are metrics with their step and time; a histogram, which MLflow lacks, is five metrics
  `<tag>/histogram/<count, sum, min, mean, max>`; texts are Markdown artifacts `<tag>/step-<step>.md`.

`wandb` and `mlflow` are optional installs (`pip install -e ".[tracking]"`); naming one without its package is a
`ConfigError` saying what to install.
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.errors import ConfigError
from pipeline.tracking.fold import Entry, Histogram, Scalar, Text, hparams
from pipeline.tracking.readback import HISTOGRAM_MARKER
from pipeline.tracking.settings import TrackerSettings

BACKENDS = ("tensorboard", "wandb", "mlflow")


class Backend(Protocol):
    name: str

    def write(self, entries: Sequence[Entry]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


def _missing(package: str, backend: str) -> ConfigError:
    return ConfigError(f"tracker backend {backend!r} needs the {package!r} package: pip install -e '.[tracking]' "
                       f"(or pip install {package}), or leave {backend!r} out of tracker.backends")


class TensorBoardBackend:
    name = "tensorboard"

    def __init__(self, directory: Path, run_id: str | None = None, config: dict[str, Any] | None = None) -> None:
        try:
            from tensorboard.summary.writer.event_file_writer import EventFileWriter
        except ImportError as error:  # pragma: no cover - tensorboard is a dependency of the project
            raise _missing("tensorboard", self.name) from error
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._writer = EventFileWriter(str(directory))
        if config is not None:
            self._hparams(run_id or directory.parent.name, config)

    def _hparams(self, run_id: str, config: dict[str, Any]) -> None:
        """The run's settings for the HParams dashboard, which lines runs up by them beside their final scalars."""
        from tensorboard.compat.proto import event_pb2
        from tensorboard.plugins.hparams.summary_v2 import hparams_pb

        summary = hparams_pb(hparams(config), trial_id=run_id)
        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=0, summary=summary))

    def write(self, entries: Sequence[Entry]) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb

        for entry in entries:
            if isinstance(entry, Scalar):
                summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=entry.tag,
                                                                               simple_value=entry.value)])
            elif isinstance(entry, Histogram):
                summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=entry.tag,
                                                                               histo=_histogram_proto(entry.values))])
            else:
                summary = text_pb(entry.tag, entry.text)
            self._writer.add_event(event_pb2.Event(wall_time=entry.wall_time, step=entry.step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


HISTOGRAM_BUCKETS = 20


def _histogram_proto(values: Sequence[float]) -> Any:
    """TensorBoard's histogram of `values`: `HISTOGRAM_BUCKETS` equal buckets between the least and the greatest
    (one bucket when they are equal), with the count, sum and sum of squares its reader gives back."""
    from tensorboard.compat.proto.summary_pb2 import HistogramProto

    low, high = min(values), max(values)
    width = (high - low) / HISTOGRAM_BUCKETS
    limits = [low + width * (i + 1) for i in range(HISTOGRAM_BUCKETS)] if width > 0 else [high]
    counts = [0.0] * len(limits)
    for value in values:
        index = min(int((value - low) / width), len(limits) - 1) if width > 0 else 0
        counts[index] += 1
    return HistogramProto(min=low, max=high, num=len(values), sum=sum(values),
                          sum_squares=sum(v * v for v in values), bucket_limit=limits, bucket=counts)


class WandbBackend:
    name = "wandb"

    def __init__(self, directory: Path, run_id: str, config: dict[str, Any], settings: TrackerSettings) -> None:
        try:
            import wandb
        except ImportError as error:
            raise _missing("wandb", self.name) from error
        directory.mkdir(parents=True, exist_ok=True)
        self._wandb = wandb
        self._run = wandb.init(project=settings.wandb_project, entity=settings.wandb_entity, name=run_id,
                               id=_wandb_id(run_id), dir=str(directory), mode=settings.wandb_mode, config=config,
                               resume="allow", settings=wandb.Settings(silent=True, console="off"))
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")

    def write(self, entries: Sequence[Entry]) -> None:
        by_step: dict[int, dict[str, Any]] = {}
        for entry in entries:
            row = by_step.setdefault(entry.step, {"step": entry.step})
            if isinstance(entry, Scalar):
                row[entry.tag] = entry.value
            elif isinstance(entry, Histogram):
                row[entry.tag] = self._wandb.Histogram(list(entry.values), num_bins=HISTOGRAM_BUCKETS)
            else:
                row[entry.tag] = self._wandb.Html(f"<pre>{html.escape(entry.text)}</pre>")
        for _, row in sorted(by_step.items()):
            self._run.log(row)

    def flush(self) -> None:
        """W&B's service process writes what was logged on its own; nothing to force here."""

    def close(self) -> None:
        self._run.finish()


def _wandb_id(run_id: str) -> str:
    """A W&B run id (letters, digits, `-`, `_`) for the run id."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in run_id)[:64]


class MlflowBackend:
    name = "mlflow"

    def __init__(self, run_dir: Path, run_id: str, config: dict[str, Any], settings: TrackerSettings) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise _missing("mlflow-skinny", self.name) from error
        uri = settings.mlflow_tracking_uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        self.client = MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment is not None else self.client.create_experiment(
            settings.mlflow_experiment, artifact_location=None if settings.mlflow_tracking_uri
            else (run_dir / "mlflow-artifacts").resolve().as_uri())
        found = self.client.search_runs([experiment_id], f"tags.`crl.run_id` = '{run_id.replace(chr(39), '')}'")
        if found:
            self.run_id = found[0].info.run_id
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_id,
                                                 tags={"crl.run_id": run_id}).info.run_id
            self.client.log_text(self.run_id, json.dumps(config, indent=2, sort_keys=True), "run/config.json")
            # Params, MLflow's hyperparameters, are set once per run (a restarted tracker finds the run and skips).
            from mlflow.entities import Param

            params = [Param(name, str(value)[:6000]) for name, value in hparams(config).items()]
            for start in range(0, len(params), 100):  # MLflow takes at most 100 params a batch
                self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, entries: Sequence[Entry]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(e.tag, e.value, int(e.wall_time * 1000), e.step) for e in entries if isinstance(e, Scalar)]
        # MLflow has no histogram: its count, sum, least, mean and greatest value, as metrics of their own.
        for e in entries:
            if isinstance(e, Histogram):
                count, total, low, high = e.summary()
                parts = {"count": count, "sum": total, "min": low, "mean": total / count, "max": high}
                metrics += [Metric(f"{e.tag}{HISTOGRAM_MARKER}{name}", value, int(e.wall_time * 1000), e.step)
                            for name, value in parts.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1,000 metrics a batch
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])
        for entry in entries:
            if isinstance(entry, Text):
                self.client.log_text(self.run_id, entry.text, f"{entry.tag}/step-{entry.step:06d}.md")

    def flush(self) -> None:
        """Every write above is a committed request to the store."""

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def open_backends(names: Sequence[str], run_dir: Path, run_id: str, config: dict[str, Any],
                  settings: TrackerSettings, tensorboard_dir: Path | None = None) -> list[Backend]:
    """The backends named, in order; an unknown name or a missing package is a `ConfigError`."""
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        raise ConfigError(f"unknown tracker backends {unknown}; valid values: {list(BACKENDS)}")
    backends: list[Backend] = []
    for name in names:
        if name == "tensorboard":
            backends.append(TensorBoardBackend(tensorboard_dir or run_dir / "tensorboard", run_id, config))
        elif name == "wandb":
            backends.append(WandbBackend(run_dir, run_id, config, settings))
        else:
            backends.append(MlflowBackend(run_dir, run_id, config, settings))
    return backends
