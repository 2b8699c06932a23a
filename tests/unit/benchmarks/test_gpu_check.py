"""`benchmarks/gpu_check.py --dry-run`: the GPU check's steps on the CPU (the SmolLM2-shaped random model with 2
layers), every part passing, and nothing imported that the offline GPU machine lacks (it has torch, transformers,
peft and safetensors; pydantic is carried as wheels)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

RUN_AND_LIST_MODULES = """
import json, runpy, sys
sys.argv = ["gpu_check.py", "--dry-run"]
try:
    runpy.run_path(sys.argv_path, run_name="__main__")
except SystemExit as exit:
    code = exit.code
print("MODULES=" + json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
sys.exit(code)
""".replace("sys.argv_path", repr(str(ROOT / "benchmarks" / "gpu_check.py")))

# What a machine with torch, transformers, peft, safetensors and the carried pydantic wheels does not have: the
# project's other dependencies (and the ones they bring). lz4 and zstandard are left out: fsspec and torch import them
# when they happen to be installed, as they are here.
ABSENT_THERE = {"kafka", "sqlalchemy", "alembic", "duckdb", "usearch", "sentence_transformers", "vllm", "nle",
                "minihack", "gymnasium", "textworld_express", "scienceworld", "pydantic_settings", "yaml_include",
                "xxhash", "crc32c", "orjson", "testcontainers", "psycopg", "llama_cpp"}


def test_dry_run_passes_every_part_and_imports_only_what_the_gpu_machine_has() -> None:
    done = subprocess.run([sys.executable, "-c", RUN_AND_LIST_MODULES], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    values = dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)
    for part in ("generation", "train", "handoff", "gpu_check"):
        assert values[f"{part}_ok"] == "True", values
    for name in ("handoff_full_in_place", "handoff_full_matches", "handoff_lora_in_place", "handoff_lora_matches",
                 "train_weights_changed"):
        assert values[name] == "True", name
    assert float(values["gen_new_tokens_per_s_b8"]) > 0 and float(values["gen_new_tokens_per_s_b16"]) > 0
    # bfloat16 sampling against float32 rescoring: small, never zero (the copy really is bfloat16).
    assert 0 < float(values["gen_logprob_mismatch_b8"]) < 0.1
    imported = set(json.loads(values["MODULES"]))
    assert not imported & ABSENT_THERE, sorted(imported & ABSENT_THERE)
