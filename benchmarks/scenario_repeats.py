"""Run the end-to-end scenario (tests/e2e/test_scenario.py: a plug-in worker kind, a killed worker restarted, a crash
that fails the run, Ctrl-C, a killed broker, three resumes, both replays) again and again on each broker, and count
how often each of its tests passed: what an intermittent failure would show.

    python benchmarks/scenario_repeats.py --quick               # 2 repeats on each broker
    python benchmarks/scenario_repeats.py --repeats 10          # what docs/testing.md quotes

Each repeat is one `pytest tests/e2e/test_scenario.py -k <broker>` in a fresh process with its own temporary
directory (a whole scenario, about 5 minutes on Tansu and 7 on Apache Kafka on 2 cores). The JUnit report of each
repeat is kept under `--out`; a failing test's message is printed when it fails. Prints per broker `runs=`,
`tests=`, `failed=` and `passed_all=` (the repeats with every test passing), then the scenario's own measurements
(episodes played again, consumers the group watch recreated) summed over the repeats. Exits 1 when any test failed.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BROKERS = {"tansu": "tansu", "apache-kafka": "kafka"}
"""Broker name -> the id pytest gives the scenario's parameter."""
MEASURED = re.compile(r"scenario on (\w+): (\d+) of (\d+) episodes played again over (\d+) attempts; consumers "
                      r"recreated by the group watch: (\d+)")


def repeat(broker: str, index: int, out: Path) -> tuple[Counter[str], list[str], str]:
    """One scenario on `broker`: (outcome -> count of tests, messages of the failed tests, the session summary)."""
    report = out / f"{broker}-{index:02d}.xml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "--junitxml", str(report),
         "tests/e2e/test_scenario.py", "-k", BROKERS[broker]],
        cwd=ROOT, env=env, capture_output=True, text=True)
    outcomes: Counter[str] = Counter()
    failures: list[str] = []
    if not report.exists():
        return Counter({"error": 1}), [f"pytest exited {result.returncode}: {result.stdout[-2000:]}"], ""
    for case in ET.parse(report).getroot().iter("testcase"):
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            outcomes["failed"] += 1
            failures.append(f"{case.get('name')}: {(problem.get('message') or '')[:400]}")
        elif case.find("skipped") is not None:
            outcomes["skipped"] += 1
        else:
            outcomes["passed"] += 1
    return outcomes, failures, result.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10, help="scenarios per broker")
    parser.add_argument("--quick", action="store_true", help="2 repeats per broker")
    parser.add_argument("--brokers", nargs="+", choices=sorted(BROKERS), default=sorted(BROKERS))
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "scenario-repeats",
                        help="where each repeat's JUnit report goes")
    args = parser.parse_args(argv)
    repeats = 2 if args.quick else args.repeats
    args.out.mkdir(parents=True, exist_ok=True)
    any_failed = False
    for broker in args.brokers:
        totals: Counter[str] = Counter()
        clean = 0
        played_again = recreated = episodes = 0
        started = time.monotonic()
        for index in range(repeats):
            began = time.monotonic()
            outcomes, failures, summary = repeat(broker, index, args.out)
            totals.update(outcomes)
            clean += not failures
            for match in MEASURED.finditer(summary):
                played_again += int(match.group(2))
                episodes += int(match.group(3))
                recreated += int(match.group(5))
            print(f"{broker} repeat {index + 1}/{repeats}: {dict(outcomes)} in {time.monotonic() - began:.0f} s",
                  flush=True)
            for failure in failures:
                print(f"  FAILED {failure}", flush=True)
        any_failed |= bool(totals["failed"] or totals["error"])
        key = broker.replace("-", "_")
        print(f"{key}_runs={repeats}")
        print(f"{key}_tests={sum(totals.values())}")
        print(f"{key}_failed={totals['failed'] + totals['error']}")
        print(f"{key}_passed_all={clean}")
        print(f"{key}_episodes_played_again={played_again}")
        print(f"{key}_episodes={episodes}")
        print(f"{key}_watch_recreations={recreated}")
        print(f"{key}_seconds={time.monotonic() - started:.0f}")
    return 1 if any_failed else 0


if __name__ == "__main__":
    sys.exit(main())
