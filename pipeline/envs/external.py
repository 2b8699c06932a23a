"""ALFWorld, WebShop and SWE-Bench behind the text protocol: adapters over their public APIs, imported lazily.

None of them runs on the development machines: ALFWorld needs its game files (`alfworld-download`, ~2 GB), WebShop
its product catalogue and search index, SWE-Bench Docker images of every repository. Constructing an adapter without
them raises `EnvUnavailableError` (a `ConfigError`) naming what is missing and how to get it. A rollout worker stops
with that message at the first episode of such an environment, without committing it, so no task is lost.

These adapters are written against the packages' documented entry points and have not been run here (no data, no
Docker); the MiniHack and Sokoban adapters are the tested ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pipeline.envs.base import ActResult, InvalidActionRule, StepOutcome, TextEnv
from pipeline.errors import EnvUnavailableError

ALFWORLD_HINT = ("pip install 'alfworld[full]' && alfworld-download (game files, ~2 GB), then point "
                 "CRL_ENVS__ALFWORLD_DATA at the download directory")
WEBSHOP_HINT = ("install WebShop from https://github.com/princeton-nlp/WebShop (its setup.sh builds the 1,000-product "
                "catalogue and the search index), then run on that checkout's Python environment")
SWEBENCH_HINT = ("pip install swebench, a running Docker engine, and the SWE-Bench Verified instances as a local JSON "
                 "file (CRL_ENVS__SWEBENCH_INSTANCES); images are built by swebench's harness")


def _missing(env_id: str, what: str, hint: str, exc: BaseException | None = None) -> EnvUnavailableError:
    detail = f" ({type(exc).__name__}: {exc})" if exc is not None else ""
    return EnvUnavailableError(f"{env_id} cannot run here: {what}{detail}. To get it: {hint}")


class AlfWorldEnv(TextEnv):
    """ALFWorld's TextWorld engine (`AlfredTWEnv`): one game file per seed, admissible commands as the action list,
    reward +1 on success and -1 on failure (the paper; docs/environments.md)."""

    env_id = "ALFWorld"
    task_family = "alfworld"

    def __init__(self, *, data_dir: Path | None, split: str = "train", max_turns: int = 40,
                 invalid_action: InvalidActionRule = "skip") -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action, success_reward=1.0,
                         failure_reward=-1.0)
        try:
            import textworld
            import textworld.gym
            from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos, AlfredTWEnv
        except ImportError as exc:
            raise _missing(self.env_id, "the alfworld package is not installed", ALFWORLD_HINT, exc) from exc
        if data_dir is None or not Path(data_dir).is_dir():
            raise _missing(self.env_id, f"the ALFWorld data directory {data_dir} does not exist", ALFWORLD_HINT)
        import yaml

        config_file = Path(data_dir) / "base_config.yaml"
        if not config_file.is_file():
            raise _missing(self.env_id, f"{config_file} is missing", ALFWORLD_HINT)
        config = yaml.safe_load(config_file.read_text())
        split_name = {"train": "train", "eval": "eval_out_of_distribution"}[split]
        self._games = sorted(AlfredTWEnv(config, train_eval=split_name).game_files)
        if not self._games:
            raise _missing(self.env_id, f"no game files for split {split_name} under {data_dir}", ALFWORLD_HINT)
        self._wrappers = [AlfredDemangler(), AlfredInfos()]
        self._infos = textworld.EnvInfos(won=True, admissible_commands=True, extras=["gamefile"])
        self._env: Any = None
        self._admissible: tuple[str, ...] = ()
        self._last = ""

    def available_actions(self) -> tuple[str, ...]:
        return self._admissible

    def _reset(self, seed: int) -> tuple[str, str]:
        import textworld.gym

        if self._env is not None:
            self._env.close()
        game = self._games[seed % len(self._games)]
        env_id = textworld.gym.register_games([game], self._infos, batch_size=1, asynchronous=False,
                                              max_episode_steps=self.max_turns, wrappers=self._wrappers)
        self._env = textworld.gym.make(env_id)
        observations, infos = self._env.reset()
        self._admissible = tuple(infos["admissible_commands"][0])
        text = observations[0]
        goal = text.split("Your task is to:", 1)[1].strip() if "Your task is to:" in text else text.strip()
        self._last = text
        return goal, text

    def _act(self, action: str) -> ActResult:
        observations, _scores, dones, infos = self._env.step([action])
        self._admissible = tuple(infos["admissible_commands"][0])
        self._last = observations[0]
        won = bool(infos["won"][0])
        return ActResult(self._last, solved=won, lost=bool(dones[0]) and not won,
                         env_truncated=bool(dones[0]) and not won)

    def render(self) -> str:
        return self._last

    def close(self) -> None:
        if self._env is not None:
            self._env.close()


class WebShopEnv(TextEnv):
    """WebShop's text environment (`WebAgentTextEnv`): `search[...]` and `click[...]` actions, success when the bought
    product scores 1.0."""

    env_id = "WebShop"
    task_family = "webshop"

    def __init__(self, *, num_products: int = 1000, max_turns: int = 15,
                 invalid_action: InvalidActionRule = "skip") -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        try:
            import gym
            from web_agent_site.envs import WebAgentTextEnv  # noqa: F401  (registers WebAgentTextEnv-v0)
        except ImportError as exc:
            raise _missing(self.env_id, "the WebShop package (web_agent_site) is not installed", WEBSHOP_HINT,
                           exc) from exc
        try:
            self._env = gym.make("WebAgentTextEnv-v0", observation_mode="text", num_products=num_products)
        except Exception as exc:  # its catalogue and index load here
            raise _missing(self.env_id, "the WebShop catalogue or search index did not load", WEBSHOP_HINT,
                           exc) from exc
        self._last = ""

    def available_actions(self) -> tuple[str, ...]:
        available = self._env.get_available_actions()
        actions = [f"click[{name}]" for name in available.get("clickables", [])]
        if available.get("has_search_bar"):
            actions.insert(0, "search[")
        return tuple(actions)

    def _reset(self, seed: int) -> tuple[str, str]:
        result = self._env.reset(session=seed)
        self._last = result[0] if isinstance(result, tuple) else result
        return self._env.get_instruction_text(), self._last

    def _act(self, action: str) -> ActResult:
        # `search[` is the search-bar prefix: the agent's full `search[query]` text is what WebShop receives.
        self._last, reward, done, _info = self._env.step(action if action != "search[" else self._pending_search)
        return ActResult(self._last, solved=bool(done) and float(reward) >= 1.0, lost=bool(done) and reward < 1.0)

    def step(self, action_text: str) -> StepOutcome:
        line = next((part.strip() for part in action_text.splitlines() if part.strip()), "")
        self._pending_search = line if line.lower().startswith("search[") and line.endswith("]") else "search[]"
        return super().step(action_text)

    def render(self) -> str:
        return self._last

    def close(self) -> None:
        self._env.close()


class SweBenchEnv(TextEnv):
    """SWE-Bench Verified: one instance per seed in its repository's Docker image; tools `bash <command>`,
    `str_replace_editor <json>` and `submit`; success when the instance's FAIL_TO_PASS and PASS_TO_PASS tests pass."""

    env_id = "SWE-Bench-Verified"
    task_family = "swebench"

    def __init__(self, *, instances_file: Path | None, max_turns: int = 50,
                 invalid_action: InvalidActionRule = "skip") -> None:
        super().__init__(max_turns=max_turns, invalid_action=invalid_action)
        try:
            import docker
            from swebench.harness.docker_build import build_container
            from swebench.harness.test_spec.test_spec import make_test_spec
        except ImportError as exc:
            raise _missing(self.env_id, "the swebench package is not installed", SWEBENCH_HINT, exc) from exc
        try:
            self._docker = docker.from_env(timeout=10)
            self._docker.ping()
        except Exception as exc:  # docker raises several unrelated types when no daemon answers
            raise _missing(self.env_id, "no Docker engine answers", SWEBENCH_HINT, exc) from exc
        if instances_file is None or not Path(instances_file).is_file():
            raise _missing(self.env_id, f"the instances file {instances_file} does not exist", SWEBENCH_HINT)
        self._instances = sorted(json.loads(Path(instances_file).read_text()), key=lambda i: i["instance_id"])
        self._make_test_spec, self._build_container = make_test_spec, build_container
        self._container: Any = None
        self._spec: Any = None
        self._last = ""

    def available_actions(self) -> tuple[str, ...]:
        return ("bash", "str_replace_editor", "submit")

    def _reset(self, seed: int) -> tuple[str, str]:
        import logging

        self.close()
        instance = self._instances[seed % len(self._instances)]
        self._spec = self._make_test_spec(instance)
        self._container = self._build_container(self._spec, self._docker, run_id="crl", logger=logging.getLogger(
            __name__), nocache=False)
        self._container.start()
        self._last = f"Repository: {instance['repo']} at /testbed\nIssue:\n{instance['problem_statement']}"
        return f"resolve the issue in {instance['repo']}", self._last

    def step(self, action_text: str) -> StepOutcome:
        # Tool calls carry an argument after the tool's name: keep it for `_act`.
        line = next((part.strip() for part in action_text.splitlines() if part.strip()), "")
        self._argument = line.partition(" ")[2]
        return super().step(action_text)

    def _act(self, action: str) -> ActResult:
        if action == "bash":
            result = self._container.exec_run(["bash", "-lc", self._argument], workdir="/testbed")
            self._last = result.output.decode("utf-8", "replace")[-4000:]
            return ActResult(self._last, solved=False)
        if action == "str_replace_editor":
            try:
                call = json.loads(self._argument)
                self._last = self._edit(call["path"], call["old_str"], call["new_str"])
            except (ValueError, KeyError, TypeError) as exc:
                self._last = f"str_replace_editor takes JSON {{path, old_str, new_str}}: {exc}"
            return ActResult(self._last, solved=False)
        resolved = self._evaluate()
        self._last = "submitted: the instance's tests " + ("pass" if resolved else "fail")
        return ActResult(self._last, solved=resolved, lost=not resolved)

    def _edit(self, path: str, old: str, new: str) -> str:
        script = ("import pathlib, sys\n"
                  f"p = pathlib.Path({path!r}); t = p.read_text(); n = t.count({old!r})\n"
                  f"sys.exit(f'{{n}} matches of old_str, need exactly 1') if n != 1 else "
                  f"p.write_text(t.replace({old!r}, {new!r}))")
        result = self._container.exec_run(["python3", "-c", script], workdir="/testbed")
        return result.output.decode("utf-8", "replace") or f"edited {path}"

    def _evaluate(self) -> bool:
        """The harness's own evaluation of the container's diff (FAIL_TO_PASS and PASS_TO_PASS tests)."""
        try:
            from swebench.harness.run_evaluation import run_instance
        except ImportError as exc:
            raise _missing(self.env_id, "swebench.harness.run_evaluation.run_instance is missing", SWEBENCH_HINT,
                           exc) from exc
        diff = self._container.exec_run(["git", "diff"], workdir="/testbed").output.decode("utf-8", "replace")
        prediction = {"instance_id": self._spec.instance_id, "model_name_or_path": "crl", "model_patch": diff}
        report = run_instance(self._spec, prediction, False, False, self._docker, "crl", 1800)
        return bool(report and report.get("report", report).get(self._spec.instance_id, {}).get("resolved"))

    def render(self) -> str:
        return self._last

    def close(self) -> None:
        if self._container is not None:
            self._container.remove(force=True)
            self._container = None
