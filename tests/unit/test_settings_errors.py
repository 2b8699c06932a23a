"""Settings errors in the user's words: each mistake a person makes in a run config or a `CRL_*` variable comes back
as one line naming where it was written (the key and the file, or the variable) and, for names and choices, what
was probably meant. `crl run` and `crl config check` print the same lines."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.errors import ConfigError
from pipeline.settings import load_settings

ARMS = "complementary, grpo, static_extractor, exp_only, frozen"
MISTAKES = [
    # (run config, CRL_* variables, the lines; F is the config's path)
    ("schedular: {steps: 3}", {}, ["schedular in F: unknown key; did you mean scheduler?"]),
    ("actor_trainer: {gruop_size: 4}", {}, ["actor_trainer.gruop_size in F: unknown key; did you mean group_size?"]),
    ("actor_trainer: {model: {lora: {rnak: 8}}}", {},
     ["actor_trainer.model.lora.rnak in F: unknown key; did you mean rank?"]),
    ("envs: {tasks: [{env_id: MiniHack-Room-5x5-v0, wieght: 2}]}", {},
     ["envs.tasks[0].wieght in F: unknown key; did you mean weight?"]),
    ("scheduler: {arm: complementry}", {},
     [f"scheduler.arm in F: 'complementry' is not one of {ARMS}; did you mean complementary?"]),
    ("rollout: {generation: {backend: vlm}}", {},
     ["rollout.generation.backend in F: 'vlm' is not one of transformers, vllm; did you mean vllm?"]),
    ("envs: {tasks: [{env_id: MiniHack-Rom-5x5-v0}]}", {},
     ["envs.tasks[0].env_id in F: unknown env id 'MiniHack-Rom-5x5-v0' (`crl envs list` lists them); did you mean "
      "MiniHack-Room-5x5-v0?"]),
    (None, {"CRL_ENVS__TASKS": '[{"env_id": "Sokoban-6x6-2bx"}]'},
     ["CRL_ENVS__TASKS[0].env_id: unknown env id 'Sokoban-6x6-2bx' (`crl envs list` lists them); did you mean "
      "Sokoban-6x6-2box?"]),
    ("scheduler: {steps: ten}", {},
     ["scheduler.steps in F: Input should be a valid integer, unable to parse string as an integer (got 'ten')"]),
    ("scheduler: {steps: 0}", {}, ["scheduler.steps in F: Input should be greater than 0 (got 0)"]),
    ("actor_trainer: {group_size: 4.5}", {},
     ["actor_trainer.group_size in F: Input should be a valid integer, got a number with a fractional part "
      "(got 4.5)"]),
    ("scheduler: {deterministic: yes please}", {},
     ["scheduler.deterministic in F: Input should be a valid boolean, unable to interpret input (got 'yes please')"]),
    ("envs: {tasks: {env_id: MiniHack-Room-5x5-v0}}", {}, ["envs.tasks in F: Input should be a list"]),
    (None, {"CRL_SCHEDULER__ARM": "grp"}, [f"CRL_SCHEDULER__ARM: 'grp' is not one of {ARMS}; did you mean grpo?"]),
    ("scheduler: {arm: grpo}", {"CRL_SCHEDULER__ARM": "frozn"},  # the variable wins over the file, and is named
     [f"CRL_SCHEDULER__ARM: 'frozn' is not one of {ARMS}; did you mean frozen?"]),
    (None, {"CRL_ACTOR_TRAINER__GRUOP_SIZE": "4"},
     ["CRL_ACTOR_TRAINER__GRUOP_SIZE: unknown key; did you mean group_size?"]),
    (None, {"CRL_MAX_PAYLOAD_BYTES": "-1"}, ["CRL_MAX_PAYLOAD_BYTES: Input should be greater than 0 (got '-1')"]),
    (None, {"CRL_KAFKA__ACKS": "some"}, ["CRL_KAFKA__ACKS: 'some' is not one of all, 0, 1"]),
    ("- scheduler\n- envs", {}, ["F: a run config is a mapping of settings (`scheduler: {steps: 3}`), not a list"]),
    ("scheduler: {steps: 3", {}, ["F is not valid YAML (line 2, column 1): expected ',' or '}', but got "
                                  "'<stream end>'"]),
    ("claim_check_bytes: 2000000", {},
     ["claim_check_bytes in F: 2000000 must be below max_payload_bytes (1048576): an event between the two would be "
      "dead-lettered"]),
    ("scheduler: {deterministic: true, staleness: 2}", {},
     ["scheduler.deterministic in F: a deterministic run goes in lock step, but scheduler.staleness is 2, needs 0; "
      "scheduler.max_steps_ahead is 1, needs 0 (docs/determinism.md)"]),
    ("actor_trainer: {gruop_size: 4}\nscheduler: {arm: grop, steps: -3}", {},
     ["scheduler.arm in F: 'grop' is not one of " + ARMS + "; did you mean grpo?",
      "scheduler.steps in F: Input should be greater than 0 (got -3)",
      "actor_trainer.gruop_size in F: unknown key; did you mean group_size?"]),
]


@pytest.fixture
def clean_environment(monkeypatch):
    for name in [name for name in os.environ if name.startswith("CRL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


@pytest.mark.parametrize(("config", "variables", "lines"), MISTAKES, ids=range(len(MISTAKES)))
def test_a_mistake_comes_back_as_one_line_naming_where_it_was_written(tmp_path, clean_environment, config, variables,
                                                                      lines):
    path = None
    if config is not None:
        path = tmp_path / "run.yaml"
        path.write_text(config + "\n")
    for name, value in variables.items():
        clean_environment.setenv(name, value)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value).splitlines() == [line.replace("F", str(path)) if path else line for line in lines]


def test_a_missing_config_is_named_with_crl_config_only_when_that_named_it(tmp_path, clean_environment):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"^run config {missing} does not exist$"):
        load_settings(missing)
    clean_environment.setenv("CRL_CONFIG", str(missing))
    with pytest.raises(ConfigError, match=rf"^run config {missing} does not exist \(CRL_CONFIG\)$"):
        load_settings()


def test_crl_run_and_crl_config_check_print_the_same_lines(tmp_path, clean_environment):
    config = tmp_path / "typos.yaml"
    config.write_text("actor_trainer: {gruop_size: 4}\nenvs: {tasks: [{env_id: MiniHack-Rom-5x5-v0}]}\n")
    expected = [f"error: actor_trainer.gruop_size in {config}: unknown key; did you mean group_size?"]
    runner = CliRunner()
    checked = runner.invoke(app, ["config", "check", str(config)])
    ran = runner.invoke(app, ["run", str(config), "--run-dir", str(tmp_path / "run")])
    given = runner.invoke(app, ["--config", str(config), "config", "show"])
    assert checked.exit_code == 1, checked.output  # a check that found an invalid config
    for result in (checked, ran, given):
        assert result.exit_code in (1, 2) and (result.exit_code == 2 or result is checked), result.output
        assert result.output.splitlines()[:1] == expected, result.output
    assert not (tmp_path / "run").exists()
